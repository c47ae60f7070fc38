"""A draft model inside the batch (engine/drafting.py): its proposals are
checked as prompt lookup's are (speculation.py), rows with and without a
draft share one batch, and the draft's own KV follows each row exactly.

Two drafts of the attention fixture: the fixture itself (its argmax is the
model's own, so nearly every proposal is kept unless the draft's KV has
drifted from the row: the test of the draft's bookkeeping) and the llama
fixture (another random model: most proposals rejected, at varied places:
the test of the rollback)."""

import threading
import time
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_plus.engine import drafting, speculation
from testkit.engine_harness import SEQUENTIAL, EngineRunner
from tests.engine.test_speculation import (
    GRAMMARS, MIXED, assert_same_distribution, chat, forced, replies, run, run_with_figures,
)


def draft_argv(path, tokens=4):
    return ["--draft-model", str(path), "--num-draft-tokens", str(tokens)]


def checked_always(monkeypatch, drop=None):
    """test_speculation's `forced` (every width checked; with `drop`,
    rejected KV always carried or always rolled), drafting free."""
    forced(monkeypatch, drop)
    monkeypatch.setattr(speculation.DraftCost, "predict", lambda self, width: 0.0)


def grammar_cuts(monkeypatch) -> list:
    """(proposed, kept for the grammar) of each grammar row's check
    (speculation.checked_proposal), as they come."""
    cuts = []
    real = speculation.checked_proposal

    def checked(processors, proposal, vocab):
        n, keep = real(processors, proposal, vocab)
        cuts.append((len(proposal), n))
        return n, keep

    monkeypatch.setattr(speculation, "checked_proposal", checked)
    return cuts


def boolean_row(fixture_path):
    """The attention fixture and a row held to {"ok": <boolean>} after its
    first step: (model, tokenizer, its ConstraintProcessor, prompt, vocab,
    that step's mask)."""
    from mlx_lm import load

    from mlx_lm_plus.planning.constraints import ConstraintProcessor
    from mlx_lm_plus.planning.grammars import compile_response_format

    model, tok = load(str(fixture_path("qwen3")))
    grammar = compile_response_format({"type": "json_schema", "json_schema": {
        "name": "b", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                "required": ["ok"], "additionalProperties": False}}})
    prompt = tok.encode("Answer:")
    vocab = model.args.vocab_size
    proc = ConstraintProcessor(grammar, tok, prompt=prompt)
    first = ConstraintProcessor.mask_batch([(0, proc, prompt[:-1], prompt[-1])], (1, vocab))
    return model, tok, proc, prompt, vocab, first


@pytest.fixture(scope="module")
def runners(fixture_path):
    model = fixture_path("qwen3")
    off = EngineRunner(model)
    itself = EngineRunner(model, argv=draft_argv(model))
    other = EngineRunner(model, argv=draft_argv(fixture_path("llama")))
    yield off, itself, other
    for r in (off, itself, other):
        r.close()


def figures(runner):
    """The draft's figures (/v1/stats' and /metrics' draft_model), of
    finished requests; prompt lookup's stay 0."""
    assert runner.engine.prompt_lookup["proposed_tokens"] == 0
    f = runner.engine.draft_model
    return f["proposed_tokens"], f["accepted_tokens"], f["verify_steps"]


@pytest.mark.parametrize("draft,together,drop", [
    ("itself", 1, None), ("other", 1, None), ("itself", 8, None), ("other", 8, None),
    ("other", 8, "carry"), ("other", 8, "roll")])
def test_greedy_text_and_logprobs_are_those_without_a_draft(
        runners, monkeypatch, draft, together, drop):
    """Alone and eight at a time (rows with penalties, logit_bias and a
    schema among them), with a draft that is nearly always right and one
    that is mostly wrong: the same tokens and logprobs as without a draft,
    every request served in the batch, proposals checked, kept and
    rejected."""
    off, itself, other = runners
    on = itself if draft == "itself" else other
    checked_always(monkeypatch, drop)
    bodies = MIXED[:together]
    reference = run(off, bodies)
    before, sequential = figures(on), on.sequential
    got = run(on, bodies)
    for (want, want_lp, _), (tokens, lp, _), body in zip(reference, got, bodies):
        assert tokens == want, body
        np.testing.assert_allclose(lp, want_lp, atol=2e-4)
    proposed, accepted, steps = (a - b for a, b in zip(figures(on), before))
    assert on.sequential == sequential
    assert steps > 3 and 0 < accepted <= proposed, (proposed, accepted)
    if draft == "other":
        assert accepted < proposed


