"""PromptStore alone, on small synthetic caches."""

import copy
import random
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, can_trim_prompt_cache, trim_prompt_cache

from mlx_lm_plus.cache import (
    ENTRY_BYTES,
    NODE_BYTES,
    Fetched,
    PromptStore,
    cache_nbytes,
    compact,
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
    assert entry.cache[0].keys.shape[2] == 3
    assert entry.nbytes == store.kv_bytes == 2 * 3 * 4 * 4
    assert store.nbytes == store.kv_bytes + store.index_bytes


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
    # Room for the system prompt and those, nothing more.
    store.max_bytes = _holding(latest | {tuple(system)}, hybrid)
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


# -- limits of 0, the index's bytes, the compressed tree --


def test_zero_sequences_or_bytes_means_no_prompt_cache():
    for store in (PromptStore(max_bytes=1 << 30, max_sequences=0),
                  PromptStore(max_bytes=0), PromptStore(max_bytes=-1)):
        for _ in range(2):  # an exact repeat too
            assert store.fetch(MODEL, [1, 2, 3]).kind == "miss"
            store.insert(MODEL, [1, 2, 3], hybrid(3))
            assert len(store) == 0 and store.nbytes == 0 and store.leaf_count() == 0
        assert store.shared_depth(MODEL, [1, 2, 3]) == 0
        snapshot = store.snapshot()
        assert snapshot["entries"] == 0 and snapshot["misses"] == 2 and not snapshot["hits"]
        assert store.stats["not_stored"] == 2


def _tree_nodes(store):
    return sum(1 for _ in _walk(store._roots.values()))


def _walk(nodes):
    stack = list(nodes)
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def test_index_bytes_are_counted_and_budgeted():
    long_key = list(range(100_000))
    store = PromptStore(max_bytes=1 << 30)
    store.insert(MODEL, long_key, [kv(1)])  # a tiny cache for a long key
    s = store.snapshot()
    assert s["kv_bytes"] == 2 * 4 * 4 and s["index_bytes"] >= 8 * 100_000
    assert s["bytes"] == store.nbytes == s["kv_bytes"] + s["index_bytes"]
    assert s["cached_tokens"] == 100_000
    store.clear()
    s = store.snapshot()
    assert s["bytes"] == s["index_bytes"] == s["kv_bytes"] == 0 and not store._roots

    # Two such keys don't fit in 1 MB: the budget evicts for the index alone.
    store = PromptStore(max_bytes=1_000_000)
    store.insert(MODEL, long_key, [kv(1)])
    store.insert(MODEL, [-5] + long_key[1:], [kv(1)])
    assert [e.key[0] for e in store.entries()] == [-5] and store.nbytes <= store.max_bytes
    assert store.snapshot()["evictions"] == 1
    # One alone over budget is not kept.
    store.max_bytes = 500_000
    store.insert(MODEL, [7] + long_key, [kv(1)])
    assert len(store) == 0 and store.nbytes == 0


def test_edges_are_compressed():
    """Keys of thousands of tokens: a node per entry and per branch point,
    about 8 bytes per distinct token, and a key is no longer stored twice."""
    store = PromptStore(max_bytes=1 << 30)
    system = list(range(1000, 3000))
    n = 40
    for i in range(n):
        store.insert(MODEL, system + [i] * 10 + list(range(5000, 7000)), hybrid(1),
                     kind="generated")
        store.insert(MODEL, system + [i] * 10, hybrid(1), kind="checkpoint")
    assert len(store) == 2 * n and store.leaf_count() == n
    nodes = _tree_nodes(store)
    assert nodes <= 2 * n + 2  # root, the system prompt's end, n checkpoints, n ends
    distinct = len(system) + n * (10 + 2000)
    index = store.index_bytes
    assert index == store.recount()["index_bytes"]
    assert 8 * distinct <= index <= 8 * distinct + 2 * len(store) * 1024
    # Keys rebuild from the path; images are counted once, on insert.
    store.insert(MODEL, system + [-(1 << 62), -(1 << 62), -3, 5], hybrid(1))
    (entry,) = [e for e in store.entries() if e.images]
    assert entry.key == tuple(system + [-(1 << 62), -(1 << 62), -3, 5])
    assert (entry.ntokens, entry.images) == (len(system) + 4, 2)
    f = store.fetch(MODEL, system + [3] * 10 + list(range(5000, 5100)))
    assert (f.kind, f.cached) == ("checkpoint", len(system) + 10)
    assert store.shared_depth(MODEL, system + [3] * 10 + list(range(5000, 5100))) == \
        len(system) + 110


# -- a randomized comparison with the per-token trie --


class _RefStore:
    """The store as it was before the tree was compressed: a Python node per
    token and each entry's key. Its byte count adds the compressed tree's
    index bytes, computed by a walk, so that both evict alike."""

    class Node:
        def __init__(self, parent, token, depth):
            self.parent, self.token, self.depth = parent, token, depth
            self.children, self.entry, self.below = {}, None, 0

    class Entry:
        def __init__(self, key, cache, nbytes, kind, now):
            self.key, self.cache, self.nbytes, self.kind = key, cache, nbytes, kind
            self.created = self.last_used = self.prev_used = now
            self.hits = 0

    def __init__(self, max_bytes, max_sequences=None, ttl=None, clock=None):
        self.max_bytes, self.max_sequences, self.ttl = max_bytes, max_sequences, ttl
        self._clock = clock
        self._roots, self._entries = {}, {}
        self.kv_bytes = 0
        self.stats = Counter()

    def entries(self):
        return list(self._entries)

    def disabled(self):
        return self.max_bytes <= 0 or (self.max_sequences is not None
                                       and self.max_sequences <= 0)

    @property
    def index_bytes(self):
        nodes = tokens = 0
        for n in _walk(self._roots.values()):
            tokens += n.parent is not None
            # A node of the compressed tree: a root, an entry, a branch point.
            nodes += n.parent is None or n.entry is not None or len(n.children) != 1
        return nodes * NODE_BYTES + 8 * tokens + len(self._entries) * ENTRY_BYTES

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
        nbytes = cache_nbytes(cache)
        node = self._roots.setdefault(model, self.Node(None, None, 0))
        for token in key:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = self.Node(node, token, node.depth + 1)
            node = child
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
        self.kv_bytes += nbytes
        self.stats[f"insert_{kind}"] += 1
        if can_trim_prompt_cache(cache):
            n = node.parent
            while n is not None:
                if n.entry is not None and can_trim_prompt_cache(n.entry.cache):
                    self._remove(n.entry, reason="redundant")
                n = n.parent
        self._enforce_limits(keep=entry)

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
        self.kv_bytes -= entry.nbytes
        if reason:
            self.stats[reason] += 1
            self.stats[f"{reason}_bytes"] += entry.nbytes
        if not prune:
            return
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.token]
            node = node.parent
        if node.parent is None and not node.children and node.entry is None:
            self._roots.pop(model, None)


