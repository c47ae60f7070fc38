"""PromptStore: a radix tree of prompt caches, with a byte budget.

One data structure in one file (after SGLang's radix_cache.py). Entries are
keyed per model by a cache key (token ids; image requests put image ids in
place of image tokens). `fetch` finds the best usable entry for a key:

  exact      an entry with the whole key (trimmed by one token, since at least
             one token must be computed; non-trimmable: the next shorter one);
  prefix     the longest entry whose key is a prefix of the key
             ("checkpoint" when that entry is a message-boundary checkpoint);
  trimmed    a longer or sibling entry sharing a longer common prefix, cut
             down to it; only when every layer of it can be trimmed.

Generation never mutates a stored entry: `fetch` hands out a deep copy (a
dequantized one under quantized storage). Entries are stored compacted to
their real length (KV buffers are allocated in steps of 256 tokens).

The tree is compressed: each node's edge holds a run of token ids (an int64
array: image ids are negative 63-bit fingerprints), a node exists only where
an entry ends or keys diverge, and an entry holds no copy of its key (its
node's path spells it). So the index costs about 8 bytes per distinct cached
token plus a fixed overhead per node and per entry, all of it counted.

Limits, enforced on every insert: `max_bytes` (`nbytes`: the entries' KV
bytes plus the index's bytes, `kv_bytes` + `index_bytes`) and
`max_sequences`, the number of distinct sequences: leaf entries only. A
conversation's chain of checkpoints counts once, so upstream's default of 10
keeps 10 conversations instead of three requests' worth of entries. Idle
entries expire after `ttl` seconds. A limit of 0 (no bytes or no sequences)
means no prompt cache: nothing is stored and every fetch misses.

Eviction policy: expired entries first; then, for the byte budget, the
least recently used entry, inner or leaf. Every entry holds its own memory
(a checkpoint is a full copy of the state at its position), so a
conversation's old checkpoints, which nothing has fetched since, go before
the latest entries of other conversations; a shared system prompt stays as
long as new conversations keep fetching it. (Evicting leaves first, as a
radix tree of shared pages does, kept every conversation's old checkpoints
and threw away their latest entries: with six interleaved conversations in
4 MB, 6.2 prompt tokens recomputed per novel one instead of 1.0.) For
`max_sequences`, which counts leaves, the least recently used leaf goes. On
models whose caches are all trimmable, a new entry makes the entries on its
own path redundant (the longer one can be trimmed to any of them), so they
are dropped.

Quantized storage (--prompt-cache-bits 4 or 8): the store then holds each
plain KV layer's keys and values `mx.quantize`d (group size --kv-group-size;
other layers as they are), counts those bytes against the budget, and
dequantizes on fetch into a layer of the class it was inserted as, so the
same budget holds about 1.9x (8 bits) or 3.6x (4 bits) the tokens of a
float16 cache at group size 64 (`quantize_for_store` / `restore_from_store`).

Disk tier (--prompt-cache-dir): a model may have a disk_cache.DiskTier
attached (`attach_disk`). Entries leaving memory for the limits (evicted) or
the TTL (expired: idle conversations are what the disk is for) are handed to
it, outside the store's lock; redundant ones are not (a longer entry on the
same path covers them), and `clear` empties the tiers too. `fetch` asks the
tier as well and, when its entry covers more of the key than memory's best,
reads it back (kind "disk") and inserts it into memory again, so the next
turn hits memory. `save_to_disk` writes the memory entries out at shutdown,
most recently used first. An evicted entry's arrays stay in memory until
the tier's writer has written them (its queue is bounded: see DiskTier).
"""

