"""Recurrent states taken inside a model call (mlx_lm_plus/engine/taps.py): the
states a tap keeps are those of calls cut at the same place, every family of
recurrent layer and padding included; a request's checkpoints inside its
prompt cost no model call of their own; the probe refuses taps that are
wrong."""

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache

from mlx_lm_plus import patches
from mlx_lm_plus.engine import taps
from testkit.engine_harness import EngineRunner
from tests.models.test_vision import image_part, noise, user

# Recurrences run token by token: cut exactly, tapped.
TAPPED_KINDS = ["qwen3_5", "olmo_hybrid", "jamba", "mamba"]
# Chunked SSD scans (mamba2, and nemotron_h's Mamba 2 mixer): a cut changes
# their sums, so a reply would depend on the rows cut beside it. Not tapped.
REFUSED_KINDS = ["mamba2", "nemotron_h"]

# (prompt lengths, checkpoint positions per prompt, --prefill-step-size).
# Prompts of different lengths are right-padded in one call: a position of
# one row that is another row's length leaves that row no real token in a
# piece; step 16 puts positions on chunk ends (16, 32) and in later chunks.
CASES = [
    ([70, 33, 50], [[20, 45], [7], [10, 30, 49]], 2048),
    ([70, 33], [[32, 60], [20]], 2048),
    ([40, 41, 9], [[16, 32], [5, 17, 33], [3]], 16),
]


