import os
from pathlib import Path

import pytest

from tests.fixtures import build_fixture


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Path:
    """Where fixture models live for this session (MLX_LM_PLUS_FIXTURES reuses one)."""
    persistent = os.environ.get("MLX_LM_PLUS_FIXTURES")
    if persistent:
        Path(persistent).mkdir(parents=True, exist_ok=True)
        return Path(persistent)
    return tmp_path_factory.mktemp("fixtures")


@pytest.fixture(scope="session")
def fixture_path(fixture_dir):
    """kind -> folder of that tiny model, built on first use."""
    return lambda kind: build_fixture(kind, fixture_dir)
