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

Generation never mutates a stored entry: `fetch` hands out a deep copy.
Entries are stored compacted to their real length (KV buffers are allocated
in steps of 256 tokens).

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
"""

import copy
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


@dataclass
class Fetched:
    cache: Optional[List[Any]]  # a private copy, or None (miss)
    cached: int  # tokens of the key it covers
    kind: str  # "exact", "prefix", "checkpoint", "trimmed", "miss"


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


def cache_nbytes(cache: List[Any]) -> int:
    return sum(c.nbytes for c in cache)


class PromptStore:
    def __init__(self, max_bytes: int, max_sequences: Optional[int] = None,
                 ttl: Optional[float] = None, clock=time.monotonic):
        self.max_bytes = max_bytes
        self.max_sequences = max_sequences
        self.ttl = ttl
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
        with self._lock:
            self._expire()
            if self.disabled():
                found = Fetched(None, 0, "miss")
            else:
                found = self._find(model, key)
            self.stats[f"fetch_{found.kind}"] += 1
            if found.kind != "miss":
                self.stats["tokens_saved"] += found.cached
            return found

    def _descend(self, model, key: array):
        """Follow `key` from the model's root: (the deepest node whose whole
        edge it matches, the tokens matched, the nodes with entries on the
        way, the child whose edge it leaves part way or None)."""
        node, pos, on_path = self._roots.get(model), 0, []
        if node is None:
            return None, 0, on_path, None
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

    def _find(self, model, key) -> Fetched:
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
                cache = copy.deepcopy(donor.entry.cache)
                trim_prompt_cache(cache, donor.depth - target)
                # A hit, but not a reason to keep the donor: the request's own
                # entry will hold the shared part. Renewing it would keep
                # stale branches (a reply the next turn re-renders
                # differently) alive at the expense of live conversations.
                donor.entry.hits += 1
                kind = "exact" if donor is exact else "trimmed"
                return Fetched(cache, target, kind)

        if best_prefix is not None:
            entry = best_prefix.entry
            self._touch(entry)
            kind = "checkpoint" if entry.kind in ("checkpoint", "system") else "prefix"
            return Fetched(copy.deepcopy(entry.cache), best_prefix.depth, kind)
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

    def insert(self, model: Any, key: List[int], cache: List[Any], kind: str = "prompt"):
        """Store `cache` (covering exactly `key`); the store takes ownership."""
        if not key:
            return
        if self.disabled():
            with self._lock:
                self.stats["not_stored"] += 1
            return
        tokens = array(_TOKENS, key)
        images = len({t for t in tokens if t < 0}) if min(tokens) < 0 else 0
        cache = compact(cache)
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
            self.stats[f"insert_{kind}"] += 1
            if can_trim_prompt_cache(cache):
                self._drop_redundant_prefixes(node)
            self._enforce_limits(keep=entry)

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
        self.trim_to(self.max_bytes, keep=keep)

    def trim_to(self, n_bytes: int, keep: Optional[Entry] = None):
        """Evict until the entries and the index hold at most `n_bytes`."""
        with self._lock:
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
        with self._lock:
            for entry in list(self._entries):
                self._remove(entry, reason="cleared")

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
            return {
                "entries": len(self._entries),
                "sequences": self._leaves,
                "bytes": self.nbytes,
                "kv_bytes": self.kv_bytes,
                "index_bytes": self.index_bytes,
                "budget_bytes": self.max_bytes,
                "max_sequences": self.max_sequences,
                "ttl_seconds": self.ttl,
                "cached_tokens": sum(e.ntokens for e in self._entries),
                "hits": hits,
                "misses": self.stats["fetch_miss"],
                "evictions": self.stats["evicted"],
                "evicted_bytes": self.stats["evicted_bytes"],
                "expired": self.stats["expired"],
                "prompt_tokens_saved": self.stats["tokens_saved"],
            }