def test_a_draft_that_is_the_model_is_kept_nearly_always(runners, monkeypatch):
    """Rows arriving while others decode (their prompts run through the
    draft as they join, one step behind the others' feeds) beside a row
    that never proposes (a schema, num_draft_tokens 0: no draft row) and rows leaving at
    different times: with the model as its own draft,
    proposals are its argmax wherever the draft's KV holds exactly each
    row's tokens, so nearly all are kept; a position lost, repeated or left
    in the draft's KV (catching up, rows padded to one width, trimming
    after a check, rows joining or leaving) would show as rejections. The
    draft's KV counts in the batch's bytes."""
    off, itself, _ = runners
    checked_always(monkeypatch)
    first = [chat(f"Tell me story number {i} about the sea and the hills.",
                  max_tokens=120 + 7 * i) for i in range(3)] + [
        {**MIXED[5], "max_tokens": 80, "num_draft_tokens": 0}]
    later = [chat(f"And story number {i} about the rain.", max_tokens=25 + 9 * i)
             for i in range(3)]
    reference = run(off, first + later)
    before = figures(itself)
    held, padded = [], []
    three, go = threading.Event(), threading.Event()
    real_settle, real_roll = drafting.DraftRows.settle, drafting.roll_into_padding

    def settle(self, uids, kept):
        batch = itself.engine._batches[itself.loaded.key]
        held.append((self.nbytes, batch.owned_nbytes()))
        out = real_settle(self, uids, kept)
        if len(self.order) == 3 and not three.is_set():
            three.set()
            go.wait(30)  # (the next step waits for the later rows to be queued)
        return out

    def roll(caches, padding):
        padded.append(sorted(set(padding)))
        return real_roll(caches, padding)

    monkeypatch.setattr(drafting.DraftRows, "settle", settle)
    monkeypatch.setattr(drafting, "roll_into_padding", roll)
    channels = [itself.submit(body) for body in first]
    assert three.wait(60), "no drafting steps with the first rows"
    for body in later:  # (they join a batch that is decoding)
        channels.append(itself.submit(body))
    time.sleep(0.05)
    go.set()
    got = [c.result()[0] for c in channels]
    assert got == [t for t, _, _ in reference]
    proposed, accepted, steps = (a - b for a, b in zip(figures(itself), before))
    assert proposed > 200 and accepted >= 0.97 * proposed, (proposed, accepted)
    assert (accepted + steps) / steps >= 3.5, (accepted, steps)
    # (Rows fed different counts in one call, and rolled: the rows that
    # joined late, one token behind the others.)
    assert padded
    assert held and all(0 < draft < owned for draft, owned in held)
    # (Its store, once rows left: in the batch's bytes too.)
    batch = itself.engine._batches[itself.loaded.key]
    stored = batch.draft_prompts.store.nbytes
    assert stored > 0 and batch.owned_nbytes() >= stored


def test_a_client_gone_mid_draft_leaves_the_others_exact(runners, monkeypatch):
    """A row cancelled between drafting steps leaves the draft's KV with
    the batch's (filter): the rows that stay keep being drafted for
    exactly (their proposals still kept) and write what they would."""
    off, itself, _ = runners
    checked_always(monkeypatch)
    bodies = [chat(f"Go on and on {i}.", max_tokens=60) for i in range(3)]
    reference = run(off, bodies)
    release, seen = threading.Event(), []
    real_settle = drafting.DraftRows.settle

    def settle(self, uids, kept):
        out = real_settle(self, uids, kept)
        if len(self.fed) == 3 and not seen:
            seen.append(True)
            release.wait(30)  # (the next step waits for the cancel)
        return out

    monkeypatch.setattr(drafting.DraftRows, "settle", settle)
    before = figures(itself)
    channels = [itself.submit(b) for b in bodies]
    deadline = time.monotonic() + 60
    while not seen:
        assert time.monotonic() < deadline, "no drafting step with three rows"
        time.sleep(0.001)
    channels[1].cancel()
    release.set()
    channels[1].cancel_and_drain()
    for i in (0, 2):
        assert channels[i].result()[0] == reference[i][0]
    proposed, accepted, _ = (a - b for a, b in zip(figures(itself), before))
    assert accepted >= 0.95 * proposed > 0


def test_requests_that_leave_the_batch_run_without_the_draft(runners):
    """A seed with XTC still takes the sequential path: on a model whose
    draft proposes in the batch it runs without the draft (the stored
    entries are the model's KV alone), and its text is the one without a
    draft."""
    off, itself, _ = runners
    body = chat("A sequential one.", max_tokens=12, **SEQUENTIAL)
    served = itself.sequential
    tokens = itself.run(body)[0]
    assert itself.sequential == served + 1 and tokens == off.run(body)[0]
    again, _, cached = itself.run(body)
    assert cached > 0 and again == tokens


def test_sampled_rows_keep_their_distribution_with_a_draft(fixture_path, monkeypatch):
    """At temperature 1 (top_k 4) the first two tokens, the second proposed
    by a draft that is another model (its argmax: kept sometimes), are
    distributed as without a draft (chi-square of the two tables, 480
    requests each)."""
    model = fixture_path("qwen3")
    body = chat("Pick a word.", max_tokens=2, temperature=1.0, top_k=4)
    counts = {}
    for name, argv in (("off", []), ("on", draft_argv(fixture_path("llama"), 1))):
        runner = EngineRunner(model, argv=argv)
        try:
            if name == "on":
                checked_always(monkeypatch)
            mx.random.seed(11)
            seen = Counter()
            before = figures(runner)
            for _ in range(0, 480, 8):
                for tokens, _, _ in run(runner, [dict(body) for _ in range(8)]):
                    seen[tuple(tokens)] += 1
            counts[name] = seen
            if name == "on":
                proposed, accepted, _ = (a - b for a, b in zip(figures(runner), before))
                assert proposed > 100 and 0 < accepted < proposed, (proposed, accepted)
        finally:
            monkeypatch.undo()
            runner.close()
    assert_same_distribution(counts)


@pytest.mark.parametrize("kind,argv,draft", [
    ("qwen3_5", [], "qwen3"), ("nemotron_h", [], "qwen3"), ("gemma3_text", [], "qwen3"),
    ("qwen3_kv", ["--kv-bits", "4", "--quantized-kv-start", "0"], "qwen3"),
    ("qwen3", [], "qwen3_5"), ("qwen3", [], "gemma3_text"), ("qwen3_5", [], "nemotron_h"),
    ("gemma3_text", [], "gemma3_text")])
