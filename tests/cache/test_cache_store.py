"""PromptStore alone, on small synthetic caches."""

import copy
import random
import time
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from mlx_lm_plus.cache.layers import cache_nbytes, compact, make_span
from mlx_lm_plus.cache.store import (
    ENTRY_BYTES,
    NODE_BYTES,
    PASSED_PROMPT_MAX_GAP,
    Fetched,
    PromptStore,
)


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


def recurrent(n):
    """A cache of one recurrent layer (16 bytes of state, whatever n)."""
    return hybrid(n)[:1]


MODEL = "m"


def _holding(keys, make):
    """The bytes a store holding just these keys (caches from `make`) uses."""
    probe = PromptStore(max_bytes=1 << 30)
    for key in keys:
        probe.insert(MODEL, list(key), make(len(key)))
    assert len(probe) == len(keys)
    return probe.nbytes


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
    assert store.stored_cache(entry)[0].keys.shape[2] == 3
    # The KV is the tree's (a span of the edge), the entry holds no arrays.
    assert entry.nbytes == 0 and store.kv_bytes == 2 * 3 * 4 * 4
    assert store.nbytes == store.kv_bytes + store.index_bytes


def test_a_row_the_batch_let_go_of_is_stored_in_its_own_bytes():
    """A finished row's cache is a view of its batch's arrays, which the
    batch replaces as it goes on (filter): the stored copy must take the
    row's bytes, not the whole batch's buffer, which MLX hands to a copy
    whose source nothing else holds (its first array counted 1,536 bytes
    and held the 8 rows' 12,288)."""
    import gc

    for shared_kv in (True, False):
        store = PromptStore(max_bytes=1 << 30, share_kv=shared_kv)
        batch = ArraysCache(2)
        batch.cache = [mx.random.normal((8, 3, 128)), mx.random.normal((8, 4, 16, 16))]
        mx.eval(batch.cache)
        row = [batch.extract(2)]
        batch.filter([0, 1, 3, 4, 5, 6, 7])  # (the batch goes on without it)
        mx.eval(batch.cache)
        gc.collect()
        mx.clear_cache()  # (a buffer reused from it may be larger than asked)
        before = mx.get_active_memory()
        store.insert(MODEL, [1, 2, 3], row)
        del row
        gc.collect()
        # The 8 rows' arrays went; the row's copies came (1,536 + 4,096).
        freed = 8 * (3 * 128 + 4 * 16 * 16) * 4
        assert mx.get_active_memory() - before <= store.kv_bytes - freed + 1024, shared_kv


def test_byte_budget_holds_after_every_insert():
    # Room for two 10-token entries: their caches and their index.
    store = PromptStore(max_bytes=_holding([[100] + list(range(9)), [101] + list(range(9))],
                                           lambda n: [kv(n)]))
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
    # Evicting one entry at a time, the old checkpoints go first.
    while len(store) > len(latest) + 1:
        store.trim_to(store.nbytes - 1)
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


# -- limits of 0, the index's bytes, the compressed tree --


def test_zero_sequences_or_bytes_means_no_prompt_cache():
    for store in (PromptStore(max_bytes=1 << 30, max_sequences=0),
                  PromptStore(max_bytes=0), PromptStore(max_bytes=-1)):
        for _ in range(2):  # an exact repeat too
            assert store.fetch(MODEL, [1, 2, 3]).kind == "miss"
            store.insert(MODEL, [1, 2, 3], hybrid(3))
            assert len(store) == 0 and store.nbytes == 0 and store.leaf_count() == 0
        assert store.divergence(MODEL, [1, 2, 3])[0] == 0
        snapshot = store.snapshot()
        assert snapshot["entries"] == 0 and snapshot["misses"] == 2 and not snapshot["hits"]
        assert store.stats["not_stored"] == 2


def _walk(nodes):
    stack = list(nodes)
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def test_index_bytes_are_counted_and_budgeted():
    long_key = list(range(100_000))
    store = PromptStore(max_bytes=1 << 30)
    store.insert(MODEL, long_key, recurrent(1))  # a tiny cache for a long key
    s = store.snapshot()
    assert s["kv_bytes"] == 4 * 4 and s["index_bytes"] >= 8 * 100_000
    assert s["bytes"] == store.nbytes == s["kv_bytes"] + s["index_bytes"]
    assert s["cached_tokens"] == 100_000
    store.clear()
    s = store.snapshot()
    assert s["bytes"] == s["index_bytes"] == s["kv_bytes"] == 0 and store.recount()["nodes"] == 0
    store.check_invariants()

    # Two such keys don't fit in 1 MB: the budget evicts for the index alone.
    store = PromptStore(max_bytes=1_000_000)
    store.insert(MODEL, long_key, recurrent(1))
    store.insert(MODEL, [-5] + long_key[1:], recurrent(1))
    assert [e.key[0] for e in store.entries()] == [-5] and store.nbytes <= store.max_bytes
    assert store.snapshot()["evictions"] == 1
    # One alone over budget is not kept.
    store.max_bytes = 500_000
    store.insert(MODEL, [7] + long_key, recurrent(1))
    assert len(store) == 0 and store.nbytes == 0


def test_edges_are_compressed():
    """Keys of thousands of tokens: a node per entry and per branch point,
    about 8 bytes per distinct token, and a key is no longer stored twice."""
    store = PromptStore(max_bytes=1 << 30)
    system = list(range(1000, 3000))
    n = 40
    for i in range(n):
        store.insert(MODEL, system + [i] * 10 + list(range(5000, 7000)), recurrent(1),
                     kind="generated")
        store.insert(MODEL, system + [i] * 10, recurrent(1), kind="checkpoint")
    assert len(store) == 2 * n and store.leaf_count() == n
    nodes = store.recount()["nodes"]
    assert nodes <= 2 * n + 2  # root, the system prompt's end, n checkpoints, n ends
    distinct = len(system) + n * (10 + 2000)
    index = store.index_bytes
    assert index == store.recount()["index_bytes"]
    assert 8 * distinct <= index <= 8 * distinct + 2 * len(store) * 1024
    # Keys rebuild from the path; images are counted once, on insert.
    store.insert(MODEL, system + [-(1 << 62), -(1 << 62), -3, 5], recurrent(1))
    (entry,) = [e for e in store.entries() if e.images]
    assert entry.key == tuple(system + [-(1 << 62), -(1 << 62), -3, 5])
    assert (entry.ntokens, entry.images) == (len(system) + 4, 2)
    f = store.fetch(MODEL, system + [3] * 10 + list(range(5000, 5100)))
    assert (f.kind, f.cached) == ("checkpoint", len(system) + 10)
    assert store.divergence(MODEL, system + [3] * 10 + list(range(5000, 5100)))[0] == \
        len(system) + 110


def test_check_invariants_fails_on_broken_bookkeeping():
    """check_invariants() (what the other tests check the tree with) fails
    on a store whose bookkeeping is put wrong on purpose, naming what."""
    def filled():
        store = PromptStore(max_bytes=1 << 30)
        store.insert(MODEL, [1, 2, 3, 4], hybrid(4), "checkpoint")
        store.insert(MODEL, [1, 2, 3, 4, 5, 6], hybrid(6), "generated")
        store.insert(MODEL, [1, 2, 9], hybrid(3))
        assert len(store) == 3
        store.check_invariants(limits=True)
        return store

    store = filled()
    store.kv_bytes += 1  # a byte count off by one
    with pytest.raises(AssertionError, match="kv_bytes is"):
        store.check_invariants()
    store.kv_bytes -= 1
    store.check_invariants()

    store = filled()
    (inner,) = [e for e in store.entries() if e.ntokens == 4]
    inner.node.below += 1  # the count of entries below a node
    with pytest.raises(AssertionError, match="below is"):
        store.check_invariants()

    store = filled()
    (leaf,) = [e for e in store.entries() if e.ntokens == 3]
    leaf.node.entry = None  # a node that lost its entry's back-link
    with pytest.raises(AssertionError, match="not its node's entry"):
        store.check_invariants()

    store = filled()
    store.max_bytes = store.nbytes - 1  # limits lowered: only limits=True checks them
    store.check_invariants()
    with pytest.raises(AssertionError, match="over the budget"):
        store.check_invariants(limits=True)


# -- a randomized comparison with the per-token trie --


