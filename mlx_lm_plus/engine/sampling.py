"""A row's sampling, for the batch: make_sampler's filters as a value the
batch can reuse (RowSampling), and a seeded request's own random state
(SeededSampler).

Upstream serves a request with `seed` alone, after mx.random.seed(seed):
its draws come from the global random state, so batched with others they
would depend on what else drew. Here the row keeps its own key, started as
mx.random.seed(seed) starts the global one and split as MLX splits that one
at every draw (KeySequence: the state becomes the first half of a split,
the draw uses the second), so a seeded request writes the same text alone,
in any batch, after a restart, and as upstream's sequential path writes it.
Its filters are upstream's own (top_p, min_p, top_k, in make_sampler's
order); XTC, which draws inside a compiled upstream function, is not
offered here (facts.is_batchable keeps such requests sequential).

Prompt lookup (speculation.py) needs the distribution a row draws from, not
only a draw: RowSampling.log_weights gives it.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class RowSampling:
    """make_sampler's settings, XTC aside; temperature 0 is greedy."""
    temperature: float
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0

    @classmethod
    def of(cls, sampling) -> "RowSampling":
        return cls(sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k)

    def log_weights(self, logprobs: mx.array) -> mx.array:
        """make_sampler's filters, in its order, then the temperature: the
        logits its categorical draw is made from."""
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, 1)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs * (1.0 / self.temperature)


class SeededSampler:
    def __init__(self, sampling, seed: int):
        if sampling.xtc_probability > 0:
            raise ValueError("XTC draws from the global random state")
        self.key = mx.random.key(seed)
        self.sampling = RowSampling.of(sampling)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(self.sampling.log_weights(logprobs), key=draw)


def batches_seeded(sampling) -> bool:
    """Whether a seeded request's sampling can run in the batch (its own
    state): not with XTC, at any temperature (one rule a client can read in
    the docs, not one that moves with the temperature)."""
    return sampling.xtc_probability <= 0
