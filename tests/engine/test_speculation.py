"""Prompt lookup in the batch (engine/speculation.py): proposals checked in
one pass, each row keeping what the model would have written, and the KV of
what it rejected gone.

Random-weight fixtures rarely repeat themselves, so most tests propose from
an oracle: the row's true continuation (from a run without speculation),
with tokens corrupted at random. Rows then keep long prefixes and reject at
varied positions in the same step, which is what the rollback must get
right: a position of rejected KV left behind changes every later token of
these context-sensitive fixtures."""

import random
import threading
import time
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache
from mlx_lm.server import Response

from mlx_lm_plus.engine import speculation
from testkit.engine_harness import EngineRunner

LOOKUP = ["--prompt-lookup-tokens", "5"]
# The chi-square distribution's 0.999 quantile, by degrees of freedom 1..20.
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26,
            32.91, 34.53, 36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31]


def chi2_statistic(table: np.ndarray) -> float:
    """Pearson's statistic of a contingency table (rows: samples)."""
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float((((table - expected) ** 2) / expected).sum())


def assert_same_distribution(counts):
    """counts["off"] and counts["on"] (outcome -> times seen) can't be told
    apart: chi-square of their table under its 0.999 quantile."""
    keys = sorted(set(counts["off"]) | set(counts["on"]))
    table = np.array([[counts[name][k] for k in keys] for name in ("off", "on")])
    assert len(keys) >= 4, table
    assert chi2_statistic(table) < CHI2_999[len(keys) - 2], (keys, table)


def chat(text, **kw):
    return {"messages": [{"role": "user", "content": text}], **kw}


def replies(runner, bodies, path="/v1/chat/completions", together=False):
    """Each request's (tokens, logprobs of those tokens, its context: the
    prompt, its speculation figures). Logprobs are asked for where a body
    does not say (a token's logprob is 0.0 unless asked). `together`: the
    engine's loop is held until every request is queued, so all are
    admitted before the batch's first step, whatever this machine's timing
    (one batch composition: under --kv-bits a row's numbers depend on it)."""
    gate = threading.Event()
    if together:
        scheduler = runner.engine.scheduler
        real_next = scheduler.next

        def held():
            gate.wait(60)
            return real_next()

        scheduler.next = held
    try:
        channels = [runner.submit({"logprobs": True, **b}, path=path) for b in bodies]
    finally:
        gate.set()
        if together:
            del scheduler.next  # (the class's again)
    out = []
    for channel in channels:
        tokens, logprobs, ctx = [], [], None
        while (item := channel.items.get(timeout=120)) is not None:
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Response):
                tokens.append(item.token)
                logprobs.append(item.logprob)
            elif not isinstance(item, tuple):
                ctx = item
        out.append((tokens, logprobs, ctx))
    return out


def run(runner, bodies, path="/v1/chat/completions", together=False):
    """Each request's (tokens, logprobs of those tokens, prompt tokens)."""
    return [(t, lp, list(ctx.prompt))
            for t, lp, ctx in replies(runner, bodies, path, together)]


def assert_as_without(reference, got, runner):
    """Each request's tokens and logprobs are those of its run without
    proposals, and proposals were checked: some kept, some rejected."""
    for (want, want_lp, _), (tokens, lp, _) in zip(reference, got, strict=True):
        assert tokens == want
        np.testing.assert_allclose(lp, want_lp, atol=2e-4)
    assert 0 < runner.engine.counters.lookup_accepted < runner.engine.counters.lookup_proposed


class Oracle:
    """Proposes each row's reference continuation (the guess at its pending
    token, then proposals), a token in `corrupt` of them changed (so rows
    reject at varied places)."""

    def __init__(self, references, corrupt=0.35, seed=0):
        self.references = [p + t for t, _, p in references]
        self.corrupt, self.random = corrupt, random.Random(seed)
        self.calls = 0

    def install(self, monkeypatch) -> "Oracle":
        """Every row's lookups answered by this oracle."""
        monkeypatch.setattr(speculation.RowLookup, "propose",
                            lambda lookup, *a: self.propose(lookup, *a))
        return self

    def propose(self, lookup, tokens, tail, room):
        known = list(tokens) + list(tail)
        for ref in self.references:
            if ref[:len(known)] == known:
                k = min(lookup.length, room)
                following = ref[len(known):len(known) + k + 1]
                if len(following) > 1 and self.random.random() < self.corrupt:
                    j = self.random.randrange(1, len(following))
                    following[j] = (following[j] + 1) % 500
                self.calls += len(following) > 1
                return following
        return []


MIXED = [
    chat("Tell me about rivers and boats.", max_tokens=40),
    chat("A long walk in the hills, told slowly.", max_tokens=60),
    chat("Count the stations on the line.", max_tokens=35, repetition_penalty=1.3),
    chat("Name three trees.", max_tokens=25, logit_bias={"7": 3.0}),
    chat("What is in the box?", max_tokens=50, temperature=0.0),
    chat("Give me JSON about a city.", max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}},
            "required": ["name"]}}}),
    chat("Sing a song of the sea.", max_tokens=45, presence_penalty=0.5),
    chat("One more about the rain, please.", max_tokens=55),
]


