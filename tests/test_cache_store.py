"""PromptStore alone, on small synthetic caches."""

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mlx_lm_plus.cache import PromptStore


def kv(n, buffer=None):
    """A KVCache holding n tokens (values encode the positions)."""
    c = KVCache()
    size = buffer or n
    k = mx.broadcast_to(mx.arange(size, dtype=mx.float32)[None, None, :, None], (1, 1, size, 4))
    c.keys, c.values, c.offset = mx.array(k), mx.array(k), n
    return c


def hybrid(n):
    a = ArraysCache(1)
    a[0] = mx.full((1, 4), float(n))
    return [a, kv(n)]


MODEL = "m"


def test_exact_prefix_trimmed_and_miss():
    store = PromptStore(max_bytes=1 << 30)
    store.insert(MODEL, [1, 2, 3, 4, 5], [kv(5)])
    f = store.fetch(MODEL, [1, 2, 3, 4, 5])
    assert (f.kind, f.cached, f.cache[0].offset) == ("exact", 4, 4)
    f = store.fetch(MODEL, [1, 2, 3, 9, 9, 9])
    assert (f.kind, f.cached, f.cache[0].offset) == ("trimmed", 3, 3)
    f = store.fetch(MODEL, [1, 2, 3, 4, 5, 6, 7])
    assert (f.kind, f.cached) in {("exact", 5), ("prefix", 5)}
    assert store.fetch(MODEL, [7, 8]).kind == "miss"
    assert store.fetch("other-model", [1, 2, 3]).kind == "miss"


def test_non_trimmable_uses_shorter_entries_only():
    store = PromptStore(max_bytes=1 << 30)
    store.insert(MODEL, [1, 2], hybrid(2), kind="checkpoint")
    store.insert(MODEL, [1, 2, 3, 4, 5], hybrid(5), kind="generated")
    f = store.fetch(MODEL, [1, 2, 3, 9])  # the long entry can't be trimmed to 3
    assert (f.kind, f.cached) == ("checkpoint", 2)
    f = store.fetch(MODEL, [1, 2, 3, 4, 5])  # exact, but one token must remain
    assert (f.kind, f.cached) == ("checkpoint", 2)
    f = store.fetch(MODEL, [1, 2, 3, 4, 5, 6])
    assert (f.kind, f.cached) == ("prefix", 5)


def test_fetch_returns_a_private_copy():
    store = PromptStore(max_bytes=1 << 30)
    store.insert(MODEL, [1, 2, 3], hybrid(3))
    f = store.fetch(MODEL, [1, 2, 3, 4])
    f.cache[0][0] = mx.zeros((1, 4))
    f.cache[1].update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    again = store.fetch(MODEL, [1, 2, 3, 4])
    assert again.cache[0][0].tolist() == [[3.0] * 4]
    assert again.cache[1].offset == 3


def test_entries_are_stored_compacted():
    store = PromptStore(max_bytes=1 << 30)
    c = kv(3, buffer=256)
    store.insert(MODEL, [1, 2, 3], [c])
    (entry,) = store.entries()
    assert entry.cache[0].keys.shape[2] == 3
    assert entry.nbytes == store.nbytes == 2 * 3 * 4 * 4


def test_byte_budget_holds_after_every_insert():
    store = PromptStore(max_bytes=2 * 2 * 10 * 4 * 4)  # room for two 10-token entries
    for i in range(12):
        store.insert(MODEL, [100 + i] + list(range(9)), [kv(10)])
        assert store.nbytes <= store.max_bytes
    assert len(store) == 2 and store.snapshot()["evictions"] == 10


def test_sequences_count_leaves_so_checkpoint_chains_count_once():
    store = PromptStore(max_bytes=1 << 30, max_sequences=2)
    for conv in range(2):
        base = [conv * 100]
        for turn in range(4):  # a chain of checkpoints, then the conversation end
            store.insert(MODEL, base + list(range(turn * 3 + 3)), hybrid(turn * 3 + 4),
                         kind="checkpoint")
    assert len(store) == 8 and store.leaf_count() == 2
    store.insert(MODEL, [999, 1, 2], hybrid(3))  # a third conversation
    assert store.leaf_count() == 2
    # The least recently used conversation lost its tail first, not the others.
    keys = {e.key for e in store.entries()}
    assert (999, 1, 2) in keys and (100, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11) in keys


def test_budget_evicts_least_recently_used_entries_inner_ones_too():
    """Interleaved conversations under a tight budget: each conversation's
    old checkpoints (never fetched again) go before the latest entries of the
    others, and a shared prefix that new requests keep fetching stays."""
    store = PromptStore(max_bytes=1 << 30)
    system = list(range(20))
    store.insert(MODEL, system, hybrid(20), kind="system")
    chains = {c: system + [100 + c] for c in range(3)}
    for turn in range(3):  # round robin, as chat clients interleave
        for c in range(3):
            store.fetch(MODEL, chains[c] + [1])  # the conversation goes on from its latest entry
            checkpoint = chains[c] + [200 + turn] * 3  # a message boundary
            chains[c] = checkpoint + [300 + turn] * 2
            store.insert(MODEL, checkpoint, hybrid(len(checkpoint)), kind="checkpoint")
            store.insert(MODEL, chains[c], hybrid(len(chains[c])), kind="generated")
    store.fetch(MODEL, system + [999])  # a new conversation reuses the system prompt
    # The last turn's entries: each conversation's end and its last boundary.
    latest = {tuple(k) for k in chains.values()} | {tuple(k[:-2]) for k in chains.values()}
    # Room for the system prompt and those, nothing more.
    store.max_bytes = sum(e.nbytes for e in store.entries()
                          if e.key in latest or e.kind == "system")
    store.trim_to(store.max_bytes)
    kept = {e.key for e in store.entries()}
    assert kept == latest | {tuple(system)}
    # Each conversation resumes from its latest entry.
    for key in chains.values():
        assert store.fetch(MODEL, key + [7, 8]).cached == len(key)
        assert store.fetch(MODEL, key[:-2] + [7, 8]).cached == len(key) - 2  # a regeneration


def test_ttl_expires_idle_entries():
    now = [0.0]
    store = PromptStore(max_bytes=1 << 30, ttl=10, clock=lambda: now[0])
    store.insert(MODEL, [1, 2, 3], hybrid(3))
    now[0] = 5
    assert store.fetch(MODEL, [1, 2, 3, 4]).kind == "prefix"  # touched at t=5
    now[0] = 14
    assert store.fetch(MODEL, [1, 2, 3, 4]).kind == "prefix"
    now[0] = 30
    assert store.fetch(MODEL, [1, 2, 3, 4]).kind == "miss"
    assert len(store) == 0 and store.snapshot()["expired"] == 1


def test_trimmable_insert_drops_redundant_prefixes():
    store = PromptStore(max_bytes=1 << 30)
    store.insert(MODEL, [1, 2], [kv(2)], kind="checkpoint")
    store.insert(MODEL, [1, 2, 3, 4], [kv(4)], kind="generated")
    assert [e.key for e in store.entries()] == [(1, 2, 3, 4)]
    f = store.fetch(MODEL, [1, 2, 7])
    assert (f.kind, f.cached) == ("trimmed", 2)


def test_reinsert_same_key_replaces_in_place():
    store = PromptStore(max_bytes=1 << 30, max_sequences=1)
    store.insert(MODEL, [1, 2, 3], hybrid(3))
    store.insert(MODEL, [1, 2, 3], hybrid(3))
    store.insert(MODEL, [5, 6], hybrid(2))
    assert [e.key for e in store.entries()] == [(5, 6)]
