"""Each patch in mlx_lm_plus/patches/ fixes a bug that shows without it, and applies
only to the mlx-lm (or mlx-embeddings) it was written for."""

import json
import logging
import math
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path

import mlx.core as mx
import numpy as np
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


# -- mlx-embeddings' ModernBERT --

# Inputs of the modernbert_embed fixture in one padded pass: the short ones'
# padding runs past their last token by more than half the sliding window
# (16), so a padded position in the local layer sees no real key.
MODERNBERT_LENGTHS = (5, 14, 43)


def _modernbert(fixture_path, dtype):
    from mlx_lm_plus.models.embedders import load_embedder
    from mlx_lm_plus.models.folders import _mlx_lm_has

    embedder, _ = load_embedder(str(fixture_path("modernbert_embed")), "embed", _mlx_lm_has)
    embedder.model.set_dtype(dtype)  # (as a converted model's weights, kept on a GPU)
    inputs = [(list(range(7, 7 + n)), 0, None) for n in MODERNBERT_LENGTHS]
    return Namespace(embedder=embedder), inputs


def _passes(lm, inputs):
    """The vectors of one padded pass over `inputs`, and of each alone, as
    the embedding runner computes them."""
    from mlx_lm_plus.engine.embedding import EmbeddingRunner

    run = EmbeddingRunner(lambda what: None, budget=lambda: 4096)._run
    return run(lm, inputs), np.concatenate([run(lm, [one]) for one in inputs])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
def test_modernbert_half_precision_batches_with_patches(dtype, fixture_path):
    patches.apply_all()
    lm, inputs = _modernbert(fixture_path, dtype)
    batched, alone = _passes(lm, inputs)
    assert np.isfinite(batched).all()
    np.testing.assert_allclose(batched, alone, atol=1e-3)
    lm32, _ = _modernbert(fixture_path, mx.float32)  # (and near float32's vectors)
    np.testing.assert_allclose(batched, _passes(lm32, inputs)[1], atol=0.05)


def test_modernbert_half_precision_batches_fail_without_patches(fixture_path, unpatched):
    for dtype in (mx.bfloat16, mx.float16):
        lm, inputs = _modernbert(fixture_path, dtype)
        with pytest.raises(ValueError, match="Mask type must promote"):
            _passes(lm, inputs)
    # A mask in the model's dtype runs, but float16's -1e9 is -inf: the short
    # rows' real positions come out NaN.
    dtype = mx.float16
    lm, inputs = _modernbert(fixture_path, dtype)
    longest = max(MODERNBERT_LENGTHS)
    tokens = mx.array([ids + [0] * (longest - len(ids)) for ids, _, _ in inputs])
    mask = (mx.arange(longest)[None] < mx.array(MODERNBERT_LENGTHS)[:, None]).astype(dtype)
    hidden = np.array(lm.embedder.model.model(tokens, attention_mask=mask)[
        "last_hidden_state"].astype(mx.float32))
    assert np.isnan(hidden[0, :MODERNBERT_LENGTHS[0]]).any()
    assert np.isfinite(hidden[2]).all()  # (the longest row has no padding)


def test_modernbert_masks_leave_no_position_without_a_key(fixture_path):
    """The patched masks: a real position's keys are transformers' (the real
    keys; in a local layer those within half the window), and every padded
    position keeps one key, its own. (MLX's CPU attention gives a row with
    no key finite values anyway; a GPU kernel need not.)"""
    patches.apply_all()
    lm, _ = _modernbert(fixture_path, mx.float32)
    lengths = np.array(MODERNBERT_LENGTHS)
    longest = lengths.max()
    mask = (np.arange(longest)[None] < lengths[:, None]).astype(np.float32)
    full, sliding = lm.embedder.model.model._update_attention_mask(mx.array(mask))
    full, sliding = np.array(full)[:, 0], np.array(sliding)[:, 0]  # [B, query, key]
    near = np.abs(np.arange(longest)[:, None] - np.arange(longest)[None]) <= 8
    for row, n in enumerate(lengths):
        keys = np.broadcast_to(np.arange(longest)[None] < n, (n, longest))
        assert (full[row, :n] == keys).all() and (sliding[row, :n] == (keys & near[:n])).all()
    assert sliding.any(axis=-1).all() and full.any(axis=-1).all()


def _glu_exact(mlp, x):
    """ModernBERT's MLP as transformers runs it: Wo(gelu(input) * gate), exact GELU."""
    x = np.array(x, dtype=np.float64)
    a, gate = np.split(x @ np.array(mlp.Wi.weight, dtype=np.float64).T, 2, axis=-1)
    gelu = 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))
    return (gelu * gate) @ np.array(mlp.Wo.weight, dtype=np.float64).T


@pytest.mark.parametrize("patched", [True, False])
def test_modernbert_mlp_runs_the_exact_gelu(patched, fixture_path, restored):
    from mlx_embeddings.utils import load as load_encoder

    patches.apply_all()
    if not patched:
        patches.modernbert_gelu.revert()
    model, _ = load_encoder(str(fixture_path("modernbert_embed")))
    mlp = model.model.layers[1].mlp
    x = mx.random.normal((1, 9, 64), key=mx.random.key(0)) * 2
    error = np.abs(np.array(mlp(x)) - _glu_exact(mlp, x)).max()
    assert (error < 1e-5) if patched else (error > 1e-4), error


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
    package = patch.PATCH.package  # (mlx-lm 0.32.2's, or mlx-embeddings 0.1.0's)
    assert f"{package} {patch.PATCH.written_for}" in message and f"installed {package}" in message


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


@pytest.mark.parametrize("name, owner, attr", [
    ("modernbert_padding", "ModernBertAttention", "__call__"),
    ("modernbert_padding", "ModernBertModel", "__call__"),
    ("modernbert_gelu", "ModernBertMLP", "__init__"),
])
def test_a_patch_waits_for_the_functions_it_rests_on(name, owner, attr, restored, monkeypatch,
                                                     caplog):
    """A patch whose fix is right only with another upstream function as it
    was (the attention that reads the masks, the constructor that picks the
    GELU) is not applied where that one changed, even if its own target
    did not."""
    from mlx_embeddings.models import modernbert

    patch = getattr(patches, name)
    patch.revert()
    cls = getattr(modernbert, owner)
    original = getattr(cls, attr)

    def changed(self, *args, **kwargs):  # (another version's: other source)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, attr, changed)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_plus.patches"):
        assert patch.apply() is False
    assert f"{owner}.{attr} is not the function it was written for" in caplog.text
    monkeypatch.undo()
    assert patch.apply() is True


def test_the_server_imports_when_mlx_embeddings_has_other_names():
    """An mlx-embeddings whose ModernBERT classes are named otherwise (any
    failure of the patches' imports, not only an ImportError) leaves the
    ModernBERT patches out with a warning; the engine still imports."""
    code = ("import mlx_embeddings.models.modernbert as m; del m.ModernBertMLP; "
            "import mlx_lm_plus.engine.engine, mlx_lm_plus.patches as p; "
            "print(sorted(x.__name__.rpartition('.')[2] for x in p.PATCHES))")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "modernbert" not in out.stdout and "batched_logits_processors" in out.stdout
    assert "ModernBERT patches not applied" in out.stderr