def forced(monkeypatch, drop=None):
    """Check every proposal (a step's cost taken as the same whatever its
    width: the widths then don't hang on this machine's timings) and, with
    `drop`, always carry (within CARRY_MAX) or always roll."""
    monkeypatch.setattr(speculation.StepCost, "predict", lambda self, positions: 1.0)
    if drop == "carry":
        monkeypatch.setattr(
            speculation.SpeculativeGenerationBatch, "_drop",
            lambda self, r: max(r) if max(r) - min(r) <= speculation.CARRY_MAX else min(r))
    elif drop == "roll":
        monkeypatch.setattr(speculation.SpeculativeGenerationBatch, "_drop",
                            lambda self, r: min(r))


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5", "gemma3_text"])
def pair(fixture_path, request):
    """The attention fixture, a hybrid one (Qwen3.5: GatedDeltaNet layers,
    their states rolled back from taps, rollback.py) and one with sliding
    windows (Gemma 3: a 32-token window every other layer, passed by every
    prompt here; batch_kv.py)."""
    off = EngineRunner(fixture_path(request.param))
    on = EngineRunner(fixture_path(request.param), argv=LOOKUP)
    yield off, on
    off.close()
    on.close()


@pytest.mark.parametrize("together,drop", [(1, None), (8, None), (8, "carry"), (8, "roll")])
def test_greedy_text_and_logprobs_are_those_without_it(pair, monkeypatch, together, drop):
    """Alone and eight at a time, rows with penalties, logit_bias and a
    schema beside rows that propose: the same tokens, the same logprobs (to
    float rounding of a wider call), and the proposals really were checked,
    kept and rejected. Rows that rejected different numbers of positions
    have them dropped as _drop chooses, or always by carrying, or always by
    rolling."""
    off, on = pair
    forced(monkeypatch, drop)
    bodies = MIXED[:together]
    reference = run(off, bodies)
    oracle = Oracle(reference).install(monkeypatch)
    before = (on.engine.counters.lookup_proposed, on.engine.counters.lookup_accepted)
    got = run(on, bodies)
    for (want, want_lp, _), (tokens, lp, _), body in zip(reference, got, bodies):
        assert tokens == want, body
        np.testing.assert_allclose(lp, want_lp, atol=2e-4)
    proposed = on.engine.counters.lookup_proposed - before[0]
    accepted = on.engine.counters.lookup_accepted - before[1]
    assert oracle.calls > 3 and 0 < accepted < proposed, (proposed, accepted)


@pytest.mark.parametrize("beside", [None, "carry", "roll"])
def test_a_row_that_stops_inside_its_kept_tokens_hands_back_only_its_own(
        pair, monkeypatch, beside):
    """A stop word met in the middle of a kept run: the reply ends there,
    the entry it stores holds its tokens' KV and no more, and a follow-up
    resuming it writes what a run without speculation writes. Beside a row
    whose proposals all fail, the tokens it kept past what that row kept
    are carried to the next step (their KV dropped), the stop among them
    or not (the entry then holds what its KV has), or that row's rejected
    positions are rolled into its padding (the two ways _drop chooses
    between)."""
    off, on = pair
    tokenizer = on.loaded.tokenizer
    body = chat("Stop me in the middle of a run.", max_tokens=40)
    (free, _, prompt), = run(off, [body])
    # A token of the answer that is a word of its own, first seen there.
    at = next(i for i in range(9, 30) if free[i] not in free[:i]
              and tokenizer.encode(tokenizer.decode([free[i]]), add_special_tokens=False)
              == [free[i]])
    body["stop"] = [tokenizer.decode([free[at]])]
    (reference, _, _), = run(off, [body])
    assert reference == free[:at + 1]
    # Proposals run on past the stop word (the answer without it).
    oracle = Oracle([(free, None, prompt)], corrupt=0.0)
    other = chat("Keep nothing of what I propose.", max_tokens=30)

    def propose(self, tokens, tail, room):
        if list(tokens[:len(prompt)]) == prompt:
            return oracle.propose(self, tokens, tail, room)
        return [0] + [(tokens[-1] + 1) % 500] * min(3, room)  # (rejected, nearly always)

    monkeypatch.setattr(speculation.RowLookup, "propose", propose)
    carried = []
    real_finish = speculation.SpeculativeGenerationBatch._finish

    def finish(self, emitted, *rest):
        carried.append(bool(self.carried))
        return real_finish(self, emitted, *rest)

    monkeypatch.setattr(speculation.SpeculativeGenerationBatch, "_finish", finish)
    forced(monkeypatch, beside)
    kept_past_the_stop = []
    real_outcome = speculation.SpeculativeGenerationBatch._outcome

    def outcome(check, proposal):
        kept, token = real_outcome(check, proposal)
        kept_past_the_stop.append(free[at] in proposal[:kept - 1])
        return kept, token

    monkeypatch.setattr(speculation.SpeculativeGenerationBatch, "_outcome",
                        staticmethod(outcome))
    on.store.clear()
    got, *rest = run(on, [body] + ([other] if beside else []))
    assert got[0] == reference and any(kept_past_the_stop)
    assert any(carried) == (beside == "carry")
    (entry,) = [e for e in on.store.entries() if e.kind == "generated"
                and list(e.key[:len(prompt)]) == prompt]
    key = list(entry.key)
    assert key == (prompt + reference)[:len(key)] and len(key) >= len(prompt) + at + 1 - speculation.CARRY_MAX
    if not beside:
        assert key == prompt + reference
    stored = on.store.stored_cache(entry)
    assert all(layer.offset == len(key) for layer in stored if hasattr(layer, "offset"))
    # A recurrent layer's state is the one after the key (at the stop, not
    # after the tokens kept past it): as a prefill of the key leaves it.
    fresh = make_prompt_cache(on.loaded.model)
    mx.eval(on.loaded.model(mx.array(key)[None], cache=fresh))
    for mine, theirs in zip(stored, fresh):
        if isinstance(mine, ArraysCache):
            for a, b in zip(mine.cache, theirs.cache):
                np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-3)
        if isinstance(mine, RotatingKVCache):
            # A sliding window's: its buffer, in the order its next update
            # reads it (a one-token update keeps all but its front), is
            # the key's last positions, the window before the next at least.
            for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                held = mine._temporal_order(a)
                assert mine.max_size - 1 <= held.shape[2] <= b.shape[2]
                np.testing.assert_allclose(np.array(held), np.array(b[..., -held.shape[2]:, :]),
                                           atol=1e-4, rtol=1e-3)
    if beside:
        (want, _, _), = run(off, [other])
        assert rest[0][0] == want
    monkeypatch.undo()
    follow = {"messages": body["messages"] + [
        {"role": "assistant", "content": tokenizer.decode(reference[:-1])},
        {"role": "user", "content": "And then?"}], "max_tokens": 12}
    tokens, _, cached = on.run(follow)
    assert cached > 0 and tokens == off.run(follow)[0]


