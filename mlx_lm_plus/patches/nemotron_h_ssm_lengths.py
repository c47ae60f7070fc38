"""nemotron_h: the Mamba2 mixer ignores `cache.lengths` in its SSM update.

BatchGenerator prefills prompts of different lengths together, right-padded,
and tells each cache the real lengths (`ArraysCache.prepare(lengths=...)`).
mlx-lm's `mamba2` passes `cache.lengths` to `ssm_update`, so the state stops
at each prompt's last real token. `nemotron_h`'s mixer (0.32.2) does not:
the padding runs through the state of every shorter prompt, and batched
greedy output differs from the same prompt alone. This passes the lengths,
as mamba2 does. (Its `_conv` already honours them.)
"""

from mlx_lm.models import nemotron_h
from mlx_lm.models.ssm import ssm_update

from ._guard import Patch

_Mixer = nemotron_h.NemotronHMamba2Mixer


def _ssm(self, hidden_states, B, C, dt, cache, mask):
    batch_size, seq_len, _ = hidden_states.shape
    hidden_states = hidden_states.reshape(batch_size, seq_len, self.num_heads, self.head_dim)
    B = B.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
    C = C.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
    state, lengths = (cache[1], cache.lengths) if cache else (None, None)
    y, state = ssm_update(
        hidden_states,
        self.A_log,
        B,
        C,
        self.D.astype(hidden_states.dtype),
        dt,
        self.dt_bias,
        state,
        self.time_step_limit,
        mask,
        lengths,
    )
    if cache:
        cache[1] = state
    return y.reshape(batch_size, seq_len, self.intermediate_size)


# _Mixer._ssm is replaced if its source is 0.32.2's (sha256 of inspect.getsource).
PATCH = Patch(
    __name__,
    _Mixer,
    "_ssm",
    sha256="128a6221b8e1087cf09f211d0a1326b18ab440530e2085fbafbd871bf649ac0b",
    replacement=_ssm,
)
apply, revert = PATCH.apply, PATCH.revert
