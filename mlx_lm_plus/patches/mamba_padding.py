"""mamba (v1, and falcon_mamba): the mixer ignores padding in batches.

BatchGenerator prefills prompts of different lengths together: merged caches
carry `left_padding`, and right-padded prefill chunks carry `lengths`
(`ArraysCache.make_mask` combines both). mlx-lm 0.32.2's `MambaBlock` runs
the convolution and the recurrent scan over the padding as if it were input,
and keeps the conv window of the padded end, so in a batch every shorter
prompt continues from a wrong state. This version masks the padded inputs,
holds the state through padded steps, keeps each row's conv window at its
own last real token, and advances the cache, as mamba2's mixer does.
"""

import mlx.core as mx
from mlx_lm.models import mamba
from mlx_lm.models.activations import swiglu

from ._guard import Patch
from ._padding import hold_padded, mixer_inputs, store

_Block = mamba.MambaBlock


def __call__(self, x, cache):
    x, z, window, mask, state, T = mixer_inputs(self, x, cache)
    A = -mx.exp(self.A_log)
    ys = []
    for t in range(T):
        y_t, new_state = self.ssm_step(x[:, t], A, state)
        state = hold_padded(new_state, state, mask, t)
        ys.append(y_t)
    out = self.out_proj(swiglu(z, mx.stack(ys, axis=1)))
    store(cache, window, state, T)
    return out


# _Block.__call__ is replaced if its source is 0.32.2's (sha256 of inspect.getsource).
PATCH = Patch(
    __name__,
    _Block,
    "__call__",
    sha256="d02561af881d636abd6da3bdcc26afc5385cf1d89e05646b36a127b31a948f35",
    replacement=__call__,
)
apply, revert = PATCH.apply, PATCH.revert