def test_lookup_finds_the_continuation_of_the_latest_earlier_occurrence():
    lookup = speculation.RowLookup(speculation.RowSampling(0.0), max_tokens=4)
    tokens = [5, 1, 2, 3, 9, 9, 7, 1, 2, 3, 8, 6, 0, 1, 2]
    # The suffix (1, 2, 3) last occurred at 7..9: 8, 6, 0, 1 followed.
    # A guess at the pending token (8), then up to four proposals.
    assert lookup.propose(tokens, [3], room=10) == [8, 6, 0, 1, 2]
    assert lookup.propose(tokens, [3], room=2) == [8, 6, 0]
    assert lookup.propose(tokens, [3, 4], room=10) == []  # (3, 4) never seen before
    assert lookup.wait == 1  # (a miss: it skips a step, more after more misses)
    assert not lookup.ready() and lookup.ready()
    assert lookup.propose(tokens, [3], room=10) == [8, 6, 0, 1, 2] and lookup.misses == 0
    # A match that runs back further wins over a later one: (0, 1, 2, 3)
    # at 1..4 against (9, 2, 3) at 7..9.
    other = speculation.RowLookup(speculation.RowSampling(0.0), max_tokens=3)
    assert other.propose([0, 1, 2, 3, 4, 4, 4, 9, 2, 3, 5, 5, 0, 1, 2], [3], room=9) == [4, 4, 4, 9]
    # The continuation runs to the last known token (a loop).
    assert other.propose([7, 8, 7, 8, 7], [8], room=9) == [7, 8]
    # Nothing kept: it waits before proposing again, longer each time.
    lookup.verified(4, 0)
    lookup.verified(1, 0)
    assert lookup.length == 1 and lookup.wait == 1
    assert not lookup.ready() and lookup.ready()
    assert lookup.propose(tokens, [3], room=10) == [8, 6]
    lookup.verified(1, 1)
    assert lookup.length == 2 and lookup.failures == 0


@pytest.mark.parametrize("sampling", [
    speculation.RowSampling(temperature=0.7, top_k=6),
    speculation.RowSampling(temperature=1.3, top_p=0.9, min_p=0.05)], ids=["top_k", "top_p_min_p"])
