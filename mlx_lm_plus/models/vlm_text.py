"""The language model inside a vision-language model, as mlx-lm's
BatchGenerator drives it (tokens in, logits out), and the KV caches it runs
on. A room apart from the image side (vision.py): this is what the batch,
the prompt store and the disk tier see of a vision model, and the cache
classes here are named in disk entries (cache/disk.py rebuilds them by
name).

Qwen2-VL's multimodal RoPE ("M-RoPE") gives image tokens 3-D positions
that advance by less than the number of image tokens; every token after an
image is at `index + rope_delta`. mlx-vlm keeps that delta on the shared
model object, which breaks as soon as two requests take turns. Here the
delta travels with each request's cache instead (`MRopeKVCache`, and
`MRopeBatchKVCache` per row of a batch), and positions are always passed
explicitly, so the model's own state is never read.

Qwen3.5 and Qwen3.5-MoE (hybrid: gated delta layers between attention layers) run
mlx-lm's own language model instead, on mlx-vlm's weights
(`HybridTextModel`); its image prompts get checkpoints at each image's end,
since a hybrid cache can't be cut back.

Gemma 3 and Idefics3/SmolVLM have no M-RoPE: the image features take the
place of the placeholders' embeddings and positions stay plain
(`PlainTextModel`, mlx-vlm's language model on mlx-lm's caches, so the
sliding-window layers of Gemma 3 batch as mlx-lm's rotating caches do).
"""

from typing import Any, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlx_lm_plus.logs import warn_once


# -- caches that carry the M-RoPE delta --


class MRopeKVCache(KVCache):
    """A KVCache plus the M-RoPE position delta of the tokens it holds."""

    def __init__(self, rope_delta: int = 0):
        super().__init__()
        self.rope_delta = rope_delta

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Not quantized (--kv-bits): KVCache.to_quantized would give a
        QuantizedKVCache without the delta, and every position after an
        image would be wrong. The layer stays as it is."""
        warn_once("--kv-bits: vision models' M-RoPE layers are not quantized")
        return self

    @classmethod
    def merge(cls, caches):
        return MRopeBatchKVCache.merge(caches)


class MRopeBatchKVCache(BatchKVCache):
    """BatchKVCache with one M-RoPE delta per row, kept through filter/extend."""

    def __init__(self, left_padding, rope_deltas=None):
        super().__init__(left_padding)
        n = len(left_padding)
        self.rope_deltas = mx.array(rope_deltas if rope_deltas is not None else [0] * n)

    @classmethod
    def merge(cls, caches):
        deltas = [getattr(c, "rope_delta", 0) for c in caches]
        if max(c.size() for c in caches) == 0:
            batch = cls([0] * len(caches))
        else:
            batch = BatchKVCache.merge.__func__(cls, caches)
        batch.rope_deltas = mx.array(deltas)
        return batch

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self.rope_deltas = self.rope_deltas[mx.array(batch_indices)]

    def extend(self, other):
        super().extend(other)
        self.rope_deltas = mx.concatenate([self.rope_deltas, other.rope_deltas])

    def extract(self, idx):
        c = super().extract(idx)
        out = MRopeKVCache(int(self.rope_deltas[idx].item()))
        out.keys, out.values, out.offset = c.keys, c.values, c.offset
        return out


def set_rope_delta(cache: List[Any], delta: int) -> None:
    for c in cache:
        c.rope_delta = delta


class TextModel(nn.Module):
    """The language model as BatchGenerator drives it: tokens in, logits out.

    Text tokens' M-RoPE positions are the same on all three axes:
    offset + delta, per row.
    """

    def __init__(self, vlm):
        super().__init__()
        self.vlm = vlm
        self.language_model = vlm.language_model

    @property
    def layers(self):
        return self.language_model.model.layers

    def make_cache(self):
        return [MRopeKVCache() for _ in self.layers]

    def __call__(self, inputs, cache=None, input_embeddings=None):
        c = cache[0]
        if isinstance(c, MRopeBatchKVCache):
            base = (c.offset + c.rope_deltas)[:, None]
        else:
            base = c.offset + c.rope_delta
        positions = mx.arange(inputs.shape[1])[None] + base
        out = self.language_model(
            inputs, inputs_embeds=input_embeddings, cache=cache, position_ids=positions
        )
        return out.logits

    def prefill_chunk(self, ids, embeddings, cache, positions, **extra):
        """A stretch of prompt with images, at explicit 3-D positions."""
        self.language_model(ids, inputs_embeds=embeddings, cache=cache,
                            position_ids=positions, **extra)


class _Unquantized:
    """A layer of mlx-vlm's language models left as it is under --kv-bits,
    as the M-RoPE layers: mlx-vlm's attention on mlx-lm's quantized caches,
    batched or not, is not what these models are tested on (and mlx-lm's
    RotatingKVCache.to_quantized raises: every Gemma 3 request a 500)."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        warn_once("--kv-bits: vision models' layers are not quantized")
        return self