def _state(store):
    return sorted((e.key, e.kind, e.hits, e.nbytes, e.created, e.last_used)
                  for e in store.entries())


@pytest.mark.parametrize("seed", range(24))
def test_matches_the_per_token_trie(seed):
    rng = random.Random(seed)
    caches = ["kv", "hybrid", "mixed"][seed % 3]

    def make(n):
        trimmable = caches == "kv" or (caches == "mixed" and rng.random() < 0.5)
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
            assert store.shared_depth(model, key) == ref.shared_depth(model, key)
        elif op < 0.9:
            key = random_key(model)
            kind = rng.choice(["prompt", "checkpoint", "generated", "system"])
            cache = make(len(key))
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
        assert store.kv_bytes == ref.kv_bytes, step
        if 0.45 <= op < 0.9 and key:  # enforced on every insert
            assert store.nbytes <= max(store.max_bytes, 0), step
        # Compressed: no node without an entry on a path that does not branch.
        for n in _walk(store._roots.values()):
            assert n.parent is None or n.entry is not None or len(n.children) >= 2
            assert all(c.parent is n and c.edge[0] == t and c.depth == n.depth + len(c.edge)
                       for t, c in n.children.items())
    assert len(store) > 0 or limits["max_bytes"] < (1 << 30)
    store.clear()
    assert store.nbytes == store.index_bytes == 0 and not store._roots
