"""Positions of a batch's speculative calls: at most MAX_POSITIONS a call,
and those a row wrote but did not keep, at the end of its KV, rolled into
its left padding (masked from then on, overwritten later), as
BatchKVCache.finalize does for a right-padded prompt."""

from typing import List

import mlx.core as mx

# Most positions (rows x width) one checking or drafting call computes: its
# logits are positions x vocabulary floats (512 x 152k: 311 MB), not in any
# budget.
MAX_POSITIONS = 512


def roll_into_padding(caches: List, padding: List[int]):
    """Row i's last padding[i] positions of every layer become left padding;
    then the left padding every row has is stripped (rolled rows' padding
    would otherwise only grow, and the KV, its attention and bytes with it)."""
    for c in caches:
        # (What BatchKVCache.finalize does after a right-padded prompt.)
        c.prepare(right_padding=padding)
        c.finalize()
    # (Every layer's padding is the same.)
    shared = int(mx.min(caches[0].left_padding).item())
    if shared > 0:
        for c in caches:
            strip_shared_padding(c, shared)


def strip_shared_padding(c, shared: int):
    """Drop `shared` positions of left padding every row of a BatchKVCache
    has (as its filter does when a row leaves)."""
    c.keys = c.keys[..., shared:, :]
    c.values = c.values[..., shared:, :]
    c._idx -= shared
    c.left_padding = c.left_padding - shared
