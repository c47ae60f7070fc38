"""Each patch in patches/ fixes a bug that shows without it, and applies
only to the mlx-lm it was written for."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

import patches
from tests.test_fixtures import greedy, long_prompt


def batched(model, prompts, n):
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    out = {u: [] for u in uids}
    while any(len(v) < n for v in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


@pytest.fixture
def unpatched():
    for patch in patches.PATCHES:
        patch.revert()
    yield
    patches.apply_all()


def _prompts(fixture_path, kind):
    model, tok = load(str(fixture_path(kind)))
    base = long_prompt(tok)
    return model, tok, [base[:60], base, base[:130]]


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba", "jamba", "olmo_hybrid"])
def test_batched_equals_single_with_patches(kind, fixture_path):
    patches.apply_all()
    model, tok, prompts = _prompts(fixture_path, kind)
    assert batched(model, prompts, 8) == [greedy(model, tok, p, 8) for p in prompts]


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba", "jamba", "olmo_hybrid"])
def test_batched_differs_without_patches(kind, fixture_path, unpatched):
    model, tok, prompts = _prompts(fixture_path, kind)
    assert batched(model, prompts, 8) != [greedy(model, tok, p, 8) for p in prompts]


# -- the version guard --

TARGETS = [pytest.param(p, p.PATCH.owner, p.PATCH.attr, id=p.PATCH.name) for p in patches.PATCHES]


def warnings(caplog):
    return [r for r in caplog.records if r.name == "patches" and r.levelno == logging.WARNING]


@pytest.fixture
def restored():
    """Leave the patches as the rest of the session expects them: applied."""
    yield
    for patch in patches.PATCHES:
        patch.revert()
    patches.apply_all()


@pytest.mark.parametrize("patch, owner, attr", TARGETS)
def test_matching_patch_is_applied(patch, owner, attr, restored, caplog):
    patch.revert()
    upstream = getattr(owner, attr)
    assert upstream is not patch.PATCH.replacement
    with caplog.at_level(logging.WARNING, logger="patches"):
        assert patch.apply() is True
        assert patch.apply() is True  # idempotent
    assert getattr(owner, attr) is patch.PATCH.replacement
    assert not warnings(caplog)
    patch.revert()
    assert getattr(owner, attr) is upstream


@pytest.mark.parametrize("patch, owner, attr", TARGETS)
def test_other_upstream_source_is_left_alone(patch, owner, attr, restored, monkeypatch, caplog):
    patch.revert()

    def changed_upstream(self, *args):  # what a later mlx-lm might have instead
        return "upstream"

    monkeypatch.setattr(owner, attr, changed_upstream)
    with caplog.at_level(logging.WARNING, logger="patches"):
        assert patch.apply() is False
        assert patches.apply_all()[patch.PATCH.name] is False
    assert getattr(owner, attr) is changed_upstream
    [first, second] = warnings(caplog)
    message = first.getMessage()
    assert second.getMessage() == message
    assert patch.PATCH.name in message and f"{owner.__qualname__}.{attr}" in message
    assert "mlx-lm 0.32.2" in message and "installed mlx-lm" in message


def test_recorded_hash_mismatch_is_not_applied(restored, monkeypatch, caplog):
    patch = patches.nemotron_h_ssm_lengths
    patch.revert()
    upstream = getattr(patch.PATCH.owner, "_ssm")
    monkeypatch.setattr(patch.PATCH, "sha256", "0" * 64)
    with caplog.at_level(logging.WARNING, logger="patches"):
        assert patch.apply() is False
    assert patch.PATCH.owner._ssm is upstream
    [record] = warnings(caplog)
    assert "nemotron_h_ssm_lengths" in record.getMessage()
    assert "NemotronHMamba2Mixer._ssm" in record.getMessage()


FRESH = """
import os
import sys
import patches
from mlx_lm_plus import engine
from tests.engine_harness import EngineRunner

def state():  # per patch: is the function in place ours (not upstream's)?
    return [getattr(p.PATCH.owner, p.PATCH.attr).__module__ == p.__name__
            for p in patches.PATCHES]

assert state() == [False] * len(patches.PATCHES), ("patched on import", state())
if sys.argv[1] == "apply_all":
    patches.apply_all()
else:
    runner = EngineRunner(sys.argv[2])  # constructs and starts an Engine
    runner.close()
assert state() == [True] * len(patches.PATCHES), ("not patched", state())
print("ok", flush=True)
os._exit(0)  # MLX can abort in interpreter teardown after an engine ran: not this test's subject
"""


@pytest.mark.parametrize("how", ["engine", "apply_all"])
def test_nothing_is_patched_on_import(how, fixture_path):
    """In a fresh process, importing the engine patches nothing; starting an
    Engine (or apply_all) patches everything."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", FRESH, how, str(fixture_path("qwen3"))],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