class _RefStore:
    """The store as it was before the tree was compressed: a Python node per
    token and each entry's key. Its byte count adds the compressed tree's
    index bytes, computed by a walk, so that both evict alike.

    Shared KV: each token's node holds that token's KV (`token_bytes` of its
    model's plain KV layers) once, whatever the entries through it; an entry
    counts only its other layers. The compressed tree keeps the KV in spans,
    one more wherever an edge was cut: a token `starts` a span where a leaf
    began or where an edge was split before it."""

    class Node:
        def __init__(self, parent, token, depth):
            self.parent, self.token, self.depth = parent, token, depth
            self.children, self.entry, self.below = {}, None, 0
            self.starts = False

    class Entry:
        def __init__(self, key, cache, nbytes, kind, now):
            self.key, self.cache, self.nbytes, self.kind = key, cache, nbytes, kind
            self.created = self.last_used = self.prev_used = now
            self.hits = 0

    def __init__(self, max_bytes, max_sequences=None, ttl=None, clock=None):
        self.max_bytes, self.max_sequences, self.ttl = max_bytes, max_sequences, ttl
        self._clock = clock
        self._roots, self._entries = {}, {}
        self.held_bytes = 0
        self.token_bytes = {}  # model -> KV bytes per token
        self.span_bytes = {}  # model -> a span's Python objects
        self.stats = Counter()

    @property
    def kv_bytes(self):
        return self.held_bytes + sum(
            self.token_bytes[m] for m, root in self._roots.items() for n in _walk([root])
            if n.parent is not None)

    def entries(self):
        return list(self._entries)

    def disabled(self):
        return self.max_bytes <= 0 or (self.max_sequences is not None
                                       and self.max_sequences <= 0)

    @property
    def index_bytes(self):
        nodes = tokens = spans = 0
        for m, root in self._roots.items():
            for n in _walk([root]):
                tokens += n.parent is not None
                # A node of the compressed tree: a root, an entry, a branch point.
                nodes += n.parent is None or n.entry is not None or len(n.children) != 1
                spans += n.starts * self.span_bytes[m]
        return nodes * NODE_BYTES + 8 * tokens + len(self._entries) * ENTRY_BYTES + spans

    @property
    def nbytes(self):
        return self.kv_bytes + self.index_bytes

    def fetch(self, model, key):
        self._expire()
        found = Fetched(None, 0, "miss") if self.disabled() else self._find(model, key)
        self.stats[f"fetch_{found.kind}"] += 1
        if found.kind != "miss":
            self.stats["tokens_saved"] += found.cached
        return found

    def _find(self, model, key):
        node = self._roots.get(model)
        if node is None or not key:
            return Fetched(None, 0, "miss")
        on_path = []
        for token in key:
            child = node.children.get(token)
            if child is None:
                break
            node = child
            if node.entry is not None:
                on_path.append(node)
        common = node.depth
        usable = [n for n in on_path if n.depth < len(key)]
        best_prefix = usable[-1] if usable else None
        exact = on_path[-1] if on_path and on_path[-1].depth == len(key) else None
        target = min(common, len(key) - 1)
        if target > (best_prefix.depth if best_prefix else 0):
            donor = exact or self._nearest_entry(node)
            if donor is not None and can_trim_prompt_cache(donor.entry.cache):
                cache = copy.deepcopy(donor.entry.cache)
                trim_prompt_cache(cache, donor.depth - target)
                donor.entry.hits += 1
                return Fetched(cache, target, "exact" if donor is exact else "trimmed")
        if best_prefix is not None:
            entry = best_prefix.entry
            entry.prev_used, entry.last_used = entry.last_used, self._clock()
            entry.hits += 1
            kind = "checkpoint" if entry.kind in ("checkpoint", "system") else "prefix"
            return Fetched(copy.deepcopy(entry.cache), best_prefix.depth, kind)
        return Fetched(None, 0, "miss")

    def shared_depth(self, model, key):
        node, depth = self._roots.get(model), 0
        while node is not None and depth < len(key):
            node = node.children.get(key[depth])
            depth += node is not None
        return depth

    @staticmethod
    def _nearest_entry(node):
        level = [node]
        while level:
            for n in level:
                if n.entry is not None:
                    return n
            level = [c for n in level for c in n.children.values()]
        return None

    def insert(self, model, key, cache, kind="prompt"):
        if not key:
            return
        if self.disabled():
            self.stats["not_stored"] += 1
            return
        cache = compact(cache)
        shared = [c for c in cache if isinstance(c, KVCache)]
        nbytes = cache_nbytes(cache) - cache_nbytes(shared)
        self.token_bytes[model] = cache_nbytes(shared) // len(key)
        self.span_bytes[model] = make_span(
            [(c.keys[..., :1, :], c.values[..., :1, :]) for c in shared], 1).overhead
        node = self._roots.setdefault(model, self.Node(None, None, 0))
        new = False
        for token in key:
            child = node.children.get(token)
            if child is None:
                if not new and self._inside_an_edge(node):
                    next(iter(node.children.values())).starts = True  # a split
                child = node.children[token] = self.Node(node, token, node.depth + 1)
                child.starts, new = not new, True
            node = child
        if not new and self._inside_an_edge(node):
            next(iter(node.children.values())).starts = True  # a split
        if node.entry is not None:
            self._remove(node.entry, prune=False)
        entry = self.Entry(tuple(key), cache, nbytes, kind, self._clock())
        node.entry = entry
        self._count_below(node, +1)
        n = node.parent
        while n is not None and len(n.children) == 1:
            if n.entry is not None:
                n.entry.last_used = n.entry.prev_used
            n = n.parent
        self._entries[entry] = (model, node)
        self.held_bytes += nbytes
        self.stats[f"insert_{kind}"] += 1
        if can_trim_prompt_cache(cache):
            n = node.parent
            while n is not None:
                if n.entry is not None and can_trim_prompt_cache(n.entry.cache):
                    self._remove(n.entry, reason="redundant")
                n = n.parent
        if kind == "checkpoint":  # a boundary past a short prompt entry, unbranched
            n = node.parent
            while n is not None and n.entry is None and len(n.children) == 1:
                n = n.parent
            if n is not None and n.entry is not None and n.entry.kind == "prompt" \
                    and len(n.children) == 1:
                above = n.parent
                while above is not None and above.entry is None:
                    above = above.parent
                if n.depth - (above.depth if above is not None else 0) \
                        <= PASSED_PROMPT_MAX_GAP:
                    self._remove(n.entry, reason="passed")
        self._enforce_limits(keep=entry)

    @staticmethod
    def _inside_an_edge(node):
        """Where the compressed tree has no node: the key leaving the path
        there, or ending there, cuts an edge."""
        return node.parent is not None and node.entry is None and len(node.children) == 1

    def _expire(self):
        if self.ttl is None:
            return
        deadline = self._clock() - self.ttl
        for entry in [e for e in self._entries if e.last_used < deadline]:
            self._remove(entry, reason="expired")

    @staticmethod
    def _count_below(node, delta):
        n = node.parent
        while n is not None:
            n.below += delta
            n = n.parent

    def _victim(self, keep, leaves_only):
        candidates = [e for e, (_, node) in self._entries.items()
                      if e is not keep and (not leaves_only or node.below == 0)]
        return min(candidates, key=lambda e: e.last_used, default=None)

    def leaf_count(self):
        return sum(node.below == 0 for _, node in self._entries.values())

    def _enforce_limits(self, keep):
        self._expire()
        while self.max_sequences is not None and self.leaf_count() > self.max_sequences:
            victim = self._victim(keep, leaves_only=True) or self._victim(keep, False)
            if victim is None:
                break
            self._remove(victim, reason="evicted")
        self.trim_to(self.max_bytes, keep=keep)

    def trim_to(self, n_bytes, keep=None):
        while self.nbytes > max(0, n_bytes) and self._entries:
            victim = self._victim(keep, leaves_only=False) or keep
            self._remove(victim, reason="evicted")
            if victim is keep:
                break

    def _remove(self, entry, reason=None, prune=True):
        model, node = self._entries.pop(entry)
        node.entry = None
        self._count_below(node, -1)
        self.held_bytes -= entry.nbytes
        freed = entry.nbytes
        while prune and node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.token]
            freed += self.token_bytes[model]
            node = node.parent
        if reason:
            self.stats[reason] += 1
            self.stats[f"{reason}_bytes"] += freed
        if not prune:
            return
        if node.parent is None and not node.children and node.entry is None:
            self._roots.pop(model, None)


