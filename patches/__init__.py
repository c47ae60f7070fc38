"""Fixes to upstream mlx-lm 0.32.2 behaviour, one module per bug.

Each module has `apply()` (idempotent) and `revert()`, and a test in
tests/test_patches.py that fails without it. `apply_all()` runs at import of
mlx_lm_plus.engine.
"""

from . import jamba_padding, mamba_padding, nemotron_h_ssm_lengths, olmo_hybrid_conv_padding

PATCHES = [
    nemotron_h_ssm_lengths,
    mamba_padding,
    jamba_padding,
    olmo_hybrid_conv_padding,
]


def apply_all():
    for patch in PATCHES:
        patch.apply()
