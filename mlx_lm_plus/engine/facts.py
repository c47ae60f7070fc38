"""Facts of a loaded model that decide how its requests are served, worked
out once per model (under mx.distributed, agreed by every rank: a pipeline
rank judges its own layers)."""

from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_plus.cache.layers import is_plain_kv
from mlx_lm_plus.engine import taps
from mlx_lm_plus.engine.drafting import drafts_in_batch
from mlx_lm_plus.engine.quantized_batch import supports_quantized_batching
from mlx_lm_plus.engine.sampling import batches_seeded
from mlx_lm_plus.models.provider import own_vision, vision_of
from mlx_lm_plus.upstream import generation_batch_as_written, image_parts


def needs_checkpoints(model) -> bool:
    """Whether message-boundary checkpoints are worth storing.

    When every layer is a plain KVCache, any prefix of a stored entry can
    be had by trimming it, so checkpoints would only cost memory. Hybrid
    (ArraysCache) and sliding-window (RotatingKVCache) layers can't be
    trimmed reliably: for them the checkpoints are what makes reuse work.
    """
    return not all(is_plain_kv(c) for c in make_prompt_cache(model))


class ModelFacts:
    def __init__(self, group, cli_args):
        self.group = group
        self.cli_args = cli_args
        self._facts = {}  # (model key, what) -> see _per_model

    def _per_model(self, lm, what: str, compute):
        """`compute()` once for model `lm` (a fact of the model that never
        changes, not worth working out per request)."""
        key = (lm.key, what)
        if key not in self._facts:
            self._facts[key] = compute()
        return self._facts[key]

    def keep_checkpoints(self, lm) -> bool:
        # (Pipeline ranks hold layers of their own kinds: where any needs
        # checkpoints, all store them alike.)
        return self._per_model(lm, "checkpoints", lambda: not self.group.on_every_rank(
            not needs_checkpoints(lm.model)))

    def drafts_in_batch(self, lm) -> bool:
        """Whether `lm`'s draft model proposes inside its batch
        (speculation.py, drafting.py): plain KV (quantized by --kv-bits
        where the model's requests batch: is_batchable), sliding windows or
        recurrent layers its checking steps tap (taps.install_for_checking),
        a draft of the same kinds of layers (its recurrent ones tapped too;
        a vision model's text draft too), the GenerationBatch it was written
        for, one process.
        Else its requests take the sequential path, as upstream's do."""
        return lm.draft_model is not None and self._per_model(lm, "drafts in batch", lambda: (
            (self.cli_args.kv_bits is None or self.batches_quantized(lm))
            and not self.group.is_distributed and generation_batch_as_written()
            and drafts_in_batch(
                lm.model, lm.draft_model,
                tapped=taps.install_for_checking(lm.model) is not None,
                draft_tapped=taps.install_for_checking(lm.draft_model, prompts=False) is not None)))

    def batches_quantized(self, lm) -> bool:
        """Whether `lm`'s --kv-bits requests batch (quantized_batch.py)."""
        return self._per_model(lm, "quantized batching", lambda: self.group.on_every_rank(
            supports_quantized_batching(lm.model, self.cli_args.kv_group_size)))

    def is_batchable(self, lm, request, args) -> bool:
        """Whether a request joins its model's batch (else the sequential
        path serves it)."""
        # Image requests batch on models served through mlx-vlm (vision.py);
        # on mlx-lm's own vision models they are served sequentially, as
        # upstream does; on text-only models they fail in planning (no
        # batch to drain for that).
        # --kv-bits batches through quantized_batch.py where every layer
        # upstream would quantize is a plain KVCache. (The messages are
        # scanned for images last: this runs every loop turn for requests
        # set aside.)
        cli_args = self.cli_args
        return (
            lm.is_batchable
            # (A vision model's draft proposes in the batch or nowhere:
            # sequential.py's path never uses it.)
            and (lm.draft_model is None or vision_of(lm) is not None
                 or self.drafts_in_batch(lm))
            and (args.seed is None or batches_seeded(args.sampling))
            and (cli_args.kv_bits is None or self.batches_quantized(lm))
            and (not own_vision(lm) or not (
                request.request_type == "chat" and any(image_parts(request.messages))))
        )