def _prompts(lengths):
    return [[(5 + 7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def _run(generator, prompts, positions, tapped: bool):
    """(the caches kept per prompt {position: cache}, the tokens generated)."""
    if tapped:
        uids = generator.insert_segments([[p] for p in prompts], max_tokens=[6] * len(prompts),
                                         taps=positions)
    else:  # a segment end at each position: a model call ends there
        segments = []
        for p, cuts in zip(prompts, positions):
            bounds = [0, *cuts, len(p)]
            segments.append([p[a:b] for a, b in zip(bounds, bounds[1:])])
        uids = generator.insert_segments(segments, max_tokens=[6] * len(prompts))
    kept = {u: {} for u in uids}
    tokens = {u: [] for u in uids}
    while True:
        prompt_responses, generated = generator.next()
        if not prompt_responses and not generated:
            break
        if tapped:
            for uid, taken in generator.take_tapped().items():
                kept[uid].update(taken)
        ends = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt]
        for uid, (cache, t) in generator.extract_cache(ends).items():
            kept[uid][len(t)] = cache
        for r in generated:
            tokens[r.uid].append(r.token)
    generator.close()
    return [kept[u] for u in uids], [tokens[u] for u in uids]


def _arrays(layer):
    if isinstance(layer, ArraysCache):
        return layer.cache
    return [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]


@pytest.fixture(scope="module", autouse=True)
def _patched():
    patches.apply_all()  # (as Engine.start: the padding fixes)


@pytest.mark.parametrize("kind", TAPPED_KINDS)
def test_tapped_states_are_those_of_calls_cut_there(kind, fixture_path):
    model, _ = load(str(fixture_path(kind)))
    recorder = taps.install(model)
    assert recorder is not None
    for lengths, positions, step in CASES:
        prompts = _prompts(lengths)
        alone = [_run(BatchGenerator(model), [p], [[]], False)[1][0] for p in prompts]
        cut = _run(BatchGenerator(model, prefill_step_size=step), prompts, positions, False)
        generator = taps.TappingBatchGenerator(model, recorder, prefill_step_size=step)
        got = _run(generator, prompts, positions, True)
        assert generator._prompt_batch.wanted == {}  # (nothing left behind)
        assert got[1] == alone == cut[1], (lengths, positions, step)
        for theirs, ours in zip(cut[0], got[0]):
            assert sorted(ours) == sorted(theirs)
            for position in theirs:
                for a, b in zip(theirs[position], ours[position]):
                    assert type(a) is type(b)
                    for x, y in zip(_arrays(a), _arrays(b)):
                        assert (x is None) == (y is None)
                        if x is not None:
                            assert x.shape == y.shape
                            assert mx.allclose(x, y, rtol=1e-4, atol=1e-5).item(), (kind, position)


@pytest.mark.parametrize("kind", TAPPED_KINDS[:2])
def test_in_bfloat16_a_reply_does_not_depend_on_the_rows_beside_it(kind, fixture_path):
    """Every row is cut at every row's positions: in bfloat16 (what real
    models run in) each prompt's reply, batched and tapped, is its reply
    alone."""
    model, _ = load(str(fixture_path(kind)))
    model.set_dtype(mx.bfloat16)
    recorder = taps.install(model)
    assert recorder is not None
    for lengths, positions, step in CASES:
        prompts = _prompts(lengths)
        alone = [_run(BatchGenerator(model), [p], [[]], False)[1][0] for p in prompts]
        got = _run(taps.TappingBatchGenerator(model, recorder, prefill_step_size=step),
                   prompts, positions, True)
        assert got[1] == alone, (lengths, positions, step)


@pytest.mark.parametrize("kind", REFUSED_KINDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mixers_whose_sums_change_when_cut_are_not_tapped(kind, dtype, fixture_path):
    model, _ = load(str(fixture_path(kind)))
    model.set_dtype(dtype)
    classes = [type(m) for _, m in model.named_modules()]
    assert taps.install(model) is None
    assert [type(m) for _, m in model.named_modules()] == classes


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_vl"])
def test_the_probe_keeps_nothing(kind, fixture_path):
    """What the probe's taps kept goes with it: a model that never taps a
    chunk held every recurrent layer's probe states for good."""
    from mlx_lm_plus.models.provider import ModelProvider
    from mlx_lm_plus.config import parse_args

    provider = ModelProvider(parse_args(["--model", str(fixture_path(kind))]))
    model = provider.load(provider.default_key).model
    recorder = taps.install(model)
    assert recorder is not None
    assert recorder.sources == [] and recorder.states == {} and recorder.cuts is None


def test_models_without_recurrent_layers_are_left_alone(fixture_path):
    model, _ = load(str(fixture_path("qwen3")))
    classes = [type(m) for _, m in model.named_modules()]
    assert taps.install(model) is None
    assert [type(m) for _, m in model.named_modules()] == classes


IN_PIECES = taps._in_pieces


def _probe_refuses(fixture_path, monkeypatch, spoil) -> bool:
    """Whether install refuses qwen3_5 when `spoil(output, recorder)` runs
    after each tapped mixer call; checks the model is left as it was."""
    model, _ = load(str(fixture_path("qwen3_5")))
    classes = [type(m) for _, m in model.named_modules()]

    def spoiled(module, call, signature, recorder, args, kwargs):
        return spoil(IN_PIECES(module, call, signature, recorder, args, kwargs), recorder)

    monkeypatch.setattr(taps, "_in_pieces", spoiled)
    refused = taps.install(model) is None
    if refused:
        assert [type(m) for _, m in model.named_modules()] == classes
        assert not any("_tap_recorder" in m.__dict__ for _, m in model.named_modules()
                       if m is not model)
        assert taps.install(model) is None  # (decided once per model)
    return refused


def test_the_probe_refuses_pieces_that_change_the_call(fixture_path, monkeypatch):
    """A tapped call whose output is off in the last bits is refused: cut
    calls must be the uncut call exactly."""
    assert _probe_refuses(fixture_path, monkeypatch, lambda out, rec: out * (1 + 2 ** -20))
    assert not _probe_refuses(fixture_path, monkeypatch, lambda out, rec: out)


def test_the_probe_refuses_states_kept_wrong(fixture_path, monkeypatch):
    """States kept 5% off what calls cut there leave are refused."""
    def off(out, recorder):
        for key, kept in recorder.states.items():
            recorder.states[key] = [None if a is None else a * 1.05 for a in kept]
        return out

    assert _probe_refuses(fixture_path, monkeypatch, off)


def _count_calls(monkeypatch, model):
    """The lengths of the model's calls, from now on."""
    calls = []
    cls = type(model)
    forward = cls.__call__

    def counted(self, inputs, *args, **kwargs):
        calls.append(inputs.shape[1])
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", counted)
    return calls


SYSTEM = "You are a careful assistant who plans trips. " * 6


@pytest.mark.parametrize("kind, tapping", [("qwen3_5", True), ("qwen3_5", False),
                                           ("qwen3_5_vl", True)])
def test_a_turn_is_one_prefill_call_with_its_checkpoints(kind, tapping, fixture_path,
                                                          monkeypatch):
    """A conversation's later turn stores a state at the start of its last
    user message (for an edit of it) and at the end of its prompt: with taps
    both come from one prefill call, as upstream's turn makes; without, each
    checkpoint ends a call. The checkpoint serves an edit of that message,
    and replies equal a cache-off server's. On a vision model (mlx-vlm's
    Qwen 3.5, whose attention layers carry an M-RoPE delta) the first
    message has a picture, and the edit resumes after it with its delta."""
    if not tapping:
        monkeypatch.setattr(taps, "install", lambda model: None)
    runner = EngineRunner(fixture_path(kind))
    cold = EngineRunner(fixture_path(kind), max_bytes=0)
    try:
        calls = _count_calls(monkeypatch, runner.loaded.model)
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(3):
            text = f"Turn {t}: plan day {t} by the sea."
            if kind.endswith("_vl") and t == 0:
                messages.append(user(image_part(noise(3)), text))
            else:
                messages.append({"role": "user", "content": text})
            calls.clear()
            tokens, prompt, cached = runner.run({"messages": messages, "max_tokens": 4})
            prefill = [n for n in calls if n > 1]
            if t:
                assert len(prefill) == (1 if tapping else 2), calls
                assert sum(prefill) == prompt - cached - 1
            text = runner.loaded.tokenizer.decode(tokens)
            messages.append({"role": "assistant", "content": text})
        # (The first turn's, at the start of its message, precedes the
        # picture: the picture's prefill stores it.)
        kinds = sorted(e.kind for e in runner.store.entries())
        assert kinds.count("checkpoint") == 2 + kind.endswith("_vl"), kinds
        # An edit of the last user message resumes at its start.
        edited = messages[:-2] + [{"role": "user", "content": "Something else entirely."}]
        start = max(e.ntokens for e in runner.store.entries() if e.kind == "checkpoint")
        body = {"messages": edited, "max_tokens": 6}
        tokens, prompt, cached = runner.run(body)
        assert cached == start
        assert tokens == cold.run(body)[0]
    finally:
        runner.close()
        cold.close()


def test_a_tap_that_kept_no_state_releases_the_requests_waiting_for_it(fixture_path, monkeypatch):
    """A request parked behind another's system-prompt checkpoint is let go
    when that checkpoint's position is passed, stored or not (here no layer
    kept a state there): not at the end of the other's prompt."""
    from mlx_lm_plus.engine import engine

    monkeypatch.setattr(taps.TappingPromptBatch, "_checkpoint", lambda *a: None)
    parked, released = [], []
    park, unpark = engine._Batch.park, engine._Batch._unpark

    def watched_park(self, *args):
        held = park(self, *args)
        if held:
            parked.append(self._parked[-1][1])
        return held

    def watched_unpark(self, uid=None, stored=None):
        waiting = len(self._parked)
        unpark(self, uid, stored)
        if len(self._parked) < waiting:
            released.append(stored)

    monkeypatch.setattr(engine._Batch, "park", watched_park)
    monkeypatch.setattr(engine._Batch, "_unpark", watched_unpark)
    system = "You are a careful assistant for travel planning. Answer with short lists. " * 6
    runner = EngineRunner(fixture_path("qwen3_5"), argv=["--prefill-step-size", "16"])
    try:
        runner.loaded
        lead = runner.submit({"messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": "Plan the coast. " * 60}],
                              "max_tokens": 3})
        while not isinstance(lead.items.get(timeout=60), tuple):
            pass  # (its prefill has begun)
        follower = runner.submit({"messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": "A question?"}],
                                  "max_tokens": 3})
        follower.result()
        lead.result()
        assert parked and released[:1] == parked[:1], (parked, released)
    finally:
        runner.close()


