"""Failures inside the generation thread fail one request, never the loop;
the byte budget holds on every path; an allocation failure is a 503.

(Found in review: removal of cancelled requests ran outside the step's guard;
the budget was enforced only when a request joined the batch; an MLX
allocation failure crashed the loop.)
"""

import time

import pytest
from mlx_lm.server import Response

from mlx_lm_plus.engine import engine as engine_module
from mlx_lm_plus.engine.housekeeping import HOUSEKEEPING_EVERY
from mlx_lm_plus.engine.watchdog import HANG_EXIT_STATUS
from mlx_lm_plus.errors import InternalError, OutOfMemory
from testkit.engine_harness import SEQUENTIAL, Collect, EngineRunner

LONG = " ".join(f"Line {i} is about trains, stations and tickets." for i in range(30))


def chat(text, **kw):
    return {"messages": [{"role": "user", "content": text}], **kw}


def wait_tokens(channel, n, timeout=60):
    deadline, got = time.monotonic() + timeout, 0
    while got < n:
        item = channel.items.get(timeout=max(0.1, deadline - time.monotonic()))
        assert not isinstance(item, Exception), item
        got += isinstance(item, Response)


@pytest.fixture
def runner(fixture_path):
    r = EngineRunner(fixture_path("qwen3"))
    yield r
    r.close()


@pytest.mark.parametrize("fault", ["store", "remove"])
def test_a_fault_while_removing_a_cancelled_request_spares_the_loop(runner, monkeypatch, fault):
    engine = runner.engine
    assert runner.run(chat("warm up", max_tokens=4))[0]
    doomed = runner.submit(chat(LONG, max_tokens=5000))
    other = runner.submit(chat("Another question", max_tokens=40))
    wait_tokens(doomed, 3)

    target = runner.store if fault == "store" else next(iter(engine._batches.values())).generator
    name = "insert" if fault == "store" else "remove"
    real = getattr(target, name)
    fired = []

    def broken(*a, **kw):
        if fired:
            return real(*a, **kw)
        fired.append(True)  # once: the cancelled request's removal
        raise RuntimeError(f"injected {fault} fault")

    monkeypatch.setattr(target, name, broken)
    doomed.cancel()
    if fault == "store":
        # Only the cancelled request's cache entry is lost.
        assert len(other.result()[0]) == 40
    else:
        # The batch's state is unknown after a failed removal: its requests
        # fail with an answer, the loop goes on.
        with pytest.raises(InternalError, match="injected remove fault"):
            other.result()
    monkeypatch.undo()
    assert engine.restarts == 0 and engine.is_healthy
    assert len(runner.run(chat("after", max_tokens=5))[0]) == 5


@pytest.mark.parametrize("path", ["batched", "sequential"])
def test_budget_covers_caches_growing_in_decode(fixture_path, path):
    """An entry stored before a long generation gives way while that
    generation's cache grows, not only when something is inserted."""
    runner = EngineRunner(fixture_path("qwen3"))
    try:
        runner.run(chat("First, a short one.", max_tokens=2))
        (first,) = runner.store.entries()
        # Room for that entry and the KV buffer of a ~70-token prompt resumed
        # from a copy of it (the copy's tokens plus a 256-token step), not
        # for the extra 256-token step that 300 generated tokens take.
        per_token = first.nbytes / len(first.key)
        runner.store.max_bytes = (
            runner.store.nbytes + int((256 + len(first.key)) * per_token) + 1024)
        seen = {}
        real_insert = runner.store.insert

        def insert(model, key, cache, kind="prompt", **kw):
            if kind == "generated" and "at_end" not in seen:
                seen["at_end"] = first in runner.store.entries()
            return real_insert(model, key, cache, kind, **kw)

        runner.store.insert = insert
        body = chat("A different, long question " * 8, max_tokens=300)
        if path == "sequential":
            body.update(SEQUENTIAL)
        tokens, _, _ = runner.run(body)
        assert runner.sequential == (path == "sequential")
        assert len(tokens) == 300
        assert seen["at_end"] is False, "the old entry outlived the budget during decode"
        assert runner.store.stats["evicted"] >= 1
    finally:
        runner.close()


