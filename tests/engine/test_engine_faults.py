"""Faults inside the engine that must stay one request's (or none's): found
by a hostile review, each reproduced before its fix."""

import time

import mlx.core as mx
import pytest

from mlx_lm_plus.errors import EngineUnavailable
from mlx_lm_plus.protocols.validation import parse_request
from testkit.engine_harness import SEQUENTIAL, Collect, EngineRunner

CHAT = "/v1/chat/completions"


def chat(text="hi", **kw):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 3, **kw}


def submit(runner, body):
    parsed = parse_request(CHAT, body, runner.args)
    channel = Collect()
    runner.engine.submit(channel, parsed.request, parsed.args)
    return channel


@pytest.fixture
def runner(fixture_path):
    r = EngineRunner(fixture_path("qwen3"))
    r.loaded
    yield r
    r.close()


def test_a_sampler_that_fails_while_traced_leaves_sampling_working(runner):
    """mlx-lm's apply_top_k is compiled with MLX's random state as input and
    output: raising while traced (top_k = the vocabulary, as if validation
    had let it through) left that state a placeholder, and every sampled
    request after it failed ("eval an array without a primitive") until a
    seeded one reseeded it."""
    lm = runner.loaded
    vocab, lm.vocab_size = lm.vocab_size, None  # (the check validation does: off)
    try:
        with pytest.raises(Exception):
            submit(runner, chat(temperature=1.0, top_k=vocab)).result(timeout=60)
    finally:
        lm.vocab_size = vocab
    for _ in range(3):
        tokens, _ = submit(runner, chat(temperature=1.0, top_k=5)).result(timeout=60)
        assert len(tokens) == 3


def test_top_k_of_the_whole_vocabulary_is_refused(runner):
    from mlx_lm_plus.protocols.validation import RequestError

    vocab = runner.loaded.vocab_size
    with pytest.raises(RequestError, match=f"less than {vocab}"):
        parse_request(CHAT, chat(top_k=vocab), runner.args, vocab)
    parse_request(CHAT, chat(top_k=vocab - 1), runner.args, vocab)


def test_a_failed_store_loses_only_the_entry(runner, monkeypatch):
    """Storing a finished request's cache can fail (out of memory): that
    request, whose tokens went out, still ends normally, and the requests
    beside it in the batch go on (they all got a 503 before)."""
    real = runner.store.insert
    failed = []

    def insert(model, key, cache, kind, **kw):
        if kind == "generated" and not failed:
            failed.append(len(key))
            raise RuntimeError("[metal::malloc] Unable to allocate 1024 bytes")
        return real(model, key, cache, kind, **kw)

    monkeypatch.setattr(runner.store, "insert", insert)
    channels = [submit(runner, chat(f"question {i}", max_tokens=2 + 3 * i)) for i in range(3)]
    results = [c.result(timeout=60)[0] for c in channels]
    assert failed and [len(t) for t in results] == [2, 5, 8]
    assert runner.engine.is_healthy


def test_a_cancelled_request_parked_behind_a_checkpoint_goes_at_once(fixture_path):
    """A request parked behind another's prefill of their shared system
    prompt was let go only once that prefill stored its checkpoint (14 s
    on a long prompt), however early its client went."""
    system = "Yet another new system prompt, long enough to take a while. " * 80
    r = EngineRunner(fixture_path("qwen3"), argv=["--prefill-step-size", "8"])
    try:
        r.loaded
        stored_at = []
        real = r.store.insert
        r.store.insert = lambda *a, **kw: (stored_at.append(time.monotonic()), real(*a, **kw))[1]
        bodies = [{"max_tokens": 3, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {i}: which river is longest?"}]}
            for i in range(2)]
        leader = submit(r, bodies[0])
        parked = submit(r, bodies[1])
        deadline = time.monotonic() + 60
        while not any(b.held_back() for b in r.engine._batches.values()):
            assert time.monotonic() < deadline, "the second request was not parked"
            time.sleep(0.005)
        parked.cancel()
        cancelled_at = time.monotonic()
        while parked.removed_at is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert leader.result(timeout=120)[0]
        # Let go while the leader still prefilled the shared prompt (before
        # it stored the checkpoint the parked request waited for).
        assert stored_at and parked.removed_at < stored_at[0]
        assert parked.removed_at - cancelled_at < 5
        assert not any(b.held_back() for b in r.engine._batches.values())
    finally:
        r.close()


def test_a_request_served_one_at_a_time_is_cut_short_when_the_engine_stops(fixture_path):
    """SIGTERM: once --shutdown-timeout is over, engine.stop() answers what
    is left. A request on the sequential path went on generating until
    aiohttp cut its connection, and the requests queued behind it waited."""
    r = EngineRunner(fixture_path("qwen3"))
    try:
        r.loaded
        long = submit(r, chat("tell me a long story", max_tokens=20000, **SEQUENTIAL))
        queued = submit(r, chat("and you?"))
        first = long.items.get(timeout=60)
        while isinstance(first, tuple):
            first = long.items.get(timeout=60)
        r.engine.stop()
        stopped_at = time.monotonic()
        with pytest.raises(EngineUnavailable, match="shutting down"):
            long.result(timeout=30)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            queued.result(timeout=30)
        assert time.monotonic() - stopped_at < 10
    finally:
        r.close()


def test_a_prompt_chunk_is_cut_short_while_another_model_decodes(runner, monkeypatch):
    """With several models loaded, a long prompt for one model was cut in
    full --prefill-step-size chunks while the other model's streams decoded
    (it looked at its own batch only): their tokens waited a whole chunk
    each. Stand-in for the other model's decoding stream: the engine says
    it decodes."""
    from mlx_lm_plus.engine import batch as engine_module

    seen = []
    real = engine_module.prefill_chunk
    monkeypatch.setattr(engine_module, "prefill_chunk",
                        lambda step, decoding: (seen.append(decoding), real(step, decoding))[1])
    monkeypatch.setattr(runner.engine, "decoding", lambda: True)
    assert submit(runner, chat("a long question " * 40)).result(timeout=60)[0]
    assert seen and all(seen)


def test_checkpoints_prefilled_one_at_a_time_are_quantized_under_kv_bits(fixture_path):
    """--kv-bits on the sequential path of a hybrid model: its
    checkpoints were prefilled by plain model calls, never quantized (stored
    as float KV, and the memory --kv-bits bounds was not bounded), unlike
    generate_step's prefill and the batched path."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    r = EngineRunner(fixture_path("qwen3_5_kv"),
                     argv=["--kv-bits", "4", "--quantized-kv-start", "0"])
    try:
        r.loaded
        body = {"max_tokens": 3, **SEQUENTIAL, "messages": [
            {"role": "system", "content": "You plan trips by the river. " * 20},
            {"role": "user", "content": "Which boat?"}]}
        assert submit(r, body).result(timeout=60)[0] and r.sequential == 1
        entries = r.store.entries()
        assert len(entries) >= 2  # checkpoints, and the reply's end
        for entry in entries:
            layers = r.store.stored_cache(entry)
            assert not any(type(c) is KVCache for c in layers), (entry.kind, layers)
            assert any(isinstance(c, QuantizedKVCache) for c in layers)
    finally:
        r.close()
