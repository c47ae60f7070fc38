import os
from pathlib import Path

import pytest

from testkit.embedding_fixtures import EMBEDDING_KINDS, build_embedding_fixture
from testkit.fixtures import (
    VISION_KINDS, VLM_KINDS, build_fixture, build_vision_fixture, build_vlm_fixture,
)

# Fixture models are local folders: nothing may wait on the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Servers the tests start keep mlx[cpu]'s own BLAS (mlx_lm_plus/models/cpu.py), as
# this process, which imports MLX first, does: the exactness tests compare
# batched with single-row results and cached with cold ones, which a
# blocked BLAS (OpenBLAS) rounds differently in their last bits, and a
# random fixture's greedy tokens (or a 4-bit KV cache) turn that into other
# tokens (test_kv_bits' batched == sequential failed so). tests/models/test_cpu.py
# runs the fast path on purpose.
os.environ.setdefault("MLX_LM_PLUS_BLAS", "bundled")


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
        if kind in EMBEDDING_KINDS:
            return build_embedding_fixture(kind, fixture_dir)
        return build_fixture(kind, fixture_dir)

    return build
