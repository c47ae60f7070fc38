import os
from pathlib import Path

import pytest

from tests.fixtures import (
    VISION_KINDS, VLM_KINDS, build_fixture, build_vision_fixture, build_vlm_fixture,
)

# Fixture models are local folders: nothing may wait on the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    def build(kind):
        if kind in VISION_KINDS:
            return build_vision_fixture(kind, fixture_dir)
        if kind in VLM_KINDS:
            return build_vlm_fixture(kind, fixture_dir)
        return build_fixture(kind, fixture_dir)

    return build
