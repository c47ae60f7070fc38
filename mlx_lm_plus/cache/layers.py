"""What a stored layer cache is, and how it is cut, shared, quantized and
measured: the prompt store's (store.py) and the disk tier's (disk.py)
helpers for a cache as a list of layers.

A plain KV layer (`is_plain_kv`) is the one kind the store shares between
entries: its keys and values go to the tree's edges as Spans (`make_span`,
`split_span`), and the entry keeps a SharedKV shell that turns them back
into the layer it was. Under quantized storage the store holds a plain KV
layer as a StoredKV (`quantize_for_store`; `restore_from_store` gives a
private copy of ordinary layers back). Also here: cutting a layer out of a
batch's buffers (`own_buffers`, `compact`), whether a cache can be cut to
any prefix (`trims_to_any_prefix`), and its bytes (`cache_nbytes`).

Apart from store.py so that the disk tier uses these without reaching into
the store; StoredKV's files name this module (disk_format.py resolves the
older names, `mlx_lm_plus.cache:StoredKV` and
`mlx_lm_plus.cache.store:StoredKV`).
"""

import copy
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)


def is_plain_kv(c) -> bool:
    """A KVCache that holds exactly its tokens' keys and values (any prefix of
    it is valid): KVCache and subclasses that only add bookkeeping, such as
    vlm_text.MRopeKVCache; not ChunkedKVCache, which drops old chunks."""
    return isinstance(c, KVCache) and not isinstance(c, ChunkedKVCache)


def trims_to_any_prefix(cache: List[Any]) -> bool:
    """Whether every layer can be trimmed to any shorter prefix. Upstream's
    ChunkedKVCache (llama4) says it can be trimmed, but once a prompt passed
    its chunk size it trims only down to its start_position: the tokens
    before were dropped."""
    return can_trim_prompt_cache(cache) and not any(
        isinstance(c, ChunkedKVCache) and c.start_position > 0 for c in cache)


def compact(cache: List[Any]) -> List[Any]:
    """Cut preallocated KV buffers down to the tokens they hold."""
    for c in cache:
        if is_plain_kv(c) and c.keys is not None and c.keys.shape[2] > c.offset:
            c.keys = mx.contiguous(c.keys[..., : c.offset, :])
            c.values = mx.contiguous(c.values[..., : c.offset, :])
    mx.eval([c.state for c in cache])
    return cache


def _copied(value):
    """`value` with each array in it copied into a buffer of its own
    (mx.array copies; copy.deepcopy and mx.contiguous may share the buffer)."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, (mx.array, list, tuple))
                                                for v in value):
        return type(value)(_copied(v) for v in value)
    return value


def own_buffers(layer, copied_from: list):
    """`layer` holding arrays of its own, plain KV cut to its tokens. A row
    extracted from a batch is a view of the batch's arrays (upstream's
    ArraysCache.extract slices them; BatchKVCache's and
    BatchRotatingKVCache's mx.contiguous keeps a row that is contiguous in
    place): stored as is, it would keep the whole batch's buffer alive,
    B times the bytes the budget counts. The arrays it copies from go to
    `copied_from`, for the caller to hold until the copies are evaluated: a
    copy whose source nothing else holds any more (the batch moved on)
    takes over the source's buffer instead of copying, every row of it."""
    if isinstance(layer, CacheList):
        for c in layer.caches:
            own_buffers(c, copied_from)
        return layer
    if is_plain_kv(layer) and layer.keys is not None:
        n = layer.offset
        copied_from += [layer.keys, layer.values]
        layer.keys = mx.array(layer.keys[..., :n, :])
        layer.values = mx.array(layer.values[..., :n, :])
        return layer
    for name, value in vars(layer).items():
        copied_from.append(value)
        setattr(layer, name, _copied(value))
    return layer


def extra_attributes(layer) -> Dict[str, Any]:
    """A plain KV layer's attributes beside keys, values and offset (such as
    vlm_text.MRopeKVCache's rope_delta)."""
    return {k: v for k, v in vars(layer).items() if k not in ("keys", "values", "offset")}


class StoredKV(QuantizedKVCache):
    """A plain KV layer as a quantized store holds it: QuantizedKVCache's
    (packed, scales, biases) keys and values (so its `nbytes`, `trim` and
    `is_trimmable` hold as they are), plus what turns it back into the layer
    it was: the class, the attributes beside keys/values/offset (such as
    vlm_text.MRopeKVCache's rope_delta) and the dtype. Never handed out."""

    def __init__(self, layer: KVCache, bits: int, group_size: int):
        super().__init__(group_size=group_size, bits=bits)
        self.layer_class = type(layer)
        self.extra = extra_attributes(layer)
        self.dtype = layer.keys.dtype
        self.offset = n = layer.offset
        self.keys = mx.quantize(layer.keys[..., :n, :], group_size, bits)
        self.values = mx.quantize(layer.values[..., :n, :], group_size, bits)

    def restore(self, trim: int = 0) -> KVCache:
        """A new layer of the original class, `trim` tokens shorter: only
        the tokens kept are dequantized (into new arrays; nothing shared)."""
        n = self.offset - min(trim, self.offset)
        keys, values = (tuple(x[..., :n, :] for x in q) for q in (self.keys, self.values))
        return self.shell().restore(keys, values, n)

    def shell(self) -> "SharedKV":
        """This layer as an entry holds it when the tree's edges hold its KV."""
        return SharedKV(self.layer_class, self.extra, self.dtype, self.bits, self.group_size)


    @classmethod
    def holding(cls, like: "SharedKV", keys, values, n: int) -> "StoredKV":
        """A StoredKV of already quantized keys and values (for the disk
        tier: what an entry whose KV the tree's edges hold looks like whole)."""
        stored = cls.__new__(cls)
        QuantizedKVCache.__init__(stored, group_size=like.group_size, bits=like.bits)
        stored.layer_class, stored.extra, stored.dtype = like.layer_class, like.extra, like.dtype
        stored.keys, stored.values, stored.offset = keys, values, n
        return stored


