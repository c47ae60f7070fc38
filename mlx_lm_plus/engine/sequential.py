"""The sequential path: a request served alone with mlx-lm's
`stream_generate` (a draft model, a seed with XTC, images for one of mlx-lm's own
vision models, --kv-bits where the batch can't quantize) or mlx-vlm's own
generation (vlm_generation.py), as upstream serves every request. Its
checkpoints are prefilled and stored here, at the positions the batch
stores them, so that either path resumes the other's."""

import copy
import logging
import time

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_plus.cache.layers import cache_nbytes, is_plain_kv
from mlx_lm_plus.engine.distributed import ends_the_group
from mlx_lm_plus.engine.host import BUDGET_EVERY, RunnerHost
from mlx_lm_plus.engine.outputs import final_events, token_response, with_prompt
from mlx_lm_plus.engine.segments import for_sequential, with_divergence
from mlx_lm_plus.engine.vision_prefill import resume
from mlx_lm_plus.errors import (
    Cancelled, EngineUnavailable, OutOfMemory, PromptError, request_error,
)
from mlx_lm_plus.logs import warn_once
from mlx_lm_plus.models.provider import group_max, vision_of
from mlx_lm_plus.models.vlm_generation import MlxVlmGeneration, responses
from mlx_lm_plus.upstream import make_logits_processors, make_sampler