def _state(store):
    return sorted((e.key, e.kind, e.hits, e.nbytes, e.created, e.last_used)
                  for e in store.entries())


@pytest.mark.parametrize("seed", range(24))
def test_matches_the_per_token_trie(seed):
    rng = random.Random(seed)
    caches = ["kv", "hybrid", "mixed"][seed % 3]

    def make(model, n):
        # One model's caches have the same layers; "mixed": a trimmable model
        # and a hybrid one in the same store.
        trimmable = caches == "kv" or (caches == "mixed" and model == "a")
        return (lambda: [kv(n)]) if trimmable else (lambda: hybrid(n))

    now = [0.0]
    limits = dict(
        max_bytes=rng.choice([1 << 30, 1 << 30, 6000, 20000]),
        max_sequences=rng.choice([None, None, 1, 3, 8]),
        ttl=rng.choice([None, None, 6.0]),
    )
    store = PromptStore(clock=lambda: now[0], **limits)
    ref = _RefStore(clock=lambda: now[0], **limits)
    models = ["a", "b"]
    keys = [[]]

    def random_key(model):
        # A prefix of an earlier key (often all of it, often a stored one),
        # then new tokens from a small alphabet, so keys share prefixes and
        # diverge mid-edge.
        stored = [list(e.key) for e, (m, _) in ref._entries.items() if m == model]
        base = rng.choice(stored if stored and rng.random() < 0.6 else keys)
        cut = len(base) if rng.random() < 0.4 else rng.randint(0, len(base))
        tail = [rng.choice([1, 2, 3, 4, -(1 << 62) + 7, (1 << 62) + 9])
                for _ in range(rng.choice([0, 1, 2, 5, 12]))]
        key = base[:cut] + tail
        keys.append(key)
        return key

    held = 0
    for step in range(400):
        now[0] += rng.choice([0.5, 1.0, 3.0])
        model = rng.choice(models)
        op = rng.random()
        if op < 0.45:
            key = random_key(model)
            f, g = store.fetch(model, key), ref.fetch(model, key)
            assert (f.kind, f.cached) == (g.kind, g.cached), (step, key)
            if f.cache is not None:
                assert [c.offset for c in f.cache if hasattr(c, "offset")] == \
                    [c.offset for c in g.cache if hasattr(c, "offset")]
                for c in f.cache:  # the spans joined in order: kv() holds positions
                    if isinstance(c, KVCache):
                        assert c.keys.shape[2] == c.offset
                        assert c.keys[0, 0, :, 0].tolist() == list(range(c.offset)), step
            assert store.divergence(model, key)[0] == ref.shared_depth(model, key)
        elif op < 0.9:
            key = random_key(model)
            kind = rng.choice(["prompt", "checkpoint", "generated", "system"])
            cache = make(model, len(key))
            store.insert(model, key, cache(), kind)
            ref.insert(model, key, cache(), kind)
        elif op < 0.95:
            store.trim_to(store.nbytes // 2)
            ref.trim_to(ref.nbytes // 2)
        else:
            store.max_bytes = ref.max_bytes = rng.choice([1 << 30, 6000, 20000])
        assert _state(store) == _state(ref), step
        assert store.stats == ref.stats, step
        counted = store.recount()
        assert store.index_bytes == counted["index_bytes"] == ref.index_bytes, step
        assert store.leaf_count() == counted["leaves"] == ref.leaf_count(), step
        assert store.kv_bytes == counted["kv_bytes"] == ref.kv_bytes, step
        assert counted["spans_cover_edges"] and store.tree_tokens == counted["edge_tokens"]
        if 0.45 <= op < 0.9 and key:  # enforced on every insert
            assert store.nbytes <= max(store.max_bytes, 0), step
        # Compressed: no node without an entry on a path that does not branch;
        # children linked to their parents under their first tokens, at
        # their depths (and the rest of the bookkeeping consistent).
        store.check_invariants()
        held = max(held, len(store))
    assert held > 1  # the comparison was not of empty stores
    store.clear()
    assert store.nbytes == store.index_bytes == 0 and store.recount()["nodes"] == 0
    store.check_invariants()


# -- quantized storage (--prompt-cache-bits) --

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache  # noqa: E402

from mlx_lm_plus.cache.layers import (  # noqa: E402
    SharedKV,
    StoredKV,
    quantize_for_store,
    restore_from_store,
)
from mlx_lm_plus.models.vlm_text import MRopeKVCache  # noqa: E402

HEADS, DIM = 4, 64  # head dim 64: one quantization group per head and token


def real_kv(n, seed=0, cls=KVCache, dtype=mx.float16, **attrs):
    """A KV layer of n tokens of random keys/values (scaled differently per
    head, so the groups have different quantization steps)."""
    c = cls(**attrs)
    mx.random.seed(seed)
    scale = mx.array([0.1, 1.0, 4.0, 30.0])[None, :, None, None]
    k = (mx.random.normal((1, HEADS, n, DIM)) * scale).astype(dtype)
    v = (mx.random.normal((1, HEADS, n, DIM)) * scale + 1.0).astype(dtype)
    c.update_and_fetch(k, v)  # a 256-token buffer, as generation leaves it
    mx.eval(c.keys, c.values)
    return c


def quantized_bytes(layer):
    if isinstance(layer, StoredKV):
        return sum(x.nbytes for x in (*layer.keys, *layer.values))
    return layer.nbytes


def test_quantized_entries_hold_more_tokens_per_byte():
    # float16 at group size 64: 16 bits per element stored as `bits` bits plus
    # a float16 scale and bias per 64 elements (0.5 bits): 16/8.5 = 1.88 for
    # 8 bits, 16/4.5 = 3.56 for 4 bits.
    n = 64
    sizes = {}
    for bits in (None, 8, 4):
        store = PromptStore(max_bytes=1 << 30, bits=bits, group_size=64)
        store.insert(MODEL, list(range(1, n + 1)), [real_kv(n), real_kv(n, seed=1)])
        (entry,) = store.entries()
        sizes[bits] = store.kv_bytes
        assert store.kv_bytes == sum(quantized_bytes(c) for c in store.stored_cache(entry))
    ratio8, ratio4 = sizes[None] / sizes[8], sizes[None] / sizes[4]
    print(f"tokens per byte vs unquantized: 8 bits {ratio8:.3f}, 4 bits {ratio4:.3f}")
    assert ratio8 == pytest.approx(16 / 8.5) and ratio8 > 1.8
    assert ratio4 == pytest.approx(16 / 4.5) and ratio4 > 3.2

    # Under one byte budget (index bytes included), the store keeps that many
    # more tokens: 70 distinct 64-token prompts into room for about 16.
    budget = 16 * sizes[None] // 2  # sizes: two layers; these entries: one
    held = {}
    for bits in (None, 8, 4):
        store = PromptStore(max_bytes=budget, bits=bits)
        for i in range(70):
            store.insert(MODEL, [1000 + i] + list(range(n - 1)), [real_kv(n, seed=i)])
            assert store.nbytes <= budget
        held[bits] = store.snapshot()["cached_tokens"]
    print(f"tokens held in {budget} bytes: {held}")
    assert held[8] / held[None] > 1.8 and held[4] / held[None] > 3.2


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_quantized_round_trip_within_one_step(bits, dtype):
    original = real_kv(40, dtype=dtype)
    keys, values = original.keys[..., :40, :], original.values[..., :40, :]
    store = PromptStore(max_bytes=1 << 30, bits=bits)
    store.insert(MODEL, list(range(40)), [original])
    (entry,) = store.entries()
    stored = store.stored_cache(entry)[0]
    assert isinstance(stored, StoredKV) and stored.keys[0].dtype == mx.uint32
    f = store.fetch(MODEL, list(range(41)))
    (c,) = f.cache
    assert (f.kind, f.cached, c.offset) == ("prefix", 40, 40)
    assert type(c) is KVCache and c.keys.dtype == c.values.dtype == dtype
    assert c.keys.shape == keys.shape and c.values.shape == values.shape
    ulp = {mx.float16: 2**-10, mx.bfloat16: 2**-7, mx.float32: 2**-23}[dtype]
    for got, want, (_, scales, _) in ((c.keys, keys, stored.keys),
                                      (c.values, values, stored.values)):
        got, want = got.astype(mx.float32), want.astype(mx.float32)
        # A group: one head's DIM elements of one token (scales: one per group).
        step = mx.abs(scales.astype(mx.float32))
        top, low = mx.max(want, axis=-1, keepdims=True), mx.min(want, axis=-1, keepdims=True)
        # Within one step of its group (MLX's affine rounding makes the group's
        # largest magnitude exact and may then leave the other end up to a step
        # off), plus the rounding of the result to `dtype` at the group's scale.
        bound = step * 1.01 + 2 * ulp * mx.maximum(mx.abs(top), mx.abs(low))
        assert mx.all(mx.abs(got - want) <= bound).item()
        # And the step is what `bits` bits give: the spread over 2**bits - 1
        # levels, at most one fewer (that exact largest magnitude).
        assert mx.all(step <= (top - low) / (2**bits - 2) * 1.01).item()


def test_quantized_keeps_class_and_rope_delta():
    store = PromptStore(max_bytes=1 << 30, bits=4)
    store.insert(MODEL, list(range(1, 11)), [real_kv(10, cls=MRopeKVCache, rope_delta=-7)])
    (entry,) = store.entries()
    assert isinstance(store.stored_cache(entry)[0], StoredKV)
    for key, kind, n in (([*range(1, 11), 99], "prefix", 10),  # the whole entry
                         ([*range(1, 11)], "exact", 9),  # trimmed by one
                         ([1, 2, 3, 4, 99], "trimmed", 4)):
        f = store.fetch(MODEL, key)
        (c,) = f.cache
        assert (f.kind, c.offset, c.keys.shape[2]) == (kind, n, n)
        assert type(c) is MRopeKVCache and c.rope_delta == -7
        c.rope_delta = 5  # the copy's own
    assert store.fetch(MODEL, [*range(1, 11), 99]).cache[0].rope_delta == -7


def test_quantized_trimmed_fetch_equals_dequantized_full_cut():
    store = PromptStore(max_bytes=1 << 30, bits=4)
    store.insert(MODEL, list(range(1, 21)), [real_kv(20), real_kv(20, seed=3)])
    full = store.fetch(MODEL, [*range(1, 21), 99]).cache
    for key, kind, n in (([*range(1, 8), 50, 51], "trimmed", 7),
                         ([*range(1, 21)], "exact", 19)):
        f = store.fetch(MODEL, key)
        assert (f.kind, f.cached) == (kind, n)
        for got, whole in zip(f.cache, full):
            assert got.offset == n
            assert mx.array_equal(got.keys, whole.keys[..., :n, :]).item()
            assert mx.array_equal(got.values, whole.values[..., :n, :]).item()


def test_quantized_generation_never_mutates_the_entry():
    store = PromptStore(max_bytes=1 << 30, bits=8)
    store.insert(MODEL, list(range(1, 11)), [real_kv(10)])
    first = store.fetch(MODEL, [*range(1, 11), 99]).cache[0]
    keys = mx.array(first.keys)
    first.update_and_fetch(mx.zeros((1, HEADS, 3, DIM), mx.float16),
                           mx.zeros((1, HEADS, 3, DIM), mx.float16))
    first.keys[..., :2, :] = 0
    first.trim(5)
    again = store.fetch(MODEL, [*range(1, 11), 99]).cache[0]
    assert again.offset == 10 and mx.array_equal(again.keys, keys).item()


def test_quantized_hybrid_stores_other_layers_as_they_are():
    def layers(n):
        a = ArraysCache(2)
        mx.random.seed(n)
        a[0] = mx.random.normal((1, 3, 8)).astype(mx.bfloat16)
        a[1] = mx.random.normal((1, 4))
        rot = RotatingKVCache(max_size=8)
        rot.update_and_fetch(*(mx.random.normal((1, 2, n, DIM)).astype(mx.float16),) * 2)
        chunk = ChunkedKVCache(chunk_size=4)
        chunk.update_and_fetch(*(mx.random.normal((1, 2, n, DIM)).astype(mx.float16),) * 2)
        return [a, rot, chunk, real_kv(n)]

    inserted = layers(12)
    before = copy.deepcopy(inserted)
    store = PromptStore(max_bytes=1 << 30, bits=4)
    store.insert(MODEL, list(range(12)), inserted, kind="checkpoint")
    (entry,) = store.entries()
    assert [type(c) for c in entry.cache] == [ArraysCache, RotatingKVCache, ChunkedKVCache,
                                              SharedKV]
    stored = store.stored_cache(entry)
    assert [type(c) for c in stored] == [ArraysCache, RotatingKVCache, ChunkedKVCache, StoredKV]
    assert store.kv_bytes == sum(quantized_bytes(c) for c in stored)
    assert store.kv_bytes < cache_nbytes(before)
    f = store.fetch(MODEL, list(range(13)))
    assert (f.kind, f.cached) == ("checkpoint", 12)
    got = f.cache
    assert [type(c) for c in got] == [ArraysCache, RotatingKVCache, ChunkedKVCache, KVCache]
    for g, b in zip(got[:3], before[:3]):  # bit-exact, dtype included
        gs, bs = tree_flatten(g.state), tree_flatten(b.state)
        assert [k for k, _ in gs] == [k for k, _ in bs] and len(gs) >= 2
        for (_, x), (_, y) in zip(gs, bs):
            if isinstance(x, mx.array):
                assert x.dtype == y.dtype and mx.array_equal(x, y).item()
            else:
                assert x == y
    assert got[3].keys.dtype == mx.float16 and got[3].offset == 12
    # Not trimmable as a whole (the ArraysCache): no trimmed or exact fetch.
    assert store.fetch(MODEL, [0, 1, 2, 99]).kind == "miss"


def test_quantized_byte_accounting_through_evictions():
    rng = random.Random(5)
    store = PromptStore(max_bytes=60_000, max_sequences=5, bits=4)
    for i in range(60):
        n = rng.randrange(2, 40)
        prefix = rng.choice([[], [7, 7, 7], [1, 2, 3, 4, 5, 6]])
        key = prefix + [rng.randrange(100, 120) for _ in range(n)]
        # An attention model and a hybrid one (ArraysCache beside the KV).
        model = rng.choice([MODEL, "hybrid"])
        cache = [real_kv(len(key), seed=i)]
        if model == "hybrid":
            cache.insert(0, ArraysCache(1))
            cache[0][0] = mx.full((1, 4), float(i))
        store.insert(model, key, cache, kind=rng.choice(["prompt", "checkpoint"]))
        entries = store.entries()
        counted = store.recount()
        assert store.kv_bytes == counted["kv_bytes"] and counted["spans_cover_edges"]
        # Shared: at most the entries' caches taken whole.
        assert store.kv_bytes <= sum(quantized_bytes(c) for e in entries
                                     for c in store.stored_cache(e))
        assert store.index_bytes == counted["index_bytes"]
        assert store.nbytes <= store.max_bytes and store.leaf_count() <= 5
        if rng.random() < 0.3:
            store.fetch(MODEL, key[: rng.randrange(1, len(key) + 1)])
    assert store.snapshot()["evictions"] > 0 and store.snapshot()["bits"] == 4
    store.clear()
    assert store.kv_bytes == 0 and store.index_bytes == 0


def test_quantization_skips_what_it_cannot_group_and_bits_none_stores_as_given():
    # Head dim 4: group size 64 does not divide it; stored as it is.
    store = PromptStore(max_bytes=1 << 30, bits=4)
    store.insert(MODEL, [1, 2, 3], [kv(3)])
    (entry,) = store.entries()
    assert type(store.stored_cache(entry)[0]) is KVCache and store.kv_bytes == 2 * 3 * 4 * 4
    # bits=None: the layers' arrays as inserted, handed out as copies.
    store = PromptStore(max_bytes=1 << 30)
    cache = [real_kv(5)]
    store.insert(MODEL, [1, 2, 3, 4, 5], cache)
    (entry,) = store.entries()
    assert store.snapshot()["bits"] is None
    assert quantize_for_store(cache, None, 64) is cache
    got = store.fetch(MODEL, [1, 2, 3, 4, 5, 6]).cache[0]
    assert got is not cache[0] and mx.array_equal(got.keys, cache[0].keys[..., :5, :]).item()
    assert restore_from_store(cache, 2)[0].offset == 3 and cache[0].offset == 5


def test_bad_quantization_settings_fail_at_construction():
    with pytest.raises(ValueError):
        PromptStore(max_bytes=1 << 30, bits=4, group_size=48)


# -- the disk tier (--prompt-cache-dir): what leaves memory goes to disk --

from mlx_lm_plus.cache.disk import DiskTier  # noqa: E402


def arrays_of(cache):
    """Every array of a cache's layers' states, as lists (an exact compare),
    and the scalars beside them."""
    def walk(x):
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if isinstance(x, mx.array):
            return (str(x.dtype), x.shape, x.tolist())
        return x

    return [walk(c.state) for c in cache]


def with_disk(tmp_path, max_bytes, **kw):
    store = PromptStore(max_bytes=max_bytes, **kw)
    tier = DiskTier(str(tmp_path / "disk"), 1 << 30, "m")
    assert tier.enabled
    store.attach_disk(MODEL, tier)
    return store, tier


def test_evicted_entry_goes_to_disk_and_a_fetch_reads_it_back_exactly(tmp_path):
    a_key, b_key = list(range(1, 41)), list(range(500, 540))
    one = _holding([a_key], lambda n: [real_kv(n), real_kv(n, seed=1)])
    store, tier = with_disk(tmp_path, max_bytes=one + one // 2)  # room for one
    store.insert(MODEL, a_key, [real_kv(40), real_kv(40, seed=1)])
    (a,) = store.entries()
    want = arrays_of(store.stored_cache(a))
    store.insert(MODEL, b_key, [real_kv(40, seed=2), real_kv(40, seed=3)])
    assert tier.flush(10)
    # A left memory (not counted there any more) and is on disk.
    (b,) = store.entries()
    assert b.key == tuple(b_key) and store.kv_bytes == cache_nbytes(store.stored_cache(b))
    snap = store.snapshot()
    assert snap["evictions"] == 1 and snap["disk"]["entries"] == 1
    assert snap["disk"]["spilled"] == 1 and snap["disk"]["tokens"] == 40
    assert snap["memory"] == {"entries": 1, "bytes": store.nbytes, "tokens": 40,
                              "distinct_tokens": 40, "hits": 0,
                              "bytes_per_token": round(store.nbytes / 40, 1)}

    # The next turn of A: a disk hit with exactly A's arrays.
    found = store.fetch(MODEL, a_key + [7, 8])
    assert (found.kind, found.cached) == ("disk", 40)
    assert arrays_of(found.cache) == want
    snap = store.snapshot()
    assert snap["hits"] == {"disk": 1} and snap["hits_by_tier"] == {"memory": 0, "disk": 1}
    assert snap["prompt_tokens_saved"] == 40 and snap["disk"]["hits"] == 1
    # A copy went back into memory (B made room for it, to disk in turn).
    assert tier.flush(10)
    assert [e.key for e in store.entries()] == [tuple(a_key)]
    assert store.snapshot()["disk"]["entries"] == 2
    again = store.fetch(MODEL, a_key + [7, 8])
    assert (again.kind, again.cached) == ("prefix", 40) and arrays_of(again.cache) == want
    assert store.snapshot()["hits_by_tier"] == {"memory": 1, "disk": 1}
    tier.close()


def test_disk_hit_of_the_exact_key_is_trimmed_like_a_memory_one(tmp_path):
    key = list(range(1, 31))
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    store.insert(MODEL, key, [real_kv(30)])
    want = store.fetch(MODEL, key)  # memory: the entry cut by one token
    assert (want.kind, want.cached) == ("exact", 29)
    store.trim_to(0)  # evicted
    assert tier.flush(10) and len(store) == 0
    found = store.fetch(MODEL, key)
    assert (found.kind, found.cached) == ("disk", 29)
    assert found.cache[0].offset == 29 and arrays_of(found.cache) == arrays_of(want.cache)
    tier.close()


def test_memory_wins_a_tie_and_disk_wins_when_it_covers_more(tmp_path):
    # Hybrid caches (not trimmable): prefix entries stay beside longer ones.
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    system, turn = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]
    store.insert(MODEL, turn, hybrid(8))
    store.trim_to(0)  # the turn is on disk
    assert tier.flush(10)
    store.insert(MODEL, system, hybrid(4), kind="system")
    assert store.fetch(MODEL, system + [9]).kind == "checkpoint"  # memory alone covers it
    found = store.fetch(MODEL, turn + [9])
    assert (found.kind, found.cached) == ("disk", 8)
    assert found.cache[0][0].tolist() == [[8.0] * 4]
    # Now in memory too: both cover 8 tokens, memory serves.
    assert tier.snapshot()["entries"] == 1
    assert store.fetch(MODEL, turn + [9]).kind == "prefix"
    tier.close()


def test_read_ahead_off_the_generation_thread_is_what_the_fetch_takes(tmp_path):
    """read_ahead (an HTTP handler's thread) reads the disk entry a request
    will fetch; the fetch (the generation thread) then reads no file and
    gets exactly the arrays a read would give. While held, the entry counts
    in nbytes; it goes when fetched, when stale and on a clear; memory that
    covers as much is not read ahead for."""
    import threading

    import mlx_lm_plus.cache.store as cache_module

    key = list(range(1, 41))
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    store.insert(MODEL, key, [real_kv(40), real_kv(40, seed=1)])
    want = arrays_of(store.stored_cache(store.entries()[0]))
    store.trim_to(0)
    assert tier.flush(10) and len(store) == 0 and store.nbytes == 0
    prompt = key + [7, 8]

    read = []
    hits = tier.snapshot()["hits"]
    written = tier.find(prompt, count=False)[1].last_used
    time.sleep(0.01)
    ahead = threading.Thread(target=lambda: read.append(store.read_ahead(MODEL, prompt)))
    ahead.start()
    ahead.join()
    assert read == [True] and store.read_ahead_bytes > 0
    assert store.nbytes == store.read_ahead_bytes  # counted while held
    assert tier.snapshot()["hits"] == hits  # a hit only once a fetch takes it
    # ...but used now: eviction by last use keeps it on disk till fetched.
    assert tier.find(prompt, count=False)[1].last_used > written
    # What a fetch would serve (the engine orders waiting requests by it).
    assert store.covers(MODEL, prompt) == 40 and store.covers(MODEL, [5] + prompt) == 0
    assert not store.read_ahead(MODEL, prompt)  # (held already: not read twice)
    tier.load = lambda *a, **k: pytest.fail("the fetch read the file again")
    found = store.fetch(MODEL, prompt)
    assert (found.kind, found.cached) == ("disk", 40) and arrays_of(found.cache) == want
    assert store.read_ahead_bytes == 0 and tier.snapshot()["hits"] == hits + 1
    assert [e.key for e in store.entries()] == [tuple(key)]  # back into memory
    del tier.load

    # Memory covers it now: nothing to read ahead.
    assert not store.read_ahead(MODEL, prompt)
    # Held but never fetched: let go once stale, and on a clear.
    store.trim_to(0)
    assert tier.flush(10)
    hits = tier.snapshot()["hits"]
    assert store.read_ahead(MODEL, prompt) and store.read_ahead_bytes > 0
    now = store.now()
    store.set_clock(lambda: now + cache_module.READ_AHEAD_SECONDS + 1)
    store.fetch(MODEL, [999, 998])  # (any fetch looks)
    assert store.read_ahead_bytes == 0 and store.nbytes == 0
    assert tier.snapshot()["hits"] == hits  # read for nothing: no hit
    store.set_clock(lambda: now)
    assert store.read_ahead(MODEL, prompt)
    store.clear()
    assert store.read_ahead_bytes == 0 and store.nbytes == 0
    tier.close()


def test_covers_counts_what_a_read_ahead_serves(tmp_path):
    """covers (the engine orders waiting requests by it) counts a disk entry
    read ahead for the key as far as the fetch will serve it: a longer
    entry sharing only a prefix serves that prefix."""
    key = list(range(1, 41))
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    store.insert(MODEL, key, [real_kv(40), real_kv(40, seed=1)])
    store.trim_to(0)
    assert tier.flush(10) and len(store) == 0
    prompt = key[:10] + [999 + i for i in range(40)]  # shares 10 of its 50 tokens
    assert store.covers(MODEL, prompt) == 0 and store.read_ahead(MODEL, prompt)
    assert store.covers(MODEL, prompt) == 10
    found = store.fetch(MODEL, prompt)
    assert (found.kind, found.cached) == ("disk", 10)
    tier.close()


def test_read_ahead_by_handlers_at_once_reads_each_file_once_within_the_cap(tmp_path):
    """Handlers reading ahead at the same time: one file is read once (its
    place is taken before the read), and different entries together stay
    within a quarter of the budget (their bytes are counted before the read)."""
    import threading
    import time as clock

    keys = [[k] + list(range(1, 40)) for k in (100, 200, 300, 400)]
    one = _holding([keys[0]], lambda n: [real_kv(n), real_kv(n, seed=1)])
    store, tier = with_disk(tmp_path, max_bytes=10 * one)  # a quarter: two entries
    for key in keys:
        store.insert(MODEL, key, [real_kv(40), real_kv(40, seed=1)])
    store.trim_to(0)
    assert tier.flush(10) and len(store) == 0
    loads, load = [], tier.load

    def slow_load(handle, **kw):
        loads.append(handle.name)
        clock.sleep(0.2)  # (a long read: the others come meanwhile)
        return load(handle, **kw)

    tier.load = slow_load

    def at_once(prompts):
        results = []
        threads = [threading.Thread(target=lambda p=p: results.append(store.read_ahead(MODEL, p)))
                   for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    results = at_once([keys[0] + [7]] * 6)
    assert len(loads) == 1 and store.read_ahead_bytes > 0
    # The one that read it; the others got its read to wait for, done now.
    assert results.count(True) == 1
    waits = [r for r in results if r is not True]
    assert len(waits) == 5 and all(w.done() and w.result() is True for w in waits)
    store.clear()
    for key in keys:  # (the clear emptied the tier too: written again)
        store.insert(MODEL, key, [real_kv(40), real_kv(40, seed=1)])
    store.trim_to(0)
    assert tier.flush(10)
    loads.clear()
    at_once([key + [7] for key in keys])
    assert len(loads) == 2 and store.read_ahead_bytes <= store.max_bytes // 4
    del tier.load
    tier.close()


def test_an_entry_over_a_quarter_of_the_budget_is_read_ahead_alone(tmp_path):
    """Read ahead holds a quarter of the budget; an entry larger than that
    (within the budget) is still read off the generation thread when no
    other is held, else its fetch would read it there."""
    keys = [[k] + list(range(1, 40)) for k in (100, 200)]
    one = _holding([keys[0]], lambda n: [real_kv(n), real_kv(n, seed=1)])
    store, tier = with_disk(tmp_path, max_bytes=2 * one)  # a quarter: half an entry
    for key in keys:
        store.insert(MODEL, key, [real_kv(40), real_kv(40, seed=1)])
    store.trim_to(0)
    assert tier.flush(10) and len(store) == 0
    assert store.read_ahead(MODEL, keys[0] + [7]) is True
    assert store.read_ahead(MODEL, keys[1] + [7]) is False  # (one is held)
    found = store.fetch(MODEL, keys[0] + [7])
    assert (found.kind, found.cached) == ("disk", 40) and store.stats["read_ahead"] == 1
    assert store.read_ahead(MODEL, keys[1] + [7]) is True  # (none held now)
    tier.close()


def test_housekeeping_lets_go_of_a_stale_read_ahead(tmp_path):
    """A read ahead whose request never came (its client went away) goes
    on a quiet server too: the generation thread's housekeeping drops it."""
    import mlx_lm_plus.cache.store as cache_module

    key = list(range(1, 41))
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    store.insert(MODEL, key, [real_kv(40), real_kv(40, seed=1)])
    store.trim_to(0)
    assert tier.flush(10)
    assert store.read_ahead(MODEL, key + [7]) and store.nbytes > 0
    now = store.now()
    store.set_clock(lambda: now + cache_module.READ_AHEAD_SECONDS + 1)
    store.drop_stale_read_ahead()
    assert store.read_ahead_bytes == 0 and store.nbytes == 0
    tier.close()


def test_read_ahead_never_holds_an_entry_over_the_budget(tmp_path):
    key = list(range(1, 41))
    one = _holding([key], lambda n: [real_kv(n), real_kv(n, seed=1)])
    store, tier = with_disk(tmp_path, max_bytes=one * 3 // 4)
    store.insert(MODEL, key, [real_kv(40), real_kv(40, seed=1)])
    store.trim_to(0)
    assert tier.flush(10)
    assert not store.read_ahead(MODEL, key + [7]) and store.read_ahead_bytes == 0
    assert store.fetch(MODEL, key + [7]).kind == "disk"  # (read by the fetch, as before)
    tier.close()


def test_unreadable_disk_entry_is_a_miss_and_memory_serves(tmp_path):
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    turn = list(range(1, 21))
    store.insert(MODEL, turn, hybrid(20))
    store.trim_to(0)
    assert tier.flush(10)
    store.insert(MODEL, turn[:5], hybrid(5), kind="system")
    for f in (tmp_path / "disk" / "m").glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])  # torn
    found = store.fetch(MODEL, turn + [99])
    assert (found.kind, found.cached) == ("checkpoint", 5)
    assert tier.snapshot()["corrupt"] == 1 and tier.snapshot()["entries"] == 0
    assert not list((tmp_path / "disk" / "m").glob("*.safetensors"))
    tier.close()


def test_quantized_entries_come_back_from_disk_as_memory_would_give_them(tmp_path):
    key = list(range(1, 41))
    store, tier = with_disk(tmp_path, max_bytes=1 << 30, bits=4)
    store.insert(MODEL, key, [real_kv(40), real_kv(40, seed=1, cls=MRopeKVCache)])
    store.entries()[0].cache[1].extra["rope_delta"] = 5
    want = store.fetch(MODEL, key[:30] + [999])  # trimmed, dequantized
    store.trim_to(0)
    assert tier.flush(10)
    found = store.fetch(MODEL, key[:30] + [999])
    assert (found.kind, found.cached) == ("disk", 30)
    assert type(found.cache[1]) is MRopeKVCache and found.cache[1].rope_delta == 5
    assert arrays_of(found.cache) == arrays_of(want.cache)
    (back,) = store.entries()  # back in memory still quantized
    assert isinstance(store.stored_cache(back)[0], StoredKV) and back.ntokens == 40
    tier.close()


def test_what_leaves_memory_for_which_reason_goes_to_disk(tmp_path):
    now = [0.0]
    store, tier = with_disk(tmp_path, max_bytes=1 << 30, ttl=10, clock=lambda: now[0])
    store.insert(MODEL, [1, 2, 3], [kv(3)])
    store.insert(MODEL, [1, 2, 3, 4, 5], [kv(5)])  # [1, 2, 3]: redundant, not written
    store.insert(MODEL, [7, 7], [kv(2)])
    store.clear()  # cleared: not written
    assert tier.flush(10) and tier.snapshot()["entries"] == 0
    store.insert(MODEL, [8, 8, 8], [kv(3)])
    now[0] = 20.0
    assert store.fetch(MODEL, [9]).kind == "miss"  # expires [8, 8, 8]: written
    assert tier.flush(10) and tier.snapshot()["entries"] == 1
    assert store.fetch(MODEL, [8, 8, 8, 1]).kind == "disk"
    tier.close()


def test_save_to_disk_writes_the_memory_entries_for_a_restart(tmp_path):
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    keys = [[i, i + 1, i + 2, i + 3] for i in range(0, 50, 10)]
    for i, key in enumerate(keys):
        store.insert(MODEL, key, [real_kv(4, seed=i)])
    want = {tuple(e.key): arrays_of(store.stored_cache(e)) for e in store.entries()}
    assert store.save_to_disk(timeout=30) == 5
    assert not tier.enabled  # closed
    # A restart: a new store and tier on the same folder.
    store2, tier2 = with_disk(tmp_path, max_bytes=1 << 30)
    assert tier2.snapshot()["entries"] == 5
    for key in keys:
        found = store2.fetch(MODEL, key + [1])
        assert (found.kind, found.cached) == ("disk", 4)
        assert arrays_of(found.cache) == want[tuple(key)]
    # No time left: nothing written, nothing raised, the tier closed.
    assert store2.save_to_disk(timeout=0) == 0 and not tier2.enabled


def test_save_to_disk_with_less_room_on_disk_keeps_the_most_recent(tmp_path):
    """At shutdown the hottest entries are handed over first (the timeout
    may cut the rest), but the tier's eviction goes by last use: stamped
    with the time they were written, the first written (the most recent)
    would be the first evicted when the disk holds fewer than memory."""
    now = [0.0]
    store = PromptStore(max_bytes=1 << 30, clock=lambda: now[0])
    one = _holding([list(range(20))], lambda n: [real_kv(n)])
    tier = DiskTier(str(tmp_path / "disk"), int(one * 3.5), "m")
    store.attach_disk(MODEL, tier)
    for i in range(6):  # conversation i last used at time i
        now[0] = float(i)
        store.insert(MODEL, [1000 + i] + list(range(19)), [real_kv(20, seed=i)])
    assert store.save_to_disk(timeout=30) == 3  # (what fits)
    tier = DiskTier(str(tmp_path / "disk"), int(one * 3.5), "m")  # restarted
    kept = [i for i in range(6) if tier.find([1000 + i] + list(range(20)))]
    assert kept == [3, 4, 5]
    tier.close()


def test_save_to_disk_keeps_every_conversation_before_inner_checkpoints(tmp_path):
    """On disk every entry is whole: a hybrid conversation's inner
    checkpoints (its message boundaries) cost about as much as its leaf.
    Saved all by recency, four conversations with half the disk that takes
    came back as the newest one's checkpoints: the tier evicted the others'
    leaves as the save went on. Leaves go first, and only what fits."""
    now = [0.0]

    def state(n, seed):
        a = ArraysCache(1)
        a[0] = mx.full((1, 64), float(seed * 1000 + n))
        return [a, real_kv(n, seed=seed)]

    def conversation(c):
        return [2000 + c] + list(range(1, 60))

    store = PromptStore(max_bytes=1 << 30, clock=lambda: now[0])
    for c in range(4):
        key = conversation(c)
        for n in (20, 40):  # message boundaries, then the reply's end
            now[0] += 1
            store.insert(MODEL, key[:n], state(n, c), kind="checkpoint")
        now[0] += 1
        store.insert(MODEL, key, state(len(key), c))
    assert len(store) == 12
    probe = DiskTier(str(tmp_path / "probe"), 1 << 30, "m")
    for c in range(4):  # (what the leaves take on disk; fetching them would make them newest)
        probe.put(conversation(c), state(len(conversation(c)), c))
    assert probe.flush(10)
    leaves = probe.snapshot()["bytes"]
    probe.close()
    tier = DiskTier(str(tmp_path / "disk"), int(leaves * 1.3), "m")
    store.attach_disk(MODEL, tier)
    assert store.save_to_disk(timeout=30) >= 4
    tier = DiskTier(str(tmp_path / "disk"), int(leaves * 1.3), "m")  # restarted
    for c in range(4):
        covered, handle = tier.find(conversation(c) + [7])
        assert covered == len(conversation(c))
        assert arrays_of(tier.load(handle)) == arrays_of(
            store.fetch(MODEL, conversation(c) + [7]).cache)
    assert tier.snapshot()["evictions"] == 0
    tier.close()


def test_chunked_layers_past_their_chunk_are_never_trimmed(tmp_path):
    """llama4's ChunkedKVCache says it is trimmable, but once past its chunk
    size it trims only down to its start_position: a trimmed lookup would
    hand out layers at different offsets (wrong positions, wrong output)."""
    from mlx_lm.models.cache import ChunkedKVCache

    def chunked(n, chunk):
        c = ChunkedKVCache(chunk)
        for _ in range(n):  # one token at a time, as generation fills it
            c.maybe_trim_front()
            c.update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
        return c

    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    key = list(range(1, 21))
    store.insert(MODEL, key, [chunked(20, 8), kv(20)])  # start_position 12
    assert store.fetch(MODEL, key[:5] + [99]).kind == "miss"
    found = store.fetch(MODEL, key + [99])  # its own key: nothing to trim
    assert (found.kind, found.cached) == ("prefix", 20)
    store.trim_to(0)  # to disk, as not trimmable either
    assert tier.flush(10) and tier.find(key[:5] + [99]) is None
    assert tier.find(key + [99])[0] == 20
    # A row written before the tier knew (its flag says trimmable): a miss
    # all the same, not layers at different offsets.
    import mlx_lm_plus.cache.disk as disk_module
    from mlx_lm.models.cache import can_trim_prompt_cache

    store.clear()
    old = [5] + key[1:]
    real = disk_module.trims_to_any_prefix
    disk_module.trims_to_any_prefix = can_trim_prompt_cache
    try:
        store.insert(MODEL, old, [chunked(20, 8), kv(20)])
        store.trim_to(0)
        assert tier.flush(10) and tier.find(old[:5] + [99])[0] == 5
    finally:
        disk_module.trims_to_any_prefix = real
    assert store.fetch(MODEL, old[:5] + [99]).kind == "miss"
    assert tier.find(old[:5] + [99]) is None  # (not offered trimmed again)
    assert tier.find(old + [99])[0] == 20  # (still exact for its own key)
    # Within its chunk it still holds every token: trimmed like plain KV.
    store.insert(MODEL, [7] * 6, [chunked(6, 8), kv(6)])
    found = store.fetch(MODEL, [7] * 3 + [99])
    assert found.cached == 3 and [c.offset for c in found.cache] == [3, 3]
    tier.close()


def test_clear_empties_the_disk_tier_too(tmp_path):
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    store.insert(MODEL, [1, 2, 3], [kv(3)])
    store.trim_to(0)
    store.insert(MODEL, [5, 6, 7], [kv(3)])
    assert tier.flush(10) and tier.snapshot()["entries"] == 1
    store.clear()
    assert len(store) == 0 and tier.snapshot()["entries"] == 0
    assert not list((tmp_path / "disk" / "m").glob("*.safetensors"))
    assert store.fetch(MODEL, [1, 2, 3, 4]).kind == "miss"
    tier.close()
    # The rows went too: a restart finds nothing.
    assert DiskTier(str(tmp_path / "disk"), 1 << 30, "m").snapshot()["entries"] == 0


@pytest.mark.parametrize("make", [lambda n: [kv(n)], hybrid], ids=["attention", "hybrid"])
def test_an_abandoned_reply_goes_and_a_continued_one_stays(make):
    store = PromptStore(max_bytes=1 << 30)
    prompt, reply = [1, 2, 3, 4], [50, 51, 52, 53]
    store.insert(MODEL, prompt + reply, make(8), "generated", reply_start=4)
    # Another conversation sharing the first tokens: it leaves before the reply.
    store.insert(MODEL, [1, 2, 9, 9], make(4), "prompt")
    assert (1, 2, 3, 4, 50, 51, 52, 53) in {e.key for e in store.entries()}
    # The same conversation's next turn, the reply sent back as generated:
    # it continues the path (the reply stays, redundant only if trimmable).
    store.insert(MODEL, prompt + reply + [7, 7], make(10), "prompt")
    assert store.stats["abandoned"] == 0
    # A reply generated again (regenerate) or rendered differently leaves the
    # old one's path inside it: the old reply goes, with its tail's KV.
    store.insert(MODEL, prompt + reply + [7, 7, 60, 61], make(12), "generated", reply_start=10)
    before = store.kv_bytes
    store.insert(MODEL, prompt + reply + [7, 7, 60, 99, 5], make(13), "checkpoint")
    assert store.stats["abandoned"] == 1
    keys = {e.key for e in store.entries()}
    assert (*prompt, *reply, 7, 7, 60, 61) not in keys
    assert (*prompt, *reply, 7, 7, 60, 99, 5) in keys and (1, 2, 9, 9) in keys
    counted = store.recount()
    assert store.kv_bytes == counted["kv_bytes"] and store.index_bytes == counted["index_bytes"]
    assert store.kv_bytes < before + 3 * 2 * 16 + 16  # the old tail's KV freed


def test_no_divergence_checkpoint_where_a_prompt_leaves_only_an_abandoned_reply():
    """divergence(): a prompt that leaves a "generated" leaf inside its reply
    (a client re-rendering the reply its own way) is not worth a checkpoint
    there; one that leaves any other path is (an edit: the next variant
    resumes there)."""
    store = PromptStore(max_bytes=1 << 30)
    prompt, reply = [1, 2, 3, 4], [50, 51, 52, 53]
    store.insert(MODEL, prompt, hybrid(4), "prompt")
    store.insert(MODEL, prompt + reply, hybrid(8), "generated", reply_start=4)
    assert store.divergence(MODEL, prompt + reply[:2] + [9, 9]) == (6, False)
    assert store.divergence(MODEL, prompt + reply + [9]) == (8, True)  # continues it
    assert store.divergence(MODEL, [1, 2, 7, 7, 7]) == (2, True)  # an edit of the prompt
    store.insert(MODEL, prompt + reply[:2] + [9, 9, 8], hybrid(9), "checkpoint")
    assert store.stats["abandoned"] == 1
    # The same prompt again: where it leaves a path it took itself, a checkpoint is
    # worth it (another variant of the same re-render).
    assert store.divergence(MODEL, prompt + reply[:2] + [9, 5]) == (7, True)
    assert store.divergence(MODEL, []) == (0, False)


def test_a_boundary_past_a_prompt_entry_drops_it_unless_the_path_branches():
    """A message boundary stored past a "prompt" entry on an unbranched path
    (the conversation's next turn) drops that entry's state; where another
    path branches off between them, the entry stays. Trimmable entries are
    not affected (the later entry replaces them anyway)."""
    store = PromptStore(max_bytes=1 << 30)
    turn = list(range(1, 11))
    store.insert(MODEL, turn, hybrid(10), "prompt")
    store.insert(MODEL, turn + [20, 21, 22], hybrid(13), "checkpoint")
    assert {e.key for e in store.entries()} == {tuple(turn + [20, 21, 22])}
    assert store.stats["passed"] == 1
    counted = store.recount()
    assert store.kv_bytes == counted["kv_bytes"] and store.index_bytes == counted["index_bytes"]
    # A "prompt" entry with a branch below it (two replies kept, or two
    # conversations) stays.
    other = list(range(100, 110))
    store.insert(MODEL, other, hybrid(10), "prompt")
    store.insert(MODEL, other + [5, 5], hybrid(12), "prompt")  # (a prompt: no rule)
    store.insert(MODEL, other + [6], hybrid(11), "generated", reply_start=11)
    store.insert(MODEL, other + [5, 5, 7, 7], hybrid(14), "checkpoint")
    assert tuple(other) in {e.key for e in store.entries()}  # branched: kept
    assert tuple(other + [5, 5]) not in {e.key for e in store.entries()}  # passed
    assert store.stats["passed"] == 2
    # Other kinds above a boundary stay.
    store.insert(MODEL, [200, 201], hybrid(2), "system")
    store.insert(MODEL, [200, 201, 202], hybrid(3), "checkpoint")
    assert (200, 201) in {e.key for e in store.entries()}
    # A long message (a document): another conversation opening with it
    # would recompute it all from the state above; its entry stays.
    system = [300, 301]
    document = system + list(range(1000, 1001 + PASSED_PROMPT_MAX_GAP))
    store.insert(MODEL, system, hybrid(2), "system")
    store.insert(MODEL, document, hybrid(len(document)), "prompt")
    store.insert(MODEL, document + [5, 6], hybrid(len(document) + 2), "checkpoint")
    assert tuple(document) in {e.key for e in store.entries()}
    assert store.stats["passed"] == 2


def test_kv_bits_caches_are_held_whole_in_both_layouts():
    """--kv-bits: a model's caches are KVCache below --quantized-kv-start and
    QuantizedKVCache above it; with share_kv=False both kinds are stored
    (each entry its own copy) and come back as they went in."""
    def layer(n, quantized):
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 2, n, 64)), mx.ones((1, 2, n, 64)) * 2)
        return c.to_quantized(64, 8) if quantized else c

    short, long = list(range(1, 11)), list(range(100, 140))
    for order in ((False, True), (True, False)):
        store = PromptStore(max_bytes=1 << 30, share_kv=False)
        for quantized in order:
            key = long if quantized else short
            store.insert(MODEL, key, [layer(len(key), quantized)] * 2)
        assert len(store) == 2 and store.stats["not_stored"] == 0
        assert store.kv_bytes == sum(e.nbytes for e in store.entries()) > 0
        f = store.fetch(MODEL, long + [1])
        assert (f.kind, f.cached) == ("prefix", 40)
        assert type(f.cache[0]) is QuantizedKVCache and f.cache[0].offset == 40
        f = store.fetch(MODEL, short[:6] + [99])  # trimmed, a plain copy
        assert (f.kind, f.cached) == ("trimmed", 6) and type(f.cache[0]) is KVCache
        assert f.cache[0].offset == 6 and f.cache[0].values[0, 0, :, 0].tolist() == [2.0] * 6
        store.clear()
        assert store.nbytes == 0
    # Shared (the default), the second kind would be another layout: refused.
    store = PromptStore(max_bytes=1 << 30)
    store.insert(MODEL, short, [layer(10, False)])
    store.insert(MODEL, long, [layer(40, True)])
    assert len(store) == 1 and store.stats["not_stored"] == 1


