"""--kv-bits inside continuous batching (mlx_lm_plus/engine/quantized_batch.py).

The cache's batch operations on ragged rows, its quantization rule, greedy
tokens of batched requests equal to upstream's sequential --kv-bits path
(generate_step) and to our own sequential path, and a server with
--kv-bits 4 that batches concurrent requests and resumes a conversation from
its prompt cache. On the qwen3_mid fixture: the tiny ones have a head dim of
16, which mx.quantize's group sizes (32, 64, 128) do not divide.
"""

import threading
import time

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from compat.launch import OURS, ServerProcess
from mlx_lm_plus.engine.quantized_batch import (
    BatchQuantizedKVCache,
    QuantizedBatchGenerator,
    from_layer,
)
from testkit.engine_harness import SEQUENTIAL, EngineRunner

H, D, G = 2, 64, 64  # kv heads, head dim, group size
SETTINGS = dict(group_size=G, kv_bits=4, quantized_kv_start=0)


def kv_layer(n, seed):
    """A request's KVCache holding n random positions."""
    mx.random.seed(seed)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
    return c


def q(x):
    return tuple(mx.quantize(x, group_size=G, bits=4))


def same(a, b):
    """Arrays, or quantized tuples, bit for bit."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and mx.array_equal(a, b).item()


def check_row(batch, i, layer):
    """Row i of the batch holds exactly `layer`'s positions, quantized when
    the batch is, right-justified after its left padding."""
    n = layer.offset
    pad = batch.left_padding.tolist()[i]
    assert pad == batch.size() - n
    assert batch.offset.tolist()[i] == n
    out = batch.extract(i)
    assert out.offset == n
    k, v = layer.keys[..., :n, :], layer.values[..., :n, :]
    if batch.quantized:
        assert isinstance(out, QuantizedKVCache) and out.bits == 4
        assert same(out.keys, q(k)) and same(out.values, q(v))
    else:
        assert type(out) is KVCache
        assert same(out.keys, k) and same(out.values, v)


def test_merge_extend_filter_extract_ragged():
    layers = [kv_layer(n, s) for s, n in enumerate([5, 2, 9])]
    batch = BatchQuantizedKVCache.merge([from_layer(c, **SETTINGS) for c in layers])
    assert batch.left_padding.tolist() == [4, 7, 0] and not batch.quantized
    for i, c in enumerate(layers):
        check_row(batch, i, c)
    batch.quantize()
    assert batch.quantized and isinstance(batch.keys, tuple)
    for i, c in enumerate(layers):
        check_row(batch, i, c)

    # Float rows joining a quantized layer are quantized; the longer newcomer
    # moves the existing rows right.
    more = [kv_layer(n, 10 + s) for s, n in enumerate([3, 12])]
    batch.extend(BatchQuantizedKVCache.merge([from_layer(c, **SETTINGS) for c in more]))
    layers += more
    assert batch.quantized and batch.size() == 12
    assert batch.left_padding.tolist() == [7, 10, 3, 9, 0]
    for i, c in enumerate(layers):
        check_row(batch, i, c)

    # Without the longest row, the padding all rows share goes.
    batch.filter([0, 2, 3])
    layers = [layers[i] for i in (0, 2, 3)]
    assert batch.size() == 9 and batch.left_padding.tolist() == [4, 0, 6]
    for i, c in enumerate(layers):
        check_row(batch, i, c)
    assert batch.nbytes == sum(x.nbytes for x in (*batch.keys, *batch.values))

    # A quantized row (from the prompt cache) makes a float batch quantized.
    fetched = kv_layer(4, 20).to_quantized(group_size=G, bits=4)
    float_batch = BatchQuantizedKVCache.merge([from_layer(kv_layer(6, 21), **SETTINGS),
                                               from_layer(fetched, **SETTINGS)])
    assert float_batch.quantized and float_batch.left_padding.tolist() == [0, 2]
    assert same(float_batch.extract(1).keys, tuple(x[..., :4, :] for x in fetched.keys))


def test_update_matches_quantized_kv_cache_per_row():
    """New positions for ragged rows of a quantized batch, then a right-padded
    prefill chunk: each row holds what a QuantizedKVCache of that request
    alone holds, and the mask hides exactly the left padding."""
    lengths = [3, 8, 1]
    layers = [kv_layer(n, s) for s, n in enumerate(lengths)]
    batch = BatchQuantizedKVCache.merge([from_layer(c, **SETTINGS) for c in layers])
    batch.quantize()
    singles = [c.to_quantized(group_size=G, bits=4) for c in layers]

    mx.random.seed(7)
    k, v = mx.random.normal((3, H, 1, D)), mx.random.normal((3, H, 1, D))
    keys, values = batch.update_and_fetch(k, v)
    assert len(keys) == 3 and keys[0].shape[2] == 9
    # Prefill chunk with right padding: real lengths 2, 4, 1 of 4.
    chunk = [2, 4, 1]
    k2, v2 = mx.random.normal((3, H, 4, D)), mx.random.normal((3, H, 4, D))
    batch.prepare(lengths=chunk, right_padding=[4 - n for n in chunk])
    batch.update_and_fetch(k2, v2)
    batch.finalize()
    for i, s in enumerate(singles):
        s.update_and_fetch(k[i : i + 1], v[i : i + 1])
        s.update_and_fetch(k2[i : i + 1, :, : chunk[i]], v2[i : i + 1, :, : chunk[i]])
        out = batch.extract(i)
        assert out.offset == s.offset == lengths[i] + 1 + chunk[i]
        assert same(out.keys, tuple(x[..., : s.offset, :] for x in s.keys))
        assert same(out.values, tuple(x[..., : s.offset, :] for x in s.values))
    pads = batch.left_padding.tolist()
    assert pads == [batch.size() - s.offset for s in singles]
    mask = batch.make_mask(1)
    assert [mask[i, 0, 0].tolist().index(True) for i in range(3)] == pads
    assert batch.offset.tolist() == [s.offset for s in singles]


def test_quantization_rule():
    """A float layer is stored quantized at the end of the call at whose end
    one of its rows holds quantized_kv_start tokens; that call attends in
    float, the next ones quantized (`bits`), as upstream's
    maybe_quantize_kv_cache. A shorter row in the layer goes with it; a layer
    left with no positions is float again."""
    start = dict(SETTINGS, quantized_kv_start=8)
    step = lambda b: b.update_and_fetch(  # noqa: E731
        mx.zeros((b.offset.shape[0], H, 1, D)), mx.zeros((b.offset.shape[0], H, 1, D)))
    batch = BatchQuantizedKVCache.merge([from_layer(kv_layer(2, 2), **start),
                                         from_layer(kv_layer(6, 3), **start)])
    keys, _ = step(batch)  # 3 and 7 tokens
    assert not batch.quantized and not isinstance(keys, tuple)
    assert type(batch.extract(1)) is KVCache
    keys, _ = step(batch)  # 4 and 8 tokens at the end of this call
    assert batch.quantized and not hasattr(batch, "bits") and not isinstance(keys, tuple)
    assert isinstance(batch.extract(0), QuantizedKVCache)  # the row of 4 too: early
    keys, _ = step(batch)
    assert batch.bits == 4 and isinstance(keys, tuple)

    # A fetched row already past the start: its first call here is float.
    fetched = BatchQuantizedKVCache.merge([from_layer(kv_layer(9, 1), **start)])
    keys, _ = step(fetched)
    assert not isinstance(keys, tuple) and fetched.quantized

    # A prefill chunk's right padding does not count: rows of 6 and 0 tokens
    # get chunks of 1 and 4 (the first padded to 4), then decode steps.
    nine = dict(start, quantized_kv_start=9)
    padded = BatchQuantizedKVCache.merge([from_layer(kv_layer(6, 4), **nine),
                                          from_layer(KVCache(), **nine)])
    padded.prepare(lengths=[1, 4], right_padding=[3, 0])
    padded.update_and_fetch(mx.zeros((2, H, 4, D)), mx.zeros((2, H, 4, D)))
    padded.finalize()
    assert padded.offset.tolist() == [7, 4] and not padded.quantized
    step(padded)  # 8 and 5 tokens
    assert not padded.quantized
    step(padded)  # 9: past the start
    assert padded.quantized

    # Only new requests left (no positions): float again.
    new = BatchQuantizedKVCache.merge([from_layer(KVCache(), **start)])
    batch.extend(new)
    assert batch.quantized and batch.left_padding.tolist() == [4, 0, 9]
    batch.filter([2])
    assert not batch.quantized and not hasattr(batch, "bits") and batch.keys is None
    keys, _ = step(batch)
    assert not isinstance(keys, tuple)


# -- the model: batched greedy tokens equal upstream's sequential --kv-bits --

PROMPTS = ["Question {i}: " + "the river and the sea near the city " * (i + 1)
           for i in range(3)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def mid(fixture_path):
    path = fixture_path("qwen3_mid")
    model, tokenizer = load(str(path))
    return path, model, tokenizer


def upstream(model, prompt, bits, start):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS,
                                        kv_bits=bits, kv_group_size=G, quantized_kv_start=start)]


def batched(model, prompts, bits, start, staggered=False):
    """Greedy tokens of `prompts` through one QuantizedBatchGenerator: all
    inserted at once, or (staggered) one more before each step, so that each
    new request joins batches already quantized."""
    generator = QuantizedBatchGenerator(model, kv_bits=bits, kv_group_size=G,
                                        quantized_kv_start=start)
    waiting = list(prompts) if staggered else [prompts]
    uids, tokens = [], {}
    while True:
        if waiting:
            new = waiting.pop(0)
            new = [new] if staggered else new
            uids += generator.insert(new, max_tokens=[MAX_TOKENS] * len(new))
        prompt_responses, responses = generator.next()
        for r in responses:
            tokens.setdefault(r.uid, []).append(r.token)
        if not (waiting or prompt_responses or responses):
            break
    generator.close()
    return [tokens[uid] for uid in uids]


@pytest.mark.parametrize("bits", [4, 8])
def test_batched_equals_upstream_sequential(mid, bits):
    _, model, tokenizer = mid
    prompts = [tokenizer.encode(p.format(i=i)) for i, p in enumerate(PROMPTS)]
    reference = [upstream(model, p, bits, 0) for p in prompts]
    assert batched(model, prompts, bits, 0) == reference
    assert batched(model, prompts, bits, 0, staggered=True) == reference
    # The quantization is on: unquantized greedy tokens differ.
    assert [upstream(model, p, None, 0) for p in prompts] != reference


def test_alone_crossing_the_start_in_decode(mid):
    """A request alone in its batch is quantized where upstream quantizes it,
    here in the middle of its decode."""
    _, model, tokenizer = mid
    prompt = tokenizer.encode(PROMPTS[0].format(i=0))
    start = len(prompt) + 3
    reference = upstream(model, prompt, 4, start)
    assert batched(model, [prompt], 4, start) == [reference]
    # Quantizing from the first call, or never, gives other tokens.
    assert reference not in (upstream(model, prompt, 4, 0), upstream(model, prompt, None, 0))


# -- the engine and the server --

KV_ARGS = ["--kv-bits", "4", "--quantized-kv-start", "0"]


def body(i):
    return {"messages": [{"role": "user", "content": PROMPTS[i].format(i=i)}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0}


class Peak(threading.Thread):
    """The largest value `read()` returns while the block runs (polled)."""

    def __init__(self, read):
        super().__init__(daemon=True)
        self.read, self.value, self.done = read, 0, threading.Event()

    def run(self):
        while not self.done.is_set():
            self.value = max(self.value, self.read())
            time.sleep(0.002)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.join()


def test_engine_concurrent_equals_alone_and_sequential(mid):
    """Several concurrent --kv-bits requests are batched, and each gives the
    tokens it gives alone and on the sequential path.
    No prompt cache, so every run quantizes at the same points."""
    path, _, _ = mid
    runner = EngineRunner(path, max_bytes=0, argv=KV_ARGS)
    try:
        with Peak(lambda: runner.engine.active_requests) as batch:
            together = runner.run_all([body(i) for i in range(3)])
        assert batch.value >= 2
        alone = [runner.run(body(i))[0] for i in range(3)]
        sequential = [runner.run({**body(i), **SEQUENTIAL})[0] for i in range(3)]
        assert together == alone == sequential and runner.sequential == 3
        assert len(set(map(tuple, together))) == 3
    finally:
        runner.close()


def chat(server, request):
    """(generated token ids, cached tokens, prompt tokens, text)."""
    status, r = server.post("/v1/chat/completions", {**request, "logprobs": True})
    assert status == 200, r
    choice, usage = r["choices"][0], r["usage"]
    return ([c["id"] for c in choice["logprobs"]["content"]],
            usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"],
            choice["message"]["content"])


def test_server_batches_and_resumes_from_cache(mid):
    """`mlx_lm_plus.server --kv-bits 4`: concurrent requests are in the batch
    together (/v1/stats), and a follow-up turn resumes the quantized entry
    the batch stored: the cached tokens and the reply of our sequential path
    resuming its own entry.

    The first request goes alone: under 4-bit KV a row's tokens can depend
    on which rows it was prefilled beside (padding moves float rounding
    across a quantization step), and the server's arrival order varies."""
    path, _, _ = mid
    args = ["--model", str(path), *KV_ARGS, "--max-tokens", str(MAX_TOKENS)]
    with ServerProcess(OURS, args) as server:
        replies = {0: chat(server, body(0))}
        threads = [threading.Thread(target=lambda i=i: replies.update({i: chat(server, body(i))}))
                   for i in (1, 2)]
        with Peak(lambda: server.get("/v1/stats")[1]["engine"]["active_requests"]) as batch:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert batch.value >= 2 and len(replies) == 3
        follow = {**body(0), "messages": body(0)["messages"] + [
            {"role": "assistant", "content": replies[0][3]},
            {"role": "user", "content": "And which city is closer to the sea?"}]}
        warm, cached, _, _ = chat(server, follow)
    assert cached >= replies[0][2]  # the first turn's prompt, at least

    runner = EngineRunner(path, argv=KV_ARGS)
    try:
        assert runner.run({**body(0), **SEQUENTIAL})[0] == replies[0][0]
        tokens, _, sequential_cached = runner.run({**follow, **SEQUENTIAL})
        assert runner.sequential == 2
    finally:
        runner.close()
    assert (warm, cached) == (tokens, sequential_cached)