def test_rejection_sampling_keeps_the_distribution(sampling):
    """A proposal d kept with probability p(d), else a draw from p without
    d, and the bonus token from p when all are kept: the first token and
    the second (given the first) are each distributed as p (chi-square over
    20,000 draws, filters and temperature included; proposals of two
    tokens, likely and unlikely, and one that filters drop)."""
    mx.random.seed(3)
    vocab = 8
    # Three positions with the same logits: p is the same at each.
    logits = mx.array([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -4.0]] * 3)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = np.array(mx.softmax(sampling.log_weights(logprobs[:1]), axis=-1)[0])
    draws = 20_000
    for proposal in ([1, 0], [0, 2], [7, 7]):
        first, second = Counter(), Counter()
        for _ in range(draws // 100):
            checks = [speculation.SpeculativeGenerationBatch._check(sampling, logprobs, proposal)
                      for _ in range(100)]
            mx.eval([v for c in checks for v in c.values()])
            for check in checks:
                kept, token = speculation.SpeculativeGenerationBatch._outcome(check, proposal)
                written = proposal[:kept] + [token]
                first[written[0]] += 1
                if len(written) > 1:  # (the first proposal kept)
                    second[written[1]] += 1
        for counts in (first, second):
            if not counts:  # (a proposal filters drop is never kept)
                continue
            observed = np.array([counts[t] for t in range(vocab)])
            expected = p * observed.sum()
            assert observed[p == 0].sum() == 0, (proposal, observed)
            live = p > 0
            chi2 = (((observed[live] - expected[live]) ** 2) / expected[live]).sum()
            assert chi2 < CHI2_999[live.sum() - 2], (proposal, chi2, observed, expected.round())
        assert sum(second.values()) >= draws * p[proposal[0]] * 0.9  # (seen when kept)


def test_sampled_rows_in_the_batch_keep_their_distribution(fixture_path, monkeypatch):
    """End to end at temperature 1 (top_k 4): the first two tokens, the
    second proposed by an oracle that always proposes the same token, are
    distributed as without proposals (a chi-square test of the two tables,
    600 requests each)."""
    body = chat("Pick a word.", max_tokens=2, temperature=1.0, top_k=4)
    counts = {}
    for name, argv in (("off", []), ("on", LOOKUP)):
        runner = EngineRunner(fixture_path("qwen3"), argv=argv)
        try:
            first = runner.run({**body, "max_tokens": 1, "temperature": 0.0})[0][0]
            mx.random.seed(11)
            if name == "on":
                proposed = []

                def propose(self, tokens, tail, room):
                    proposed.append(len(tokens))
                    return [0, first]  # (a guess, then always the same token)

                monkeypatch.setattr(speculation.RowLookup, "propose", propose)
            # Both tokens sampled (the second proposed: always `first`).
            seen = Counter()
            for start in range(0, 600, 8):
                for tokens, _, _ in run(runner, [
                        {**body, "messages": body["messages"]} for _ in range(8)]):
                    seen[tuple(tokens)] += 1
            counts[name] = seen
            if name == "on":
                assert proposed
        finally:
            monkeypatch.undo()
            runner.close()
    assert_same_distribution(counts)


def test_a_short_row_beside_a_long_one_in_a_sliding_window(fixture_path, monkeypatch):
    """Sliding windows (Gemma 3's 32 tokens): a long row fills and wraps
    the window's buffer with plain steps while a short row beside it is
    still left-padded there; checks made then (every third step) keep both
    rows' text and logprobs those without speculation (a check's mask must
    take the buffer's order from before the check: batch_kv.py)."""
    kind = "gemma3_text"
    off, on = EngineRunner(fixture_path(kind)), EngineRunner(fixture_path(kind), argv=LOOKUP)
    try:
        long = " ".join(f"w{i}" for i in range(30))
        bodies = [{"prompt": long, "max_tokens": 40}, {"prompt": "a b", "max_tokens": 24}]
        tokenizer = on.loaded.tokenizer
        assert len(tokenizer.encode(long)) > 40 and len(tokenizer.encode("a b")) < 6
        reference = run(off, bodies, "/v1/completions")
        oracle = Oracle(reference, corrupt=0.3)
        calls = []

        def propose(lookup, tokens, tail, room):
            calls.append(1)  # (proposals every third call: plain steps between)
            return oracle.propose(lookup, tokens, tail, room) if len(calls) % 3 == 0 else []

        monkeypatch.setattr(speculation.RowLookup, "propose", propose)
        monkeypatch.setattr(speculation.RowLookup, "ready", lambda lookup: True)
        forced(monkeypatch)
        got = run(on, bodies, "/v1/completions")
        assert_as_without(reference, got, on)
    finally:
        off.close()
        on.close()


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "gemma3_vl", "qwen3_5_vl"])
def test_vision_models_propose_beside_images(kind, fixture_path, monkeypatch):
    """Vision models (Qwen2.5-VL's M-RoPE, whose text positions follow each
    row's offset; Gemma 3's sliding windows; Qwen3.5's recurrent layers):
    rows with images and rows of text in one batch, offered an oracle's
    proposals, write the text and logprobs they write without; rejected
    positions rolled or carried."""
    from tests.models.test_vision import BLUE, RED, image_part, user

    off, on = EngineRunner(fixture_path(kind)), EngineRunner(fixture_path(kind), argv=LOOKUP)
    try:
        bodies = [{"messages": [user(image_part(RED), "Describe the picture.")], "max_tokens": 40},
                  {"messages": [user(image_part(BLUE), "and", image_part(RED), "Compare.")],
                   "max_tokens": 30},
                  chat("Tell me about rivers and boats.", max_tokens=40),
                  chat("Count the stations.", max_tokens=35, repetition_penalty=1.3)]
        reference = run(off, bodies)
        Oracle(reference, corrupt=0.3).install(monkeypatch)
        forced(monkeypatch)
        got = replies(on, bodies)
        for (want, want_lp, _), (tokens, lp, ctx), body in zip(reference, got, bodies):
            assert tokens == want, body
            np.testing.assert_allclose(lp, want_lp, atol=2e-4)
            assert ctx.speculation["accepted"] > 0, body  # (image rows too)
        assert 0 < on.engine.counters.lookup_accepted < on.engine.counters.lookup_proposed
    finally:
        off.close()
        on.close()


@pytest.mark.parametrize("start,together,drop", [
    (0, 8, None), (0, 8, "carry"), (0, 8, "roll"), (40, 1, None)])
