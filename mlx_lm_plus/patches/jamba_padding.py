"""jamba: the Mamba mixer ignores padding in batches.

The same bug as mamba v1 (see mamba_padding.py): `JambaMambaMixer` in
mlx-lm 0.32.2 convolves and scans over the padding of shorter prompts in a
BatchGenerator batch, so their continuation is wrong. This version follows
upstream's mixer step by step, with padded inputs zeroed, the state held
through padded steps, per-row conv windows, and the cache advanced.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import jamba
from mlx_lm.models.activations import swiglu

from ._guard import Patch
from ._padding import hold_padded, mixer_inputs, store

_Mixer = jamba.JambaMambaMixer


def __call__(self, x, cache):
    x, z, window, mask, state, T = mixer_inputs(self, x, cache)

    # Upstream's ssm_step, with the scan written out so padded steps hold.
    A = -mx.exp(self.A_log)
    delta, B, C = mx.split(
        self.x_proj(x),
        [self.time_step_rank, self.time_step_rank + self.ssm_state_size],
        axis=-1,
    )
    delta, B, C = self.dt_layernorm(delta), self.b_layernorm(B), self.c_layernorm(C)
    delta = nn.softplus(self.dt_proj(delta))
    inputs = mx.expand_dims(delta * x, -1) * mx.expand_dims(B, -2)
    dtA = mx.exp(mx.expand_dims(delta, -1) * A)
    states = []
    for t in range(T):
        new_state = inputs[:, t] if state is None else jamba.fma(state, dtA[:, t], inputs[:, t])
        state = hold_padded(new_state, state, mask, t)
        states.append(state)
    y = (mx.stack(states, axis=1) @ mx.expand_dims(C, -1)).squeeze(-1) + self.D * x
    out = self.out_proj(swiglu(z, y))
    store(cache, window, state, T)
    return out


# _Mixer.__call__ is replaced if its source is 0.32.2's (sha256 of inspect.getsource).
PATCH = Patch(
    __name__,
    _Mixer,
    "__call__",
    sha256="43e7cd73cb997d506661372b568cf46ba7b3f577aac29135b7d8f8573f26e64f",
    replacement=__call__,
)
apply, revert = PATCH.apply, PATCH.revert
