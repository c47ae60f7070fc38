"""Each patch in mlx_lm_plus/patches/ fixes a bug that shows without it, and applies
only to the mlx-lm it was written for."""

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from mlx_lm_plus import patches
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
    return [r for r in caplog.records if r.name == "mlx_lm_plus.patches" and r.levelno == logging.WARNING]


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
    with caplog.at_level(logging.WARNING, logger="mlx_lm_plus.patches"):
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
    with caplog.at_level(logging.WARNING, logger="mlx_lm_plus.patches"):
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
    with caplog.at_level(logging.WARNING, logger="mlx_lm_plus.patches"):
        assert patch.apply() is False
    assert patch.PATCH.owner._ssm is upstream
    [record] = warnings(caplog)
    assert "nemotron_h_ssm_lengths" in record.getMessage()
    assert "NemotronHMamba2Mixer._ssm" in record.getMessage()


FRESH = """
import os
import sys
from mlx_lm_plus import patches
from mlx_lm_plus.engine import engine
from testkit.engine_harness import EngineRunner

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


# -- batched logits processors --


def _mixed_batch(model, tok):
    """A batch of constrained rows (one behind a repetition penalty), an
    unconstrained row and a row with only an ordinary processor, greedy:
    (outputs, how often each ConstraintProcessor entry point ran)."""
    from mlx_lm.sample_utils import make_repetition_penalty

    from mlx_lm_plus.planning.constraints import ConstraintProcessor
    from mlx_lm_plus.planning.grammars import compile_response_format
    from tests.planning.test_constraints import run_batch

    schemas = [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "array", "items": {"type": "string"}, "minItems": 3},
               {"type": "object"}]
    procs = [ConstraintProcessor(compile_response_format(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}), tok)
        for s in schemas]
    calls = {"row": 0, "batch": 0, "threads": set()}
    row_call, batch_call = ConstraintProcessor.__call__, ConstraintProcessor.mask_batch

    def counting_row(self, tokens, logits):
        calls["row"] += 1
        return row_call(self, tokens, logits)

    def counting_batch(rows, shape):
        calls["batch"] += 1
        calls["threads"].add(threading.current_thread().name)
        return batch_call(rows, shape)

    prompts = [tok.apply_chat_template([{"role": "user", "content": f"json {i} " * (i + 1)}],
                                       add_generation_prompt=True) for i in range(5)]
    penalty = make_repetition_penalty(1.3, 20)
    rows = [[procs[0]], [penalty, procs[1]], [procs[2]], [], [penalty]]
    mp = pytest.MonkeyPatch()
    mp.setattr(ConstraintProcessor, "__call__", counting_row)
    mp.setattr(ConstraintProcessor, "mask_batch", staticmethod(counting_batch))
    try:
        gen = BatchGenerator(model, stop_tokens=[[i] for i in tok.eos_token_ids],
                             completion_batch_size=8, prefill_batch_size=8)
        uids = gen.insert(prompts, max_tokens=[30] * 5, logits_processors=rows)
        out = {u: [] for u in uids}
        done = set()
        steps = 0
        while len(done) < len(uids):
            responses = gen.next_generated()
            steps += bool(responses)
            for r in responses:
                out[r.uid].append(r.token)
                if r.finish_reason:
                    done.add(r.uid)
        gen.close()
    finally:
        mp.undo()
    return [out[u] for u in uids], calls, steps


@pytest.mark.parametrize("beside_the_pass", [True, False], ids=["worker", "inline"])
def test_batched_processors_one_call_per_step(fixture_path, restored, beside_the_pass,
                                              monkeypatch):
    """With the patch, the constrained rows of a step are masked in one call
    (never row by row), and every row's tokens are what upstream's per-row
    loop gives: constrained, penalised, free and mixed rows alike. Both ways
    a step makes its masks: on the worker thread while the forward pass
    runs (the CPU's), and on the stepping thread after queuing it (a GPU's,
    run here on the CPU)."""
    model, tok = load(str(fixture_path("qwen3")))
    patch = patches.batched_logits_processors
    patch.revert()
    upstream, upstream_calls, _ = _mixed_batch(model, tok)
    assert upstream_calls["batch"] == 0 and upstream_calls["row"] > 0
    assert patch.apply()
    monkeypatch.setattr(patch, "masks_beside_the_pass", lambda: beside_the_pass)
    ours, calls, steps = _mixed_batch(model, tok)
    assert ours == upstream
    assert calls["row"] == 0
    assert 0 < calls["batch"] <= steps + 1
    here = threading.current_thread().name
    assert calls["threads"] == ({"mlx_lm_plus-masks_0"} if beside_the_pass else {here})
    assert json.loads(tok.decode(ours[0][:-1]))["a"] is not None  # constrained: JSON


def test_the_mask_worker_works_in_a_forked_child():
    """A forked child has the cached executor but not its thread: without
    the at-fork reset a task submitted there waits forever."""
    import os

    from mlx_lm_plus.patches.batched_logits_processors import _mask_worker

    assert _mask_worker().submit(lambda: 1).result(timeout=30) == 1
    pid = os.fork()
    if pid == 0:  # the child: nothing of MLX, and out without atexit
        try:
            ok = _mask_worker().submit(lambda: 2).result(timeout=10) == 2
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