def test_only_leaves_go_to_disk_and_never_after_an_allocation_failure(tmp_path):
    store, tier = with_disk(tmp_path, max_bytes=1 << 30)
    chain = list(range(1, 41))
    store.insert(MODEL, chain[:10], hybrid(10), kind="checkpoint")
    store.insert(MODEL, chain, hybrid(40), kind="generated")
    inner = [e for e in store.entries() if e.ntokens == 10]
    store.fetch(MODEL, chain + [5])  # the leaf is used last: the checkpoint goes first
    store.trim_to(store.nbytes - 1)
    assert tier.flush(10) and len(store) == 1 and store.entries()[0].ntokens == 40
    assert inner and tier.snapshot()["entries"] == 0  # its path stays in memory
    store.trim_to(0, to_disk=False)  # as the engine does after an allocation failure
    assert tier.flush(10) and len(store) == 0 and tier.snapshot()["entries"] == 0
    store.insert(MODEL, chain, hybrid(40), kind="generated")
    store.trim_to(0)
    assert tier.flush(10) and tier.snapshot()["entries"] == 1
    tier.close()


def test_spans_hold_buffers_of_their_own():
    """Cut from a row-contiguous slice (one KV head), a span must not keep
    its source's buffer alive: what kv_bytes counts is what is held."""
    import gc

    def one_head(n, seed):
        mx.random.seed(seed)
        c = KVCache()
        c.keys = mx.random.normal((1, 1, n, 128))
        c.values = c.keys + 1
        c.offset = n
        mx.eval(c.keys, c.values)
        return c

    gc.collect()
    mx.clear_cache()  # (a buffer reused from it may be larger than asked)
    start = mx.get_active_memory()
    store = PromptStore(max_bytes=1 << 34)
    for i in range(40):  # 40 branches after 8 shared tokens: each span a suffix cut
        store.insert(MODEL, list(range(8)) + [1000 + i] * 52, [one_head(60, i) for _ in range(4)])
    gc.collect()
    held = mx.get_active_memory() - start
    assert store.kv_bytes <= held <= store.kv_bytes * 1.02 + (1 << 16), (held, store.kv_bytes)


