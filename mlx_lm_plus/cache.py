"""PromptStore: a token trie of prompt caches, with a byte budget.

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

Limits, enforced on every insert: `max_bytes` (the sum of the entries'
nbytes) and `max_sequences`, the number of distinct sequences: leaf entries
only. A conversation's chain of checkpoints counts once, so upstream's default
of 10 keeps 10 conversations instead of three requests' worth of entries.
Idle entries expire after `ttl` seconds.

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
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import (
    ChunkedKVCache,
    KVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)


@dataclass(eq=False)
class Entry:
    key: Tuple[int, ...]
    cache: List[Any]
    nbytes: int
    kind: str  # "checkpoint", "system", "prompt", "generated"
    created: float
    last_used: float
    # last_used before the latest fetch: restored when that fetch turns out
    # to have been a plain continuation (see _supersede_ancestors).
    prev_used: float = 0.0
    hits: int = 0


@dataclass(eq=False)
class _Node:
    parent: Optional["_Node"]
    token: Optional[int]
    depth: int
    children: Dict[int, "_Node"] = field(default_factory=dict)
    entry: Optional[Entry] = None
    # Entries stored strictly below this node: an entry is a leaf (a
    # distinct sequence) when its node has none.
    below: int = 0


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
        self._entries: Dict[Entry, Tuple[Any, _Node]] = {}
        self.nbytes = 0
        self.stats = Counter()
        # The generation thread mutates; HTTP handlers read snapshots.
        self._lock = threading.RLock()

    def __len__(self):
        return len(self._entries)

    def now(self) -> float:
        """The store's clock (entries' created/last_used are on it)."""
        return self._clock()

    # -- lookup --

    def fetch(self, model: Any, key: List[int]) -> Fetched:
        with self._lock:
            self._expire()
            found = self._find(model, key)
            self.stats[f"fetch_{found.kind}"] += 1
            if found.kind != "miss":
                self.stats["tokens_saved"] += found.cached
            return found

    def _find(self, model, key) -> Fetched:
        node = self._roots.get(model)
        if node is None or not key:
            return Fetched(None, 0, "miss")
        # Walk down the key, remembering the entries on the way.
        on_path: List[_Node] = []
        for token in key:
            child = node.children.get(token)
            if child is None:
                break
            node = child
            if node.entry is not None:
                on_path.append(node)
        common = node.depth  # tokens shared with the trie

        # Entries that leave at least one token to compute.
        usable = [n for n in on_path if n.depth < len(key)]
        best_prefix = usable[-1] if usable else None
        exact = on_path[-1] if on_path and on_path[-1].depth == len(key) else None

        # A longer/sibling/exact entry trimmed to the common prefix (at most
        # len(key) - 1), when that beats the best prefix entry.
        target = min(common, len(key) - 1)
        if target > (best_prefix.depth if best_prefix else 0):
            donor = exact or self._nearest_entry(node)
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
        """How many leading tokens of `key` the trie holds (any entry's path)."""
        with self._lock:
            node, depth = self._roots.get(model), 0
            while node is not None and depth < len(key):
                node = node.children.get(key[depth])
                depth += node is not None
            return depth

    @staticmethod
    def _nearest_entry(node: _Node) -> Optional[_Node]:
        """The shallowest entry in the subtree of `node` (breadth first)."""
        level = [node]
        while level:
            for n in level:
                if n.entry is not None:
                    return n
            level = [c for n in level for c in n.children.values()]
        return None

    def _touch(self, entry: Entry):
        entry.prev_used, entry.last_used = entry.last_used, self._clock()
        entry.hits += 1

    # -- insert --

    def insert(self, model: Any, key: List[int], cache: List[Any], kind: str = "prompt"):
        """Store `cache` (covering exactly `key`); the store takes ownership."""
        if not key:
            return
        cache = compact(cache)
        nbytes = cache_nbytes(cache)
        with self._lock:
            node = self._roots.setdefault(model, _Node(None, None, 0))
            for token in key:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node(node, token, node.depth + 1)
                node = child
            if node.entry is not None:
                # Replaced in place: the node stays in the trie.
                self._remove(node.entry, prune=False)
            now = self._clock()
            entry = Entry(tuple(key), cache, nbytes, kind, now, now, now)
            node.entry = entry
            self._count_below(node, +1)
            self._supersede_ancestors(node)
            self._entries[entry] = (model, node)
            self.nbytes += nbytes
            self.stats[f"insert_{kind}"] += 1
            if can_trim_prompt_cache(cache):
                self._drop_redundant_prefixes(node)
            self._enforce_limits(keep=entry)

    @staticmethod
    def _supersede_ancestors(node: _Node):
        """A new entry continues the path of the entries above it.

        The fetch that led here renewed the entry it resumed from; but when
        the path from that entry down to the new one does not branch, the new
        entry serves everything it did and more (its next turn resumes from
        the new one), so it goes back to its recency before that fetch and
        ages out first. Where the path branches on the way, the entries
        above the branch point are shared by both branches and keep it.
        """
        n = node.parent
        while n is not None and len(n.children) == 1:
            if n.entry is not None:
                n.entry.last_used = n.entry.prev_used
            n = n.parent

    def _drop_redundant_prefixes(self, node: _Node):
        n = node.parent
        while n is not None:
            if n.entry is not None and can_trim_prompt_cache(n.entry.cache):
                self._remove(n.entry, reason="redundant")
            n = n.parent

    # -- eviction --

    def _expire(self):
        if self.ttl is None:
            return
        deadline = self._clock() - self.ttl
        for entry in [e for e in self._entries if e.last_used < deadline]:
            self._remove(entry, reason="expired")

    @staticmethod
    def _count_below(node: _Node, delta: int):
        n = node.parent
        while n is not None:
            n.below += delta
            n = n.parent

    @staticmethod
    def _is_leaf(node: _Node) -> bool:
        return node.below == 0

    def _victim(self, keep: Entry, leaves_only: bool) -> Optional[Entry]:
        candidates = [
            e for e, (_, node) in self._entries.items()
            if e is not keep and (not leaves_only or self._is_leaf(node))
        ]
        return min(candidates, key=lambda e: e.last_used, default=None)

    def leaf_count(self) -> int:
        return sum(self._is_leaf(node) for _, node in self._entries.values())

    def _enforce_limits(self, keep: Entry):
        self._expire()
        while self.max_sequences is not None and self.leaf_count() > self.max_sequences:
            victim = self._victim(keep, leaves_only=True) or self._victim(keep, False)
            if victim is None:
                break
            self._remove(victim, reason="evicted")
        self.trim_to(self.max_bytes, keep=keep)

    def trim_to(self, n_bytes: int, keep: Optional[Entry] = None):
        """Evict until the entries hold at most `n_bytes`."""
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
        model, node = self._entries.pop(entry)
        node.entry = None
        self._count_below(node, -1)
        self.nbytes -= entry.nbytes
        if reason:
            self.stats[reason] += 1
            self.stats[f"{reason}_bytes"] += entry.nbytes
        if not prune:
            return
        # Prune the branch up to the nearest node still in use.
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.token]
            node = node.parent
        if node.parent is None and not node.children and node.entry is None:
            self._roots.pop(model, None)

    def clear(self):
        with self._lock:
            for entry in list(self._entries):
                self._remove(entry, reason="cleared")

    # -- reporting --

    def entries(self) -> List[Entry]:
        with self._lock:
            return list(self._entries)

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            hits = {k[len("fetch_"):]: v for k, v in self.stats.items()
                    if k.startswith("fetch_") and k != "fetch_miss"}
            return {
                "entries": len(self._entries),
                "sequences": self.leaf_count(),
                "bytes": self.nbytes,
                "budget_bytes": self.max_bytes,
                "max_sequences": self.max_sequences,
                "ttl_seconds": self.ttl,
                "cached_tokens": sum(len(e.key) for e in self._entries),
                "hits": hits,
                "misses": self.stats["fetch_miss"],
                "evictions": self.stats["evicted"],
                "evicted_bytes": self.stats["evicted_bytes"],
                "expired": self.stats["expired"],
                "prompt_tokens_saved": self.stats["tokens_saved"],
            }
