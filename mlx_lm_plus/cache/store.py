"""PromptStore: a radix tree of prompt caches, with a byte budget.

One data structure (after SGLang's radix_cache.py): its token trie is
radix.py's (shared with the disk tier), and what a stored layer cache is and
how it is cut, shared and quantized is layers.py's. Entries are keyed per
model by a cache key (token ids; image requests put image ids in place of
image tokens). `fetch` finds the best usable entry for a key:

  exact      an entry with the whole key (trimmed by one token, since at least
             one token must be computed; non-trimmable: the next shorter one);
  prefix     the longest entry whose key is a prefix of the key
             ("checkpoint" when that entry is a message-boundary checkpoint);
  trimmed    a longer or sibling entry sharing a longer common prefix, cut
             down to it; only when every layer of it can be trimmed.

Generation never mutates a stored entry: `fetch` hands out a private copy
(new arrays, dequantized under quantized storage).

The tree is compressed: each node's edge holds a run of token ids (an int64
array: image ids are negative 63-bit fingerprints), a node exists only where
an entry ends or keys diverge, and an entry holds no copy of its key (its
node's path spells it). So the index costs about 8 bytes per distinct cached
token plus a fixed overhead per node and per entry, all of it counted.

Shared attention KV, state-only checkpoints (after SGLang's radix cache and
its Mamba radix cache): the edges own their tokens' attention KV (Spans, one
per run of tokens inserted or cut apart; every edge in the tree is on the
path of some entry, so every edge has its KV). An entry holds only what
cannot be shared: a SharedKV shell per plain KV layer (its class and
attributes) and its other layers whole: recurrent states (ArraysCache),
sliding windows, chunked KV. So a hybrid model's message-boundary
checkpoint costs its recurrent state, not another copy of the history; a
pure attention model's entries cost their new tokens only, and branches
share their common prefix; a pure recurrent model's entries are states.
`fetch` joins the spans along the key into new arrays. An edge's KV is freed
when the last entry below it goes (the branch is pruned). Every cache
inserted for a model must have the same layer kinds in the same places (its
`layout`); a plain KV layer must hold exactly the key's tokens. Under
--kv-bits (share_kv=False) a model's caches have two layouts (KVCache below
--quantized-kv-start, QuantizedKVCache above), so entries hold every layer
whole, as before the tree held KV.

Limits, enforced on every insert: `max_bytes` (`nbytes`: the spans' and the
entries' own bytes plus the index's bytes, `kv_bytes` + `index_bytes`) and
`max_sequences`, the number of distinct sequences: leaf entries only. A
conversation's chain of checkpoints counts once, so upstream's default of 10
keeps 10 conversations instead of three requests' worth of entries. Idle
entries expire after `ttl` seconds. A limit of 0 (no bytes or no sequences)
means no prompt cache: nothing is stored and every fetch misses.

Eviction policy: expired entries first; then, for the byte budget, the
least recently used entry, inner or leaf. Evicting an inner checkpoint frees
its state; evicting a leaf also frees the KV of the edges only it used. A
conversation's old checkpoints, which nothing has fetched since, go before
the latest entries of other conversations; a shared system prompt stays as
long as new conversations keep fetching it. (Evicting leaves first, as a
radix tree of shared pages does, kept every conversation's old checkpoints
and threw away their latest entries: with six interleaved conversations in
4 MB, 6.2 prompt tokens recomputed per novel one instead of 1.0.) For
`max_sequences`, which counts leaves, the least recently used leaf goes. On
models whose caches are all trimmable, a new entry makes the entries on its
own path redundant (the longer one can be cut to any of them), so they
are dropped. A "generated" leaf that a new entry leaves inside its reply
(the template re-rendered it, or it was regenerated) is dropped too: nothing
will continue its tokens (_drop_abandoned_replies).

Quantized storage (--prompt-cache-bits 4 or 8): the spans then hold each
plain KV layer's keys and values `mx.quantize`d (group size --kv-group-size;
other layers as they are), those bytes count against the budget, and
fetch dequantizes into a layer of the class it was inserted as, so the
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

import logging
import sys
import threading
import time
from array import array
from collections import Counter
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx

from mlx_lm_plus.cache.layers import (
    SharedKV,
    Span,
    StoredKV,
    cache_nbytes,
    compact,
    cut_tokens,
    extra_attributes,
    first_tokens,
    is_plain_kv,
    join_tokens,
    make_span,
    own_buffers,
    quantizable,
    quantize_for_store,
    restore_from_store,
    split_span,
    tensors_of,
    trims_to_any_prefix,
)
from mlx_lm_plus.cache.radix import TOKEN_BYTES, TOKENS, Node, descend, matching


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
    # Every layer can be cut to a prefix (plain KV and trimmable held layers).
    trimmable: bool = False
    # "generated" entries: where the reply starts in the key (0: unknown).
    reply_start: int = 0
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


class _Node(Node):
    """A node of the memory tier's tree: also its edge's KV and the number
    of entries below it."""

    __slots__ = ("below", "kv")
    entry: Optional[Entry]

    def __init__(self, parent: Optional["_Node"], edge: array, depth: int):
        super().__init__(parent, edge, depth)
        # The attention KV of the edge's tokens, as Spans in order (their
        # tokens add up to len(edge)); the root has none.
        self.kv: List[Span] = []
        # Entries stored strictly below this node: an entry is a leaf (a
        # distinct sequence) when its node has none.
        self.below = 0


def _path_spans(node: _Node) -> List[Tuple["Span", int]]:
    """(span, its tokens) of the KV along the path from the root to `node`:
    all of an entry's shared KV, in order."""
    path = []
    while node is not None:
        path.append(node.kv)
        node = node.parent
    return [(span, span.ntokens) for kv in reversed(path) for span in kv]