def test_kv_bits_rows_propose(fixture_path, monkeypatch, start, together, drop):
    """--kv-bits (a batched quantized KV, quantized_batch.py): rows quantized
    from their first call, eight at a time, or alone and quantized in the
    middle of the answer (--quantized-kv-start 40), write what they write
    without proposals: a check never takes a float layer to its start (it
    would attend in float what one-token steps attend quantized)."""
    path = fixture_path("qwen3_kv")
    kv = ["--kv-bits", "4", "--quantized-kv-start", str(start)]
    off, on = EngineRunner(path, argv=kv), EngineRunner(path, argv=kv + LOOKUP)
    try:
        bodies = MIXED[:together]
        reference = run(off, bodies, together=True)
        if start:
            assert len(reference[0][2]) < start < len(reference[0][2]) + len(reference[0][0])
        Oracle(reference, corrupt=0.5, seed=3).install(monkeypatch)
        forced(monkeypatch, drop)
        got = run(on, bodies, together=True)
        assert_as_without(reference, got, on)
        assert on.sequential == 0
    finally:
        off.close()
        on.close()


@pytest.mark.parametrize("kind", ["mamba", "mamba2", "nemotron_h", "jamba"])
def test_recurrent_models_roll_back_their_states(kind, fixture_path, monkeypatch):
    """Recurrent layers (Mamba 1 and 2, Nemotron-H's, Jamba's beside
    attention) have each row's state set back to the one after what it
    kept (rollback.py; mamba2's chunked scan too: a checking step cuts it at
    every position, one token a piece as a decode step runs it): offered an
    oracle's proposals, they check them and write what they write without."""
    off, on = EngineRunner(fixture_path(kind)), EngineRunner(fixture_path(kind), argv=LOOKUP)
    try:
        bodies = [chat(" ".join(f"word {j} of line {i}." for j in range(12)), max_tokens=40)
                  for i in range(4)]
        reference = run(off, bodies)
        Oracle(reference, corrupt=0.3).install(monkeypatch)
        forced(monkeypatch)
        got = run(on, bodies)
        assert_as_without(reference, got, on)
    finally:
        off.close()
        on.close()


def test_seeded_rows_beside_proposing_rows_keep_their_text(pair, monkeypatch):
    """A seeded row shares checking steps with rows that propose (its
    pending token checked at position 0): its text is its text alone."""
    off, on = pair
    seeded = [chat(f"A seeded story {i}.", max_tokens=20, temperature=0.8, seed=7 + i)
              for i in range(2)]
    alone = [on.run(b)[0] for b in seeded]
    greedy = MIXED[:4]
    Oracle(run(off, greedy)).install(monkeypatch)
    forced(monkeypatch, "carry")
    before = on.engine.counters.lookup_steps
    got = run(on, seeded + greedy)
    assert [t for t, _, _ in got[:2]] == alone
    assert on.engine.counters.lookup_steps > before


def test_a_client_gone_while_its_row_carries_tokens(pair, monkeypatch):
    """Rows carrying tokens (their KV dropped with others' rejections) when
    one of them is cancelled: it leaves, its carried tokens with it, and
    the rest write what they write without proposals."""
    off, on = pair
    bodies = [chat(f"Carry on {i}.", max_tokens=60) for i in range(3)]
    reference = run(off, bodies)
    Oracle(reference, corrupt=0.5, seed=4).install(monkeypatch)
    forced(monkeypatch, "carry")
    carrying = []  # the requests (by arrival: uids grow) whose rows carried tokens
    release = threading.Event()
    real_finish = speculation.SpeculativeGenerationBatch._finish

    def finish(self, emitted, *rest):
        out = real_finish(self, emitted, *rest)
        if len(self.uids) == 3 and self.carried and not carrying:
            carrying.extend(sorted(self.uids).index(uid) for uid in self.carried)
            release.wait(30)  # (the next step waits for the cancel)
        return out

    monkeypatch.setattr(speculation.SpeculativeGenerationBatch, "_finish", finish)
    channels = [on.submit(b) for b in bodies]
    deadline = time.monotonic() + 60
    while not carrying:
        assert time.monotonic() < deadline, "no row carried tokens"
        time.sleep(0.001)
    gone = carrying[0]
    channels[gone].cancel()
    release.set()
    channels[gone].cancel_and_drain()
    for i, (channel, (want, _, _)) in enumerate(zip(channels, reference)):
        if i != gone:
            assert channel.result()[0] == want
    assert len(on.run(chat("After them.", max_tokens=5))[0]) == 5


def test_another_mlx_lm_turns_it_off_with_a_warning(fixture_path, monkeypatch, caplog):
    """Where GenerationBatch is not the one this was written for, the flag
    is off (a warning says so) and requests are served as without it."""
    from mlx_lm_plus import upstream

    assert upstream.generation_batch_as_written()  # (the installed 0.32.2)
    monkeypatch.setitem(upstream._GENERATION_BATCH_SOURCES, ("GenerationBatch", "next"),
                        "0" * 64)
    monkeypatch.setattr(upstream, "_as_written", {})
    runner = EngineRunner(fixture_path("qwen3"), argv=LOOKUP)
    try:
        with caplog.at_level("WARNING"):
            assert len(runner.run(chat("Still served.", max_tokens=5))[0]) == 5
        assert "--prompt-lookup-tokens is off" in caplog.text
    finally:
        runner.close()