class PlainKVCache(_Unquantized, KVCache):
    """mlx-lm's KVCache for mlx-vlm's language models, not quantized."""


class PlainRotatingKVCache(_Unquantized, RotatingKVCache):
    """A sliding-window layer (Gemma 3), not quantized."""


class PlainTextModel(nn.Module):
    """mlx-vlm's language model of a family without M-RoPE, on mlx-lm's
    caches (which BatchGenerator merges and the prompt store keeps)."""

    def __init__(self, vlm):
        super().__init__()
        self.language_model = vlm.language_model

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self):
        # mlx-vlm's own cache classes have no batch counterparts in mlx-lm:
        # the same layout in mlx-lm's classes (full or sliding window).
        make = getattr(self.language_model, "make_cache", None)
        if make is None:
            return [PlainKVCache() for _ in self.layers]
        return [PlainRotatingKVCache(max_size=c.max_size, keep=c.keep)
                if hasattr(c, "max_size") else PlainKVCache() for c in make()]

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache).logits

    def prefill_chunk(self, ids, embeddings, cache, positions, **extra):
        self.language_model(ids, inputs_embeds=embeddings, cache=cache)


class _Positions:
    """Where the next tokens sit, read by every attention layer's rotary
    embedding during one forward pass: the request's M-RoPE delta (text,
    per row in a batch) or explicit 3-D positions (a stretch with images)."""

    delta: Any = 0
    ids: Any = None


class ShiftedRoPE(nn.Module):
    """mlx-lm's rotary embedding at offset + the M-RoPE delta, or mlx-vlm's
    multimodal one at explicit positions. For text tokens the three M-RoPE
    axes are equal, and M-RoPE at (p, p, p) is plain RoPE at p."""

    def __init__(self, rope, mrope, positions: _Positions):
        super().__init__()
        self.rope = rope
        self._mrope = mrope  # underscored: not a parameter of the model
        self._positions = positions

    def __call__(self, x, offset=0):
        p = self._positions
        if p.ids is not None:
            return self._mrope.apply_rotary(x, x, p.ids)[0]
        return self.rope(x, offset=offset + p.delta)


class HybridTextModel(nn.Module):
    """Qwen3.5's language model as mlx-lm implements it, for a Qwen3.5
    checkpoint with vision.

    mlx-lm's qwen3_5 is what BatchGenerator, the hybrid caches (ArraysCache
    for the gated delta layers) and our checkpoints are built and tested
    on; mlx-vlm's own language model brings its own cache classes and batch
    code. So text steps and image prefill both run mlx-lm's model, with the
    weights mlx-vlm loaded (shared, not copied), and only the rotary
    embedding of its attention layers made M-RoPE aware (ShiftedRoPE).
    """

    def __init__(self, lm, vlm):
        super().__init__()
        self.lm = lm
        self._positions = _Positions()
        vlm_layers = vlm.language_model.model.layers
        # (All layers by number: a pipeline rank has None for the others'.)
        for layer, vlm_layer in zip(lm.language_model.model.layers, vlm_layers):
            if layer is not None and not layer.is_linear:
                attn = layer.self_attn
                attn.rope = ShiftedRoPE(attn.rope, vlm_layer.self_attn.rotary_emb,
                                        self._positions)

    @property
    def layers(self):
        return self.lm.layers

    def make_cache(self):
        return [MRopeKVCache() if isinstance(c, KVCache) else c for c in self.lm.make_cache()]

    def __call__(self, inputs, cache=None, input_embeddings=None):
        self._positions.delta = _rope_delta(cache)
        return self.lm(inputs, cache=cache, input_embeddings=input_embeddings)

    def prefill_chunk(self, ids, embeddings, cache, positions, **extra):
        self._positions.ids = positions
        try:
            self.lm(ids, cache=cache, input_embeddings=embeddings)
        finally:
            self._positions.ids = None


def _rope_delta(cache):
    """The M-RoPE delta of a cache list (per row for a batch), 0 if none."""
    for c in cache or ():
        if isinstance(c, MRopeBatchKVCache):
            return c.rope_deltas
        if isinstance(c, MRopeKVCache):
            return c.rope_delta
    return 0
