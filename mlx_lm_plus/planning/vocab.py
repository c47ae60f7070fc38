"""A request's token ids against a model's vocabulary."""

from mlx_lm_plus.errors import RequestError


def check_vocab(top_k, logit_bias, vocab_size: int) -> None:
    """top_k and logit_bias ids against the model's vocabulary: upstream's
    top-k sampler fails on the generation thread and kills it, and an id out
    of range is written out of bounds (MLX does not check). Here before the
    request is queued when its model is loaded, else by the engine once it
    is."""
    # (Upstream's apply_top_k takes 0 < top_k < vocab_size, and raises inside
    # a compiled function that leaves MLX's random state broken.)
    if top_k >= vocab_size:
        raise RequestError(f"top_k must be less than {vocab_size}")
    if logit_bias:
        bad = [t for t in logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"logit_bias token ids must be in [0, {vocab_size}), got {bad[0]}"
            )