class SequentialRunner:
    def __init__(self, host: RunnerHost):
        self.host = host

    def serve(self, lm, channel, request, args, planned, stream):
        """Sequential path: draft model, a seed with XTC, images (and --kv-bits on models
        quantized_batch.py does not batch), and every request for a model
        served through mlx-vlm's own generation (vlm_generation.py)."""
        host = self.host
        tic = time.perf_counter()
        host.counters.admitted += 1
        try:
            tokenizer, draft_model = lm.tokenizer, self._draft(lm)
            planned = host.planner.for_model(lm, request, args, planned)
            plan, constraint = planned.plan, planned.constraint
            ctx, stop_sequences = host.planner.context(lm, plan, args)
            if args.seed is not None:
                mx.random.seed(args.seed)
            sampler = make_sampler(args, tokenizer)
            logits_processors = make_logits_processors(args)
            if constraint is not None and draft_model is not None:
                # Speculation runs the processors on draft tokens it may
                # reject; a matcher can't follow that.
                raise PromptError(
                    "Structured output (response_format, a forced tool_choice) is not "
                    "available with a draft model (--draft-model)")
            if planned.budget is not None and draft_model is not None:
                warn_once("budget with a draft model", (
                    "A request asked for a thinking budget on a model served with a draft "
                    "model (--draft-model): not applied (speculation calls the processors "
                    "on draft tokens it may reject, which a count can't follow)"))
            elif planned.budget is not None:
                logits_processors.append(planned.budget)
            if constraint is not None:
                logits_processors.append(constraint)

            cache_key = list(plan.cache_key)  # (the plan is not ours to grow)
            through_mlx_vlm = isinstance(lm.processor, MlxVlmGeneration)
            if through_mlx_vlm:
                cache, generation = self._mlx_vlm_generation(
                    lm, channel, plan, ctx, args, sampler, logits_processors)
            else:
                cache, generation = self._mlx_lm_generation(
                    lm, channel, plan, ctx, args, stream, sampler, logits_processors)

            stop_matcher = stop_sequences.matcher()
            cut_short = None  # the engine stopping cuts it short: its error
            seconds = host.counters.thread_seconds
            seconds["admission"] += time.perf_counter() - tic
            tic = time.perf_counter()
            for gen in generation:
                toc = time.perf_counter()
                seconds["model"] += toc - tic
                host.counters.tokens_out += 1
                finish_reason = gen.finish_reason
                if stop_matcher.advance(gen.token):
                    finish_reason = "stop"
                channel.put(token_response(gen.text, gen.token, gen.logprobs, finish_reason,
                                           args, tokenizer))
                cache_key.append(gen.token)
                host.beat("a decode step")
                counters = host.counters
                if counters.steps % BUDGET_EVERY == 0:
                    host.tick()  # (loads finished meanwhile, keepalives)
                counters.steps += 1
                if counters.steps % BUDGET_EVERY == 0:
                    # The budget covers this request's growing cache too.
                    host.store.trim_to(host.store.max_bytes - cache_nbytes(cache))
                gone = ctx._should_stop or channel.cancelled
                if host.group.is_distributed:
                    # Only rank 0 sees the client: every rank stops at the
                    # same token, looked at every BUDGET_EVERY (a collective).
                    gone = counters.steps % BUDGET_EVERY == 0 and bool(group_max([gone])[0])
                tic = time.perf_counter()
                seconds["outside_model"] += tic - toc
                if gone and finish_reason is None:
                    logging.info(f"Stopped a cancelled request at step {counters.steps}")
                if gone or finish_reason is not None:
                    break
                if host.stopping():
                    cut_short = EngineUnavailable("server shutting down")
                    break
            if channel.cancelled:
                channel.removed()
            # Stored before the answer ends, so that a follow-up sent the
            # moment it ends finds it.
            if not through_mlx_vlm:  # (nothing of that path is stored)
                self._store(lm, cache_key, cache, "generated", reply_start=len(plan.tokens))
            if cut_short is not None:
                channel.put(cut_short)
                return
            for event in final_events(constraint):
                channel.put(event)
            host.log_store()
        except EngineUnavailable as e:  # (stopping during its prefill)
            channel.put(e)
        except Cancelled as stopped:
            channel.removed()
            after = ""
            if channel.cancelled_at is not None:  # (rank 0's: it saw the client go)
                waited = channel.removed_at - channel.cancelled_at
                host.observe("removal_seconds", waited)
                after = f", {waited * 1000:.1f} ms after the disconnect"
            logging.info(f"Stopped the prefill of a cancelled request at prompt token "
                         f"{stopped.args[0]}{after}")
        except Exception as e:
            if host.group.is_distributed and ends_the_group(e):
                raise  # (the admission guard answers it; _run ends the group)
            logging.exception("Sequential generation failed")
            error = request_error(e, "generating")
            host.reset_random_state()
            if isinstance(error, OutOfMemory):
                cache = None
                host.relieve_memory()
            channel.put(error)

    def _mlx_lm_generation(self, lm, channel, plan, ctx, args, stream, sampler,
                           logits_processors):
        """(cache, responses) of the sequential path on mlx-lm's generation:
        the cached prefix, the images and checkpoints prefilled here, the
        rest in stream_generate."""
        host = self.host
        model, tokenizer, draft_model = lm.model, lm.tokenizer, self._draft(lm)
        segments = with_divergence(plan, host.planner.shared_depth(lm, plan)[1])
        vision_support = vision_of(lm)
        found = host.store.fetch(lm.key, plan.cache_key)
        cache, ctx.prompt_cache_count = found.cache, found.cached
        covered = ctx.prompt_cache_count
        if vision_support is not None:
            cache, ctx.prompt_cache_count, covered = resume(
                lm, plan, segments, cache, covered, step=host.cli_args.prefill_step_size,
                progress=lambda cache: host.prefill_progress(channel, cache),
                keep_checkpoints=host.facts.keep_checkpoints(lm),
                store=lambda key, cache, kind: self._store(lm, key, cache, kind),
                on_every_rank=host.group.on_every_rank, observe=host.observe)
        rest = plan.tokens[covered:]
        if cache is None:
            cache = make_prompt_cache(model)
            if draft_model is not None:
                cache += make_prompt_cache(draft_model)
        ctx.cache_miss = host.planner.explain_miss(lm, plan, ctx.prompt_cache_count)
        channel.put(ctx)

        progress = host.prefill_progress(channel, cache)

        if draft_model is None and (plan.vision is None or vision_support is not None):
            rest = self._prefill_checkpoints(lm, cache, plan, segments, covered,
                                             progress)

        input_embeddings = None
        vision = plan.vision
        if vision is not None and vision_support is None:  # mlx-lm's own vision models
            n = sum(i < ctx.prompt_cache_count for i in vision.starts)
            if pixel_values := vision.pixel_values[n:]:
                tic = time.perf_counter()
                input_embeddings = model.embed_inputs(
                    mx.array(rest), pixel_values=pixel_values
                )
                mx.eval(input_embeddings)
                host.observe("vision_seconds", time.perf_counter() - tic)

        fed = len(plan.tokens) - len(rest)  # (cached, and prefilled to checkpoints here)
        # (Speculative decoding hands its processors no prompt at all, cached
        # or not, but the last token: nothing to add there.)
        if logits_processors and fed and draft_model is None:
            logits_processors = [with_prompt(logits_processors, plan.tokens[:fed], False)]
        return cache, stream_generate(
            model=model,
            stream=stream,
            tokenizer=tokenizer,
            prompt=rest,
            max_tokens=args.max_tokens,
            sampler=sampler,
            logits_processors=logits_processors,
            prompt_cache=cache,
            draft_model=draft_model,
            num_draft_tokens=args.num_draft_tokens,
            input_embeddings=input_embeddings,
            prompt_progress_callback=progress,
            prefill_step_size=host.cli_args.prefill_step_size,
            kv_bits=host.cli_args.kv_bits,
            kv_group_size=host.cli_args.kv_group_size,
            quantized_kv_start=host.cli_args.quantized_kv_start,
        )

    def _draft(self, lm):
        """The draft model this path speculates with: none where the draft
        proposes in the batch (facts.drafts_in_batch), whose stored caches
        are the model's alone (a request here then runs without it), nor
        for a vision model (mlx-lm's speculative step knows neither its
        caches nor its images: --kv-bits on a vision family with a draft
        serves its requests here, without the draft)."""
        if (lm.draft_model is None or vision_of(lm) is not None
                or self.host.facts.drafts_in_batch(lm)):
            return None
        return lm.draft_model

    def _mlx_vlm_generation(self, lm, channel, plan, ctx, args, sampler, logits_processors):
        """(cache, responses) of a model served through mlx-vlm's own
        generation: the whole prompt into an empty cache, never stored (its
        bytes count against the budget while it runs). The logits processors
        see the prompt and the tokens so far, as on mlx-lm's paths (mlx-vlm
        hands them only what it fed since its prefill)."""
        host = self.host
        ctx.prompt_cache_count = 0
        channel.put(ctx)
        host.beat("an mlx-vlm prefill")  # (the vision tower runs before its first chunk)
        cache = lm.processor.make_cache()
        pairs = lm.processor.generate(
            plan.tokens, plan.vision, cache, sampler,
            [with_prompt(logits_processors, plan.tokens, True)] if logits_processors else [],
            args.max_tokens, host.cli_args.prefill_step_size,
            progress=host.prefill_progress(channel, cache), kv_bits=host.cli_args.kv_bits,
            kv_group_size=host.cli_args.kv_group_size,
            quantized_kv_start=host.cli_args.quantized_kv_start)
        return cache, responses(lm.tokenizer, pairs, len(plan.tokens), args.max_tokens)

    def _prefill_checkpoints(self, lm, cache, plan, segments, cached, progress):
        """Prefill up to each checkpoint and store a copy there (the positions
        the batched path stores: segments.for_sequential). Returns the tokens
        left for stream_generate."""
        if not self.host.facts.keep_checkpoints(lm):
            return plan.tokens[cached:]
        segments, kinds = for_sequential(*segments, cached)
        model = lm.model
        done, total = cached, len(plan.tokens)
        args = self.host.cli_args
        step = args.prefill_step_size
        for segment, kind in zip(segments[:-1], kinds):
            for i in range(0, len(segment), step):
                model(mx.array(segment[i : i + step])[None], cache=cache)
                # --kv-bits: as generate_step's prefill does after each chunk
                # (the checkpoints stored quantized, the memory bounded).
                maybe_quantize_kv_cache(cache, args.quantized_kv_start, args.kv_group_size,
                                        args.kv_bits)
                mx.eval([c.state for c in cache])
                progress(done + min(i + step, len(segment)), total)
            done += len(segment)
            self._store(lm, plan.cache_key[:done], copy.deepcopy(cache), kind)
        return segments[-1]

    def _store(self, lm, key, cache, kind, reply_start=0):
        # Speculative decoding leaves the model's and the draft's caches
        # behind the key, by different counts: cut all to the shortest (a
        # stored cache holds exactly its key's tokens).
        held = min((c.offset for c in cache if is_plain_kv(c)), default=len(key))
        if held < len(key) and all(is_plain_kv(c) for c in cache):
            for c in cache:
                c.trim(c.offset - held)
            key = key[:held]
        self.host.store_entry(lm.key, key, cache, kind, reply_start)
