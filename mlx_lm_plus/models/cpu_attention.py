"""Attention on a CPU for models whose weights were made float32 here
(cpu.weights_for_cpu): mx.fast.scaled_dot_product_attention's float32 calls
made from their forward passes, computed as MLX's CPU fallback computes
them but for two things.

Why: on a CPU, MLX 0.32 runs scaled_dot_product_attention as its fallback
graph (a matmul, the mask, a softmax, a matmul), and two parts of it are
slow there:
- the softmax: MLX's CPU exp runs about 17 ns a value on this 2-core
  x86-64 machine (the wheel is built for any x86-64), 10x NumPy's; ours
  (mlx_lm_plus.native's `softmax`, 8 lanes) about 1.8. At a 3,000-token
  context a query row's softmax is 3,000 exps per head: most of the
  attention of a decode step, nearly all of a long prompt's;
- grouped-query heads: the fallback multiplies each query head group by
  its KV head broadcast to the group (a copy of the keys a call); here the
  group's queries are stacked as rows of one matmul against their KV head.
Measured per layer of the demo model's shape (9 query heads, 3 KV heads, 64
dims) against 3,000 keys: 1.76 ms for one query position with MLX's, 6.1
ms for eight (a speculative check).

The arithmetic is the fallback's: q * scale, scores against the keys, a
boolean mask as MLX's finfo.min, an additive one added, softmax in float32,
the values; results equal MLX's to float rounding (the exp is 8e-8 from
float64's at most, in a standalone test over [-15, 5], and the softmax
closer to float64's than MLX's). A row's numbers do not depend on the other
rows of its call.

Scope: MLX's op is replaced in mx.fast once (`install`), but it computes
here only inside the forward pass of a model `install` was given (its class
wraps __call__ to say so, per thread), so other models (kept quantized, or
a test process's fixtures) compute as MLX does. Calls with sinks, other
dtypes, a stream of their own or a mask MLX would refuse go to MLX's op.
"""

import functools
import threading

import mlx.core as mx

from mlx_lm_plus import native

_inside = threading.local()  # .depth: forward passes of installed models running
_mlx_sdpa = None  # MLX's own op, once replaced


def install(model) -> None:
    """`model`'s forward passes compute float32 attention here (see the
    module doc). Idempotent."""
    global _mlx_sdpa
    if native.kernels() is None:
        return
    if _mlx_sdpa is None:
        _mlx_sdpa = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = scaled_dot_product_attention
    if not getattr(type(model), "_native_attention", False):
        model.__class__ = _with_native_attention(type(model))


def installed(model) -> bool:
    return getattr(type(model), "_native_attention", False)


@functools.lru_cache(maxsize=None)
def _with_native_attention(cls):
    @functools.wraps(cls.__call__)  # (its signature: taps.py reads a module's)
    def __call__(self, *args, **kwargs):
        depth = getattr(_inside, "depth", 0)
        _inside.depth = depth + 1
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            _inside.depth = depth

    return type(cls.__name__, (cls,), {"__call__": __call__, "_native_attention": True,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def scaled_dot_product_attention(q, k, v, *, scale, mask=None, sinks=None, stream=None,
                                 **rest):
    """mx.fast.scaled_dot_product_attention, computed by `attention` where
    it can (see the module doc)."""
    if (getattr(_inside, "depth", 0) and stream is None and sinks is None and not rest
            and q.dtype == mx.float32 and k.dtype == mx.float32 and v.dtype == mx.float32
            and q.ndim == 4 and k.ndim == 4 and v.ndim == 4 and _mask_ok(mask, q, k)
            and mx.default_device() == mx.cpu):
        return attention(q, k, v, scale, mask)
    return _mlx_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **rest)


def _mask_ok(mask, q, k) -> bool:
    """A mask `attention` takes as MLX would: none, "causal", or a boolean
    or floating array that broadcasts to (B, query heads, S, L)."""
    if mask is None or (isinstance(mask, str) and mask in ("", "causal")):
        return True
    if not isinstance(mask, mx.array) or mask.ndim > 4:
        return False
    if mask.dtype != mx.bool_ and mask.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return False
    want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return all(m in (1, w) for m, w in zip(mask.shape[::-1], want[::-1]))


def attention(q, k, v, scale: float, mask=None) -> mx.array:
    """Attention of float32 q (B, H, S, D) over k, v (B, Hkv, L, D) with
    the grouped-query convention (query head h reads KV head h // (H /
    Hkv)), as MLX's fallback computes it (see the module doc)."""
    B, H, S, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    # A group's query heads stacked as rows against their KV head.
    q = (q * mx.array(scale, q.dtype)).reshape(B, Hkv, G * S, D)
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = (mx.arange(L - S, L)[:, None] >= mx.arange(L)[None]) if mask else None
    if mask is not None:
        scores = scores.reshape(B, Hkv, G, S, L)
        if mask.ndim >= 3:  # (its head axis: one for all, or a query head each)
            mask = (mx.expand_dims(mask, -3) if mask.shape[-3] == 1
                    else mask.reshape(*mask.shape[:-3], Hkv, G, *mask.shape[-2:]))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(mx.float32).min, mx.float32))
        else:
            scores = scores + mask.astype(mx.float32)
        scores = scores.reshape(B, Hkv, G * S, L)
    probs = native.kernels().softmax(scores)
    return (probs @ v).reshape(B, H, S, v.shape[-1])