def test_proposals_are_checked_only_where_they_pay():
    """widest_paying, on step costs as measured: where each position costs
    its share (a CPU) low acceptance checks none and high acceptance some;
    where a step costs the same whatever its size (a GPU) all are checked."""
    def rows(rate, n=4):
        out = []
        for _ in range(n):
            r = speculation.RowLookup(speculation.RowSampling(0.0), max_tokens=8)
            r._kept, r._checked = rate, 1.0
            out.append(r)
        return out

    proposals, fed = [[1] * 8] * 4, [1] * 4
    cpu = speculation.StepCost()
    for positions in (4, 4, 12, 20, 36):
        cpu.observe(positions, 0.03 + 0.025 * positions)
    assert abs(cpu.predict(100) - 2.53) < 1e-6 and abs(cpu.slope() - 0.025) < 1e-9
    assert speculation.widest_paying(rows(0.2), proposals, fed, cpu) == 0
    assert 0 < speculation.widest_paying(rows(0.95), proposals, fed, cpu) < 8
    gpu = speculation.StepCost()
    for positions in (4, 12, 36):
        gpu.observe(positions, 0.02)
    assert speculation.widest_paying(rows(0.2), proposals, fed, gpu) == 8
    fresh = speculation.StepCost()  # (nothing seen: proposals get tried)
    assert speculation.widest_paying(rows(0.5), proposals, fed, fresh) == 8
    # Positions cheap but not free (a + b P, 0.1 + 0.004 P): all rows
    # proposing, the widest; one row proposing nothing, no step over
    # MAX_STEP_GROWTH times a plain one (1.5 x 0.116 s: 4 rows of 1 + 3,
    # 0.164 s, not of 1 + 4, 0.18 s).
    cheap = speculation.StepCost()
    for positions in (4, 12, 36):
        cheap.observe(positions, 0.1 + 0.004 * positions)
    assert speculation.widest_paying(rows(0.95), proposals, fed, cheap) == 8
    assert speculation.MAX_STEP_GROWTH == 1.5
    idle = [[1] * 8] * 3 + [[]]
    assert speculation.widest_paying(rows(0.95), idle, fed, cheap) == 3
    # ... a probe too (its rate as if free, its bound the costs seen); and
    # where no slope is known yet, one (the narrowest check, to learn it).
    assert speculation.widest_paying(rows(0.2), idle, fed, cheap, probe=True) == 3
    assert speculation.widest_paying(rows(0.95), idle, fed, fresh) == 1
    flat_so_far = speculation.StepCost()
    flat_so_far.observe(4, 0.1)
    assert speculation.widest_paying(rows(0.95), idle, fed, flat_so_far) == 1
    # Drafting's own cost (a draft model): where drafting 8 costs 0.5 s,
    # fewer are drafted.
    drafting = speculation.DraftCost()
    for width in (1, 4, 8):
        drafting.observe(width, 0.02 + 0.06 * width)
    assert 0 < speculation.widest_paying(rows(0.95), proposals, fed, cheap, drafting) < 8
    # (and drafting not seen yet, beside a row proposing nothing: one)
    assert speculation.widest_paying(rows(0.95), idle, fed, cheap,
                                     speculation.DraftCost()) == 1


def test_its_figures_reach_stats_metrics_and_the_request_record(pair, monkeypatch):
    """The engine's prompt_lookup figures (for /v1/stats and /metrics) and a
    request's own (its log line and record: tokens per step)."""
    from mlx_lm_plus.http.metrics import RequestRecord

    off, on = pair
    body = MIXED[0]
    Oracle(run(off, [body]), corrupt=0.0).install(monkeypatch)
    forced(monkeypatch)
    before = dict(on.engine.prompt_lookup)
    channel = on.submit(body)
    tokens, ctx = channel.result()
    after = on.engine.prompt_lookup
    figures = ctx.speculation
    assert figures["accepted"] > 0 and figures["verify_steps"] > 0
    assert after["accepted_tokens"] - before["accepted_tokens"] == figures["accepted"]
    assert after["verify_steps"] - before["verify_steps"] == figures["verify_steps"]
    record = RequestRecord(id="x", endpoint="/v1/chat/completions", model="m", status=200,
                           started=0.0, generated_tokens=len(tokens), speculation=figures)
    steps = len(tokens) - figures["accepted"]
    assert record.tokens_per_step == len(tokens) / steps > 1
    assert record.as_dict()["tokens_per_step"] == round(len(tokens) / steps, 2)


def test_recurrent_states_held_by_a_check_stay_in_their_budget(fixture_path, monkeypatch):
    """A checking step holds each position's recurrent states: where even
    two positions' would pass STATE_BUDGET_BYTES, nothing is checked (and
    the text is the text without proposals)."""
    from mlx_lm_plus.engine import rollback

    off, on = EngineRunner(fixture_path("mamba")), EngineRunner(fixture_path("mamba"), argv=LOOKUP)
    try:
        bodies = [chat(f"Line {i} of a long song about the hills.", max_tokens=30)
                  for i in range(2)]
        reference = run(off, bodies)
        oracle = Oracle(reference, corrupt=0.0).install(monkeypatch)
        forced(monkeypatch)
        monkeypatch.setattr(rollback, "STATE_BUDGET_BYTES", 1)
        assert [t for t, _, _ in run(on, bodies)] == [t for t, _, _ in reference]
        assert on.engine.counters.lookup_steps == 0 and oracle.calls > 0
        monkeypatch.setattr(rollback, "STATE_BUDGET_BYTES", 1 << 30)
        assert [t for t, _, _ in run(on, bodies)] == [t for t, _, _ in reference]
        assert on.engine.counters.lookup_steps > 0
    finally:
        off.close()
        on.close()


