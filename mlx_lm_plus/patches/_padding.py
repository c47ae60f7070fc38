"""Padding-aware pieces shared by the SSM mixer patches (as mamba2 does it).

In a BatchGenerator batch an ArraysCache knows each row's left padding and,
during right-padded prefill chunks, its real length; `make_mask(T)` says
which of the T positions are real.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache


def batch_mask(cache, T):
    """(mask of real positions or None, lengths or None) for this chunk."""
    if isinstance(cache, ArraysCache):
        return cache.make_mask(T), cache.lengths
    return None, None


def padded_conv(x, conv_cache, conv1d, K, mask, lengths):
    """silu(conv1d) over [window, x] with padded inputs zeroed; returns the
    output and each row's new window (ending at its own last real token)."""
    B, T, C = x.shape
    if mask is not None:
        x = mx.where(mask[..., None], x, 0)
    if conv_cache is None:
        conv_cache = mx.zeros((B, K - 1, C), dtype=x.dtype)
    x_full = mx.concatenate([conv_cache, x], axis=1)
    if lengths is not None:
        ends = mx.clip(lengths, 0, T)
        positions = (ends[:, None] + mx.arange(K - 1))[..., None]
        window = mx.take_along_axis(x_full, positions, axis=1)
    else:
        window = x_full[:, -(K - 1) :, :]
    return nn.silu(conv1d(x_full)), window


def mixer_inputs(block, x, cache):
    """The shared front of the Mamba-style mixers (in_proj, masked conv).

    Returns (x after the conv, z, new conv window, mask, state, T).
    """
    T = x.shape[1]
    mask, lengths = batch_mask(cache, T)
    conv_cache, state = (cache[0], cache[1]) if cache is not None else (None, None)
    x, z = block.in_proj(x).split(indices_or_sections=2, axis=-1)
    x, window = padded_conv(x, conv_cache, block.conv1d, block.conv_kernel_size, mask, lengths)
    return x, z, window, mask, state, T


def hold_padded(new_state, old_state, mask, t):
    """The state after step t: unchanged where position t is padding."""
    if mask is None:
        return new_state
    if old_state is None:
        old_state = mx.zeros_like(new_state)
    keep = mask[:, t].reshape(-1, *([1] * (new_state.ndim - 1)))
    return mx.where(keep, new_state, old_state)


def store(cache, conv_window, state, T):
    if isinstance(cache, ArraysCache):
        cache[0] = conv_window
        cache[1] = state
        cache.advance(T)
