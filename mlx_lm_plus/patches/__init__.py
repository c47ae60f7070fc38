"""Fixes to upstream mlx-lm 0.32.2 behaviour (and mlx-embeddings 0.1.0's:
the modernbert_ ones), one module per bug.

Each module replaces one upstream function through a `_guard.Patch`, which
checks that the function in place is the version's it was written for (a
hash of its source) and otherwise logs a warning and leaves it alone. Each
has `apply()` (idempotent; True if the patch is in place) and `revert()`,
and a test in tests/test_patches.py that fails without it.

Nothing is patched on import: `Engine.start()` calls `apply_all()`, and so
must any other code that runs these models without an engine.
"""

import logging

from . import (
    batched_logits_processors,
    jamba_padding,
    mamba_padding,
    nemotron_h_ssm_lengths,
    olmo_hybrid_conv_padding,
)

PATCHES = [
    nemotron_h_ssm_lengths,
    mamba_padding,
    jamba_padding,
    olmo_hybrid_conv_padding,
    batched_logits_processors,
]

try:  # (an mlx-embeddings that doesn't import, or has other names, is not fixed here)
    from . import modernbert_gelu, modernbert_padding

    PATCHES += [modernbert_padding, modernbert_gelu]
except Exception as e:
    logging.getLogger("mlx_lm_plus.patches").warning(
        f"mlx-embeddings' ModernBERT patches not applied: {e}")


def apply_all():
    """Apply every patch that matches the installed mlx-lm (mlx-embeddings); idempotent.

    Returns {patch module name: applied}.
    """
    return {patch.PATCH.name: patch.apply() for patch in PATCHES}
