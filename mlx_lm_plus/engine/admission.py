"""A request's admission into a batch, on the generation thread: its plan
(made here when it could not be made ahead), its cached prefix from the
store, and on vision-language models its images through the vision tower
and prefilled. `prepare` hands back the `Admission` a batch inserts (or
PARKED, or None when the request was answered here); `count` answers a
count_tokens request with its context alone.

Both use only the runner host (host.RunnerHost): the engine's loop decides
where a request goes, this module what it takes to get it there.
"""

import logging

from mlx_lm_plus.engine.distributed import ends_the_group
from mlx_lm_plus.engine.handoffs import PARKED, Admission
from mlx_lm_plus.engine.host import RunnerHost
from mlx_lm_plus.engine.segments import prefill_chunk, with_divergence
from mlx_lm_plus.engine.vision_prefill import resume
from mlx_lm_plus.errors import Cancelled, PromptError, is_out_of_memory
from mlx_lm_plus.models.provider import vision_of


def prepare(host: RunnerHost, lm, channel, request, args, planned=None, batch=None,
            between_chunks=None):
    """A request's admission into the batch: its plan, its cached prefix
    and, on vision-language models, its images through the vision tower
    and prefilled (unless the cache covers them; `between_chunks`: see
    _resume). Errors that are the request's own are answered here
    (None); others raise for the admission guard. `batch`: (the _Batch,
    the request as queued), which may hold it back before anything is
    fetched (PARKED), and whose requests may store its divergence
    checkpoint already."""
    planner = host.planner
    try:
        planned = planner.for_model(lm, request, args, planned)
    except PromptError as e:
        channel.put(e)
        return None
    plan = planned.plan
    depth, divergence = planner.shared_depth(lm, plan)
    if batch is not None:
        if batch[0].park(batch[1], planned, depth):
            return PARKED
        if batch[0].will_store(plan.cache_key, divergence):
            divergence = 0  # (another request of the batch stores it)
    segments = with_divergence(plan, divergence)
    found = host.store.fetch(lm.key, plan.cache_key)
    cache, cached = found.cache, found.cached
    ctx, stop_sequences = planner.context(lm, plan, args)
    ctx.prompt_cache_count = cached
    if vision_of(lm) is not None:
        try:
            cache, ctx.prompt_cache_count, cached = _resume(
                host, lm, plan, segments, cache, cached, channel, between_chunks)
        except Cancelled as stopped:
            channel.removed()
            logging.info(f"Stopped the image prefill of a cancelled request at prompt "
                         f"token {stopped.args[0]}")
            return None
        except Exception as e:
            if host.group.is_distributed and ends_the_group(e):
                raise  # (the admission guard answers it; _run ends the group)
            logging.exception("Image prefill failed")
            if is_out_of_memory(e):
                raise  # the admission guard answers 503
            channel.put(PromptError(f"Could not process the images: {e}"))
            return None
    ctx.cache_miss = planner.explain_miss(lm, plan, ctx.prompt_cache_count)
    return Admission(channel, args, plan, ctx, stop_sequences, cache, cached,
                     *segments, planned.constraint, planned.budget)


def _resume(host: RunnerHost, lm, plan, segments, cache, cached, channel,
            between_chunks=None):
    """vision_prefill.resume at admission: progress on `channel`, and
    `between_chunks()`, if given, run after each chunk (the chunks are
    smaller while requests decode: prefill_chunk)."""
    step = host.cli_args.prefill_step_size

    def progress(cache):
        own = host.prefill_progress(channel, cache)
        if between_chunks is None:
            return own

        def chunk_done(done, total):
            between_chunks()
            own(done, total)  # (then the watchdog's beat is the chunk's again)
        return chunk_done

    if between_chunks is not None:
        step = prefill_chunk(step, host.decoding())
    return resume(lm, plan, segments, cache, cached, step=step, progress=progress,
                  keep_checkpoints=host.facts.keep_checkpoints(lm),
                  store=lambda key, kept, kind: host.store_entry(lm.key, key, kept, kind),
                  on_every_rank=host.group.on_every_rank, observe=host.observe)


def count(host: RunnerHost, lm, channel, request, args):
    """Plan a request and answer its context only: the prompt's size, as
    the same request would be generated (count_tokens)."""
    plan = host.planner.for_model(lm, request, args).plan  # PromptError: the guard answers
    ctx, _ = host.planner.context(lm, plan, args)
    ctx.prompt_cache_count = 0
    channel.put(ctx)
    channel.put(None)