def test_a_hybrid_model_drafts_in_the_batch(kind, argv, draft, fixture_path, monkeypatch):
    """A hybrid model (recurrent states rolled back from taps, rollback.py),
    one with sliding windows (Gemma 3's, batch_kv.py) or a quantized KV
    (--kv-bits, quantized_batch.py) with an attention draft, and drafts
    that are hybrid (their states set back per row, drafting.py) or have
    sliding windows (set back before their drafting calls): eight rows in
    the batch, rolled or carried as they reject, write what they write
    without a draft, all in the batch."""
    model = fixture_path(kind)
    off = EngineRunner(model, argv=argv)
    on = EngineRunner(model, argv=argv + draft_argv(fixture_path(draft)))
    try:
        checked_always(monkeypatch)
        bodies = MIXED
        # (All admitted before the first step: under --kv-bits a row's
        # numbers depend on its batch's composition, test_speculation.)
        reference = run(off, bodies, together=True)
        got = run(on, bodies, together=True)
        for (want, want_lp, _), (tokens, lp, _), body in zip(reference, got, bodies):
            assert tokens == want, body
            np.testing.assert_allclose(lp, want_lp, atol=2e-4)
        proposed, _, steps = figures(on)
        assert on.sequential == 0 and steps > 3 and proposed >= steps
        # (Asked after the runs, the facts worked out then on the engine's
        # thread: working them out here, while the engine runs the model,
        # ran MLX from two threads at once and changed its numbers.)
        assert on.engine.facts.drafts_in_batch(on.loaded)
    finally:
        off.close()
        on.close()


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h", "gemma3_text"])
def test_a_hybrid_or_windowed_draft_that_is_the_model_is_kept_nearly_always(
        kind, fixture_path, monkeypatch):
    """The model as its own draft, where it has recurrent layers or sliding
    windows: its proposals are the model's argmax wherever the draft holds
    exactly each row's tokens (a state not set back, set back to the wrong
    position, a row's state taken after its padding, a window's positions
    lost or kept twice would show as rejections), rows of different lengths
    (right-padded in the draft's feeding calls), beside a row whose
    logit_bias the draft doesn't see, which rejects at varied places (the
    other rows then feed different counts)."""
    model = fixture_path(kind)
    off = EngineRunner(model)
    on = EngineRunner(model, argv=draft_argv(model))
    try:
        checked_always(monkeypatch)
        bodies = [chat(f"Tell me story number {i} about the sea" + " and the hills" * i,
                       max_tokens=40 + 5 * i) for i in range(4)]
        bodies.append(chat("Tell me a story about the sea.", max_tokens=40,
                           logit_bias={str(t): 2.0 for t in range(100, 110)}))
        reference = run(off, bodies)
        got = run_with_figures(on, bodies)
        assert [t for t, _, _ in got] == [t for t, _, _ in reference]
        assert on.sequential == 0
        for _, _, f in got[:4]:
            assert f["verify_steps"] > 2 and f["accepted"] >= 0.9 * f["proposed"], f
        biased = got[4][2]
        assert biased["accepted"] < 0.8 * biased["proposed"], biased  # (it rejects)
    finally:
        off.close()
        on.close()


def test_a_draft_under_kv_bits_the_model_cannot_batch_keeps_the_sequential_path(
        fixture_path):
    """--kv-bits on a model whose head dim --kv-group-size does not divide
    (the fixture's 16): its requests are served one at a time, and there
    with the draft, as before."""
    model = fixture_path("qwen3")
    runner = EngineRunner(model, argv=["--kv-bits", "4"] + draft_argv(model))
    try:
        assert not runner.engine.facts.drafts_in_batch(runner.loaded)
        served = runner.sequential
        assert len(runner.run(chat("Alone, then.", max_tokens=4))[0]) == 4
        assert runner.sequential == served + 1
        assert runner.engine.sequential._draft(runner.loaded) is runner.loaded.draft_model
    finally:
        runner.close()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "gemma3_text"])
