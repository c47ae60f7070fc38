"""--kv-bits inside continuous batching: a batched quantized KV cache.

mlx-lm 0.32.2 has no batched quantized KV cache, so its server (and ours
until now) serves every request one at a time when --kv-bits is set. Here
`BatchQuantizedKVCache` is mlx-lm's `BatchKVCache` (left padding, one offset
per row, filter / extend / extract / merge / prepare / finalize) whose keys
and values, once quantized, are `mx.quantize`d (packed, scales, biases)
tuples as in `QuantizedKVCache`. It then has a `bits` attribute, which is
what `mlx_lm.models.base.scaled_dot_product_attention` dispatches on to
`quantized_scaled_dot_product_attention`; the batch's mask is used as it is.

`QuantizedBatchGenerator` is a `BatchGenerator` whose requests carry such a
layer in place of each plain `KVCache` layer (a one-row cache holding the
fetched layer's buffers: no copy). `BatchGenerator` merges a batch's caches
with the class of its first request's layer, so every prompt batch and
generation batch it builds is made of these; other layers (recurrent) are
batched as upstream does. Models with other layers upstream would quantize
(rotating: upstream raises; vlm_text.MRopeKVCache), or with head dims that
--kv-group-size does not divide, stay on the sequential path
(`supports_quantized_batching`).

--quantized-kv-start, per request. Upstream's sequential path
(`maybe_quantize_kv_cache`) quantizes a request's whole cache after the
model call at whose end it holds at least quantized_kv_start tokens: calls
up to and including that one attend in float, every later one quantized.
Attention runs once for all rows of a batch, with one kernel, so the rows
of a layer can not mix float and quantized attention in one call. The rule:

  * a layer is float (as `BatchKVCache`) until a call at whose end one of
    its rows holds at least quantized_kv_start tokens (upstream's point for
    that row); that call attends in float, and then the layer, all its
    rows, is stored quantized: later calls attend quantized. (So no float
    copy outlives the call: between steps a quantized layer holds only its
    quantized tuples.)
  * a request bringing a quantized layer (a QuantizedKVCache from the
    prompt cache) makes the layer it joins quantized, and a float row
    joining a quantized layer is quantized as it joins (extend, merge);
  * quantized is for good (the float values are gone), except for a layer
    left with no positions at all (only new requests), which is float again.

So each row is quantized exactly where upstream quantizes it, or earlier
when it shares a layer with a row that passed the start: never later (the
memory bound of --kv-bits holds), and the difference from upstream's
outputs is quantization noise on the early positions of those rows. The
prompt batch and the generation batch are separate layers, and the
generation batch's are rebuilt whenever it empties. With
--quantized-kv-start 0 every row is quantized after its first call, as
upstream does, whatever it shares a layer with; the arithmetic is then
upstream's and greedy tokens are the same (tests/engine/test_kv_bits.py), unless a
new request joins a prompt batch in which another one is still prefilling a
prompt longer than --prefill-step-size (its first chunk is then quantized).
(Not yet explained: a review on 2026-11-30 saw a batched row's greedy text
at start 0 change when some of eight short requests arrived 2 ms later
than the others, here and at the tree before; tests admit such rows
together.)

`extract` gives what the sequential path leaves in the prompt cache: a
`QuantizedKVCache` for a quantized row, else a plain `KVCache`. Either is
fetched and resumed by a later request, batched or not.
"""

from typing import Any, List, Optional

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    dynamic_roll,
    make_prompt_cache,
)

from mlx_lm_plus.upstream import BaseCache


def supports_quantized_batching(model, group_size: int) -> bool:
    """Whether --kv-bits requests on `model` may be batched here: every layer
    that upstream would quantize (`to_quantized`) is a plain KVCache whose
    head dims `group_size` divides. A rotating layer (upstream raises on
    it) or a KVCache subclass with state of its own (vlm_text.MRopeKVCache)
    keeps the model on the sequential path; so do head dims mx.quantize
    can not take (16 with any group size, 96 with 64): there each request
    that reaches --quantized-kv-start fails alone, as upstream's, where in
    a batch the whole batch would."""
    if model is None:
        return False
    cache = make_prompt_cache(model)
    if not all(type(c) is KVCache or not hasattr(c, "to_quantized") for c in cache):
        return False
    try:
        # One token through the model, for the shapes of its keys and
        # values: MLX is lazy and nothing is evaluated (but by a model whose
        # call evaluates, as dbrx's routing does: one token's step, once).
        model(mx.array([[0]]), cache=cache)
    except Exception:
        return False
    return all(c.keys.shape[-1] % group_size == 0 and c.values.shape[-1] % group_size == 0
               for c in cache if type(c) is KVCache and c.keys is not None)


