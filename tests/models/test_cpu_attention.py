"""Attention on a CPU for models made float32 here (models/cpu_attention.py):
our softmax kernel and the grouped-query matmuls give MLX's numbers, with
every mask MLX takes, and only inside an installed model's forward pass.
(Its speed is the benchmark's: `python -m benchmarks.cpu_profile`.)"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_plus import native
from mlx_lm_plus.models import cpu_attention
from tests.models.test_cpu_decode import _quantized, needs_kernels

kernels = native.kernels()
pytestmark = needs_kernels
MIN = float(mx.finfo(mx.float32).min)


def mlx_sdpa(*args, **kwargs):
    """MLX's own op, whether or not ours replaced it in mx.fast."""
    return (cpu_attention._mlx_sdpa or mx.fast.scaled_dot_product_attention)(*args, **kwargs)


def rows_with_masked_values(width, seed):
    x = np.random.RandomState(seed).normal(0, 8, (5, width)).astype(np.float32)
    x[1, ::3] = -np.inf
    x[2, 1::2] = MIN
    x[3, :] = MIN  # (every value masked: uniform, as MLX's)
    return x


@pytest.mark.parametrize("width", [1, 2, 7, 8, 9, 16, 33, 100, 3000])
def test_the_softmax_kernel_equals_mlx_s(width):
    x = rows_with_masked_values(width, width)
    ours, theirs = np.array(kernels.softmax(mx.array(x))), np.array(mx.softmax(mx.array(x), -1))
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-7)
    # Against float64: within a few float32 roundings (MLX's own is 1e-5 off).
    wide = x.astype(np.float64)
    with np.errstate(invalid="ignore"):  # (width 1: a row of -inf, nan)
        exact = np.exp(wide - wide.max(-1, keepdims=True))
        exact /= exact.sum(-1, keepdims=True)
    np.testing.assert_allclose(ours, exact, rtol=5e-6, atol=1e-12)
    # Leading axes are rows; a row of -inf is nan throughout, as MLX's.
    np.testing.assert_array_equal(np.array(kernels.softmax(mx.array(x).reshape(5, 1, width))),
                                  ours.reshape(5, 1, width))
    empty = mx.full((2, width), -mx.inf)
    assert np.isnan(np.array(kernels.softmax(empty))).all()
    assert np.isnan(np.array(mx.softmax(empty, -1))).all()


def padded_mask(B, S, L, heads=1):
    """A batch's boolean mask: causal, rows left-padded by 0, 2, ..., the
    last by all but 3 positions (its first query rows of a longer call see
    nothing at all: MLX's finfo.min makes them uniform, not nan)."""
    q = mx.arange(L - S, L)[:, None]
    k = mx.arange(L)[None]
    rows = [(q >= k) & (k >= (2 * b if b < B - 1 else L - 3)) for b in range(B)]
    mask = mx.stack(rows)[:, None]
    return mx.broadcast_to(mask, (B, heads, S, L)) if heads > 1 else mask


MASKS = ["none", "causal", "padded", "padded per head", "additive", "additive 2-D"]


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("S", [1, 6])
def test_attention_equals_mlx_s(mask_kind, heads, kv_heads, S):
    """Batches of 3 rows, keys and values read from a larger buffer (as a
    KV cache hands them), each mask MLX takes: MLX's numbers to rounding."""
    B, L, D = 3, 50, 16
    rng = np.random.RandomState(heads * 10 + S)
    q = mx.array(rng.normal(0, 1, (B, heads, S, D)).astype(np.float32))
    buffer = mx.array(rng.normal(0, 1, (2, B, kv_heads, L + 14, D)).astype(np.float32))
    k, v = buffer[0, :, :, :L, :], buffer[1, :, :, :L, :]
    mask = {"none": None, "causal": "causal", "padded": padded_mask(B, S, L),
            "padded per head": padded_mask(B, S, L, heads),
            "additive": mx.array(rng.normal(0, 2, (B, 1, 1, L)).astype(np.float32)),
            "additive 2-D": mx.array(rng.normal(0, 2, (S, L)).astype(np.float32))}[mask_kind]
    if mask_kind == "padded per head":  # (heads masked differently)
        mask = mask & (mx.arange(heads)[None, :, None, None] != mx.arange(L)[None, None, None])
    ours = cpu_attention.attention(q, k, v, 0.25, mask)
    theirs = mlx_sdpa(q, k, v, scale=0.25, mask=mask)
    assert ours.shape == theirs.shape == (B, heads, S, D)
    assert not np.isnan(np.array(ours)).any()
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-5)


def _float32_pair(fixture_path, monkeypatch):
    """The quantized fixture made float32 by weights_for_cpu (ours
    installed), and the same weights in a model without ours."""
    from mlx_lm_plus.models import cpu

    model, tok = _quantized(fixture_path)
    plain, _ = _quantized(fixture_path)
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    assert cpu.weights_for_cpu(model)
    from mlx_lm.utils import dequantize_model

    cpu._float32_scales(plain)
    dequantize_model(plain)
    plain.set_dtype(mx.float32)
    return model, plain, tok


def test_only_an_installed_model_s_forward_pass_computes_here(fixture_path, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache

    model, plain, tok = _float32_pair(fixture_path, monkeypatch)
    assert cpu_attention.installed(model) and not cpu_attention.installed(plain)
    assert mx.fast.scaled_dot_product_attention is cpu_attention.scaled_dot_product_attention
    calls = []
    real = cpu_attention.attention

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(cpu_attention, "attention", counted)
    prompt = mx.array(tok.encode("Seven brass lanterns on the harbour wall."))[None]

    def logits(m):
        cache = make_prompt_cache(m)
        first = m(prompt, cache=cache)[:, -1]
        return first, m(mx.array([[7]]), cache=cache)[:, -1]

    ours = logits(model)
    assert len(calls) == 2 * 2  # (two layers, the prompt and a step)
    theirs = logits(plain)
    assert len(calls) == 4  # (a model not installed: MLX's op)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    # Outside any forward pass, and inside one with what it does not take
    # (other dtypes, sinks), MLX's op computes.
    q = mx.random.normal((1, 2, 3, 16))
    assert mx.array_equal(mx.fast.scaled_dot_product_attention(q, q, q, scale=0.5),
                          mlx_sdpa(q, q, q, scale=0.5)).item()
    assert len(calls) == 4
    cpu_attention._inside.depth = 1
    try:
        half = q.astype(mx.float16)
        assert mx.array_equal(mx.fast.scaled_dot_product_attention(half, half, half, scale=0.5),
                              mlx_sdpa(half, half, half, scale=0.5)).item()
        sinks = mx.zeros((2,))
        assert mx.array_equal(
            mx.fast.scaled_dot_product_attention(q, q, q, scale=0.5, sinks=sinks),
            mlx_sdpa(q, q, q, scale=0.5, sinks=sinks)).item()
        assert len(calls) == 4
    finally:
        cpu_attention._inside.depth = 0
