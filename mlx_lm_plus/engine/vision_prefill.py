"""A vision-language model's prompt at admission: its cache resumed where
images allow, and the images not cached yet through the vision tower and
prefilled (with their checkpoints), so that the batch or the sequential
path gets text only."""

import copy
import itertools
import time
from typing import Any, Callable

from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_lm_plus.cache.layers import trims_to_any_prefix
from mlx_lm_plus.models.provider import vision_of
from mlx_lm_plus.models.vlm_text import set_rope_delta


def resume(lm, plan, segments, cache, cached, *, step: int,
           progress: Callable[[Any], Callable[[int, int], None]], keep_checkpoints: bool,
           store: Callable, on_every_rank: Callable[[bool], bool],
           observe: Callable[[str, float], None]):
    """A vision-language model's cache, ready for the rest of `plan`.

    A cached prefix may not end inside an image (its positions come out
    of the vision tower): cut back to before the image. The cache gets
    the M-RoPE delta of its end, whatever entry it came from. Then the
    images not covered yet go through the vision tower and are prefilled
    here in chunks of `step` tokens (`progress(cache)`: the callback run
    after each chunk, which may cancel), storing a checkpoint at each
    segment end (`store(key, cache, kind)`) when `keep_checkpoints`; the
    rest of the prompt is text. Returns (cache, tokens reused from the
    store, tokens covered now).
    """
    vision, model = vision_of(lm), lm.model
    if vision is None:
        return cache, cached, cached
    images = plan.vision
    safe = images.safe_prefix(cached) if images is not None else cached
    if cache is not None and safe < cached:
        if on_every_rank(trims_to_any_prefix(cache)):
            trim_prompt_cache(cache, cached - safe)
        else:  # hybrid: its entries end at checkpoints, never in an image
            cache = None
    cached = safe if cache is not None else 0
    if cache is None:
        cache = make_prompt_cache(model)
    reused = cached
    if images is not None:
        vision.hits += sum(img.end <= cached for img in images.images)
    set_rope_delta(cache, images.delta_at(cached) if images is not None else 0)
    if images is not None and cached < images.end_of_images():
        tic = time.perf_counter()
        checkpoints = {}
        if keep_checkpoints:
            ends = itertools.accumulate(len(s) for s in segments[0][:-1])
            checkpoints = dict(zip(ends, segments[1]))

        def store_checkpoint(position):
            kept = copy.deepcopy(cache)
            set_rope_delta(kept, images.delta_at(position))
            store(plan.cache_key[:position], kept, checkpoints[position])

        cached = vision.prefill(
            model, plan.tokens, images, cache, cached, step,
            checkpoints=checkpoints, on_checkpoint=store_checkpoint, progress=progress(cache),
        )
        observe("vision_seconds", time.perf_counter() - tic)
    return cache, reused, cached
