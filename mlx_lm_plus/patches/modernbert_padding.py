"""modernbert: a padded batch in float16 turns into NaN; in bfloat16 or
float16 it doesn't run at all.

`ModernBertModel._update_attention_mask` in mlx-embeddings 0.1.0 makes
additive masks (0, and -1e9 on a padded key or one outside the sliding
window) in the dtype of the attention mask it is given:
  * a float32 mask (what the server passes, and what the padding of a
    batch gives) with bfloat16 or float16 weights fails in
    `mx.fast.scaled_dot_product_attention` ("Mask type must promote to
    output type");
  * in float16, -1e9 is -inf. A padded position more than half a window
    past its row's last token sees no key in a local layer: every score is
    -inf, and its output is NaN. In the next layer, a real position gives
    that padded key weight 0, and 0 * NaN is NaN: the row's vectors are NaN.
This version makes boolean masks (True: attend), which the attention takes
at any dtype, with every position allowed to attend to itself: a real
position's keys are what upstream's are (its own position is a real key in
its window), and a padded one always has a key (MLX's CPU attention gives a
boolean row with no key finite values, but a GPU kernel need not). In
float32 a real position's hidden states are upstream's.
"""

import mlx.core as mx
from mlx_embeddings.models import modernbert

from ._guard import Patch

_Model = modernbert.ModernBertModel


def _update_attention_mask(self, attention_mask):
    seq_len = attention_mask.shape[1]
    positions = mx.arange(seq_len)
    itself = positions[:, None] == positions[None, :]  # (seq_len, seq_len)
    # (batch_size, 1, seq_len, seq_len): the real keys, and the query's own position.
    global_attention_mask = (attention_mask == 1)[:, None, None, :] | itself
    # transformers' window: |i - j| <= local_attention // 2, as upstream's.
    window = mx.abs(positions[:, None] - positions[None, :]) <= self.config.local_attention // 2
    sliding_window_mask = global_attention_mask & window
    return global_attention_mask, sliding_window_mask


# _Model._update_attention_mask is replaced if its source is 0.1.0's.
PATCH = Patch(
    __name__,
    _Model,
    "_update_attention_mask",
    sha256="59a98d62bf794d84ad9acf20750bfe663a28febae26b1e2fc6fa64461a36694f",
    replacement=_update_attention_mask,
    package="mlx-embeddings",
    written_for="0.1.0",
    # Boolean masks are masks only where they reach
    # mx.fast.scaled_dot_product_attention (an attention that added them to
    # the scores would mask nothing): the model's and attention's calls too.
    depends_on=[
        (_Model, "__call__", "6c3260b833a1e264f914c48a4f41fac0d3d171612e8261053e2dd57ff41f7f27"),
        (modernbert.ModernBertAttention, "__call__",
         "e3cb37f071d81b0b1e175920a381dfced5fa67a95c15ffcde539c551c2c287d7"),
    ],
)
apply, revert = PATCH.apply, PATCH.revert