def _zeros(like, rows: int, length: int):
    """Zero keys or values shaped as `like` (an array or a quantized tuple)
    with `rows` rows and `length` positions."""
    return tree_map(lambda x: mx.zeros((rows, x.shape[1], length, x.shape[3]), x.dtype), like)


def _positions(x, start: int, stop: Optional[int]):
    """Positions start:stop of keys or values (an array or a quantized tuple)."""
    return tree_map(lambda a: a[..., start:stop, :], x)


def _length(x) -> int:
    """Positions in a buffer of keys or values (an array or a quantized tuple)."""
    return (x[0] if isinstance(x, tuple) else x).shape[2]


def _quantize(x, group_size: int, bits: int):
    """(packed, scales, biases) of `x`, quantized along its last axis: each
    position on its own, so it does not matter when or in which batch."""
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


class BatchQuantizedKVCache(BaseCache):
    step = 256

    def __init__(self, left_padding: List[int], *, group_size: int = 64, kv_bits: int = 8,
                 quantized_kv_start: int = 0):
        """Inputs are left padded as for BatchKVCache. Keys and values are
        float arrays until the layer is quantized, then quantized tuples."""
        self.keys = None
        self.values = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-l for l in left_padding])
        self._idx = 0
        self._right_padding = None
        self.group_size = group_size
        self.kv_bits = kv_bits
        self.quantized_kv_start = quantized_kv_start
        # Whether keys and values are stored quantized. Attention follows
        # from the next call on: `bits` is set on the instance there (mlx-lm's
        # attention takes the quantized kernel iff hasattr(cache, "bits")).
        self.quantized = False
        # The rows' offsets as Python ints: the quantization rule reads them
        # without waiting for the arrays being computed (see _lengths).
        self._lengths = [-l for l in left_padding]

    @property
    def _lengths(self) -> List[int]:
        """The rows' offsets: a base per row plus what every row grew since
        (a decode step adds to one int, not to a list, on every layer)."""
        return [b + self._grown for b in self._base]

    @_lengths.setter
    def _lengths(self, lengths):
        self._base, self._grown = list(lengths), 0
        self._longest = None  # (worked out again when next needed)

    def _longest_real(self) -> float:
        """The longest row's real length at the end of this call (a prefill
        chunk's right padding leaves at finalize)."""
        if self._longest is None:
            right = self._right_padding or [0] * len(self._base)
            self._longest = max((b - r for b, r in zip(self._base, right)),
                                default=float("-inf"))
        return self._longest + self._grown

    def quantize(self):
        """Store the layer (all rows, the whole buffer) quantized."""
        if not self.quantized and self.keys is not None:
            self.keys = _quantize(self.keys, self.group_size, self.kv_bits)
            self.values = _quantize(self.values, self.group_size, self.kv_bits)
        self.quantized = True

    def _to_float(self):
        """A layer with no positions left: float again, nothing is lost."""
        self.keys = self.values = None
        self._idx = 0
        self.quantized = False
        self.__dict__.pop("bits", None)

    def _settings(self):
        return dict(group_size=self.group_size, kv_bits=self.kv_bits,
                    quantized_kv_start=self.quantized_kv_start)

    # -- the cache protocol --

    def update_and_fetch(self, keys, values):
        if self.quantized:
            self.bits = self.kv_bits
            keys = _quantize(keys, self.group_size, self.kv_bits)
            values = _quantize(values, self.group_size, self.kv_bits)
        n = _length(keys)
        prev = self._idx
        if self.keys is None or prev + n > _length(self.keys):
            steps = (self.step + n - 1) // self.step * self.step
            B = self.offset.shape[0]
            new_k, new_v = _zeros(keys, B, steps), _zeros(values, B, steps)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step != 0:
                    self.keys, self.values = _positions((self.keys, self.values), 0, prev)
                cat = lambda a, b: mx.concatenate([a, b], axis=2)  # noqa: E731
                self.keys = tree_map(cat, self.keys, new_k)
                self.values = tree_map(cat, self.values, new_v)
        self.offset = self.offset + n
        self._idx += n
        self._grown += n
        if self.quantized:
            for i in range(3):
                self.keys[i][..., prev : self._idx, :] = keys[i]
                self.values[i][..., prev : self._idx, :] = values[i]
        else:
            self.keys[..., prev : self._idx, :] = keys
            self.values[..., prev : self._idx, :] = values
        fetched = self.keys_and_values()
        if not self.quantized and self._longest_real() >= self.quantized_kv_start:
            self.quantize()  # this call attends `fetched`, still float
        return fetched

    def keys_and_values(self):
        return _positions((self.keys, self.values), 0, self._idx)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty cache")
            self.left_padding += mx.array(left_padding)
            self.offset = self.offset - mx.array(left_padding)
            self._lengths = [l - p for l, p in zip(self._lengths, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)
            self._longest = None

    def finalize(self):
        """Move the right padding of a prefill chunk to the left (as
        BatchKVCache); quantization is per position, so rolling the packed
        tuples moves the same values as rolling floats would."""
        if self._right_padding is not None:
            padding = mx.array(self._right_padding)
            roll = lambda x: dynamic_roll(x, padding[:, None], axis=2)  # noqa: E731
            self.keys, self.values = tree_map(roll, (self.keys, self.values))
            self.offset = self.offset - padding
            self.left_padding += padding
            self._lengths = [l - p for l, p in zip(self._lengths, self._right_padding)]
            self._right_padding = None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self._lengths = self.offset.tolist()
        self.quantized = isinstance(self.keys, tuple)

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        self._lengths = [l - n for l in self._lengths]
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def size(self):
        return self._idx

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)

    # -- batch operations --

    def filter(self, batch_indices):
        """In-place: keep the given rows, then drop the padding they all share."""
        rows = mx.array(batch_indices)
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[rows], (self.keys, self.values))
        self.offset = self.offset[rows]
        self.left_padding = self.left_padding[rows]
        self._lengths = [self._lengths[i] for i in batch_indices]
        min_left_pad = min(self.left_padding.tolist())
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys, self.values = _positions(
                    (self.keys, self.values), min_left_pad, None)
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad
        if self._idx == 0:
            self._to_float()

    def extend(self, other):
        """In-place: append the rows of `other` (right-justified at the longer
        `_idx`, as BatchKVCache). Float rows joining a quantized layer, or a
        float layer joined by quantized rows, are quantized."""
        joined = _concatenate([self, other])
        self.__dict__.clear()
        self.__dict__.update(joined.__dict__)

    def extract(self, idx):
        """Row `idx` as the sequential path leaves it: a QuantizedKVCache
        when quantized, else a KVCache."""
        if self.quantized:
            cache = QuantizedKVCache(group_size=self.group_size, bits=self.kv_bits)
        else:
            cache = KVCache()
        if self.keys is not None:
            padding = self.left_padding.tolist()[idx]
            cache.keys, cache.values = tree_map(
                lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]),
                (self.keys, self.values))
            cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches):
        """One batch of per-request layers: BatchQuantizedKVCache rows (what
        QuantizedBatchGenerator queues), KVCache or QuantizedKVCache."""
        settings = next(c for c in caches if isinstance(c, cls))._settings()
        return _concatenate([c if isinstance(c, cls) else from_layer(c, **settings)
                             for c in caches])