TOOL = {"type": "function", "function": {
    "name": "move", "description": "Move to a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}}
GRAMMARS = [
    # A string grammar (the JSON runs past max_tokens), and one that ends
    # early (then EOS only): proposals past its last token are cut.
    chat("Give me JSON about a city.", max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}},
            "required": ["name"]}}}),
    chat("Which city?", max_tokens=30, chat_template_kwargs={"enable_thinking": False},
         response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome"]},
                                             "ok": {"type": "boolean"}},
            "required": ["city", "ok"], "additionalProperties": False}}}),
    # A forced tool call (the grammar from its first token), with a penalty.
    chat("Go somewhere.", max_tokens=40, tools=[TOOL], tool_choice="required",
         repetition_penalty=1.2),
    # Strict tools: free text until the model opens a call (none here).
    chat("Talk, then maybe move.", max_tokens=35, tools=[{**TOOL, "function": {
        **TOOL["function"], "strict": True}}]),
    chat("A plain row beside them.", max_tokens=30),
    # A thinking budget that closes the block for the model: no proposals
    # while it counts (a rejected token would be counted), then the grammar's.
    chat("Think a little, then JSON.", max_tokens=40, thinking_budget=6,
         chat_template_kwargs={"enable_thinking": True}, response_format={
             "type": "json_schema", "json_schema": {"name": "c", "schema": {
                 "type": "object", "properties": {"name": {"type": "string"}},
                 "required": ["name"]}}}),
]


def run_with_figures(runner, bodies, path="/v1/chat/completions"):
    """Each request's (tokens, logprobs, its speculation figures)."""
    return [(t, lp, getattr(ctx, "speculation", None))
            for t, lp, ctx in replies(runner, bodies, path)]


@pytest.mark.parametrize("drop", [None, "carry", "roll"])
def test_rows_with_a_grammar_propose_and_write_what_they_would_without(
        pair, monkeypatch, drop):
    """Structured output, a forced tool call and strict tools, each beside
    the others and a plain row: their proposals are checked under the mask
    their grammar gives each position (the grammar rolled back after), so
    the tokens and logprobs are those without speculation, and each
    grammar row kept some. Their proposals are cut where the grammar
    refuses a token or would end; they never carry (forced carrying
    included)."""
    off, on = pair
    forced(monkeypatch, drop)
    reference = run(off, GRAMMARS)
    oracle = Oracle(reference, corrupt=0.3, seed=3).install(monkeypatch)
    cut = []
    real = speculation.checked_proposal

    def checked(processors, proposal, vocab):
        n, keep = real(processors, proposal, vocab)
        cut.append(n < len(proposal))
        return n, keep

    monkeypatch.setattr(speculation, "checked_proposal", checked)
    got = run_with_figures(on, GRAMMARS)
    for (want, want_lp, _), (tokens, lp, figures), body in zip(reference, got, GRAMMARS):
        assert tokens == want, body
        np.testing.assert_allclose(lp, want_lp, atol=2e-4)
        assert figures and figures["accepted"] > 0, (body["messages"], figures)
    assert oracle.calls > 5 and any(cut) and not all(cut)
    # The one that ends: its JSON is complete, then EOS.
    ended = on.loaded.tokenizer.decode(got[1][0])
    assert ended.startswith('{"city": "') and len(got[1][0]) < 30, ended


def test_a_thinking_budget_proposes_once_it_is_done(pair, monkeypatch):
    """Rows whose prompt opens the think block, with a budget: no proposals
    while it counts (it counts a token a step: a kept proposal would go
    uncounted), then proposals; the text is the text without speculation,
    the block closed at the same token."""
    off, on = pair
    forced(monkeypatch)
    opened = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    bodies = [{"prompt": opened + text, "max_tokens": 30, "thinking_budget": budget}
              for text, budget in (("", 6), ("Well", 9), ("", 3))]
    reference = run(off, bodies, path="/v1/completions")
    Oracle(reference, corrupt=0.2, seed=5).install(monkeypatch)
    got = run_with_figures(on, bodies, path="/v1/completions")
    end = on.loaded.tokenizer.think_end_tokens[0]
    for body, (want, want_lp, _), (tokens, lp, figures) in zip(bodies, reference, got):
        assert tokens == want and end in want, body
        np.testing.assert_allclose(lp, want_lp, atol=2e-4)
        assert figures and figures["accepted"] > 0, figures