def test_queued_copies_of_stored_entries_are_not_counted(runner):
    """A fetched entry shares its buffers with the stored one (MLX arrays are
    immutable), so a request waiting in the generator holds no new memory."""
    from mlx_lm.generate import BatchGenerator

    runner.run(chat(LONG, max_tokens=2))
    engine = runner.engine
    (entry,) = runner.store.entries()
    fetched = runner.store.fetch(runner.provider.default_key, list(entry.key) + [5, 6])
    assert fetched.cache is not None
    batch = engine_module._Batch.__new__(engine_module._Batch)
    batch.generator = BatchGenerator(runner.loaded.model)
    (uid,) = batch.generator.insert_segments(segments=[[[5, 6]]], max_tokens=[1],
                                             caches=[fetched.cache],
                                             all_tokens=[list(entry.key)])
    batch.results = {uid: {"prefilled": False}}  # (from the store: no images prefilled)
    assert batch.generator.prompt_cache_nbytes >= entry.nbytes  # upstream's count
    assert batch.owned_nbytes() == 0
    batch.generator.close()


def fail_next_model_call(runner, monkeypatch, message, error=RuntimeError):
    """The model's next forward pass raises error(message) (RuntimeError: as
    MLX does when an allocation fails); the calls after it run as usual."""
    model_type = type(runner.loaded.model)
    real_call = model_type.__call__
    armed = [True]

    def failing(self, *a, **kw):
        if armed.pop() if armed else False:
            raise error(message)
        return real_call(self, *a, **kw)

    monkeypatch.setattr(model_type, "__call__", failing)


@pytest.mark.parametrize("path", ["batched", "sequential"])
def test_allocation_failure_is_a_503_for_that_request(runner, monkeypatch, path):
    """An MLX allocation failure (Metal's text) in a step fails the requests of
    that step with OutOfMemory (503), frees memory, and the loop goes on."""
    engine = runner.engine
    assert runner.run(chat("warm up", max_tokens=4))[0]
    fail_next_model_call(runner, monkeypatch,
                         "[metal::malloc] Unable to allocate 68719476736 bytes.")
    body = chat("This one runs out of memory", max_tokens=4)
    if path == "sequential":
        body.update(SEQUENTIAL)
    sequential_before = runner.sequential
    with pytest.raises(OutOfMemory, match="Unable to allocate"):
        runner.run(body)
    monkeypatch.undo()
    assert runner.sequential - sequential_before == (path == "sequential")
    assert engine.restarts == 0 and engine.is_healthy
    assert len(runner.run(chat("and this one does not", max_tokens=4))[0]) == 4


@pytest.mark.parametrize("path", ["batched", "sequential"])
@pytest.mark.parametrize("message,reason", [
    ("[metal::malloc] Unable to allocate 1024 bytes.", "out of memory on a rank"),
    ("[metal::Device] Attempting to allocate 8 bytes which is greater than the maximum "
     "allowed buffer size of 4 bytes.", "an error on a rank")])
def test_an_mlx_error_on_a_rank_ends_the_group(fixture_path, monkeypatch, path,
                                               message, reason):
    """Under mx.distributed an error of MLX's is one host's (its memory, its
    Metal's buffer limit, which differ between Macs): the other ranks went
    on with the step this one gave up, and a rank out of step garbles or
    hangs every collective after it. So it ends the group, as a lost host
    does: the request a 503 naming it, /health the reason, exit 70. (On a
    group of one: the engine's handling, not the collectives.)"""
    r = EngineRunner(fixture_path("qwen3"), argv=["--watchdog-grace", "0"], as_a_rank=True)
    try:
        assert r.run(chat("warm up", max_tokens=4))[0]
        fail_next_model_call(r, monkeypatch, message)
        body = chat("This one fails on one host", max_tokens=4, **(
            SEQUENTIAL if path == "sequential" else {}))
        with pytest.raises(engine_module.EngineUnavailable,
                           match=f"Generation engine unavailable: {reason}"):
            r.run(body)
        deadline = time.monotonic() + 30
        while not r.exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.exits == [HANG_EXIT_STATUS]
        assert f"{reason} of the distributed group" in r.engine.unhealthy_reason
        assert r.engine.restarts == 0  # (never a loop restarted on one rank)
    finally:
        r.close()


class NotPartOfARequest:
    """A class the other ranks refuse to unpickle."""