def _measure() -> Tuple[int, int]:
    """Fixed bytes per node and per entry, beside the edges' token buffers:
    the objects the store creates for them, measured once."""
    node = _Node(None, array(TOKENS), 0)
    token = 1 << 40  # a child's key in its parent's children
    node_bytes = (sys.getsizeof(node) + sys.getsizeof(node.edge)  # its header
                  + sys.getsizeof({token: node})  # a children dict (to 5)
                  + sys.getsizeof(token)
                  + sys.getsizeof([None]))  # its list of spans (usually one)
    entry = Entry([], 1 << 40, "prompt", 1.5, 2.5, 3.5, 0, 1 << 40, 0)
    # Its slot in the store's dict of entries, averaged over a large one.
    table = dict.fromkeys(object() for _ in range(1024))
    slot = (sys.getsizeof(table) - sys.getsizeof({})) // len(table)
    entry_bytes = (sys.getsizeof(entry) + slot
                   + 3 * sys.getsizeof(1.5)  # created, last_used, prev_used
                   + 3 * sys.getsizeof(1 << 40))  # nbytes, ntokens, reply_start
    return node_bytes, entry_bytes


NODE_BYTES, ENTRY_BYTES = _measure()


@dataclass
class Fetched:
    cache: Optional[List[Any]]  # a private copy, or None (miss)
    cached: int  # tokens of the key it covers
    kind: str  # "exact", "prefix", "checkpoint", "trimmed", "disk", "miss"


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



# A past turn's prompt entry is dropped once its conversation went on only
# when the state above it is at most this many tokens back (_drop_passed_prompt).
PASSED_PROMPT_MAX_GAP = 256
# Seconds a disk entry read ahead for a request waits for its fetch (a
# request that went away, or waited longer, lets it go: nbytes counts it).
READ_AHEAD_SECONDS = 60.0


@dataclass
class ReadAhead:
    """A disk entry read off the generation thread (PromptStore.read_ahead)."""

    model: Any
    key: List[int]  # the request's key it was read for
    covered: int  # tokens of `key` it serves
    handle: Any  # the tier's DiskEntry
    cache: Optional[List[Any]]  # as the tier's load returns it; None while read
    nbytes: int
    read_at: float
    loaded: Future = field(default_factory=Future)  # (done when its read ends)