def test_sampled_rows_with_a_grammar_keep_their_distribution(fixture_path, monkeypatch):
    """At temperature 1, a schema whose answer is one of five strings: with
    the greedy answer always proposed, the answers are distributed as
    without proposals (chi-square, 480 requests each): a proposal is kept
    with its probability under the grammar's mask, and the residual drawn
    from the masked distribution."""
    body = chat("Pick one.", max_tokens=8, temperature=1.0,
                chat_template_kwargs={"enable_thinking": False}, response_format={
                    "type": "json_schema", "json_schema": {"name": "p", "schema": {
                        "type": "string", "enum": ["oak", "elm", "ash", "yew", "fir"]}}})
    counts = {}
    for name, argv in (("off", []), ("on", LOOKUP)):
        runner = EngineRunner(fixture_path("qwen3"), argv=argv)
        try:
            (greedy, _, prompt), = run(runner, [{**body, "temperature": 0.0}])
            mx.random.seed(13)
            if name == "on":
                oracle = Oracle([(greedy, None, prompt)], corrupt=0.0).install(monkeypatch)
                forced(monkeypatch)
            seen = Counter()
            for _ in range(0, 480, 8):
                for tokens, _, _ in run(runner, [body] * 8):
                    seen[runner.loaded.tokenizer.decode(tokens).replace("<|im_end|>", "")] += 1
            counts[name] = seen
            if name == "on":
                assert oracle.calls > 50
        finally:
            monkeypatch.undo()
            runner.close()
    assert set(counts["off"]) <= {'"oak"', '"elm"', '"ash"', '"yew"', '"fir"'}, counts
    assert_same_distribution(counts)


def test_a_row_whose_grammar_refuses_its_proposals_backs_off(pair, monkeypatch):
    """Proposals the grammar refuses from their first token (EOS: refused
    while the JSON is open, and one that would end it where it could close)
    count as failures: the row waits longer and longer before proposing
    again, as any row whose proposals fail, rather than making every step a
    check. (Ids past the tokenizer's: tests/planning/test_constraints.py.
    Not fed here: past the fixture's embedding rows they read memory out of
    bounds, and no path of the engine proposes one: a draft's are capped at
    the served model's vocabulary, prompt lookup copies the row's tokens.)"""
    off, on = pair
    forced(monkeypatch)
    body = GRAMMARS[0]
    (want, _, _), = run(off, [body])
    refused = min(on.loaded.tokenizer.eos_token_ids)
    monkeypatch.setattr(speculation.RowLookup, "propose",
                        lambda lookup, tokens, tail, room: [0] + [refused] * min(3, room))
    checks = []
    real = speculation.SpeculativeGenerationBatch._verify

    def verify(self, proposals):
        checks.append(1)
        return real(self, proposals)

    monkeypatch.setattr(speculation.SpeculativeGenerationBatch, "_verify", verify)
    (tokens, _, figures), = run_with_figures(on, [body])
    assert tokens == want
    assert figures and figures["accepted"] == 0 and figures["verify_steps"] == len(checks)
    assert 2 <= len(checks) <= 8, (len(checks), len(want))


def test_a_row_whose_first_checks_failed_is_checked_again():
    """A rate learnt from early failures (an answer that opens with a line
    of its own, then copies its context) moves back toward the prior's each
    time the row's proposals are not worth checking, so it is checked again
    after a look or two (EXPLORE_EVERY, 256 steps without any check, was
    the way back); a rate above the prior's stays."""
    one = speculation.StepCost()  # (one stream on a CPU, a long context)
    for positions in (1, 1, 2, 5, 9):
        one.observe(positions, 0.054 + 0.013 * (positions - 1))
    row = speculation.RowLookup(speculation.RowSampling(0.0), max_tokens=8)
    proposal, fed = [[1] * 8], [1]
    assert speculation.widest_paying([row], proposal, fed, one) > 0  # (the prior's rate)
    row.verified(8, 0)
    row.verified(8, 0)
    assert speculation.widest_paying([row], proposal, fed, one) == 0
    looks = 0
    while speculation.widest_paying([row], proposal, fed, one) == 0:
        row.unpaid(speculation.UNPAID_WAIT)
        looks += 1
        assert looks < 10, row.rates(1)
    assert looks >= 1
    good = speculation.RowLookup(speculation.RowSampling(0.0), max_tokens=8)
    good.verified(8, 8)
    rate = good.rates(1)[0]
    good.unpaid(speculation.UNPAID_WAIT)
    assert good.rates(1)[0] == rate > 0.5 and good.wait == speculation.UNPAID_WAIT


def test_a_row_that_failed_early_keeps_its_later_proposals(pair, monkeypatch):
    """Through the batch, with a CPU's step costs (each position 13 ms on
    54): a row whose first two checks fail (proposals all wrong) is checked
    again once its proposals are right, and keeps them."""
    off, on = pair
    monkeypatch.setattr(speculation.StepCost, "predict",
                        lambda self, positions: 0.054 + 0.013 * (positions - 1))
    monkeypatch.setattr(speculation.StepCost, "spread", property(lambda self: True))
    body = chat("Tell me about rivers and boats.", max_tokens=70)
    reference = run(off, [body])
    oracle = Oracle(reference, corrupt=0.0)
    calls = []

    def propose(lookup, tokens, tail, room):
        following = oracle.propose(lookup, tokens, tail, room)
        calls.append(len(following) > 1)
        if sum(calls) <= 2 and len(following) > 1:  # (the first two: every proposal wrong)
            following = following[:1] + [(t + 1) % 500 for t in following[1:]]
        return following

    monkeypatch.setattr(speculation.RowLookup, "propose", propose)
    (tokens, _, figures), = run_with_figures(on, [body])
    assert tokens == reference[0][0]
    assert figures["accepted"] > 10 and figures["verify_steps"] > 2, figures
