"""Concurrent requests sharing prefixes, and the byte budget on both paths."""

import pytest

from testkit.engine_harness import SEQUENTIAL, EngineRunner
from tests.cache.test_cache_exactness import SYSTEM, assert_store_invariant, conversation

KINDS = ["qwen3_5", "mamba2", "qwen3", "gemma3_text"]


def round_bodies(r):
    """8 requests of mixed lengths sharing the system prompt and histories."""
    bodies = []
    for i in range(8):
        if i % 3 == 0:
            body = conversation(2 + i % 5, tag=f" r{r}")
        elif i % 3 == 1:
            body = conversation(3 + i % 4, edit_at=1 + i % 2, edit=f"variant {i} {r}")
        else:
            body = {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"Short {i} {r}" * (1 + i)}]}
        bodies.append(body)
    return bodies


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_rounds_equal_sequential_fresh(kind, fixture_path):
    path = fixture_path(kind)
    cached = EngineRunner(path)
    try:
        for r in range(3):
            bodies = round_bodies(r)
            concurrent = cached.run_all(bodies)
            fresh = EngineRunner(path, max_bytes=0)
            try:
                sequential = [fresh.run(b)[0] for b in bodies]
            finally:
                fresh.close()
            assert concurrent == sequential, (kind, r)
            assert_store_invariant(cached)
        assert cached.store.snapshot()["prompt_tokens_saved"] > 0
    finally:
        cached.close()


@pytest.mark.parametrize("seeded", [False, True], ids=["batched", "sequential"])
def test_byte_budget_holds_after_every_insert(seeded, fixture_path):
    runner = EngineRunner(fixture_path("qwen3_5"), max_bytes=0)
    store = runner.store
    # Room for a few entries of this model, then check on every insert.
    store.max_bytes = 300_000
    seen = []
    insert = store.insert

    def checked_insert(*args, **kw):
        insert(*args, **kw)
        seen.append(store.nbytes)
        assert store.nbytes <= store.max_bytes

    store.insert = checked_insert
    try:
        extra = SEQUENTIAL if seeded else {}
        for t in range(1, 7):
            runner.run({**conversation(t), **extra})
        assert len(seen) >= 6 and store.snapshot()["evictions"] > 0
    finally:
        runner.close()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_concurrent_requests_compute_a_new_system_prompt_once(kind, fixture_path):
    """Requests that arrive together with the same system prompt, not cached
    yet: one computes it, the others wait for its checkpoint (parking) and
    reuse it; every reply equals the same request served alone by a fresh
    engine."""
    path = fixture_path(kind)
    system = "A new system prompt for parking, not seen before. " * 12
    bodies = [{"messages": [{"role": "system", "content": system},
                            {"role": "user", "content": f"Question {i}: which river is longest?"}]}
              for i in range(4)]
    runner = EngineRunner(path)
    try:
        channels = [runner.submit(b) for b in bodies]
        results = [c.result() for c in channels]
        fresh = EngineRunner(path, max_bytes=0)
        try:
            alone = [fresh.run(b)[0] for b in bodies]
        finally:
            fresh.close()
        assert [tokens for tokens, _ in results] == alone
        prompt = len(results[0][1].prompt)
        reused = sorted(ctx.prompt_cache_count for _, ctx in results)
        # The first computed the system prompt; the other three reused it.
        assert reused[0] == 0
        assert all(n >= prompt // 2 for n in reused[1:]), (reused, prompt)
        # Held back before any lookup: one miss, four admissions.
        assert runner.store.snapshot()["misses"] == 1
        assert runner.engine.admitted == 4
        assert_store_invariant(runner)
    finally:
        runner.close()


def test_a_parked_request_gets_keepalives(fixture_path, monkeypatch):
    """A request parked behind another's prefill of their shared system
    prompt waits that whole prefill: it gets a keepalive every
    KEEPALIVE_EVERY meanwhile (a stream's proxy or SDK would time it out
    otherwise), as a request waiting for a model does."""
    import time

    from mlx_lm_plus.engine import housekeeping
    from mlx_lm_plus.protocols.validation import parse_request
    from testkit.engine_harness import Collect

    monkeypatch.setattr(housekeeping, "KEEPALIVE_EVERY", 0.05)
    monkeypatch.setattr(housekeeping, "HOUSEKEEPING_EVERY", 0.01)
    system = "Yet another new system prompt, long enough to take a while. " * 60
    runner = EngineRunner(fixture_path("qwen3"), argv=["--prefill-step-size", "8"])
    try:
        runner.loaded
        channels = []
        for i in range(2):
            parsed = parse_request("/v1/chat/completions", {"max_tokens": 3, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: which river is longest?"}]},
                runner.args)
            channels.append(Collect())
            runner.engine.submit(channels[-1], parsed.request, parsed.args)
        leader, parked = channels
        start, before_ctx = time.monotonic(), []
        while True:  # the parked request's items until its context comes
            item = parked.items.get(timeout=120)
            if not isinstance(item, tuple):
                break
            before_ctx.append(item)
        waited = time.monotonic() - start
        assert leader.result()[0] and parked.result()[0]
        assert runner.store.snapshot()["misses"] == 1  # (it was parked: one lookup)
        keepalives = before_ctx.count((0, 0))
        # (Every 0.05 s it waited, give or take the steps' length.)
        assert keepalives >= max(1, int(waited / 0.05) // 3), (waited, before_ctx)
    finally:
        runner.close()
