"""olmo_hybrid: the short convolutions ignore padding in batches.

`GatedDeltaNet._apply_conv1d` (mlx-lm 0.32.2) convolves the padded inputs of
shorter prompts in a BatchGenerator batch and keeps the conv window of the
padded end; the delta rule itself is masked, but the wrong windows make
every shorter prompt continue from a wrong state. qwen3_5's mixer gets this
right (masked inputs, per-row windows from `cache.lengths`); this does the
same for olmo_hybrid's three q/k/v convolutions.
"""

from mlx_lm.models import olmo_hybrid

from ._guard import Patch
from ._padding import batch_mask, padded_conv

_Net = olmo_hybrid.GatedDeltaNet


def _apply_conv1d(self, x, conv, conv_state, cache_slot, slot_idx):
    mask, lengths = batch_mask(cache_slot, x.shape[1])
    out, window = padded_conv(x, conv_state, conv, self.conv_kernel_size, mask, lengths)
    if cache_slot is not None:
        cache_slot[slot_idx] = window
    return out


# _Net._apply_conv1d is replaced if its source is 0.32.2's (sha256 of inspect.getsource).
PATCH = Patch(
    __name__,
    _Net,
    "_apply_conv1d",
    sha256="8eea8a5ce6f12c81c9ef6103347064db02f2cc50f00df4e599c3fae9ab5685a8",
    replacement=_apply_conv1d,
)
apply, revert = PATCH.apply, PATCH.revert
