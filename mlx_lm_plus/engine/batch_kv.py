"""Positions of a batch's speculative calls: at most MAX_POSITIONS a call;
those a row wrote but did not keep, at the end of its KV, trimmed from every
row alike (trim_end) or rolled into the row's left padding (masked from then
on, overwritten later), as BatchKVCache.finalize does for a right-padded
prompt.

Sliding-window layers (mlx-lm's BatchRotatingKVCache: Gemma 3's, gpt-oss's)
take both, right after a call of several positions
(`in_temporal_order` before it): the call leaves the window before its
first position and its positions in the buffer, in order; what is trimmed is
cut off the buffer, and what is rolled sits at its front, where the next
update's trim of the front takes it away before any of the window it
holds."""

from typing import List

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache, dynamic_roll

# Most positions (rows x width) one checking or drafting call computes: its
# logits are positions x vocabulary floats (512 x 152k: 311 MB), not in any
# budget.
MAX_POSITIONS = 512


def _sliding(c) -> bool:
    return isinstance(c, (RotatingKVCache, BatchRotatingKVCache))


def in_temporal_order(caches: List):
    """Each sliding-window layer's buffer in the order of its positions,
    before a call of several positions. mlx-lm reorders it in that call's
    update, but its mask, made before, takes the buffer's front trim from
    the write index of a wrapped buffer (BatchRotatingKVCache.make_mask):
    a row with left padding would lose its oldest position. Upstream never
    makes such a call on a wrapped batch (its prompts are prefilled apart)."""
    for c in caches:
        if isinstance(c, BatchRotatingKVCache) and c.keys is not None:
            c._temporal_order()


def trim_end(c, n: int):
    """The last n positions off a KV layer (c.trim), cut off a sliding-window
    layer's buffer too: mlx-lm's rotating caches only move their write index
    back (their trim is meant for before the window fills: is_trimmable),
    and their next one-token update would trim the buffer's front by its
    length and write over its start, the trimmed positions still attended.
    Right after a call of several positions (or on a row extracted after
    one): its buffer is in order and holds the window before them."""
    c.trim(n)
    if _sliding(c) and c.keys is not None and c._idx < c.keys.shape[2]:
        c.keys = c.keys[..., :c._idx, :]
        c.values = c.values[..., :c._idx, :]


def roll_into_padding(caches: List, padding: List[int]):
    """Row i's last padding[i] positions of every layer become left padding;
    then the left padding every row of a plain layer has is stripped (rolled
    rows' padding would otherwise only grow, and the KV, its attention and
    bytes with it; a sliding window's buffer has its front trimmed as it
    goes)."""
    plain = []
    for c in caches:
        if isinstance(c, BatchRotatingKVCache):
            # (Its buffer holds just its positions, in order: trim_end.)
            shifts = mx.array(padding)
            c.keys = dynamic_roll(c.keys, shifts[:, None], axis=2)
            c.values = dynamic_roll(c.values, shifts[:, None], axis=2)
            c.left_padding = c.left_padding + shifts
            c.offset = c.offset - shifts
            continue
        # (What BatchKVCache.finalize does after a right-padded prompt.)
        c.prepare(right_padding=padding)
        c.finalize()
        plain.append(c)
    if not plain:
        return
    # (Every plain layer's padding is the same.)
    shared = int(mx.min(plain[0].left_padding).item())
    if shared > 0:
        for c in plain:
            strip_shared_padding(c, shared)


def strip_shared_padding(c, shared: int):
    """Drop `shared` positions of left padding every row of a BatchKVCache
    (or a BatchQuantizedKVCache: its keys and values quantized tuples) has,
    as its filter does when a row leaves."""
    c.keys, c.values = tree_map(lambda x: x[..., shared:, :], (c.keys, c.values))
    c._idx -= shared
    c.left_padding = c.left_padding - shared
