"""modernbert: the MLP's GELU is the tanh approximation, not ModernBERT's.

ModernBERT's configs say `hidden_activation: "gelu"`, which transformers
runs as the exact GELU (x * Phi(x), through erf). `ModernBertMLP` in
mlx-embeddings 0.1.0 makes `nn.GELU(approx="precise")`, which in MLX is the
tanh approximation (`gelu_approx`, up to 4.7e-4 off): every layer's MLP
drifts from the model's, and the tiny 3-layer fixture's vectors move by
5e-5 (more in a real model's 22 layers). This version runs upstream's MLP
with the exact GELU. (`__call__` is replaced rather than `__init__`, where
the activation is chosen, so that a model loaded before `apply()` runs the
exact GELU too.)
"""

import mlx.nn as nn
from mlx_embeddings.models import modernbert

from ._guard import Patch

_MLP = modernbert.ModernBertMLP


def __call__(self, hidden_states):
    x = self.Wi(hidden_states)
    split_dim = x.shape[-1] // 2
    input, gate = x[:, :, :split_dim], x[:, :, split_dim:]
    return self.Wo(self.drop(nn.gelu(input) * gate))


# _MLP.__call__ is replaced if its source is 0.1.0's.
PATCH = Patch(
    __name__,
    _MLP,
    "__call__",
    sha256="85ba66c8cb74dfd3287557438d30cab60b3e860ff76d5023acecd4dd75e2ae04",
    replacement=__call__,
    package="mlx-embeddings",
    written_for="0.1.0",
    # (The approximation is chosen in __init__: one that changed may have
    # fixed it, and this patch would then not apply.)
    depends_on=[(_MLP, "__init__",
                 "9558897be7610177a39f225bf3bf049f348b53015d740397a9f11c3f311c728d")],
)
apply, revert = PATCH.apply, PATCH.revert