def test_the_draft_kv_holds_exactly_the_tokens_each_row_has_fed(kind, fixture_path, monkeypatch):
    """DraftRows alone, over random steps: rows proposing or not, kept
    counts at random, tokens gained between drafting steps (plain steps,
    some carried), rows catching up alone a chunk a step before joining
    (chunk 5), then a few tokens a drafting step (CATCH_UP_MAX 3), rows
    leaving and joining. After every step each draft row's KV, and each
    catching-up row's, is, to float rounding, a fresh prefill of the first
    `fed` tokens of that row: a draft of attention layers, one with
    recurrent layers (Qwen3.5: each state the fresh prefill's) and one with
    sliding windows (Gemma 3's 32: the window the fresh prefill ends
    with)."""
    import random

    from mlx_lm import load
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

    model, _ = load(str(fixture_path(kind)))
    monkeypatch.setattr(drafting, "CATCH_UP_MAX", 3)
    rng = random.Random(3)
    class Recording:  # (DraftPrompts' part DraftRows uses: a store that records)
        nbytes = 0

        def __init__(self):
            self.put_calls = []

        def fetch(self, tokens):
            return None, 0

        def put(self, tokens, cache):
            self.put_calls.append((list(tokens), cache))

    prompts = Recording()
    draft = drafting.DraftRows(model, chunk=5, cost=speculation.DraftCost(), prompts=prompts)
    uids = [10, 11, 12]
    rows = [[rng.randrange(500) for _ in range(n)] for n in (7, 19, 3)]
    carried = [[], [], []]
    proposing = [True, True, False]
    draft.extend(uids, rows, proposing)

    def fresh(tokens):
        cache = make_prompt_cache(model)
        if tokens:
            model(mx.array(tokens)[None], cache=cache)
        return cache

    def same(got, tokens):
        want = fresh(tokens)
        for w, g in zip(want, got):
            if isinstance(w, ArraysCache):
                if tokens:
                    for a, b in zip(g.cache, w.cache):
                        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)
                continue
            assert g.offset == len(tokens), (g.offset, len(tokens))
            if isinstance(w, RotatingKVCache):
                if tokens:  # (the window a next position attends: its last max_size - 1)
                    n = min(len(tokens), w.max_size - 1)
                    for a, b in ((g.keys, w.keys), (g.values, w.values)):
                        a = np.array(g._temporal_order(a))
                        assert a.shape[2] >= n, (a.shape, n)
                        np.testing.assert_allclose(a[..., -n:, :],
                                                   np.array(b[..., len(tokens) - n:len(tokens), :]),
                                                   atol=1e-4)
                continue
            if tokens:
                for a, b in ((g.keys, w.keys), (g.values, w.values)):
                    np.testing.assert_allclose(np.array(a[..., :len(tokens), :]),
                                               np.array(b[..., :len(tokens), :]), atol=1e-4)

    proposed, caught_up = 0, 0
    for step in range(40):
        known = [(r, c) for r, c in zip(rows, carried)]
        caught_up += draft.catch_up(uids, known)
        pending = [rng.randrange(500) for _ in rows]
        lengths = [rng.choice([0, 1, 2, 4]) if p else 0 for p in proposing]
        proposals = draft.propose(uids, known, mx.array(pending, dtype=mx.uint32), lengths)
        proposed += sum(map(bool, proposals))
        assert all(not p or proposing[i] for i, p in enumerate(proposals))
        kept = [rng.randint(0, len(p)) for p in proposals]
        draft.settle(uids, kept)
        for i in range(len(rows)):
            # (the row's tokens: in its KV, then carried; some move across)
            whole = rows[i] + carried[i] + [pending[i]] + proposals[i][:kept[i]]
            if rng.random() < 0.3:  # (plain steps since)
                whole += [rng.randrange(500) for _ in range(rng.randint(1, 4))]
            cut = len(whole) - rng.choice([0, 0, 1, 2])
            rows[i], carried[i] = whole[:cut], whole[cut:]
        leave = {15: [0, 1], 19: [0, 1], 30: [1, 2]}.get(step)
        if leave is not None:
            # 15: the row that never proposes leaves, a long one joins;
            # 19: that one leaves while catching up, another joins;
            # 30: the first row leaves, joined. Each leaving row's draft KV
            # is stored under the tokens it holds.
            gone = [i for i in range(len(uids)) if i not in leave]
            for i in gone:  # (as a stop word trims a finished row's tokens)
                rows[i], carried[i] = (rows[i] + carried[i])[:-2], []
            known = [(r, c) for r, c in zip(rows, carried)]
            held = {}
            for i in gone:
                if uids[i] in draft.joining:
                    held[i] = draft.joining[uids[i]][1]
                elif uids[i] in draft.order:
                    held[i] = draft.fed[draft.order.index(uids[i])]
            stored = len(prompts.put_calls)
            draft.filter(uids, leave, known)
            # (A recurrent state or a window holding tokens past the row's
            # can't be cut back to them: not stored.)
            storable = [i for i in gone if held.get(i) and (
                kind == "qwen3" or held[i] <= len(rows[i] + carried[i]))]
            for (key, cache), i in zip(prompts.put_calls[stored:], storable):
                whole = rows[i] + carried[i]
                assert key == whole[:min(held[i], len(whole))]
                same(cache, key)
            assert len(prompts.put_calls) - stored == len(storable)
            uids, rows, carried, proposing = ([x[i] for i in leave]
                                              for x in (uids, rows, carried, proposing))
            uids.append(13 + step)
            rows.append([rng.randrange(500) for _ in range(60)])
            carried.append([])
            proposing.append(True)
            draft.extend(uids[-1:], rows[-1:], [True])
        assert set(draft.joining) | set(draft.order) <= set(uids)
        for i, uid in enumerate(uids):
            whole = rows[i] + carried[i]
            if uid in draft.joining:
                cache, fed = draft.joining[uid]
                same(cache, whole[:fed])
            elif uid in draft.order:
                j = draft.order.index(uid)
                assert draft.fed[j] <= len(whole)
                same([c.extract(j) for c in draft.cache], whole[:draft.fed[j]])
            else:
                assert not proposing[i]
    assert proposed > 20 and caught_up >= 4 and len(prompts.put_calls) >= (2 if kind == "qwen3" else 1)