def widest_float_call(prompt_cache) -> Optional[int]:
    """The most positions a speculative check (engine/speculation.py) may
    have while a layer is float, so that it leaves the layer float: upstream
    quantizes after the call at whose end a row holds quantized_kv_start
    tokens, and a check whose last positions reach it would attend its first
    ones in float where one-token steps would not. (None: no such layer.
    Once quantized, a check attends quantized as those steps do. A batch's
    layers see the same calls: they quantize together, and the first says.)"""
    layer = next((c for c in prompt_cache if isinstance(c, BatchQuantizedKVCache)), None)
    if layer is None or layer.quantized:
        return None
    return layer.quantized_kv_start - 1 - max(layer._lengths, default=0)


def from_layer(layer, *, group_size: int, kv_bits: int,
               quantized_kv_start: int) -> BatchQuantizedKVCache:
    """A one-row cache holding a request's KVCache or QuantizedKVCache
    layer's buffers as they are (positions past its offset are free room).
    A quantized layer of other settings is dequantized and quantized again."""
    row = BatchQuantizedKVCache([0], group_size=group_size, kv_bits=kv_bits,
                                quantized_kv_start=quantized_kv_start)
    quantized = isinstance(layer, QuantizedKVCache)
    if quantized and (layer.bits, layer.group_size) != (kv_bits, group_size):
        layer = _dequantized(layer)
    if layer.keys is None or layer.offset == 0:
        return row
    row.keys, row.values = (tuple(x) if isinstance(x, list) else x
                            for x in (layer.keys, layer.values))
    row._idx = n = layer.offset
    row.offset = mx.array([n])
    row._lengths = [n]
    row.quantized = isinstance(row.keys, tuple)
    if quantized:
        row.quantize()
    return row