import copy
import logging
import sys
import threading
import time
from array import array
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import (
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

# Edges hold token ids as int64: image ids are negative 63-bit fingerprints.
_TOKENS = "q"
_TOKEN_BYTES = array(_TOKENS).itemsize


@dataclass(eq=False, slots=True)
class Entry:
    cache: List[Any]
    nbytes: int  # the cache's arrays
    kind: str  # "checkpoint", "system", "prompt", "generated"
    created: float
    last_used: float
    # last_used before the latest fetch: restored when that fetch turns out
    # to have been a plain continuation (see _supersede_ancestors).
    prev_used: float = 0.0
    hits: int = 0
    ntokens: int = 0  # len(key)
    images: int = 0  # distinct image ids (negative tokens) in the key
    node: Optional["_Node"] = field(default=None, repr=False)
    lock: Any = field(default=None, repr=False)  # the store's

    @property
    def key(self) -> Optional[Tuple[int, ...]]:
        """The entry's token ids, spelled by its node's path (rebuilt on each
        call: the store keeps no copy); None once it has left the store."""
        with self.lock or nullcontext():
            node, edges = self.node, []
            if node is None:
                return None
            while node is not None:
                edges.append(node.edge)
                node = node.parent
            return tuple(chain.from_iterable(reversed(edges)))


class _Node:
    __slots__ = ("parent", "edge", "depth", "children", "entry", "below")

    def __init__(self, parent: Optional["_Node"], edge: array, depth: int):
        self.parent = parent
        self.edge = edge  # the tokens from the parent to here (root: none)
        self.depth = depth  # tokens from the root to the end of the edge
        # Keyed by the first token of the child's edge.
        self.children: Dict[int, "_Node"] = {}
        self.entry: Optional[Entry] = None
        # Entries stored strictly below this node: an entry is a leaf (a
        # distinct sequence) when its node has none.
        self.below = 0


def _measure() -> Tuple[int, int]:
    """Fixed bytes per node and per entry, beside the edges' token buffers:
    the objects the store creates for them, measured once."""
    node = _Node(None, array(_TOKENS), 0)
    token = 1 << 40  # a child's key in its parent's children
    node_bytes = (sys.getsizeof(node) + sys.getsizeof(node.edge)  # its header
                  + sys.getsizeof({token: node})  # a children dict (to 5)
                  + sys.getsizeof(token))
    entry = Entry([], 1 << 40, "prompt", 1.5, 2.5, 3.5, 0, 1 << 40, 0)
    # Its slot in the store's dict of entries, averaged over a large one.
    table = dict.fromkeys(object() for _ in range(1024))
    slot = (sys.getsizeof(table) - sys.getsizeof({})) // len(table)
    entry_bytes = (sys.getsizeof(entry) + slot
                   + 3 * sys.getsizeof(1.5)  # created, last_used, prev_used
                   + 2 * sys.getsizeof(1 << 40))  # nbytes, ntokens
    return node_bytes, entry_bytes


NODE_BYTES, ENTRY_BYTES = _measure()


def _matching(edge: array, key: array, pos: int) -> int:
    """How many leading tokens of `edge` equal key[pos:]."""
    n = min(len(edge), len(key) - pos)
    if (edge if n == len(edge) else edge[:n]) == key[pos:pos + n]:
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        m = (lo + hi) // 2
        if edge[lo:m] == key[pos + lo:pos + m]:
            lo = m
        else:
            hi = m
    return lo


def descend(node, key: array):
    """Follow `key` down from `node` (a radix tree of nodes with `children`
    keyed by first token, `edge` and `entry`; also the disk tier's index):
    (the deepest node whose whole edge it matches, the tokens matched, the
    nodes with entries on the way, the child whose edge it leaves part way
    or None)."""
    pos, on_path = 0, []
    while pos < len(key):
        child = node.children.get(key[pos])
        if child is None:
            break
        m = _matching(child.edge, key, pos)
        pos += m
        if m < len(child.edge):
            return node, pos, on_path, child
        node = child
        if node.entry is not None:
            on_path.append(node)
    return node, pos, on_path, None


@dataclass
class Fetched:
    cache: Optional[List[Any]]  # a private copy, or None (miss)
    cached: int  # tokens of the key it covers
    kind: str  # "exact", "prefix", "checkpoint", "trimmed", "disk", "miss"


def is_plain_kv(c) -> bool:
    """A KVCache that holds exactly its tokens' keys and values (any prefix of
    it is valid): KVCache and subclasses that only add bookkeeping, such as
    vision.MRopeKVCache; not ChunkedKVCache, which drops old chunks."""
    return isinstance(c, KVCache) and not isinstance(c, ChunkedKVCache)


def compact(cache: List[Any]) -> List[Any]:
    """Cut preallocated KV buffers down to the tokens they hold."""
    for c in cache:
        if is_plain_kv(c) and c.keys is not None and c.keys.shape[2] > c.offset:
            c.keys = mx.contiguous(c.keys[..., : c.offset, :])
            c.values = mx.contiguous(c.values[..., : c.offset, :])
    mx.eval([c.state for c in cache])
    return cache


class StoredKV(QuantizedKVCache):
    """A plain KV layer as a quantized store holds it: QuantizedKVCache's
    (packed, scales, biases) keys and values (so its `nbytes`, `trim` and
    `is_trimmable` hold as they are), plus what turns it back into the layer
    it was: the class, the attributes beside keys/values/offset (such as
    vision.MRopeKVCache's rope_delta) and the dtype. Never handed out."""

    def __init__(self, layer: KVCache, bits: int, group_size: int):
        super().__init__(group_size=group_size, bits=bits)
        self.layer_class = type(layer)
        self.extra = {k: v for k, v in vars(layer).items()
                      if k not in ("keys", "values", "offset")}
        self.dtype = layer.keys.dtype
        self.offset = n = layer.offset
        self.keys = mx.quantize(layer.keys[..., :n, :], group_size, bits)
        self.values = mx.quantize(layer.values[..., :n, :], group_size, bits)

    def restore(self, trim: int = 0) -> KVCache:
        """A new layer of the original class, `trim` tokens shorter: only
        the tokens kept are dequantized (into new arrays; nothing shared)."""
        n = self.offset - min(trim, self.offset)
        layer = self.layer_class.__new__(self.layer_class)
        layer.__dict__.update(copy.deepcopy(self.extra))

        def dequantize(q):
            w, scales, biases = (x[..., :n, :] for x in q)
            return mx.dequantize(w, scales, biases, self.group_size, self.bits,
                                 dtype=self.dtype)

        layer.keys, layer.values = dequantize(self.keys), dequantize(self.values)
        layer.offset = n
        return layer


def _quantizable(c, group_size: int) -> bool:
    return (is_plain_kv(c) and c.keys is not None and c.offset > 0
            and c.keys.shape[-1] % group_size == 0
            and c.values.shape[-1] % group_size == 0)


def quantize_for_store(cache: List[Any], bits: Optional[int], group_size: int) -> List[Any]:
    """The cache as the store holds it: with `bits`, each plain KV layer a
    StoredKV (head dims that `group_size` does not divide stay as they are);
    recurrent, rotating and chunked layers as they are. Evaluated."""
    if bits is None:
        return cache
    cache = [StoredKV(c, bits, group_size) if _quantizable(c, group_size) else c
             for c in cache]
    mx.eval([c.state for c in cache])
    return cache


def restore_from_store(stored: List[Any], trim: int = 0) -> List[Any]:
    """A private copy of a stored cache, of ordinary layers (StoredKV layers
    dequantized, the others deep copied), `trim` tokens shorter when every
    layer can be trimmed (as trim_prompt_cache)."""
    if not any(isinstance(c, StoredKV) for c in stored):
        cache = copy.deepcopy(stored)
        if trim:
            trim_prompt_cache(cache, trim)
        return cache
    trim = trim if can_trim_prompt_cache(stored) else 0
    cache = []
    for c in stored:
        if isinstance(c, StoredKV):
            cache.append(c.restore(trim))
        else:
            c = copy.deepcopy(c)
            if trim:
                c.trim(trim)
            cache.append(c)
    return cache


# Why entries leave memory that sends them to the disk tier: the limits and
# the TTL. Not "redundant" (a longer entry on the same path covers them) nor
# "cleared" (DELETE /v1/cache).
_TO_DISK = ("evicted", "expired")


def default_budget() -> int:
    """Bytes for the prompt cache when --prompt-cache-bytes is not given.

    20% of the memory MLX may use (Metal's recommended working set, or the
    machine's RAM), between 256 MB and 16 GB.
    """
    total = 0
    try:
        info = mx.device_info()
        total = int(info.get("max_recommended_working_set_size", 0) or info.get("memory_size", 0))
    except Exception:
        pass
    if not total:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(256 << 20, min(int(total * 0.2), 16 << 30))


def _per_token(nbytes: int, tokens: int) -> Optional[float]:
    return round(nbytes / tokens, 1) if tokens else None


def cache_nbytes(cache: List[Any]) -> int:
    return sum(c.nbytes for c in cache)


class PromptStore:
    def __init__(self, max_bytes: int, max_sequences: Optional[int] = None,
                 ttl: Optional[float] = None, clock=time.monotonic,
                 bits: Optional[int] = None, group_size: int = 64):
        self.max_bytes = max_bytes
        self.max_sequences = max_sequences
        self.ttl = ttl
        # Quantized storage of plain KV layers (None: stored as they are).
        self.bits, self.group_size = bits, group_size
        if bits is not None:  # a bad combination fails here, not on an insert
            mx.quantize(mx.zeros((1, group_size)), group_size, bits)
        self._clock = clock
        self._roots: Dict[Any, _Node] = {}
        self._entries: Dict[Entry, Any] = {}  # entry -> model
        # Kept up to date on every change (never a walk): the entries' cache
        # bytes, the index's bytes (nodes, edges, entries' own objects), and
        # the entries that are leaves.
        self.kv_bytes = 0
        self.index_bytes = 0
        self._leaves = 0
        self.stats = Counter()
        # The generation thread mutates; HTTP handlers read snapshots.
        self._lock = threading.RLock()
        # model -> its disk_cache.DiskTier (only with --prompt-cache-dir).
        self._disks: Dict[Any, Any] = {}
        # (tier, key, cache, kind) of entries that left memory, handed to
        # their tier once the lock is released: `put` evaluates and copies
        # views of the arrays, which HTTP handlers reading a snapshot should
        # not wait for.
        self._spills: List[Tuple[Any, List[int], List[Any], str]] = []

    def __len__(self):
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """What `max_bytes` limits: the entries' caches and the index."""
        return self.kv_bytes + self.index_bytes

    def now(self) -> float:
        """The store's clock (entries' created/last_used are on it)."""
        return self._clock()

    def disabled(self) -> bool:
        """No room for anything (--prompt-cache-size 0 or no bytes)."""
        return (self.max_bytes is not None and self.max_bytes <= 0) or (
            self.max_sequences is not None and self.max_sequences <= 0)

    # -- lookup --

    def fetch(self, model: Any, key: List[int]) -> Fetched:
        """The best cached prefix of `key`: from memory, or from the model's
        disk tier when that covers more of it (memory wins a tie: nothing
        to read).

        The store's lock is not held while the tier reads a file (hundreds of
        milliseconds for a long context): HTTP handlers reading a snapshot
        don't wait for it. Only the generation thread changes the store, so
        nothing but a DELETE /v1/cache can come between; the entry read back
        is then inserted after the clear, as if fetched just after it.
        """
        with self._lock:
            self._expire()
            disabled = self.disabled()
            tier = None if disabled else self._disks.get(model)
        self._spill()
        # (covered, handle) of the tier's best entry: its in-memory index only.
        on_disk = tier.find(key) if tier is not None and key else None
        with self._lock:
            if disabled:
                found = Fetched(None, 0, "miss")
            else:
                # A miss, without touching anything, when memory covers less.
                found = self._find(model, key, floor=on_disk[0] if on_disk else 0)
        if on_disk is not None and found.kind == "miss":
            found = self._from_disk(model, tier, *on_disk)
            if found is None:  # unreadable (deleted by the tier): memory's best
                with self._lock:
                    found = self._find(model, key)
        with self._lock:
            self.stats[f"fetch_{found.kind}"] += 1
            if found.kind != "miss":
                self.stats["tokens_saved"] += found.cached
        return found

    def _from_disk(self, model, tier, covered: int, handle) -> Optional[Fetched]:
        """The tier's entry read back and cut to `covered` tokens (None: it
        could not be read); a copy of the whole entry goes back into memory
        under its own key, so the next turn hits memory."""
        stored = tier.load(handle)  # as the store held it (StoredKV layers too)
        if stored is None:
            return None
        cache = restore_from_store(stored, handle.ntokens - covered)
        key = tier.key_of(handle)  # None: replaced or evicted since `find`
        if key is not None:
            self.insert(model, key, stored, handle.kind, from_disk=True)
        return Fetched(cache, covered, "disk")

    def _descend(self, model, key: array):
        """descend() from the model's root (None when it has no tree)."""
        root = self._roots.get(model)
        if root is None:
            return None, 0, [], None
        return descend(root, key)

    def _find(self, model, key, floor: int = 0) -> Fetched:
        """Memory's best entry for `key`; a miss (nothing touched or copied)
        when it would cover fewer than `floor` tokens."""
        if not key:
            return Fetched(None, 0, "miss")
        node, common, on_path, partial = self._descend(model, array(_TOKENS, key))
        if node is None:
            return Fetched(None, 0, "miss")

        # Entries that leave at least one token to compute.
        usable = [n for n in on_path if n.depth < len(key)]
        best_prefix = usable[-1] if usable else None
        exact = on_path[-1] if on_path and on_path[-1].depth == len(key) else None

        # A longer/sibling/exact entry trimmed to the common prefix (at most
        # len(key) - 1), when that beats the best prefix entry.
        target = min(common, len(key) - 1)
        if target > (best_prefix.depth if best_prefix else 0):
            # Below the point where the key leaves the tree: the subtree of
            # the node it ends at, or of the child whose edge it leaves.
            donor = exact or self._nearest_entry(partial or node)
            if donor is not None and can_trim_prompt_cache(donor.entry.cache):
                if target < floor:
                    return Fetched(None, 0, "miss")
                cache = restore_from_store(donor.entry.cache, donor.depth - target)
                # A hit, but not a reason to keep the donor: the request's own
                # entry will hold the shared part. Renewing it would keep
                # stale branches (a reply the next turn re-renders
                # differently) alive at the expense of live conversations.
                donor.entry.hits += 1
                kind = "exact" if donor is exact else "trimmed"
                return Fetched(cache, target, kind)

        if best_prefix is not None and best_prefix.depth >= floor:
            entry = best_prefix.entry
            self._touch(entry)
            kind = "checkpoint" if entry.kind in ("checkpoint", "system") else "prefix"
            return Fetched(restore_from_store(entry.cache), best_prefix.depth, kind)
        return Fetched(None, 0, "miss")

    def shared_depth(self, model: Any, key: List[int]) -> int:
        """How many leading tokens of `key` the tree holds (any entry's path)."""
        with self._lock:
            if not key:
                return 0
            return self._descend(model, array(_TOKENS, key))[1]

    @staticmethod
    def _nearest_entry(node: _Node) -> Optional[_Node]:
        """The shallowest entry in the subtree of `node` (in tokens; between
        equally deep ones, the first in the children's order, as a breadth
        first walk of the uncompressed trie finds it)."""
        best, stack = None, [node]
        while stack:
            n = stack.pop()
            if best is not None and n.depth >= best.depth:
                continue  # nothing below it is shallower
            if n.entry is not None:
                best = n
                continue
            stack.extend(reversed(n.children.values()))
        return best

    def _touch(self, entry: Entry):
        entry.prev_used, entry.last_used = entry.last_used, self._clock()
        entry.hits += 1

    # -- insert --

    def insert(self, model: Any, key: List[int], cache: List[Any], kind: str = "prompt",
               from_disk: bool = False):
        """Store `cache` (covering exactly `key`); the store takes ownership.
        `from_disk`: an entry read back from the disk tier (counted apart)."""
        if not key:
            return
        if self.disabled():
            with self._lock:
                self.stats["not_stored"] += 1
            return
        tokens = array(_TOKENS, key)
        images = len({t for t in tokens if t < 0}) if min(tokens) < 0 else 0
        cache = quantize_for_store(compact(cache), self.bits, self.group_size)
        nbytes = cache_nbytes(cache)
        with self._lock:
            node = self._node_for(model, tokens)
            if node.entry is not None:
                # Replaced in place: the node stays in the tree.
                self._remove(node.entry, prune=False)
            now = self._clock()
            entry = Entry(cache, nbytes, kind, now, now, now, ntokens=len(tokens),
                          images=images, node=node, lock=self._lock)
            node.entry = entry
            self._leaves += node.below == 0
            self._count_below(node, +1)
            self._supersede_ancestors(node)
            self._entries[entry] = model
            self.kv_bytes += nbytes
            self.index_bytes += ENTRY_BYTES
            self.stats["from_disk" if from_disk else f"insert_{kind}"] += 1
            if can_trim_prompt_cache(cache):
                self._drop_redundant_prefixes(node)
            self._enforce_limits(keep=entry)
        self._spill()

    def _node_for(self, model, key: array) -> _Node:
        """The node at the end of `key`, made (splitting an edge where the key
        leaves it part way, or adding a leaf) if the tree has none."""
        node = self._roots.get(model)
        if node is None:
            node = self._roots[model] = _Node(None, array(_TOKENS), 0)
            self.index_bytes += NODE_BYTES
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = node.children[key[pos]] = _Node(node, key[pos:], len(key))
                self.index_bytes += NODE_BYTES + _TOKEN_BYTES * len(leaf.edge)
                return leaf
            m = _matching(child.edge, key, pos)
            if m < len(child.edge):
                child = self._split(child, m)
            node, pos = child, pos + m
        return node

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut `node`'s edge after `m` tokens: a new node above it ends there."""
        parent = node.parent
        upper = _Node(parent, node.edge[:m], parent.depth + m)
        node.edge = node.edge[m:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        upper.below = node.below + (node.entry is not None)
        parent.children[upper.edge[0]] = upper  # in node's place
        self.index_bytes += NODE_BYTES  # the tokens only moved
        return upper

    def _merge(self, node: _Node):
        """Fold `node` (no entry, one child) into its child."""
        (child,) = node.children.values()
        child.edge = node.edge + child.edge
        child.parent = node.parent
        node.parent.children[node.edge[0]] = child  # in node's place
        node.parent, node.children = None, {}
        self.index_bytes -= NODE_BYTES

    @staticmethod
    def _supersede_ancestors(node: _Node):
        """A new entry continues the path of the entries above it.

        The fetch that led here renewed the entry it resumed from; but when
        the path from that entry down to the new one does not branch, the new
        entry serves everything it did and more (its next turn resumes from
        the new one), so it goes back to its recency before that fetch and
        ages out first. Where the path branches on the way, the entries
        above the branch point are shared by both branches and keep it.
        (Every branch point and every entry is a node of the tree, so walking
        its nodes sees the same as walking the tokens.)
        """
        n = node.parent
        while n is not None and len(n.children) == 1:
            if n.entry is not None:
                n.entry.last_used = n.entry.prev_used
            n = n.parent

    def _drop_redundant_prefixes(self, node: _Node):
        n = node.parent
        while n is not None:
            up = n.parent  # n itself may be merged away below
            if n.entry is not None and can_trim_prompt_cache(n.entry.cache):
                self._remove(n.entry, reason="redundant")
            n = up

    # -- eviction --

    def _expire(self):
        if self.ttl is None:
            return
        deadline = self._clock() - self.ttl
        for entry in [e for e in self._entries if e.last_used < deadline]:
            self._remove(entry, reason="expired")

    def _count_below(self, node: _Node, delta: int):
        n = node.parent
        while n is not None:
            if n.entry is not None and n.below == (0 if delta > 0 else 1):
                self._leaves -= delta  # an entry gains its first / loses its last
            n.below += delta
            n = n.parent

    @staticmethod
    def _is_leaf(node: _Node) -> bool:
        return node.below == 0

    def _victim(self, keep: Entry, leaves_only: bool) -> Optional[Entry]:
        candidates = [
            e for e in self._entries
            if e is not keep and (not leaves_only or self._is_leaf(e.node))
        ]
        return min(candidates, key=lambda e: e.last_used, default=None)

    def leaf_count(self) -> int:
        return self._leaves

    def _enforce_limits(self, keep: Entry):
        self._expire()
        while self.max_sequences is not None and self._leaves > self.max_sequences:
            victim = self._victim(keep, leaves_only=True) or self._victim(keep, False)
            if victim is None:
                break
            self._remove(victim, reason="evicted")
        self._trim_to(self.max_bytes, keep=keep)

    def trim_to(self, n_bytes: int, keep: Optional[Entry] = None):
        """Evict until the entries and the index hold at most `n_bytes`."""
        with self._lock:
            self._trim_to(n_bytes, keep)
        self._spill()

    def _trim_to(self, n_bytes: int, keep: Optional[Entry] = None):
        while self.nbytes > max(0, n_bytes) and self._entries:
            victim = self._victim(keep, leaves_only=False)
            if victim is None:
                # Only `keep` is left and it alone is over budget.
                victim = keep
            self._remove(victim, reason="evicted")
            if victim is keep:
                break

    def _remove(self, entry: Entry, reason: Optional[str] = None, prune: bool = True):
        model = self._entries.pop(entry)
        tier = self._disks.get(model) if reason in _TO_DISK else None
        if tier is not None:  # the key, while the node's path still spells it
            self._spills.append((tier, list(entry.key), entry.cache, entry.kind))
        node, entry.node = entry.node, None
        node.entry = None
        self._leaves -= node.below == 0
        self._count_below(node, -1)
        self.kv_bytes -= entry.nbytes
        self.index_bytes -= ENTRY_BYTES
        if reason:
            self.stats[reason] += 1
            self.stats[f"{reason}_bytes"] += entry.nbytes
        if not prune:
            return
        # Prune the branch up to the nearest node still in use...
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.edge[0]]
            self.index_bytes -= NODE_BYTES + _TOKEN_BYTES * len(node.edge)
            node.parent, node = None, node.parent
        if node.parent is None:
            if not node.children:
                del self._roots[model]
                self.index_bytes -= NODE_BYTES
        elif node.entry is None and len(node.children) == 1:
            # ...which, left without an entry on a path that no longer
            # branches there, is folded into its child.
            self._merge(node)

    def clear(self):
        """Drop every entry, the disk tiers' too (DELETE /v1/cache)."""
        with self._lock:
            for entry in list(self._entries):
                self._remove(entry, reason="cleared")
            for tier in dict.fromkeys(self._disks.values()):
                self.stats["cleared_on_disk"] += tier.clear()

    # -- the disk tier --

    def attach_disk(self, model: Any, tier) -> None:
        """Give `model`'s entries a disk_cache.DiskTier (its identity must be
        this model's: the store only routes entries to it)."""
        with self._lock:
            self._disks[model] = tier

    def disk_for(self, model: Any):
        with self._lock:
            return self._disks.get(model)

    def _spill(self):
        """Hand the entries that left memory to their tiers. Called with the
        lock released, on the generation thread (put evaluates the arrays
        and makes numpy views of them: MLX on the thread that owns them; the
        tier's writer thread then writes)."""
        with self._lock:
            spills, self._spills = self._spills, []
        for tier, key, cache, kind in spills:
            try:
                tier.put(key, cache, kind)  # the tier owns the cache now
            except Exception:  # never fails the request that evicted it
                logging.exception("Prompt cache: could not hand an entry to the disk tier")
                continue
            with self._lock:
                self.stats["spilled"] += 1

    def save_to_disk(self, timeout: float) -> int:
        """At shutdown: write the memory entries to their tiers, most
        recently used first (the ones most likely to be asked for again; a
        key already on disk is only touched), wait for the writes and close
        the tiers, all within about `timeout` seconds. Run on the generation
        thread once it stops serving. Returns the entries handed over; logs
        errors, never raises."""
        deadline = time.monotonic() + max(0.0, timeout)
        self._spill()
        with self._lock:
            order = sorted(self._entries.items(), key=lambda em: -em[0].last_used)
            jobs = [(self._disks[m], list(e.key), e.cache, e.kind, e.nbytes)
                    for e, m in order if m in self._disks]
            tiers = list(dict.fromkeys(self._disks.values()))
        saved = 0
        for tier, key, cache, kind, nbytes in jobs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                # The tier drops a put that would overfill its queue: let the
                # writer catch up first.
                queued = tier.snapshot()["queued_bytes"]
                if queued and queued + nbytes > tier.max_queue_bytes:
                    tier.flush(left)
                tier.put(key, cache, kind)
                saved += 1
            except Exception:
                logging.exception("Prompt cache: could not save an entry to disk")
        for tier in tiers:
            try:
                if not tier.flush(max(0.0, deadline - time.monotonic())):
                    logging.warning("Prompt cache on disk: shutdown timeout reached "
                                    "with writes still queued; they are dropped")
                # Stops the writer (not waiting for a write past the
                # deadline), saves the last uses, closes the index.
                tier.close(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                logging.exception("Prompt cache: could not close the disk tier")
        if jobs:
            logging.info(f"Prompt cache: {saved} of {len(jobs)} entries handed to the "
                         "disk tier at shutdown")
        return saved

    def _disk_snapshot(self) -> Optional[Dict[str, Any]]:
        """The tiers' figures, summed (one tier per model); None without."""
        snaps = [t.snapshot() for t in dict.fromkeys(self._disks.values())]
        if not snaps:
            return None
        out: Dict[str, Any] = {
            "enabled": any(s["enabled"] for s in snaps),
            "directories": [s["directory"] for s in snaps],
            "full": any(s["full"] for s in snaps),
        }
        for k, v in snaps[0].items():
            if isinstance(v, int) and not isinstance(v, bool):
                out[k] = sum(s[k] for s in snaps)
        out["bytes_per_token"] = _per_token(out["bytes"], out["tokens"])
        out["spilled"] = self.stats["spilled"]  # entries handed over on eviction
        return out

    # -- reporting --

    def entries(self) -> List[Entry]:
        with self._lock:
            return list(self._entries)

    def recount(self) -> Dict[str, int]:
        """The tree's size by a full walk (for tests: `index_bytes` and the
        leaf count are kept up to date without one)."""
        with self._lock:
            nodes = tokens = 0
            stack = list(self._roots.values())
            while stack:
                n = stack.pop()
                nodes += 1
                tokens += len(n.edge)
                stack.extend(n.children.values())
            return {
                "nodes": nodes,
                "edge_tokens": tokens,
                "index_bytes": (nodes * NODE_BYTES + tokens * _TOKEN_BYTES
                                + len(self._entries) * ENTRY_BYTES),
                "leaves": sum(e.node.below == 0 for e in self._entries),
            }

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            hits = {k[len("fetch_"):]: v for k, v in self.stats.items()
                    if k.startswith("fetch_") and k != "fetch_miss"}
            tokens = sum(e.ntokens for e in self._entries)
            memory_hits = sum(v for k, v in hits.items() if k != "disk")
            return {
                "entries": len(self._entries),
                "sequences": self._leaves,
                "bytes": self.nbytes,
                "kv_bytes": self.kv_bytes,
                "index_bytes": self.index_bytes,
                "budget_bytes": self.max_bytes,
                "bits": self.bits,
                "max_sequences": self.max_sequences,
                "ttl_seconds": self.ttl,
                "cached_tokens": tokens,
                "hits": hits,
                "misses": self.stats["fetch_miss"],
                "evictions": self.stats["evicted"],
                "evicted_bytes": self.stats["evicted_bytes"],
                "expired": self.stats["expired"],
                "prompt_tokens_saved": self.stats["tokens_saved"],
                # By tier. Memory: what --prompt-cache-bytes limits, per
                # token of the entries' keys (each entry holds its own copy).
                "memory": {"entries": len(self._entries), "bytes": self.nbytes,
                           "tokens": tokens, "hits": memory_hits,
                           "bytes_per_token": _per_token(self.nbytes, tokens)},
                "disk": self._disk_snapshot(),  # None without --prompt-cache-dir
                "hits_by_tier": {"memory": memory_hits, "disk": hits.get("disk", 0)},
            }