def test_a_windowed_draft_feeds_a_short_row_beside_a_wrapped_one(fixture_path):
    """A Gemma 3 draft (32-token windows): a long row whose window wrapped
    in one-token feeds beside a short, left-padded row, then a feeding call
    of several positions for the short one (it gained tokens) and one for
    the long one (right-padded), then drafting and a check that keeps
    some: each row's window is the one a fresh prefill of its tokens ends
    with (the buffer is put in order before the call: mlx-lm's mask reads
    a wrapped buffer's front from its write index and would cut the short
    row's oldest position), and its left padding, written in place by the
    drafting calls, is set back with the window."""
    from mlx_lm import load
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    model, _ = load(str(fixture_path("gemma3_text")))
    draft = drafting.DraftRows(model, chunk=64, cost=speculation.DraftCost())
    rows = [[(7 * i) % 500 + 3 for i in range(40)], [11, 12, 13]]
    uids = [1, 2]
    draft.extend(uids, rows, [True, True])
    for _ in range(3):  # (both join: caught up)
        draft.catch_up(uids, [(r, []) for r in rows])
    assert draft.order == uids

    def step(lengths, pending, kept):
        proposals = draft.propose(uids, [(r, []) for r in rows],
                                  mx.array(pending, dtype=mx.uint32), lengths)
        draft.settle(uids, kept)
        for r, p, d, k in zip(rows, pending, proposals, kept):
            r.extend([p] + d[:k])

    for n in range(6):  # (one-token feeds: the long row's window wraps)
        step([0, 0], [20 + n, 40 + n], [0, 0])
    rows[1].extend([61, 62])  # (the short row gained tokens: a wider call)
    step([3, 3], [70, 71], [2, 1])
    step([2, 2], [80, 81], [0, 2])
    step([2, 2], [90, 91], [0, 0])  # (computed on the window set back)

    for j, row in enumerate(rows):
        fed = draft.fed[j]
        assert fed <= len(row)
        want = make_prompt_cache(model)
        model(mx.array(row[:fed])[None], cache=want)
        got = [c.extract(j) for c in draft.cache]
        for w, g in zip(want, got):
            n = min(fed, w.max_size - 1) if isinstance(w, RotatingKVCache) else fed
            for have, fresh in ((g.keys, w.keys), (g.values, w.values)):
                a = np.array(g._temporal_order(have) if isinstance(w, RotatingKVCache)
                             else have[..., :fed, :])
                # (Float rounding here is under 2e-5; a window set back with
                # 4 positions of padding unmasked was 3.5e-4 off.)
                np.testing.assert_allclose(a[..., -n:, :], np.array(fresh[..., fed - n:fed, :]),
                                           atol=5e-5)


def test_a_conversation_prefills_only_its_new_tokens_through_the_draft(runners, monkeypatch):
    """A row's draft KV is stored when it leaves (under a key of its own in
    the prompt store) and the next turn starts from it: the draft prefills
    what the model prefills, no more, its proposals still kept (a draft KV
    stored or fetched wrong would show as rejections), and the replies are
    those without a draft."""
    off, itself, _ = runners
    checked_always(monkeypatch)
    fetched = []
    real_fetch = drafting.DraftPrompts.fetch

    def fetch(self, tokens):
        cache, cached = real_fetch(self, tokens)
        fetched.append((len(tokens), cached))
        return cache, cached

    monkeypatch.setattr(drafting.DraftPrompts, "fetch", fetch)
    itself.engine.clear_cache()
    before = figures(itself)
    # (Two conversations at a time: each row's own draft KV stored.)
    talks = [[{"role": "user", "content": f"Tell me about the sea, {i}. " * (12 + 5 * i)}]
             for i in range(2)]
    for turn in range(3):
        bodies = [{"messages": messages, "max_tokens": 27 - 7 * i}
                  for i, messages in enumerate(talks)]
        fetched.clear()
        channels = [itself.submit(body) for body in bodies]
        for i, (body, channel) in enumerate(zip(bodies, channels)):
            tokens, ctx = channel.result()
            assert tokens == off.run(body)[0]
            prompt, cached = len(ctx.prompt), ctx.prompt_cache_count
            (draft_cached,) = [c for n, c in fetched if n == prompt]  # (the model's prompt)
            if turn:
                assert cached > 0 and draft_cached >= cached, (fetched, cached)
            talks[i] = talks[i] + [
                {"role": "assistant", "content": itself.loaded.tokenizer.decode(tokens)},
                {"role": "user", "content": f"And then, {turn}?"}]
    proposed, accepted, _ = (a - b for a, b in zip(figures(itself), before))
    assert accepted >= 0.97 * proposed > 0
    itself.store.check_invariants()
    assert itself.engine.draft_model["cache_bytes"] > 0
    itself.engine.clear_cache()  # (DELETE /v1/cache: the draft's too)
    assert itself.engine.draft_model["cache_bytes"] == 0


def test_a_long_prompt_catches_up_through_the_draft_a_chunk_a_step(fixture_path, monkeypatch):
    """A row with a long prompt runs it through the draft a decode-time
    chunk a step (32 here, 64 where a first token is due), alone, while
    another streams: it proposes
    nothing until it has joined (no width chosen for it meanwhile), then
    its proposals are kept (its draft KV is its prompt's); both write what
    they write without a draft."""
    model = fixture_path("qwen3")
    argv = ["--prefill-step-size", "32"]
    off, on = EngineRunner(model, argv=argv), EngineRunner(model, argv=argv + draft_argv(model))
    try:
        checked_always(monkeypatch)
        fed, empty = [], []
        real_catch_up, real_propose = drafting.DraftRows.catch_up, drafting.DraftRows.propose

        def catch_up(self, uids, tokens):
            before = {u: f for u, (_, f) in self.joining.items()}
            joined = dict(zip(self.order, self.fed))
            out = real_catch_up(self, uids, tokens)
            after = {**{u: f for u, (_, f) in self.joining.items()},
                     **{u: f for u, f in zip(self.order, self.fed) if u not in joined}}
            fed.append(sum(after[u] - f for u, f in before.items()))
            return out

        def propose(self, *a):
            empty.append(not self.order)
            return real_propose(self, *a)

        monkeypatch.setattr(drafting.DraftRows, "catch_up", catch_up)
        monkeypatch.setattr(drafting.DraftRows, "propose", propose)
        bodies = [chat("Stream on about the sea.", max_tokens=150)] + [
            chat(f"A long one, {k}. " + " ".join(f"item {i} of the list" for i in range(120)),
                 max_tokens=60) for k in range(2)]
        reference = run(off, bodies)
        first = on.submit(bodies[0])
        time.sleep(0.3)  # (the first decoding when the long ones come)
        later = [on.submit(body) for body in bodies[1:]]
        assert [c.result()[0] for c in [first] + later] == [t for t, _, _ in reference]
        # (32 a step for both long ones together; a draft call's worth, 64,
        # in the steps where a first token is due and prompts get no chunk)
        assert max(fed) <= drafting.CATCH_UP_MAX and sum(f > 0 for f in fed) >= 8, fed
        assert not any(empty)
        proposed, accepted, _ = figures(on)
        assert accepted >= 0.97 * proposed > 100
    finally:
        off.close()
        on.close()