def _dequantized(layer: QuantizedKVCache) -> KVCache:
    float_layer = KVCache()
    if layer.keys is not None:
        n = layer.offset
        float_layer.keys, float_layer.values = (
            mx.dequantize(*_positions(q, 0, n), group_size=layer.group_size,
                          bits=layer.bits, dtype=q[1].dtype)
            for q in (layer.keys, layer.values))
        float_layer.offset = n
    return float_layer


def _concatenate(caches: List[BatchQuantizedKVCache]) -> BatchQuantizedKVCache:
    """The rows of `caches`, in order, in one new cache: each right-justified
    at the longest `_idx` (the shorter ones get more left padding), the
    buffer as long as the longest one's. Quantized if any of them holds
    quantized positions."""
    out = BatchQuantizedKVCache([], **caches[0]._settings())
    out.offset = mx.concatenate([c.offset for c in caches])
    out._lengths = [l for c in caches for l in c._lengths]
    full = [c for c in caches if c.keys is not None and c._idx > 0]
    if not full:
        out.left_padding = mx.concatenate([c.left_padding for c in caches])
        return out
    out.quantized = any(c.quantized for c in full)
    idx = max(c._idx for c in full)
    size = max(_length(c.keys) for c in full)

    def as_out(kv):
        """Keys or values in the result's form."""
        if out.quantized and not isinstance(kv, tuple):
            return _quantize(kv, out.group_size, out.kv_bits)
        return kv

    # Rows with no positions (new requests) take their shapes from a full one.
    like = [as_out(tree_map(lambda a: a[:1, :, :1], x)) for x in (full[0].keys, full[0].values)]
    keys, values, left_padding = [], [], []
    for c in caches:
        if c in full:
            k, v = (as_out(x) for x in _positions((c.keys, c.values), 0, c._idx))
            left = idx - c._idx
        else:
            k, v = (_zeros(x, c.offset.shape[0], 0) for x in like)
            left = idx
        if left or size > idx:
            pad = lambda x: mx.pad(x, [(0, 0), (0, 0), (left, size - idx), (0, 0)])  # noqa: E731
            k, v = tree_map(pad, (k, v))
        keys.append(k)
        values.append(v)
        left_padding.append(c.left_padding + left)
    cat = lambda *xs: mx.concatenate(xs, axis=0)  # noqa: E731
    out.keys, out.values = tree_map(cat, *keys), tree_map(cat, *values)
    out.left_padding = mx.concatenate(left_padding)
    out._idx = idx
    return out


class QuantizedBatchGenerator(BatchGenerator):
    """A BatchGenerator whose plain KV layers are BatchQuantizedKVCache.

    Each inserted request's KVCache / QuantizedKVCache layers (a fetched
    prompt cache, or new ones) become one-row BatchQuantizedKVCache, so
    upstream's merge (`caches[0][i].merge(...)`) builds batches of them."""

    def __init__(self, model, *, kv_bits: int, kv_group_size: int = 64,
                 quantized_kv_start: int = 0, **kwargs):
        super().__init__(model, **kwargs)
        self.kv_settings = dict(group_size=kv_group_size, kv_bits=kv_bits,
                                quantized_kv_start=quantized_kv_start)

    def _rows(self, cache: Optional[List[Any]]) -> List[Any]:
        """A request's cache (new when None) with its KVCache and
        QuantizedKVCache layers as one-row BatchQuantizedKVCache."""
        if cache is None:
            cache = make_prompt_cache(self.model, self.max_kv_size)
        return [from_layer(c, **self.kv_settings)
                if type(c) is KVCache or isinstance(c, QuantizedKVCache) else c
                for c in cache]

    def insert_segments(self, segments, max_tokens=None, caches=None, *args, **kwargs):
        caches = [self._rows(c) for c in (caches or [None] * len(segments))]
        return super().insert_segments(segments, max_tokens, caches, *args, **kwargs)

    def extract_cache(self, uids):
        """Upstream's, with queued requests' one-row layers turned back into
        the per-request layers the rest of the server stores."""
        results = super().extract_cache(uids)
        for uid, (cache, tokens) in results.items():
            results[uid] = ([c.extract(0) if isinstance(c, BatchQuantizedKVCache) else c
                             for c in cache], tokens)
        return results