def test_disk_tier_resumes_batched_entries(mid, tmp_path):
    """With --prompt-cache-dir and a memory budget of one byte, the batch's
    quantized entries go to disk and come back: the follow-up turn resumes
    from disk with the cached tokens and reply of a memory hit."""
    path, _, _ = mid
    disk = EngineRunner(path, max_bytes=1, argv=[*KV_ARGS, "--prompt-cache-dir", str(tmp_path)])
    memory = EngineRunner(path, argv=KV_ARGS)
    follow = {**body(1), "messages": body(1)["messages"] + [
        {"role": "assistant", "content": "The ferry crosses at seven."},
        {"role": "user", "content": "And when does it come back?"}]}
    try:
        for runner in (disk, memory):
            runner.run(body(1))
        disk.store.disk_for(disk.provider.default_key).flush(10)
        from_disk, from_memory = disk.run(follow), memory.run(follow)
        assert from_disk == from_memory and from_disk[2] > 0
        assert disk.store.snapshot()["hits_by_tier"] == {"memory": 0, "disk": 1}
    finally:
        disk.close()
        memory.close()


def test_mrope_layers_keep_their_delta_under_kv_bits():
    """Upstream's maybe_quantize_kv_cache (the sequential path vision models
    take) would turn an MRopeKVCache into a QuantizedKVCache without its
    M-RoPE delta: it stays as it is."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    from mlx_lm_plus.models.vlm_text import MRopeKVCache

    layer = MRopeKVCache(rope_delta=-37)
    layer.update_and_fetch(mx.ones((1, 2, 8, 64)), mx.ones((1, 2, 8, 64)))
    cache = [layer]
    maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=64, kv_bits=4)
    assert cache[0] is layer and layer.rope_delta == -37 and layer.offset == 8


def test_head_dim_the_group_size_does_not_divide_fails_only_requests_past_the_start(
        fixture_path):
    """The tiny fixture's head dim (16) is one mx.quantize can not take with
    --kv-group-size 64: as upstream, a request that reaches
    --quantized-kv-start fails, alone. Batched, its row's quantization
    failed every request beside it."""
    runner = EngineRunner(fixture_path("qwen3"), max_bytes=0,
                          argv=["--kv-bits", "4", "--quantized-kv-start", "60"])
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
             "temperature": 0.0}
    long = {**short, "messages": [{"role": "user", "content": "the river and the sea " * 20}]}
    try:
        alone = runner.run(short)[0]
        channels = [runner.submit(long), runner.submit(short)]
        with pytest.raises(Exception, match="divisible by the quantization group size 64"):
            channels[0].result()
        assert channels[1].result()[0] == alone
        assert runner.run(short)[0] == alone and runner.engine.is_healthy
    finally:
        runner.close()