def test_the_drafts_store_leaves_the_models_alone(fixture_path):
    """The draft's entries are kept apart (DraftPrompts' own store): with
    room for two sequences, two conversations keep their cached turns as
    without a draft, and the prompt cache's figures are the model's alone."""
    model = fixture_path("qwen3")
    runners = [EngineRunner(model, max_sequences=2),
               EngineRunner(model, max_sequences=2, argv=draft_argv(model))]
    try:
        seen = []
        for runner in runners:
            talks = [[{"role": "user", "content": f"Plan day {i} by the river. " * 8}]
                     for i in range(2)]
            cached = []
            for turn in range(2):
                for i in range(2):
                    tokens, ctx = runner.submit({"messages": talks[i], "max_tokens": 12}).result()
                    cached.append(ctx.prompt_cache_count)
                    talks[i] = talks[i] + [
                        {"role": "assistant", "content": runner.loaded.tokenizer.decode(tokens)},
                        {"role": "user", "content": "And then?"}]
            stats = {k: v for k, v in runner.store.stats.items() if k.startswith("fetch_")}
            seen.append((cached, stats, sorted(e.key for e in runner.store.entries())))
        assert seen[0] == seen[1] and min(seen[0][0][2:]) > 50, seen
    finally:
        for runner in runners:
            runner.close()


def test_a_huge_num_draft_tokens_is_cut(runners, monkeypatch):
    """num_draft_tokens past MAX_DRAFT_TOKENS is cut to it (a row's
    lists and its checks' widths follow it): served, as without a draft."""
    off, itself, _ = runners
    made = []
    real_init = speculation.RowLookup.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self.max_tokens)

    monkeypatch.setattr(speculation.RowLookup, "__init__", init)
    body = chat("A long one, please.", max_tokens=30, num_draft_tokens=10 ** 9)
    assert itself.run(body)[0] == off.run(body)[0]
    assert made == [drafting.MAX_DRAFT_TOKENS]