@dataclass(eq=False, slots=True)
class Span:
    """The attention KV of a run of tokens on one edge of the tree: per
    shared layer, (keys, values), each an array (B, heads, tokens, dim) or,
    under quantized storage, mx.quantize's (packed, scales, biases) tuple.
    Its arrays are its own (never views of a larger buffer), so dropping a
    span frees what `nbytes` counts."""
    ntokens: int
    layers: List[Tuple[Any, Any]]
    nbytes: int  # its arrays
    overhead: int  # its Python objects (counted as index bytes)


_SPAN_OBJECT = sys.getsizeof(Span(0, [], 0, 0))


def tensors_of(x) -> Tuple[mx.array, ...]:
    return x if isinstance(x, tuple) else (x,)


def cut_tokens(x, start: int, stop: int, own: bool = False):
    """Tokens [start, stop) of keys or values, in a buffer of their own
    (mx.array copies; mx.contiguous may keep a row-contiguous slice in its
    source's buffer, which would keep uncounted bytes alive). `own`: x is
    in a buffer of its own (read from disk), so all of it is taken as is."""
    if isinstance(x, tuple):
        return tuple(cut_tokens(p, start, stop, own) for p in x)
    if own and start == 0 and stop == x.shape[2]:
        return x
    return mx.array(x[..., start:stop, :])


def first_tokens(x, n: int):
    """The first n tokens of keys or values (a view: to be read, not kept)."""
    if isinstance(x, tuple):
        return tuple(p[..., :n, :] for p in x)
    return x[..., :n, :]


def join_tokens(parts: List[Any]):
    """Keys or values of consecutive spans as one (a new array, or tuple of
    arrays, never one of the spans' own objects: callers write into it)."""
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate([p[i] for p in parts], axis=2)
                     for i in range(len(parts[0])))
    return mx.concatenate(parts, axis=2)


def make_span(layers: List[Tuple[Any, Any]], ntokens: int) -> Span:
    nbytes = overhead = 0
    for pair in layers:
        overhead += sys.getsizeof(pair)
        for x in pair:
            overhead += sys.getsizeof(x) if isinstance(x, tuple) else 0
            for t in tensors_of(x):
                nbytes += t.nbytes
                overhead += sys.getsizeof(t)
    overhead += sys.getsizeof(layers) + _SPAN_OBJECT
    return Span(ntokens, layers, nbytes, overhead)


def split_span(span: Span, m: int) -> Tuple[Span, Span]:
    """The span's first m tokens and the rest, each in buffers of its own."""
    first = [(cut_tokens(k, 0, m), cut_tokens(v, 0, m)) for k, v in span.layers]
    rest = [(cut_tokens(k, m, span.ntokens), cut_tokens(v, m, span.ntokens))
            for k, v in span.layers]
    return make_span(first, m), make_span(rest, span.ntokens - m)


@dataclass(eq=False)
class SharedKV:
    """In an entry, a plain KV layer whose keys and values the tree's edges
    hold (shared by every entry whose key passes there): what turns them back
    into the layer it was. `bits`: quantized storage of this layer (None:
    as it was)."""
    layer_class: type
    extra: Dict[str, Any]
    dtype: Any
    bits: Optional[int] = None
    group_size: int = 64
    nbytes = 0  # its tokens' KV is counted in the spans

    def is_trimmable(self) -> bool:
        return True

    def restore(self, keys, values, n: int):
        """A new layer of the original class holding n tokens: `keys` and
        `values` are the spans' parts joined (dequantized here)."""
        if self.bits is not None:
            keys, values = (mx.dequantize(*x, self.group_size, self.bits, dtype=self.dtype)
                            for x in (keys, values))
        layer = self.layer_class.__new__(self.layer_class)
        layer.__dict__.update(copy.deepcopy(self.extra))
        layer.keys, layer.values, layer.offset = keys, values, n
        return layer

    def stored(self, keys, values, n: int):
        """The layer as an unshared store held it (StoredKV when quantized):
        what the disk tier writes."""
        if self.bits is not None:
            return StoredKV.holding(self, keys, values, n)
        return self.restore(keys, values, n)


def quantizable(c, group_size: int) -> bool:
    return (is_plain_kv(c) and c.keys is not None and c.offset > 0
            and c.keys.shape[-1] % group_size == 0
            and c.values.shape[-1] % group_size == 0)


def quantize_for_store(cache: List[Any], bits: Optional[int], group_size: int) -> List[Any]:
    """The cache as the store holds it: with `bits`, each plain KV layer a
    StoredKV (head dims that `group_size` does not divide stay as they are);
    recurrent, rotating and chunked layers as they are. Evaluated."""
    if bits is None:
        return cache
    cache = [StoredKV(c, bits, group_size) if quantizable(c, group_size) else c
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
            for c in cache:  # as the memory tier's fetch gives it (views: no copy)
                if is_plain_kv(c) and c.keys is not None and c.keys.shape[2] > c.offset:
                    c.keys, c.values = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
        return cache
    trim = trim if trims_to_any_prefix(stored) else 0
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


def cache_nbytes(cache: List[Any]) -> int:
    return sum(c.nbytes for c in cache)