class PromptStore:
    def __init__(self, max_bytes: int, max_sequences: Optional[int] = None,
                 ttl: Optional[float] = None, clock=time.monotonic,
                 bits: Optional[int] = None, group_size: int = 64,
                 share_kv: bool = True):
        self.max_bytes = max_bytes
        # False (--kv-bits): entries hold their plain KV layers whole, as
        # their QuantizedKVCache ones (a model's caches are then KVCache
        # below --quantized-kv-start and QuantizedKVCache above: two layouts
        # that can't share spans).
        self.share_kv = share_kv
        self.max_sequences = max_sequences
        self.ttl = ttl
        # Quantized storage of plain KV layers (None: stored as they are).
        self.bits, self.group_size = bits, group_size
        if bits is not None:  # a bad combination fails here, not on an insert
            mx.quantize(mx.zeros((1, group_size)), group_size, bits)
        self._clock = clock
        self._roots: Dict[Any, _Node] = {}
        # model -> where its entries' shared layers are and whether each is
        # quantized: every span of its tree has one (keys, values) per item.
        self._layouts: Dict[Any, Tuple[Tuple[int, Optional[int]], ...]] = {}
        self._entries: Dict[Entry, Any] = {}  # entry -> model
        # Kept up to date on every change (never a walk): the entries' cache
        # bytes, the index's bytes (nodes, edges, entries' own objects), and
        # the entries that are leaves.
        self.kv_bytes = 0
        self.index_bytes = 0
        self.tree_tokens = 0  # distinct tokens: the edges' (their KV is held once)
        self._leaves = 0
        # Arrays made under the lock (spans cut on insert) and evaluated
        # once it is released.
        self._fresh: List[mx.array] = []
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
        # (model, file name) -> ReadAhead: disk entries read off the
        # generation thread for the fetch that follows (read_ahead), counted
        # in nbytes while held.
        self._read_ahead: Dict[Tuple[Any, str], ReadAhead] = {}
        self.read_ahead_bytes = 0
        self._no_spill = False  # set by trim_to(to_disk=False) while it runs
        # Under mx.distributed each rank has a store of its share of every
        # entry, and all must decide alike: `group_max(values)` is each
        # value's largest over the ranks (a collective, so never called
        # under the lock; set by the engine). One process: the values.
        self.group_max: Callable[[List[int]], List[int]] = lambda values: values

    def __len__(self):
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """What `max_bytes` limits: the entries' caches, the index, and disk
        entries read ahead for a request about to fetch them."""
        return self.kv_bytes + self.index_bytes + self.read_ahead_bytes

    def now(self) -> float:
        """The store's clock (entries' created/last_used are on it)."""
        return self._clock()

    def set_clock(self, clock: Callable[[], float]):
        """Under mx.distributed: a clock every rank reads alike."""
        self._clock = clock

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
        if self._read_ahead:
            with self._lock:  # (read ahead for nothing: memory or another entry served)
                self._drop_read_ahead(lambda r: r.model == model and r.key == key
                                      and r.cache is not None)
                self._drop_stale_read_ahead()
        with self._lock:
            self.stats[f"fetch_{found.kind}"] += 1
            if found.kind != "miss":
                self.stats["tokens_saved"] += found.cached
        return found

    def _from_disk(self, model, tier, covered: int, handle) -> Optional[Fetched]:
        """The tier's entry read back and cut to `covered` tokens (None: it
        could not be read); a copy of the whole entry goes back into memory
        under its own key, so the next turn hits memory. Read ahead for this
        request (read_ahead), it is not read here."""
        with self._lock:
            ahead = self._read_ahead.get((model, handle.name))
            if ahead is not None and ahead.cache is not None:
                self._drop_read_ahead(lambda r: r is ahead)
            else:
                ahead = None  # (none, or still being read: read here)
        if ahead is not None and ahead.handle.ntokens == handle.ntokens:
            stored = ahead.cache
            tier.used(ahead.handle)  # (its read counted nothing)
            with self._lock:
                self.stats["read_ahead"] += 1
        else:  # as the store held it (StoredKV layers too)
            stored = tier.load(handle)
        if stored is None:
            return None
        if covered < handle.ntokens and not trims_to_any_prefix(stored):
            # (A row written before the tier knew chunked layers past their
            # chunk can't be trimmed: its flag said they could. Flagged now,
            # not offered trimmed again; still exact for its own key.)
            tier.not_trimmable(handle)
            return None
        try:
            cache = restore_from_store(stored, handle.ntokens - covered)
            key = tier.key_of(handle)  # None: replaced or evicted since `find`
            if key is not None:
                self.insert(model, key, stored, handle.kind, from_disk=True)
        except Exception:  # an entry that won't restore is a miss, not a failure
            logging.exception("Prompt cache: could not use an entry read from disk")
            return None
        return Fetched(cache, covered, "disk")

    def _descend(self, model, key: array):
        """descend() from the model's root (None when it has no tree)."""
        root = self._roots.get(model)
        if root is None:
            return None, 0, [], None
        return descend(root, key)

    def read_ahead(self, model, key) -> Union[bool, Future]:
        """Read the model's disk entry for `key` on the caller's thread (an
        HTTP handler's executor, once the request is planned) when it covers
        more of `key` than memory does: the generation thread's fetch then
        takes it (_from_disk) instead of reading the file while running
        streams wait. Held entries count in `nbytes`, together at most a
        quarter of the budget; one not fetched within READ_AHEAD_SECONDS of
        its read is let go (one entry up to half the budget is read when
        none is held). Returns True when it read one; when another
        caller is reading that entry, the Future its read ends (the caller
        waits for it rather than leave the read to the generation thread);
        else False."""
        with self._lock:
            self._drop_stale_read_ahead()
            tier = None if self.disabled() else self._disks.get(model)
        if tier is None or not key:
            return False
        on_disk = tier.find(key, count=False)
        if on_disk is None:
            return False
        covered, handle = on_disk
        name = (model, handle.name)
        with self._lock:
            # (One entry up to half the budget when none is held: its read
            # would otherwise stall every stream on the generation thread.
            # Held, it evicts from memory what its fetch would; bounded, for
            # a client that may go away before its fetch.)
            room = (self.max_bytes is None
                    or self.read_ahead_bytes + handle.nbytes <= self.max_bytes // 4
                    or (not self.read_ahead_bytes and handle.nbytes <= self.max_bytes // 2))
            held = self._read_ahead.get(name)
            if held is not None:
                return held.loaded if held.cache is None else False
            if not room or self._find(model, key, floor=covered, probe=True).kind != "miss":
                return False
            # Its place and bytes (the file's size) are taken before the read:
            # handlers reading at once don't read it twice, nor past the cap.
            ahead = self._read_ahead[name] = ReadAhead(
                model, list(key), covered, handle, None, handle.nbytes, self._clock())
            self.read_ahead_bytes += ahead.nbytes
        cache = None
        try:
            # Its arrays evaluated on this thread; a hit once a fetch takes it.
            cache = tier.load(handle, count=False)
        finally:
            with self._lock:
                if self._read_ahead.get(name) is ahead:  # (not dropped meanwhile)
                    self.read_ahead_bytes -= ahead.nbytes
                    if cache is None:
                        del self._read_ahead[name]
                    else:
                        ahead.cache, ahead.nbytes = cache, cache_nbytes(cache)
                        ahead.read_at = self._clock()
                        self.read_ahead_bytes += ahead.nbytes
                else:
                    cache = None  # (DELETE /v1/cache, or stale: let go)
            ahead.loaded.set_result(cache is not None)
        return cache is not None

    def drop_stale_read_ahead(self):
        """Let go of disk entries read ahead that nothing fetched in time (a
        client that went away): the generation thread's housekeeping."""
        if self._read_ahead:
            with self._lock:
                self._drop_stale_read_ahead()

    def _drop_stale_read_ahead(self):
        now = self._clock()
        self._drop_read_ahead(lambda r: now - r.read_at > READ_AHEAD_SECONDS)

    def _drop_read_ahead(self, which: Callable[["ReadAhead"], bool]):
        for name, ahead in list(self._read_ahead.items()):
            if which(ahead):
                del self._read_ahead[name]
                self.read_ahead_bytes -= ahead.nbytes

    def covers(self, model, key: List[int]) -> int:
        """How many leading tokens of `key` a fetch would serve now from
        memory, or from a disk entry read ahead for it (nothing touched,
        nothing copied)."""
        with self._lock:
            covered = self._find(model, key, probe=True).cached
            for ahead in self._read_ahead.values():
                if ahead.cache is not None and ahead.model == model and ahead.key == key:
                    covered = max(covered, ahead.covered)
            return covered

    def _find(self, model, key, floor: int = 0, probe: bool = False) -> Fetched:
        """Memory's best entry for `key`; a miss (nothing touched or copied)
        when it would cover fewer than `floor` tokens. probe: only how many
        tokens it covers and how (no cache made, nothing touched)."""
        if not key:
            return Fetched(None, 0, "miss")
        tokens = array(TOKENS, key)
        node, common, on_path, partial = self._descend(model, tokens)
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
            if donor is not None and donor.entry.trimmable:
                if target < floor:
                    return Fetched(None, 0, "miss")
                if probe:
                    return Fetched(None, target, "trimmed")
                cache = self._materialize(model, tokens, target, donor.entry,
                                          trim=donor.depth - target)
                # A hit, but not a reason to keep the donor: the request's own
                # entry will hold the shared part. Renewing it would keep
                # stale branches (a reply the next turn re-renders
                # differently) alive at the expense of live conversations.
                donor.entry.hits += 1
                kind = "exact" if donor is exact else "trimmed"
                return Fetched(cache, target, kind)

        if best_prefix is not None and best_prefix.depth >= floor:
            entry = best_prefix.entry
            if probe:
                return Fetched(None, best_prefix.depth, "prefix")
            self._touch(entry)
            kind = "checkpoint" if entry.kind in ("checkpoint", "system") else "prefix"
            return Fetched(self._materialize(model, tokens, best_prefix.depth, entry),
                           best_prefix.depth, kind)
        return Fetched(None, 0, "miss")

    def _spans_along(self, model, key: array, n: int) -> List[Tuple[Span, int]]:
        """(span, tokens of it used) for the first n tokens of `key`, which
        the model's tree must hold."""
        node, pos, spans = self._roots[model], 0, []
        while pos < n:
            node = node.children[key[pos]]
            for span in node.kv:
                if pos >= n:
                    break
                take = min(span.ntokens, n - pos)
                spans.append((span, take))
                pos += take
        return spans

    def _layers(self, spans, n: int, entry: Entry, trim: int, whole: bool):
        """The entry's layers holding n tokens: shared layers joined from
        `spans` ((span, tokens of it used) along the path; whole: as an
        unshared store held them, for the disk tier), its own layers deep
        copied and `trim` tokens shorter."""
        out, j = [], 0
        for layer in entry.cache:
            if isinstance(layer, SharedKV):
                k, v = (join_tokens([s.layers[j][i] if take == s.ntokens
                                     else first_tokens(s.layers[j][i], take)
                                     for s, take in spans])
                        for i in (0, 1))
                j += 1
                out.append(layer.stored(k, v, n) if whole else layer.restore(k, v, n))
            elif whole:
                out.append(layer)
            else:  # a copy, `trim` shorter (StoredKV dequantized)
                out.extend(restore_from_store([layer], trim))
        return out

    def _materialize(self, model, key: array, n: int, entry: Entry, trim: int = 0):
        """A private copy of `entry`'s cache holding the first n tokens of
        `key` (new arrays: nothing the store holds is handed out)."""
        spans = self._spans_along(model, key, n) if self._layouts[model] else []
        return self._layers(spans, n, entry, trim, whole=False)

    def _whole(self, entry: Entry) -> List[Any]:
        """The entry as one cache in stored form (StoredKV layers under
        quantized storage; its own layers not copied): what the disk tier
        writes. Lazy: the joins run when the tier evaluates them."""
        return self._layers(_path_spans(entry.node), entry.ntokens, entry, 0, whole=True)

    def stored_cache(self, entry: Entry) -> Optional[List[Any]]:
        """The entry's cache in stored form, evaluated (for tests and tools);
        None once it has left the store."""
        with self._lock:
            model = self._entries.get(entry)
            if model is None:
                return None
            cache = self._whole(entry)
        mx.eval([c.state for c in cache])
        return cache

    def divergence(self, model: Any, key: List[int]) -> Tuple[int, bool]:
        """(how many leading tokens of `key` the tree holds on any entry's
        path, whether a checkpoint there is worth storing): not
        where `key` leaves only a reply it abandons (a "generated" leaf left
        inside its reply, which _drop_abandoned_replies drops once this
        request stores past it). Its state would then sit on a path that
        doesn't branch: a chat client re-rendering the reply its own way (a
        reasoning block dropped) does so again next time, and follows this
        request's path."""
        with self._lock:
            if not key:
                return 0, False
            _, depth, _, left = self._descend(model, array(TOKENS, key))
            abandoned = (left is not None and not left.children and left.entry is not None
                         and left.entry.kind == "generated"
                         and 0 < left.entry.reply_start <= depth)
            return depth, not abandoned

    def departure(self, model: Any, key: List[int], n: int = 16) -> Tuple[int, List[int]]:
        """(how many leading tokens of `key` the tree holds, up to `n` tokens
        a stored sequence has there instead of key's next ones): where a
        prompt leaves what is stored, for explaining a miss. No tokens: key
        only extends what is stored (or ends inside it)."""
        with self._lock:
            node, depth, _, left = self._descend(model, array(TOKENS, key))
            if node is None or depth >= len(key):
                return depth, []
            if left is not None:
                follow = list(left.edge[depth - (left.depth - len(left.edge)):][:n])
                node = left
            else:
                follow = []
            # (On down the most recently added branch: the last child.)
            while len(follow) < n and node.children:
                node = list(node.children.values())[-1]
                follow += list(node.edge[: n - len(follow)])
            return depth, follow

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
               from_disk: bool = False, reply_start: int = 0):
        """Store `cache` (covering exactly `key`); the store takes ownership.
        `from_disk`: an entry read back from the disk tier (counted apart).
        `reply_start`: for a "generated" entry, where the reply starts in the
        key (see _drop_abandoned_replies)."""
        if not key:
            return
        if self.disabled():
            with self._lock:
                self.stats["not_stored"] += 1
            return
        tokens = array(TOKENS, key)
        images = len({t for t in tokens if t < 0}) if min(tokens) < 0 else 0
        copied_from = []  # (held until the copies are evaluated: see own_buffers)
        layers, sources, layout = self._take(cache, len(tokens), copied_from, own=from_disk)
        with self._lock:  # (not this model's layer kinds: no server makes such a cache)
            foreign = layers is not None and self._layouts.get(model, layout) != layout
        trimmable = layers is not None and trims_to_any_prefix(layers)
        # (A pipeline rank's layers are of its own kinds: stored, and
        # trimmable, only where every rank's are.)
        untaken, untrimmable = self.group_max([layers is None or foreign, not trimmable])
        if untaken:
            with self._lock:
                self.stats["not_stored"] += 1
            return
        trimmable = not untrimmable
        nbytes = cache_nbytes(layers)
        with self._lock:
            self._layouts.setdefault(model, layout)
            # The new leaf's span (where the key leaves the tree), made before
            # the tree changes: an error here leaves the tree as it was.
            start = self._descend(model, tokens)[1]
            leaf = [(self._span_part(k, start, len(tokens), q, from_disk),
                     self._span_part(v, start, len(tokens), q, from_disk))
                    for k, v, q in sources] if start < len(tokens) else None
            node = self._node_for(model, tokens)
            if not node.kv and node.parent is not None:  # the new leaf
                self._add_span(node, leaf, len(node.edge))
            if node.entry is not None:
                # Replaced in place: the node stays in the tree.
                self._remove(node.entry, prune=False)
            now = self._clock()
            entry = Entry(layers, nbytes, kind, now, now, now, ntokens=len(tokens),
                          images=images, trimmable=trimmable, reply_start=reply_start,
                          node=node, lock=self._lock)
            node.entry = entry
            self._leaves += node.below == 0
            self._count_below(node, +1)
            self._supersede_ancestors(node)
            self._entries[entry] = model
            self.kv_bytes += nbytes
            self.index_bytes += ENTRY_BYTES
            self.stats["from_disk" if from_disk else f"insert_{kind}"] += 1
            if trimmable:
                self._drop_redundant_prefixes(node)
            self._drop_abandoned_replies(node)
            if kind == "checkpoint":
                self._drop_passed_prompt(node)
            evicted = self._enforce_limits(keep=entry)
        self._evict_as_the_group(evicted, keep=entry)
        with self._lock:
            fresh, self._fresh = self._fresh, []
        mx.eval(fresh + [c.state for c in layers if not isinstance(c, SharedKV)])
        del copied_from
        self._spill()

    def _take(self, cache: List[Any], n: int, copied_from: list, own: bool = False):
        """An inserted cache of n tokens split into (the entry's layers, the
        shared layers' sources, the layout); (None, None, None) when a plain
        KV layer does not hold exactly n tokens. `own`: its arrays are in
        buffers of their own (read from disk); else the layers the entry
        keeps are copied out of whatever buffer they are views of.

        Plain KV layers (and StoredKV ones read back from disk) become
        SharedKV shells: their keys and values go to the tree's spans, cut
        from the sources, (keys, values, bits to quantize them with, or None)
        at full length. Recurrent, rotating and chunked layers stay the
        entry's own: fixed-size states (or windows) at its position."""
        layers, sources, layout = [], [], []
        if not self.share_kv:  # every layer the entry's own
            if not own:
                cache = [own_buffers(c, copied_from) for c in cache]
            cache = compact(cache)  # (evaluates the copies)
            copied_from.clear()
            cache = quantize_for_store(cache, self.bits, self.group_size)
            return cache, [], ()
        for c in cache:
            if isinstance(c, StoredKV) and (c.bits, c.group_size) != (self.bits, self.group_size):
                c = c.restore()  # written under other settings: as plain KV
            if isinstance(c, StoredKV):
                if c.offset != n:
                    return None, None, None
                shell = c.shell()
                source = (tuple(c.keys), tuple(c.values), None)  # quantized already
            elif is_plain_kv(c):
                if c.keys is None or c.offset != n:
                    return None, None, None
                bits = self.bits if quantizable(c, self.group_size) else None
                shell = SharedKV(type(c), extra_attributes(c), c.keys.dtype, bits, self.group_size)
                source = (c.keys, c.values, bits)
            else:
                layers.append(c if own else own_buffers(c, copied_from))
                continue
            layout.append((len(layers), shell.bits))
            layers.append(shell)
            sources.append(source)
        return layers, sources, tuple(layout)

    def _span_part(self, x, start: int, stop: int, bits: Optional[int], own: bool):
        """Tokens [start, stop) of a source's keys or values, as a span holds
        them (quantized with `bits` when given; `own`: see cut_tokens)."""
        if bits is None:
            return cut_tokens(x, start, stop, own)
        return tuple(mx.quantize(x[..., start:stop, :], self.group_size, bits))

    def _add_span(self, node: _Node, layers: List[Tuple[Any, Any]], ntokens: int):
        span = make_span(layers, ntokens)
        node.kv.append(span)
        self.kv_bytes += span.nbytes
        self.index_bytes += span.overhead
        self._fresh.extend(t for pair in layers for x in pair for t in tensors_of(x))

    def _node_for(self, model, key: array) -> _Node:
        """The node at the end of `key`, made (splitting an edge where the key
        leaves it part way, or adding a leaf) if the tree has none."""
        node = self._roots.get(model)
        if node is None:
            node = self._roots[model] = _Node(None, array(TOKENS), 0)
            self.index_bytes += NODE_BYTES
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = node.children[key[pos]] = _Node(node, key[pos:], len(key))
                self.index_bytes += NODE_BYTES + TOKEN_BYTES * len(leaf.edge)
                self.tree_tokens += len(leaf.edge)
                return leaf
            m = matching(child.edge, key, pos)
            if m < len(child.edge):
                child = self._split(child, m)
            node, pos = child, pos + m
        return node

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut `node`'s edge after `m` tokens: a new node above it ends there."""
        parent = node.parent
        upper = _Node(parent, node.edge[:m], parent.depth + m)
        upper.kv, node.kv = self._split_spans(node.kv, m)
        node.edge = node.edge[m:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        upper.below = node.below + (node.entry is not None)
        parent.children[upper.edge[0]] = upper  # in node's place
        self.index_bytes += NODE_BYTES  # the tokens only moved
        return upper

    def _split_spans(self, spans: List[Span], m: int) -> Tuple[List[Span], List[Span]]:
        """Spans covering an edge cut after m tokens: those of the first m
        and those of the rest (a span across the cut is cut in two)."""
        pos = 0
        for i, span in enumerate(spans):
            if pos + span.ntokens > m:
                break
            pos += span.ntokens
        else:
            return spans, []
        if pos == m:
            return spans[:i], spans[i:]
        first, rest = split_span(span, m - pos)
        self.kv_bytes += first.nbytes + rest.nbytes - span.nbytes
        self.index_bytes += first.overhead + rest.overhead - span.overhead
        self._fresh.extend(t for s in (first, rest) for pair in s.layers
                           for x in pair for t in tensors_of(x))
        return spans[:i] + [first], [rest] + spans[i + 1:]

    def _merge(self, node: _Node):
        """Fold `node` (no entry, one child) into its child."""
        (child,) = node.children.values()
        child.kv = node.kv + child.kv
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

    def _drop_abandoned_replies(self, node: _Node):
        """A new entry that leaves the path of a "generated" leaf inside its
        reply: that reply was abandoned. A chat client that sends a reply
        back as it was generated continues its path; one whose template
        renders it differently (reasoning dropped, tool calls re-serialized)
        or that regenerated it leaves it there, and nothing will continue
        the old tokens. So it goes (the KV of its own tail and, on hybrid
        models, its state), instead of waiting for the budget."""
        parent = node.parent
        if parent is None or node.children or len(parent.children) < 2:
            return
        for sibling in list(parent.children.values()):
            old = sibling.entry
            if (sibling is not node and old is not None and not sibling.children
                    and old.kind == "generated" and 0 < old.reply_start <= parent.depth):
                self._remove(old, reason="abandoned")

    def _drop_passed_prompt(self, node: _Node):
        """A message boundary stored past a "prompt" entry with no branch
        between them: the conversation went on to its next turn, which
        resumes from its own entries, not that one. The old entry (at the
        end of a past turn's prompt) is left for a regenerate of that past
        turn, or another conversation opening the same way, which would
        resume from the state above it instead: when that is at most
        PASSED_PROMPT_MAX_GAP tokens back (a short message), the entry goes
        (its state; the path's KV stays). Where the path branches, or the
        message was long (a document), it stays. (Trimmable entries never
        get here: the new entry already replaced them.)"""
        n = node.parent
        while n is not None and n.entry is None and len(n.children) == 1:
            n = n.parent
        if (n is None or n.entry is None or n.entry.kind != "prompt"
                or len(n.children) != 1):
            return
        above = n.parent
        while above is not None and above.entry is None:
            above = above.parent
        if n.depth - (above.depth if above is not None else 0) <= PASSED_PROMPT_MAX_GAP:
            self._remove(n.entry, reason="passed")

    def _drop_redundant_prefixes(self, node: _Node):
        n = node.parent
        while n is not None:
            up = n.parent  # n itself may be merged away below
            if n.entry is not None and n.entry.trimmable:
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

    def _enforce_limits(self, keep: Entry) -> int:
        """The entries evicted for the byte budget (the others' count is
        every rank's own)."""
        self._expire()
        while self.max_sequences is not None and self._leaves > self.max_sequences:
            victim = self._victim(keep, leaves_only=True) or self._victim(keep, False)
            if victim is None:
                break
            self._remove(victim, reason="evicted")
        return self._trim_to(self.max_bytes, keep=keep)

    def trim_to(self, n_bytes: int, keep: Optional[Entry] = None, to_disk: bool = True):
        """Evict until the entries and the index hold at most `n_bytes`.
        to_disk=False: nothing goes to the disk tier (after an allocation
        failure, when a copy for the writer is the last thing wanted)."""
        with self._lock:
            self._no_spill = not to_disk
            try:
                evicted = self._trim_to(n_bytes, keep)
            finally:
                self._no_spill = False
        self._evict_as_the_group(evicted, keep)
        self._spill()

    def _trim_to(self, n_bytes: int, keep: Optional[Entry] = None) -> int:
        """How many entries it evicted: the least recently used first, `keep`
        only when it alone is over budget. Sorted once: trimming to half
        after an allocation failure may evict thousands."""
        n_bytes, evicted = max(0, n_bytes), 0
        if self.nbytes <= n_bytes:
            return 0
        for victim in sorted(self._entries, key=lambda e: e.last_used):
            if self.nbytes <= n_bytes:
                return evicted
            if victim is not keep and victim in self._entries:  # (not gone with another)
                self._remove(victim, reason="evicted")
                evicted += 1
        if self.nbytes > n_bytes and keep in self._entries:
            self._remove(keep, reason="evicted")
            evicted += 1
        return evicted

    def _evict_one(self, keep: Optional[Entry]) -> bool:
        """Evict the least recently used entry, `keep` only when it is the
        last one left (False then: it alone is over budget)."""
        victim = self._victim(keep, leaves_only=False)
        if victim is None:
            victim = keep
        self._remove(victim, reason="evicted")
        return victim is not keep

    def _evict_as_the_group(self, evicted: int, keep: Optional[Entry]):
        """Evict as many entries as the rank of the group that evicted most.
        Their stores are alike, so the order of victims is too: every rank
        ends with the same entries, each within its own budget."""
        more = self.group_max([evicted])[0] - evicted
        with self._lock:
            while more > 0 and self._entries:
                more -= 1
                if not self._evict_one(keep):
                    break

    def _remove(self, entry: Entry, reason: Optional[str] = None, prune: bool = True):
        # An inner entry's path stays in memory (entries below use it): only
        # leaves go to disk, whole (their file is a whole cache: joining the
        # path's spans makes a copy, held until the tier has written it).
        tier = (self._disks.get(self._entries[entry])
                if reason in _TO_DISK and entry.node.below == 0 and not self._no_spill
                else None)
        if tier is not None:  # while the node's path still spells it and holds its KV
            whole = self._whole(entry)
            self._spills.append((tier, list(entry.key), whole, entry.kind,
                                 self._wall_time(entry.last_used)))
        model = self._entries.pop(entry)
        node, entry.node = entry.node, None
        node.entry = None
        self._leaves -= node.below == 0
        self._count_below(node, -1)
        self.kv_bytes -= entry.nbytes
        self.index_bytes -= ENTRY_BYTES
        freed = entry.nbytes
        if prune:
            # Prune the branch up to the nearest node still in use (the KV of
            # edges no entry passes through any more goes with it)...
            while node.parent is not None and node.entry is None and not node.children:
                del node.parent.children[node.edge[0]]
                spans = sum(s.nbytes for s in node.kv)
                self.kv_bytes -= spans
                freed += spans
                self.index_bytes -= (NODE_BYTES + TOKEN_BYTES * len(node.edge)
                                     + sum(s.overhead for s in node.kv))
                self.tree_tokens -= len(node.edge)
                node.parent, node.kv, node = None, [], node.parent
        if reason:
            self.stats[reason] += 1
            self.stats[f"{reason}_bytes"] += freed
        if not prune:
            return
        if node.parent is None:
            if not node.children:
                del self._roots[model]
                self._layouts.pop(model, None)
                self.index_bytes -= NODE_BYTES
        elif node.entry is None and len(node.children) == 1:
            # ...which, left without an entry on a path that no longer
            # branches there, is folded into its child.
            self._merge(node)

    def clear(self):
        """Drop every entry, the disk tiers' too (DELETE /v1/cache)."""
        with self._lock:
            self._drop_read_ahead(lambda r: True)
            for entry in list(self._entries):
                self._remove(entry, reason="cleared")
            # No lookup finds a disk entry from now on...
            cleared = [(tier, tier.clear_index()) for tier in dict.fromkeys(self._disks.values())]
            for _, names in cleared:
                self.stats["cleared_on_disk"] += len(names)
        # ...and their files go with the store's lock released: the
        # generation thread takes it for every fetch and insert.
        for tier, names in cleared:
            tier.remove_files(names)

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
        for tier, key, cache, kind, last_used in spills:
            try:
                tier.put(key, cache, kind, last_used)  # the tier owns the cache now
            except Exception:  # never fails the request that evicted it
                logging.exception("Prompt cache: could not hand an entry to the disk tier")
                continue
            with self._lock:
                self.stats["spilled"] += 1

    def _wall_time(self, when: float) -> float:
        """A time of the store's clock (monotonic) as time.time(), as the
        disk tier keeps last uses (across restarts)."""
        return time.time() - max(0.0, self._clock() - when)

    def save_to_disk(self, timeout: float) -> int:
        """At shutdown: write the memory entries to their tiers, most
        recently used first (the ones most likely to be asked for again; a
        key already on disk is only touched), wait for the writes and close
        the tiers, all within about `timeout` seconds. Run on the generation
        thread once it stops serving. Returns the entries handed over; logs
        errors, never raises.

        On disk every entry is whole (its path's KV too): an inner
        checkpoint of a conversation costs about as much as its leaf. So the
        leaves (one per conversation) go first, then inner checkpoints, and
        only what fits each tier's budget: more would make the tier evict
        files this save just wrote, whole conversations with them."""
        deadline = time.monotonic() + max(0.0, timeout)
        self._spill()
        with self._lock:
            order = sorted(self._entries.items(),
                           key=lambda em: (not self._is_leaf(em[0].node), -em[0].last_used))
            room = {id(t): t.max_bytes for t in self._disks.values()}
            jobs = []
            for e, m in order:
                tier = self._disks.get(m)
                nbytes = e.nbytes + self._path_bytes(e) + 8 * e.ntokens  # (+ its key)
                if tier is None or nbytes > room[id(tier)]:
                    continue
                room[id(tier)] -= nbytes
                jobs.append((tier, list(e.key), self._whole(e), e.kind, nbytes,
                             self._wall_time(e.last_used)))
            tiers = list(dict.fromkeys(self._disks.values()))
        saved = 0
        for tier, key, cache, kind, nbytes, last_used in jobs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                # The tier drops a put that would overfill its queue: let the
                # writer catch up first.
                queued = tier.snapshot()["queued_bytes"]
                if queued and queued + nbytes > tier.max_queue_bytes:
                    tier.flush(left)
                # Stamped with its last use, not the time of writing: with
                # less room on disk than in memory, the tier's eviction then
                # lets the least recently used go, not the first written.
                tier.put(key, cache, kind, last_used)
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
        # Disk hits read before the generation thread fetched them, and the
        # bytes of those read and not fetched yet (in memory's bytes too).
        out["read_ahead"] = self.stats["read_ahead"]
        out["read_ahead_bytes"] = self.read_ahead_bytes
        return out

    def entry_bytes(self, entry: Entry) -> int:
        """What the entry's leaving frees: its own layers, and for a leaf the
        KV of the edge into its node (the dashboard's per-entry figure)."""
        with self._lock:
            node = entry.node
            alone = node is not None and not node.children
            return entry.nbytes + (sum(s.nbytes for s in node.kv) if alone else 0)

    def _path_bytes(self, entry: Entry) -> int:
        """The KV bytes of the spans along the entry's key."""
        return sum(s.nbytes for s, _ in _path_spans(entry.node))

    # -- reporting --

    def entries(self) -> List[Entry]:
        with self._lock:
            return list(self._entries)

    def recount(self) -> Dict[str, int]:
        """The tree's size by a full walk (for tests: `index_bytes` and the
        leaf count are kept up to date without one)."""
        with self._lock:
            nodes = tokens = spans = overhead = 0
            whole = True  # every edge's spans cover exactly its tokens
            stack = list(self._roots.values())
            while stack:
                n = stack.pop()
                nodes += 1
                tokens += len(n.edge)
                spans += sum(s.nbytes for s in n.kv)
                overhead += sum(s.overhead for s in n.kv)
                whole &= sum(s.ntokens for s in n.kv) == len(n.edge) or (
                    n.parent is None and not n.kv)
                stack.extend(n.children.values())
            return {
                "nodes": nodes,
                "edge_tokens": tokens,
                "index_bytes": (nodes * NODE_BYTES + tokens * TOKEN_BYTES + overhead
                                + len(self._entries) * ENTRY_BYTES),
                "kv_bytes": spans + sum(e.nbytes for e in self._entries),
                "spans_cover_edges": whole,
                "leaves": sum(e.node.below == 0 for e in self._entries),
            }

    def check_invariants(self, limits: bool = False) -> None:
        """Raise AssertionError naming each invariant the store's bookkeeping
        breaks (for tests: a full walk under the lock). What holds between
        any two calls of the store's methods:

        - a root has no parent, no edge, depth 0, no KV, no entry, and at
          least one child (an empty tree goes), and its model a layout;
        - every other node is its parent's child under its edge's first
          token, its edge a non-empty array of TOKENS, its depth its
          parent's plus len(edge), and it has an entry or two children or
          more (the tree is compressed);
        - a node's spans cover exactly its edge's tokens, each with one
          (keys, values) per shared layer of the model's layout, and its
          `nbytes` its arrays' bytes;
        - a node's `below` counts the entries strictly below it;
        - every entry of `_entries` is its node's entry, reached from its
          model's root, with `ntokens` its node's depth, `nbytes` its
          cache's bytes, its SharedKV shells where the model's layout has
          them and the store's lock; every entry in the tree is in
          `_entries`, under that model;
        - the counters kept without a walk match one: `kv_bytes`,
          `index_bytes`, `tree_tokens` and the leaf count (recount()), and
          `read_ahead_bytes` (the held read-aheads' bytes, each under its
          (model, file name)).

        limits=True: also `nbytes` within `max_bytes` and the leaves within
        `max_sequences`, as every insert that stores an entry leaves them
        (not after the limits were lowered, or a read ahead taken, since)."""
        wrong: List[str] = []
        with self._lock:
            found: Dict[Entry, Any] = {}  # entry -> model, by the walk
            for model, root in self._roots.items():
                layout = self._layouts.get(model)
                if layout is None:
                    wrong.append(f"model {model!r}: a tree without a layout")
                if (root.parent is not None or len(root.edge) or root.depth or root.kv
                        or root.entry is not None or not root.children):
                    wrong.append(f"model {model!r}: its root is not an empty node with children")
                order, stack = [], [root]
                while stack:
                    n = stack.pop()
                    order.append(n)
                    stack.extend(n.children.values())
                    if n.entry is not None:
                        found[n.entry] = model
                    if n is root:
                        continue
                    where = f"model {model!r}, node at depth {n.depth}"
                    if not (isinstance(n.edge, array) and n.edge.typecode == TOKENS
                            and len(n.edge)):
                        wrong.append(f"{where}: its edge is not a non-empty token array")
                        continue
                    if n.parent is None or n.parent.children.get(n.edge[0]) is not n:
                        wrong.append(f"{where}: not its parent's child under its first token")
                    elif n.depth != n.parent.depth + len(n.edge):
                        wrong.append(f"{where}: depth is not its parent's plus its edge")
                    if n.entry is None and len(n.children) < 2:
                        wrong.append(f"{where}: no entry and {len(n.children)} children")
                    if sum(s.ntokens for s in n.kv) != len(n.edge):
                        wrong.append(f"{where}: spans of {sum(s.ntokens for s in n.kv)} "
                                     f"tokens on an edge of {len(n.edge)}")
                    for s in n.kv:
                        if layout is not None and len(s.layers) != len(layout):
                            wrong.append(f"{where}: a span of {len(s.layers)} layers, "
                                         f"the layout has {len(layout)}")
                        held = sum(t.nbytes for pair in s.layers for x in pair
                                   for t in tensors_of(x))
                        if s.nbytes != held:
                            wrong.append(f"{where}: a span counts {s.nbytes} bytes, holds {held}")
                below: Dict[_Node, int] = {}
                for n in reversed(order):  # children before their parents
                    below[n] = sum(below[c] + (c.entry is not None)
                                   for c in n.children.values())
                    if n.below != below[n]:
                        wrong.append(f"model {model!r}, node at depth {n.depth}: below is "
                                     f"{n.below}, {below[n]} entries are")
            for entry, model in self._entries.items():
                node = entry.node
                where = f"entry of {entry.ntokens} tokens ({entry.kind})"
                if node is None or node.entry is not entry:
                    wrong.append(f"{where}: not its node's entry")
                    continue
                if entry not in found or found[entry] != model:
                    wrong.append(f"{where}: not reached from its model's root")
                if entry.ntokens != node.depth:
                    wrong.append(f"{where}: at a node of depth {node.depth}")
                if entry.nbytes != cache_nbytes(entry.cache):
                    wrong.append(f"{where}: counts {entry.nbytes} bytes, its cache "
                                 f"{cache_nbytes(entry.cache)}")
                shells = tuple((i, c.bits) for i, c in enumerate(entry.cache)
                               if isinstance(c, SharedKV))
                if shells != self._layouts.get(model):
                    wrong.append(f"{where}: shared layers {shells}, the model's layout "
                                 f"{self._layouts.get(model)}")
                if entry.lock is not self._lock:
                    wrong.append(f"{where}: not holding the store's lock")
            for entry in found.keys() - self._entries.keys():
                wrong.append(f"entry of {entry.ntokens} tokens ({entry.kind}): in the tree, "
                             "not in _entries")
            counted = self.recount()
            for name, kept, walked in (
                    ("kv_bytes", self.kv_bytes, counted["kv_bytes"]),
                    ("index_bytes", self.index_bytes, counted["index_bytes"]),
                    ("tree_tokens", self.tree_tokens, counted["edge_tokens"]),
                    ("leaf count", self._leaves, counted["leaves"]),
                    ("read_ahead_bytes", self.read_ahead_bytes,
                     sum(r.nbytes for r in self._read_ahead.values()))):
                if kept != walked:
                    wrong.append(f"{name} is {kept}, counted {walked}")
            for name, ahead in self._read_ahead.items():
                if name != (ahead.model, ahead.handle.name):
                    wrong.append(f"a read ahead held as {name!r}")
            if limits and self.max_bytes is not None and self.nbytes > max(self.max_bytes, 0):
                wrong.append(f"{self.nbytes} bytes over the budget of {self.max_bytes}")
            if (limits and self.max_sequences is not None
                    and self._leaves > max(self.max_sequences, 0)):
                wrong.append(f"{self._leaves} sequences, at most {self.max_sequences}")
        if wrong:
            shown = wrong[:20] + ([f"... and {len(wrong) - 20} more"] if len(wrong) > 20 else [])
            raise AssertionError("PromptStore invariants broken:\n  " + "\n  ".join(shown))

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
                # distinct token (the tree's: entries share their prefixes).
                "memory": {"entries": len(self._entries), "bytes": self.nbytes,
                           "tokens": tokens, "distinct_tokens": self.tree_tokens,
                           "hits": memory_hits,
                           "bytes_per_token": _per_token(self.nbytes, self.tree_tokens)},
                "disk": self._disk_snapshot(),  # None without --prompt-cache-dir
                "hits_by_tier": {"memory": memory_hits, "disk": hits.get("disk", 0)},
            }