def test_a_drafting_call_stays_within_its_positions(fixture_path, monkeypatch):
    """Rows x width of a draft call stays within MAX_POSITIONS (its logits):
    24 rows far behind each feed at most 512 // 24 a call, and catch up
    over several."""
    from mlx_lm import load

    model, _ = load(str(fixture_path("qwen3")))
    widths = []

    class Counting:  # (the draft model, its calls' shapes seen)
        def __call__(self, inputs, cache=None):
            widths.append(inputs.shape)
            return model(inputs, cache=cache)

        def __getattr__(self, name):
            return getattr(model, name)

    draft = drafting.DraftRows(Counting(), chunk=10 ** 6, cost=speculation.DraftCost())
    uids = list(range(24))
    rows = [[(7 * u + i) % 500 for i in range(5)] for u in uids]
    draft.extend(uids, rows, [True] * 24)
    assert draft.catch_up(uids, [(r, ()) for r in rows]) and draft.order == uids
    rows = [r + [(3 * i) % 500 for i in range(60)] for r in rows]  # (all 60 behind)
    widths.clear()
    pending = mx.array([1] * 24, dtype=mx.uint32)
    made = []
    for _ in range(3):
        made.append(draft.propose(uids, [(r, ()) for r in rows], pending, [2] * 24))
        draft.settle(uids, [0] * 24)
    assert widths and all(b * w <= drafting.MAX_POSITIONS for b, w in widths), widths
    # (21 a call, twice, proposing nothing; then the last 19 and the pending
    # token, and proposals)
    assert widths[:2] == [(24, drafting.MAX_POSITIONS // 24)] * 2
    assert not any(made[0] + made[1]) and all(made[2])
    assert draft.fed == [len(rows[0]) + 1] * 24


@pytest.mark.parametrize("drop", [None, "carry", "roll"])
def test_rows_with_a_grammar_check_a_draft_s_proposals_exactly(runners, monkeypatch, drop):
    """Structured output, tools and a thinking budget beside a plain row,
    with the model as its own draft: the draft proposes its greedy tokens
    (unconstrained: the grammar cuts them where it refuses one), the
    check masks each position as the grammar would, and the text and
    logprobs are those without a draft; a grammar row keeps some."""
    off, itself, _ = runners
    checked_always(monkeypatch, drop)
    reference = run(off, GRAMMARS)
    got = run_with_figures(itself, GRAMMARS)
    for (want, want_lp, _), (tokens, lp, figures), body in zip(reference, got, GRAMMARS):
        assert tokens == want, body
        np.testing.assert_allclose(lp, want_lp, atol=2e-4)
    assert any(f and f["accepted"] for _, _, f in got[:3]), [f for _, _, f in got]


def test_a_draft_drafts_what_the_grammar_allows(runners, monkeypatch):
    """Another random model as the draft (its own argmax knows nothing of
    JSON): rows with a schema that runs past max_tokens and a forced tool
    call, the draft walking their grammars as it drafts (draft_walk), so
    the check never cuts a drafted proposal for the grammar (a free draft's
    were cut to nothing at every check here), the rows keep some (where
    the grammar leaves one token, the draft drafts it), and the text and
    logprobs are those without a draft (each walk rolled back: the grammar
    as it was)."""
    off, _, other = runners
    checked_always(monkeypatch)
    # (GRAMMARS[1] completes early: the token that completes it is not
    # drafted, as the check would cut it.)
    bodies = [GRAMMARS[0], GRAMMARS[2], GRAMMARS[1],
              chat("A plain row beside them.", max_tokens=30)]
    cuts = grammar_cuts(monkeypatch)
    reference = run(off, bodies)
    got = run_with_figures(other, bodies)
    for (want, want_lp, _), (tokens, lp, _), body in zip(reference, got, bodies):
        assert tokens == want, body
        np.testing.assert_allclose(lp, want_lp, atol=2e-4)
    assert len(cuts) >= 5 and all(n == made for made, n in cuts), [c for c in cuts if c[0] != c[1]]
    assert all(f and f["accepted"] for _, _, f in got[:2]), [f for _, _, f in got]


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_5_vl", "gemma3_vl"])
def test_a_vision_model_drafts_beside_images(kind, fixture_path, monkeypatch):
    """A vision model (through mlx-vlm: Qwen2.5-VL's M-RoPE, Qwen3.5's
    recurrent layers, Gemma 3's windows) with a text draft of its
    tokenizer, its images served (before, a draft made it a text model):
    rows with one and two images beside text rows, all in the batch, write
    the text and logprobs they write without a draft; the draft reads an
    image row's placeholder tokens as the text they are, and its proposals
    for image rows are checked too."""
    from tests.models.test_vision import BLUE, RED, image_part, user

    model = fixture_path(kind)
    off = EngineRunner(model)
    on = EngineRunner(model, argv=draft_argv(fixture_path("qwen3")))
    try:
        checked_always(monkeypatch)
        bodies = [{"messages": [user(image_part(RED), "Describe the picture.")], "max_tokens": 40},
                  {"messages": [user(image_part(BLUE), "and", image_part(RED), "Compare.")],
                   "max_tokens": 30},
                  chat("Tell me about rivers and boats.", max_tokens=40),
                  chat("Count the stations.", max_tokens=35, repetition_penalty=1.3)]
        assert on.loaded.processor is not None  # (images served)
        reference = run(off, bodies, together=True)
        got = [(t, lp, getattr(ctx, "speculation", None))
               for t, lp, ctx in replies(on, bodies, together=True)]
        for (want, want_lp, _), (tokens, lp, f), body in zip(reference, got, bodies):
            assert tokens == want, body
            np.testing.assert_allclose(lp, want_lp, atol=2e-4)
            assert f and f["proposed"] > 0, body  # (image rows too)
        assert on.sequential == 0 and on.engine.facts.drafts_in_batch(on.loaded)
    finally:
        off.close()
        on.close()


def test_a_grammar_row_drafts_again_right_after_a_check_it_kept(runners, monkeypatch):
    """The model as its own draft, rows with a schema and a forced call:
    the tokens a check keeps reach the grammar only at the next step, so
    the draft's walk takes them first (else it would walk on from the
    grammar's state before them and refuse the pending token: no
    proposals every other step). Each grammar row proposes at nearly every
    drafting step that asks it to, and keeps nearly all; the text is the
    one without a draft. A grammar that completes (GRAMMARS[1]) is not
    drafted past: the token that completes it, inside a long draft, is not
    proposed (the check would cut it)."""
    off, itself, _ = runners
    checked_always(monkeypatch)
    bodies = [GRAMMARS[0], GRAMMARS[2], GRAMMARS[1]]
    asked, drafted = Counter(), Counter()
    real = drafting.DraftRows._draft
    cuts = grammar_cuts(monkeypatch)

    def spy(self, tokens, pending, lengths, grammars=None):
        out = real(self, tokens, pending, lengths, grammars)
        for n, g, d in zip(lengths, grammars or [None] * len(out), out):
            if g is not None and n:
                asked[id(g)] += 1
                drafted[id(g)] += bool(d)
        return out

    monkeypatch.setattr(drafting.DraftRows, "_draft", spy)
    reference = run(off, bodies)
    got = run_with_figures(itself, bodies)
    assert [t for t, _, _ in got] == [t for t, _, _ in reference]
    # (Before the walk took the kept tokens: every other step at most. A row
    # also drafts nothing while it catches up, or where its pending token
    # completes the grammar.)
    assert len(asked) == 3 and all(drafted[g] >= 0.6 * asked[g] > 2 for g in asked), \
        (asked, drafted)
    # (The schema row; the forced call's penalty, which the draft doesn't
    # see, rejects some.)
    assert got[0][2]["accepted"] >= 0.8 * got[0][2]["proposed"], got[0][2]
    assert all(n == made for made, n in cuts), [c for c in cuts if c[0] != c[1]]


def test_a_draft_stops_before_the_token_that_completes_the_grammar(fixture_path):
    """DraftRows alone, a row held to {"ok": <boolean>}: eight drafted
    positions under the grammar reach its closing brace mid-draft; the
    proposals stop before it (the token that completes a grammar is
    sampled by the check, not proposed: proposal_masks would cut it), every
    proposal is one the check keeps for the grammar, and the grammar is
    left as it was."""
    from mlx_lm_plus.planning.constraints import ConstraintProcessor

    model, tok, proc, prompt, vocab, first = boolean_row(fixture_path)
    pending = int(np.flatnonzero(first.keep[0])[0])  # (what the plain step may sample)
    draft = drafting.DraftRows(model, chunk=64, cost=speculation.DraftCost(), vocab=vocab)
    draft.extend([1], [prompt], [True])
    draft.catch_up([1], [(prompt, [])])
    proposal, = draft.propose([1], [(prompt, [])], mx.array([pending], dtype=mx.uint32), [8],
                              [proc])
    draft.settle([1], [0])
    # (The check's view: the pending token in the grammar, then the proposals.)
    ConstraintProcessor.mask_batch([(0, proc, prompt, pending)], (1, vocab))
    n, _ = proc.proposal_masks(proposal, vocab)
    text = tok.decode([pending] + proposal)
    assert 0 < len(proposal) < 8 and n == len(proposal), (text, proposal, n)
    assert not text.rstrip().endswith("}"), text
    assert proc.error is None and not proc.matcher.is_stopped()


def test_a_recurrent_draft_holds_its_states_within_the_budget(fixture_path, monkeypatch):
    """A Qwen3.5 draft: its feeding call keeps a batch's states only at its
    rows' feeds, and drafting one after each drafted position, within
    rollback.STATE_BUDGET_BYTES (here 3 batch states: rollback.widest 4)
    as a checking step's: rows feed at most 4 tokens and draft at most 4
    (they catch up over more steps), and each row's draft state is still a
    fresh prefill's."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_plus.engine import rollback

    model, _ = load(str(fixture_path("qwen3_5")))
    draft = drafting.DraftRows(model, chunk=64, cost=speculation.DraftCost())
    rows = [[(5 * i + j) % 400 + 20 for i in range(n)] for j, n in enumerate((9, 30))]
    uids = [1, 2]
    draft.extend(uids, rows, [True, True])
    draft.catch_up(uids, [(r, []) for r in rows])
    state = sum(a.nbytes for c in draft.cache if isinstance(c, drafting.ArraysCache)
                for a in c.cache if a is not None)
    monkeypatch.setattr(rollback, "STATE_BUDGET_BYTES", 3 * state)
    assert rollback.widest(draft.cache) == 4
    held, real_close = [], rollback.StateTaps.close

    def close(self):
        real_close(self)
        held.append(len({position for _, position, _ in self.states}))

    monkeypatch.setattr(rollback.StateTaps, "close", close)
    rows[1].extend(range(100, 110))  # (ten tokens more to feed: several steps)
    drafted, fed = [], []
    for step in range(6):
        before = list(draft.fed)
        proposals = draft.propose(uids, [(r, []) for r in rows],
                                  mx.array([7 + step, 9 + step], dtype=mx.uint32), [8, 8])
        fed.append(max(b - a for a, b in zip(before, draft.fed)))
        drafted.append(max(map(len, proposals)))
        kept = [min(1, len(p)) for p in proposals]
        draft.settle(uids, kept)
        for r, p, k, t in zip(rows, proposals, kept, (7 + step, 9 + step)):
            r.extend([t] + p[:k])
    # (Two rows: one position kept a call, where their feeds differ.)
    assert max(drafted) == 4 and max(fed) == 4 and held and max(held) == 1, (drafted, fed, held)
    for j, row in enumerate(rows):
        fed = draft.fed[j]
        want = make_prompt_cache(model)
        model(mx.array(row[:fed])[None], cache=want)
        for w, g in zip(want, [c.extract(j) for c in draft.cache]):
            if isinstance(w, drafting.ArraysCache):
                for a, b in zip(g.cache, w.cache):
                    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def test_a_vision_model_with_a_draft_under_kv_bits_serves_without_it(fixture_path):
    """--kv-bits on a vision model with a draft (vision models don't batch
    --kv-bits): its requests, image ones too, take the sequential path
    without the draft (mlx-lm's speculative step knows neither images nor
    these caches: every request failed there) and write what the model
    writes without a draft."""
    from tests.models.test_vision import RED, image_part, user

    model = fixture_path("qwen2_5_vl")
    argv = ["--kv-bits", "8"]
    off = EngineRunner(model, argv=argv)
    on = EngineRunner(model, argv=argv + draft_argv(fixture_path("qwen3")))
    try:
        bodies = [{"messages": [user(image_part(RED), "Describe the picture.")], "max_tokens": 8},
                  chat("Tell me about rivers.", max_tokens=8)]
        for body in bodies:
            assert on.run(body)[0] == off.run(body)[0], body
        assert on.sequential >= 2 and on.loaded.processor is not None
        assert on.engine.sequential._draft(on.loaded) is None
    finally:
        off.close()
        on.close()


def test_a_draft_whose_grammars_cut_every_proposal_keeps_no_drafted_position(fixture_path):
    """DraftRows alone, a row held to {"ok": <boolean>} whose pending token
    is the closing brace: the grammar completes there, so the row proposes
    nothing, no check follows and no settle; the positions the draft drafted
    are taken out at once (left in, every later proposal was off: the
    model as its own draft kept 2 of 10 where it kept all)."""
    from mlx_lm_plus.planning.constraints import ConstraintProcessor

    model, tok, proc, prompt, vocab, _ = boolean_row(fixture_path)
    body = tok.encode('{"ok": true', add_special_tokens=False)
    brace, = tok.encode("}", add_special_tokens=False)
    row = list(prompt)
    for t in body:  # (the plain steps before: each token into the grammar)
        ConstraintProcessor.mask_batch([(0, proc, row, t)], (1, vocab))
        row.append(t)
    draft = drafting.DraftRows(model, chunk=64, cost=speculation.DraftCost(), vocab=vocab)
    draft.extend([1], [row], [True])
    draft.catch_up([1], [(row, [])])
    proposal, = draft.propose([1], [(row, [])], mx.array([brace], dtype=mx.uint32), [4], [proc])
    assert proposal == []
    assert draft.fed == [len(row) + 1]  # (its tokens and the brace)
    assert all(c.extract(0).offset == draft.fed[0] for c in draft.cache)
    assert proc.error is None and not proc.matcher.is_stopped()