def test_any_error_in_a_batch_step_of_a_rank_ends_the_group(fixture_path, monkeypatch):
    """Not only MLX's: whatever a rank's batch step raises (its own layers'
    code, say) may be that rank's alone, and the others went on."""
    r = EngineRunner(fixture_path("qwen3"), argv=["--watchdog-grace", "0"], as_a_rank=True)
    try:
        assert r.run(chat("warm up", max_tokens=4))[0]
        fail_next_model_call(r, monkeypatch, "a layer's own bug", error=ValueError)
        with pytest.raises(engine_module.EngineUnavailable, match="an error on a rank"):
            r.run(chat("This one fails on one host", max_tokens=4))
        deadline = time.monotonic() + 30
        while not r.exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.exits == [HANG_EXIT_STATUS]
    finally:
        r.close()


def test_a_request_the_other_ranks_would_refuse_fails_alone(fixture_path):
    """Rank 0 unpickles what it would hand the other ranks first: a request
    they would refuse gets a 500 of its own, and nothing goes out (sent, the
    refusal on every rank would end the group)."""
    from mlx_lm_plus.protocols.validation import parse_request

    r = EngineRunner(fixture_path("qwen3"), as_a_rank=True)
    try:
        parsed = parse_request("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, r.args)
        parsed.request.tool_choice = NotPartOfARequest()
        channel = Collect()
        r.engine.submit(channel, parsed.request, parsed.args)
        with pytest.raises(InternalError, match="Could not hand the request to the other"):
            channel.result()
        assert len(r.run(chat("and this one", max_tokens=3))[0]) == 3
        assert r.engine.is_healthy and not r.exits
    finally:
        r.close()


def test_a_buffer_larger_than_the_machine_allows_is_a_400(runner, monkeypatch):
    """Metal's per-buffer limit can never be met by retrying: 400, and the
    prompt cache is not given up for it."""
    from mlx_lm_plus.errors import PromptError

    assert runner.run(chat("warm up", max_tokens=4))[0]
    entries = len(runner.store.entries())
    fail_next_model_call(runner, monkeypatch,
                         "[metal::malloc] Attempting to allocate 99999999999 bytes which is "
                         "greater than the maximum allowed buffer size of 77309411328 bytes.")
    with pytest.raises(PromptError, match="larger buffer"):
        runner.run(chat("too big", max_tokens=4))
    monkeypatch.undo()
    assert len(runner.store.entries()) >= entries and runner.engine.restarts == 0


def test_rows_with_the_same_sampling_share_one_sampler(runner):
    """BatchGenerator samples rows whose sampler is the same object in one
    call: requests with equal settings get the same one; XTC, whose random
    draw would then be shared by the rows, gets its own each time."""
    from types import SimpleNamespace

    runner.run(chat("Load the model.", max_tokens=1))
    batch = engine_module._Batch.__new__(engine_module._Batch)
    batch._samplers, batch.tokenizer = {}, runner.loaded.tokenizer

    def args(temperature, xtc=0.0, top_p=1.0):
        return SimpleNamespace(seed=None, sampling=SimpleNamespace(
            temperature=temperature, top_p=top_p, top_k=0, min_p=0.0,
            xtc_probability=xtc, xtc_threshold=0.1))

    warm = batch._sampler(args(0.7))
    assert batch._sampler(args(0.7)) is warm
    assert batch._sampler(args(0.7, top_p=0.9)) is not warm
    assert batch._sampler(args(0.7, xtc=0.5)) is not batch._sampler(args(0.7, xtc=0.5))


def test_a_checkpoint_a_token_past_the_previous_one_is_not_its_own_segment():
    """Each segment is a model call: one shorter than MIN_SEGMENT_TOKENS joins
    the next (its checkpoint is dropped), the tokens and the other
    checkpoints stay as they were, and the last segment is never merged."""
    from mlx_lm_plus.engine.segments import MIN_SEGMENT_TOKENS
    from mlx_lm_plus.engine.segments import drop_cached as _drop_cached

    tokens = list(range(40))
    segments = [tokens[:10], tokens[10:11], tokens[11:30], tokens[30:38], tokens[38:]]
    kinds = ["system", "checkpoint", "checkpoint", "checkpoint", "prompt"]
    assert MIN_SEGMENT_TOKENS > 2
    out, out_kinds = _drop_cached(segments, kinds, 0)
    assert sum(out, []) == tokens
    assert [len(s) for s in out] == [10, 20, 8, 2]
    assert out_kinds == ["system", "checkpoint", "checkpoint", "prompt"]
    # The cached prefix counts too: a segment cut short by it joins the next.
    out, out_kinds = _drop_cached(segments, kinds, 9)
    assert sum(out, []) == tokens[9:]
    assert [len(s) for s in out] == [21, 8, 2] and out_kinds == ["checkpoint"] * 2 + ["prompt"]


def test_a_plan_made_before_admission_is_used_as_it_is(runner):
    """Engine.plan (the HTTP layer's planning thread) hands the generation
    thread a finished plan: it is not planned again, and the reply is the
    one it plans itself."""
    from mlx_lm_plus.protocols.validation import parse_request

    body = chat("Plan me once, please.", max_tokens=6)
    alone, _, _ = runner.run(body)  # planned at admission (no planning thread here)
    engine = runner.engine
    planned_here = engine.planned_at_admission
    assert planned_here >= 1
    parsed = parse_request("/v1/chat/completions", {"max_tokens": 10, **body}, runner.args)
    planned = engine.plan(parsed.request, parsed.args)
    assert planned is not None
    channel = Collect()
    engine.submit(channel, parsed.request, parsed.args, planned)
    tokens, _ = channel.result()
    assert tokens == alone
    assert engine.planned_at_admission == planned_here


async def test_a_handler_waits_for_the_read_ahead_of_its_entry_by_another():
    """Server._plan: when another request's handler is reading the disk
    entry this request needs (Engine.read_ahead returns that read's
    Future), the request is queued only once that read ended, so the
    generation thread doesn't read the file again while streams wait."""
    import concurrent.futures
    import threading
    import types

    from mlx_lm_plus.http.server import Server

    reading = concurrent.futures.Future()
    planned = types.SimpleNamespace(on_disk=True)
    engine = types.SimpleNamespace(
        is_healthy=True, plan=lambda request, args: planned,
        read_ahead=lambda p: reading if p is planned else None)
    from mlx_lm_plus.planning.lanes import Lane

    server = types.SimpleNamespace(engine=engine, _planner=Lane("planning"),
                                   _planning_timeout=60.0, _engine_down=lambda: None)
    server._in_lane = lambda *a: Server._in_lane(server, *a)
    parsed = types.SimpleNamespace(request=types.SimpleNamespace(count_only=False), args=None,
                                   carried_bytes=0)
    threading.Timer(0.3, reading.set_result, (True,)).start()
    assert await Server._plan(server, parsed, 0) is planned
    assert reading.done()


def test_housekeeping_lets_stale_reads_ahead_go_on_a_quiet_server(fixture_path):
    """The generation thread's housekeeping (every HOUSEKEEPING_EVERY, idle
    or not) asks the store to drop reads ahead nothing fetched in time."""
    runner = EngineRunner(fixture_path("qwen3"))
    try:
        runner.loaded
        asked = []
        runner.store.drop_stale_read_ahead = lambda: asked.append(time.monotonic())
        time.sleep(4 * HOUSEKEEPING_EVERY)
        assert len(asked) >= 2
    finally:
        runner.close()


def test_requests_after_a_stop_are_answered(fixture_path):
    """Once the engine is told to stop (a graceful shutdown past
    --shutdown-timeout), a request submitted gets "server shutting down" at
    once, and one that slipped into the queue while the loop saved the
    prompt cache is answered after the save (never left waiting)."""
    from mlx_lm_plus.errors import EngineUnavailable
    from mlx_lm_plus.protocols.validation import parse_request

    runner = EngineRunner(fixture_path("qwen3"))
    engine = runner.engine
    parsed = parse_request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, runner.args)
    late = Collect()
    save = engine._save_to_disk

    def save_while_one_comes():
        engine.requests.put((late, parsed.request, parsed.args, None))  # (past submit's check)
        save()

    engine._save_to_disk = save_while_one_comes
    try:
        runner.loaded
        engine.stop()
        with pytest.raises(EngineUnavailable, match="shutting down"):
            engine.submit(Collect(), parsed.request, parsed.args)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            late.result(timeout=30)
    finally:
        runner.close()