def test_a_tap_holds_its_own_rows_state_only(fixture_path):
    """What a chunk's taps keep, once the chunk is done, is each wanting row's
    state alone: a row's slice of a piece's batch state (a view) would keep
    the whole batch's state alive, and a copy not yet evaluated the piece's
    output; eight rows tapped at positions of their own, 24 checkpoints."""
    import gc

    model, _ = load(str(fixture_path("qwen3_5")))
    recorder = taps.install(model)
    prompts = _prompts([60] * 8)
    positions = [[5 + row, 20 + 2 * row, 40 + 2 * row] for row in range(8)]

    def tapped_states():
        generator = taps.TappingBatchGenerator(model, recorder, prefill_step_size=2048)
        generator.insert_segments([[p] for p in prompts], max_tokens=[1] * 8, taps=positions)
        generator.next()  # the prompts' one chunk
        taken = generator.take_tapped()
        generator.close()
        states = [a for checkpoints in taken.values() for _, cache in checkpoints
                  for layer in cache if isinstance(layer, ArraysCache)
                  for a in layer.cache if a is not None]
        assert len(taken) == 8 and sum(map(len, taken.values())) == 24
        return states

    tapped_states()  # (anything made once)
    gc.collect()
    mx.clear_cache()  # (a buffer reused from it may be larger than asked)
    before = mx.get_active_memory()
    states = tapped_states()
    gc.collect()
    held = mx.get_active_memory() - before
    # What as many arrays of their shapes take (the allocator rounds up).
    before = mx.get_active_memory()
    alone = [mx.zeros(a.shape, a.dtype) for a in states]
    mx.eval(alone)
    kept = mx.get_active_memory() - before
    assert kept >= sum(a.nbytes for a in states) > 0
    assert held <= 1.25 * kept, (held, kept)