@pytest.mark.parametrize("share_kv", [True, False])
def test_a_row_extracted_from_a_batch_holds_only_its_own_bytes(share_kv):
    """BatchGenerator hands the engine a request's cache as rows extracted
    from the batch: upstream's ArraysCache.extract slices the batch's state,
    BatchKVCache.extract's mx.contiguous keeps a contiguous row in place.
    Stored as given, each entry would keep a whole batch's arrays alive,
    rows times what the budget counts."""
    from mlx_lm.models.cache import BatchKVCache

    rows, n = 8, 64
    store = PromptStore(max_bytes=1 << 30, share_kv=share_kv)
    mx.synchronize()
    mx.clear_cache()  # (a buffer reused from it may be larger than asked)
    before = mx.get_active_memory()
    for step in range(6):
        state = ArraysCache(1)
        state.cache = [mx.random.normal((rows, 16, 32, 32))]
        batch_kv = BatchKVCache([0] * rows)
        batch_kv.keys = mx.random.normal((rows, 2, n + step, 32))
        batch_kv.values = mx.random.normal((rows, 2, n + step, 32))
        batch_kv._idx = batch_kv.offset = n + step
        batch_kv.offset = mx.array([n + step] * rows)
        mx.eval(state.cache, batch_kv.keys, batch_kv.values)
        store.insert(MODEL, list(range(1, n + step + 1)),
                     [state.extract(3), batch_kv.extract(3)], "checkpoint")
        del state, batch_kv
    mx.synchronize()
    held = mx.get_active_memory() - before
    assert store.recount()["kv_bytes"] == store.kv_bytes
    # Without copies: about `rows` times the counted bytes.
    assert held <= 1.25 * store.kv_bytes, (held, store.kv_bytes)
    store.clear()
