"""A model's batch: mlx-lm's BatchGenerator and the requests in it, stepped
by the engine's loop. Requests come in admitted (`insert`), leave when they
end, fail or their client goes, and store their checkpoints and final
caches as they pass them; a request that shares a checkpoint another row is
about to store waits for it (`park`)."""

import logging
import time
from typing import Any, Dict, List, Optional

from mlx_lm.generate import BatchGenerator

from mlx_lm_plus.engine import taps
from mlx_lm_plus.engine.handoffs import Admission, Planned, Queued
from mlx_lm_plus.engine.channel import deliver
from mlx_lm_plus.engine.distributed import HANDOFF_STOPPED
from mlx_lm_plus.engine.host import BUDGET_EVERY, RunnerHost
from mlx_lm_plus.engine.outputs import final_events, token_response
from mlx_lm_plus.engine.quantized_batch import QuantizedBatchGenerator
from mlx_lm_plus.engine import speculation
from mlx_lm_plus.cache.store import PromptStore
from mlx_lm_plus.engine.drafting import CATCH_UP_MAX, MAX_DRAFT_TOKENS, DraftPrompts
from mlx_lm_plus.engine.sampling import SeededSampler
from mlx_lm_plus.engine.segments import for_batch, prefill_chunk, same_prefix
from mlx_lm_plus.errors import OutOfMemory, request_error
from mlx_lm_plus.upstream import (
    generation_batch, in_flight_caches, make_logits_processors, make_sampler, queued_caches,
)

# A request waits for another one in the batch to store a checkpoint it shares
# (its system prompt, say) when that saves it at least this many tokens.
PARK_MIN_TOKENS = 32
# The batch steps from a prompt being in (but its last token) to its first
# token handed out: they run without a prompt chunk (_Batch._step), and no
# more than this many do in a row.
FIRST_TOKEN_STEPS = 2


class _Batch:
    """A BatchGenerator and the requests in it, for one model."""

    def __init__(self, host: RunnerHost, lm, stream):
        # (What it uses of the engine: host.RunnerHost.)
        self.host = host
        self.model = lm.model
        self.tokenizer = lm.tokenizer
        self.stream = stream
        self.model_key = lm.key
        self.keep_checkpoints = host.facts.keep_checkpoints(lm)
        # (Proposes for this model's rows in the batch: speculation.py.)
        self.draft_model = getattr(lm, "draft_model", None)
        # (The draft's KV between requests: a store of its own, a quarter of
        # the prompt cache's budget, counted in this batch's bytes.)
        store = host.store
        self.draft_prompts = None if self.draft_model is None else DraftPrompts(PromptStore(
            max_bytes=store.max_bytes // 4, max_sequences=store.max_sequences, ttl=store.ttl))
        # (Tokens the model has logits for, its draft's too: the fewer.)
        self.vocab = getattr(lm, "vocab_size", None)
        self.results: Dict[int, Dict[str, Any]] = {}
        self._outbox = []  # (channel, event) of the step running
        self._samplers = {}  # sampling settings -> sampler (see _sampler)
        # Requests waiting for a checkpoint another request in the batch is
        # about to store: [leader uid, position, the request as queued]; and
        # those whose wait is over, for the engine to admit again.
        self._parked: List[list] = []
        self._unparked: List[tuple] = []
        # Steps to run without a prompt chunk, so that a request's first
        # token is handed out before one (see _step), and how many ran in a
        # row (at most FIRST_TOKEN_STEPS: prompts keep going in).
        self._decode_only = 0
        self._decode_only_run = 0
        self._new_generator()

    def _new_generator(self):
        args = self.host.cli_args
        generator, kv = BatchGenerator, {}
        if args.kv_bits is not None:  # a batched quantized KV cache
            generator = QuantizedBatchGenerator
            kv = dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                      quantized_kv_start=args.quantized_kv_start)
        elif self.keep_checkpoints and not self.host.group.is_distributed:
            # Recurrent states at checkpoints inside a chunk (taps.py).
            recorder = taps.install(self.model)
            if recorder is not None:
                generator, kv = taps.TappingBatchGenerator, dict(recorder=recorder)
        self.tapping = generator is taps.TappingBatchGenerator
        self.generator = generator(
            self.model,
            completion_batch_size=args.decode_concurrency,
            prefill_batch_size=args.prompt_concurrency,
            prefill_step_size=args.prefill_step_size,
            stream=self.stream,
            **kv,
        )
        # Speculation (speculation.py), from the draft model or by prompt
        # lookup, with any of these generators (each step checks only where
        # its layers can be rolled back: speculation.speculates), where one
        # process decides (under mx.distributed every rank would have to
        # draw alike). A model with a draft is batched only where its draft
        # can propose here (facts.drafts_in_batch).
        self.lookups = None
        if ((args.prompt_lookup_tokens or self.draft_model is not None)
                and not self.host.group.is_distributed):
            self.lookups = speculation.install(
                self.generator, self.draft_model,
                prefill_chunk(args.prefill_step_size, True), self.draft_prompts, self.vocab)

    @property
    def active(self) -> bool:
        return bool(self.results)

    def close(self):
        self.generator.close()

    def _sampler(self, args):
        """One sampler per distinct setting: rows that share it are sampled
        by one call per step (BatchGenerator batches rows whose sampler is
        the same object; a sampler holds no state of its own). Not with XTC,
        whose one random draw per call would then decide for all the rows."""
        s = args.sampling
        if args.seed is not None and s.temperature > 0:
            return SeededSampler(s, args.seed)  # (a row's own: never shared)
        if s.xtc_probability > 0:
            return make_sampler(args, self.tokenizer)
        key = (s.temperature, s.top_p, s.top_k, s.min_p)
        sampler = self._samplers.get(key)
        if sampler is None:
            if len(self._samplers) > 64:
                self._samplers.clear()
            sampler = self._samplers[key] = make_sampler(args, self.tokenizer)
        return sampler

    def insert(self, a: Admission):
        """Add an admitted request to the generator."""
        cut = for_batch(a.segments, a.segment_types, a.cached, self.keep_checkpoints,
                        self.tapping)
        segments, segment_types, tapped = cut.segments, cut.segment_types, cut.tapped
        more = dict(taps=[list(tapped)]) if self.tapping else {}
        processors = (make_logits_processors(a.args) + ([a.budget] if a.budget else [])
                      + ([a.constraint] if a.constraint else []))
        if sum(map(len, segments)) == 1:  # (its prompt is in but its last token)
            self._decode_only = FIRST_TOKEN_STEPS
        # (An error here is answered by the engine's admission guard.)
        (uid,) = self.generator.insert_segments(
            segments=[segments],
            max_tokens=[a.args.max_tokens],
            caches=[a.cache],
            all_tokens=[a.plan.tokens[:a.cached]],
            samplers=[self._sampler(a.args)],
            logits_processors=[processors],
            stop_sequences=[a.stop_sequences],
            **more,
        )
        most = (self.host.cli_args.prompt_lookup_tokens if self.draft_model is None
                else min(a.args.num_draft_tokens, MAX_DRAFT_TOKENS))
        if (self.lookups is not None and most > 0
                and speculation.proposes_for(a.args)):
            self.lookups[uid] = speculation.RowLookup(
                speculation.RowSampling.of(a.args.sampling), most)
        a.channel.put(a.ctx)
        self.results[uid] = {
            "ctx": a.ctx,
            "channel": a.channel,
            "detokenizer": self.tokenizer.detokenizer,
            # Popped from the end as segment ends are reached.
            "segment_types": segment_types[::-1],
            "ends": cut.ends,  # those not reached yet
            "taps": tapped,  # position -> kind, of those taken inside a chunk
            "args": a.args,  # (logprobs, top_logprobs)
            "decoding": False,  # set at its first generated token
            # Cache keys of this request: the prompt's key (image ids in
            # place of image tokens), then the tokens it generates.
            "key_prefix": a.plan.cache_key,
            # Structured output: a grammar failure fails this request alone.
            "constraint": a.constraint,
            # Its images prefilled at admission (_resume): a cache of its
            # own, counted in flight while it waits in the generator's queue.
            "prefilled": a.cached > a.ctx.prompt_cache_count,
        }

    def step(self) -> bool:
        """One BatchGenerator step. Returns whether it did any work.

        Anything raised inside, removing cancelled requests included, fails
        the requests of this batch, not the generation thread (under
        mx.distributed it ends the group: the error may be one rank's).
        """
        tic = time.perf_counter()
        seconds = self.host.counters.thread_seconds
        model = seconds["model"]
        try:
            self._remove_stopped()
            return self._step()
        except Exception as e:
            if self.host.group.is_distributed:
                # (A step's error may be one rank's: its own layers, its
                # memory. The others went on: the whole group ends.)
                raise
            self._flush()  # what the step produced comes before the error
            self._fail_all(e)
            return False
        finally:
            self._flush()
            seconds["outside_model"] += time.perf_counter() - tic - (seconds["model"] - model)

    def _flush(self):
        """Hand the step's events to their channels at once (the HTTP side:
        one call into the event loop per step, not one per token)."""
        if self._outbox:
            events, self._outbox = self._outbox, []
            deliver(events)

    def _remove_stopped(self):
        """Clients that went away leave the batch wherever they are."""
        host = self.host
        if not host.group.is_distributed:  # (there, rank 0 alone sees a client go)
            # Parked behind another request's checkpoint: let go now (the
            # engine's admission drops it), not once that checkpoint is in.
            gone = [p for p in self._parked if p[2][0].cancelled]
            if gone:
                self._parked = [p for p in self._parked if not p[2][0].cancelled]
                self._unparked += [p[2] for p in gone]
        stopped = [
            uid
            for uid, r in self.results.items()
            if r["ctx"]._should_stop or r["channel"].cancelled
        ]
        # (Rank 0's, on every rank: they leave the batch at the same step.)
        stopped = host.share_object(stopped or None, HANDOFF_STOPPED)
        if not stopped:
            return
        # Work done for a request in decode stays useful: its cache covers
        # its prompt and the tokens generated so far, as at a normal end.
        decoding = [uid for uid in stopped if self.results[uid]["decoding"]]
        kept = self.generator.remove(stopped, return_prompt_caches=True)
        waits = []
        for uid in stopped:
            if uid in decoding:
                cache, tokens = kept[uid]
                self._insert(self._key(uid, tokens), cache, "generated",
                             reply_start=self._reply_start(uid))
            result = self.results.pop(uid, None)
            self._forget_lookup(uid)
            self._unpark(uid)
            if result is None:
                continue
            channel = result["channel"]
            channel.removed()
            if channel.cancelled_at is not None:
                waits.append(channel.removed_at - channel.cancelled_at)
                host.observe("removal_seconds", waits[-1])
        del kept
        logging.info(
            f"Removed {len(stopped)} cancelled request(s) from the batch at step "
            f"{host.counters.steps}"
            + (f", {max(waits) * 1000:.1f} ms after the disconnect" if waits else "")
        )

    @property
    def decoding(self) -> bool:
        """Whether a request of this batch is past its prompt."""
        return any(r["decoding"] for r in self.results.values())

    def _step(self) -> bool:
        host, counters = self.host, self.host.counters
        counters.steps += 1
        # (BatchGenerator reads it at each step, for the chunk it cuts next.)
        # A request whose prompt is in but its last token gets its first
        # token computed by the next step and returned by the one after,
        # each after that step's decode; a prompt chunk in either (of another
        # request) would come before it: those two steps cut none (0).
        # (Requests whose prompts were cached whole arm it as they come: at
        # most FIRST_TOKEN_STEPS such steps, then a chunk, so a stream of
        # them can't hold a long prompt back.)
        decode_only = self._decode_only > 0 and self._decode_only_run < FIRST_TOKEN_STEPS
        self._decode_only = max(0, self._decode_only - 1)
        self._decode_only_run = self._decode_only_run + 1 if decode_only else 0
        self.generator.prefill_step_size = 0 if decode_only else prefill_chunk(
            host.cli_args.prefill_step_size, host.decoding())
        if self.draft_prompts is not None:
            # Its rows catching up: as much, or a draft call's worth where a
            # first token is due (short prompts join at once).
            draft = getattr(generation_batch(self.generator), "draft", None)
            if draft is not None:
                draft.chunk = self.generator.prefill_step_size or CATCH_UP_MAX
        tic = time.perf_counter()
        prompt_responses, gen_responses = self.generator.next()
        counters.thread_seconds["model"] += time.perf_counter() - tic
        if not prompt_responses and not gen_responses:
            return False
        counters.tokens_out += len(gen_responses)
        if prompt_responses or counters.steps % BUDGET_EVERY == 0:
            # Prefill allocates, and decode grows the caches a little per step.
            self.enforce_budget()

        for r in prompt_responses:
            if decode_only and not r.end_of_prompt:
                continue  # (no chunk: their progress is as it was)
            self._outbox.append((self.results[r.uid]["channel"], r.progress))
            if r.progress[1] - r.progress[0] == 1:
                self._decode_only = FIRST_TOKEN_STEPS

        if self.tapping:
            for uid, taken in self.generator.take_tapped().items():
                for position, cache in taken:
                    self._stored_checkpoint(uid, position, cache,
                                            self.results[uid]["taps"].pop(position))

        # Each request's checkpoints are its own segment ends: the cache
        # extracted there covers exactly the tokens that request has seen.
        ends = [
            r.uid
            for r in prompt_responses
            if r.end_of_segment
            and not r.end_of_prompt
            and self.results[r.uid]["segment_types"]
        ]
        for uid, (cache, tokens) in self.generator.extract_cache(ends).items():
            self._stored_checkpoint(uid, len(tokens), cache,
                                    self.results[uid]["segment_types"].pop())

        for r in gen_responses:
            result = self.results[r.uid]
            result["decoding"] = True
            detokenizer = result["detokenizer"]
            # The stop token itself is not decoded.
            if r.finish_reason != "stop":
                detokenizer.add_token(r.token)
            if r.finish_reason is not None:
                detokenizer.finalize()
            self._outbox.append((result["channel"], token_response(
                detokenizer.last_segment, r.token, r.logprobs, r.finish_reason,
                result["args"], self.tokenizer)))
            if r.finish_reason is not None:
                # Stored before the answer ends, so that a follow-up sent the
                # moment it ends finds it.
                self._insert(self._key(r.uid, r.all_tokens), r.prompt_cache, "generated",
                             reply_start=self._reply_start(r.uid))
                self._outbox += [(result["channel"], event)
                                 for event in final_events(result["constraint"])]
                host.log_store()
                self._forget_lookup(r.uid, result)
                del self.results[r.uid]
                self._unpark(r.uid)
        return True

    def _forget_lookup(self, uid, result=None):
        """A row leaves: its proposals' figures go to its request's log."""
        if self.lookups is None:
            return
        lookup = self.lookups.pop(uid, None)
        figures = speculation.summary(lookup)
        if figures is not None:
            counters = self.host.counters
            source = "lookup" if self.draft_model is None else "draft"
            for name, figure in (("proposed", "proposed"), ("accepted", "accepted"),
                                 ("steps", "verify_steps")):
                counter = f"{source}_{name}"
                setattr(counters, counter, getattr(counters, counter) + figures[figure])
            if result is not None:
                result["ctx"].speculation = figures

    def _stored_checkpoint(self, uid, position: int, cache, kind: str):
        """Store request `uid`'s checkpoint at `position` (of its prompt; no
        cache: a tap that got none) and release the requests waiting for it."""
        result = self.results[uid]
        if cache is not None:
            self._insert(result["key_prefix"][:position], cache, kind)
        result["ends"] = [e for e in result["ends"] if e > position]
        self._unpark(uid, position)

    def _insert(self, key, cache, kind, reply_start=0):
        self.host.store_entry(self.model_key, key, cache, kind, reply_start)

    def will_store(self, key, position: int) -> bool:
        """Whether a request of this batch is about to store a checkpoint at
        `key[:position]` (requests that arrive together with different last
        messages diverge from the store at the same point: one stores it)."""
        if not position:
            return False
        return any(position in r["ends"] and same_prefix(key, r["key_prefix"], position)
                   for r in self.results.values())

    def park(self, request, planned: Planned, cached: int) -> bool:
        """Hold `request` back if a request in the batch is about to store a
        checkpoint that covers at least PARK_MIN_TOKENS more of its prompt
        than the store can (`cached`, at most): concurrent requests with the
        same new system prompt have it computed once, not once per request.
        Returns whether it was held; it comes back through take_unparked once
        that request stored the checkpoint or left, and is admitted again
        with its plan. A stream gets its headers and a keepalive meanwhile."""
        plan = planned.plan
        if plan.vision is not None or self.host.store.disabled():
            return False  # (images: a plan of their own; no store: no checkpoint)
        key = plan.cache_key
        best = None
        for uid, r in self.results.items():
            for end in reversed(r["ends"]):
                if best is not None and end <= best[1]:
                    break
                if (cached + PARK_MIN_TOKENS <= end < len(key)
                        and same_prefix(key, r["key_prefix"], end)):
                    best = (uid, end)
                    break
        if best is None:
            return False
        request = Queued(*request[:3], planned)  # (admitted again with its plan)
        self._parked.append([*best, request])
        request[0].put((0, len(plan.tokens)))
        request[0].set_aside_at = time.monotonic()  # (keepalives: ModelResidency.tick)
        return True

    def _unpark(self, uid=None, stored: Optional[int] = None):
        """Release the requests waiting for `uid` (all with uid None): those
        whose checkpoint it stored (at `stored`), or all of them when it left."""
        keep = []
        for parked in self._parked:
            if uid is None or (parked[0] == uid and (stored is None or parked[1] <= stored)):
                self._unparked.append(parked[2])
            else:
                keep.append(parked)
        self._parked = keep

    def take_unparked(self) -> List[tuple]:
        """Requests whose wait is over, as they were queued."""
        out, self._unparked = self._unparked, []
        return out

    def held_back(self) -> List[tuple]:
        """Requests parked or released and not admitted yet."""
        return [p[2] for p in self._parked] + self._unparked

    def _reply_start(self, uid) -> int:
        """Where request `uid`'s generated tokens start in its cache key."""
        return len(self.results[uid]["key_prefix"])

    def _key(self, uid, tokens) -> List[int]:
        """The cache key of `tokens` of request `uid` (a prefix of its prompt
        and what it generated)."""
        prefix = self.results[uid]["key_prefix"]
        n = len(tokens)
        return prefix[:n] + list(tokens[len(prefix):n])

    def _fail_all(self, error: Exception):
        """A step raised: fail the requests in flight and start a fresh batch."""
        logging.exception(f"Batch step failed, failing {len(self.results)} requests")
        error = request_error(error, "generating")
        self.host.reset_random_state()
        for uid, result in self.results.items():
            result["channel"].put(error)
            self._forget_lookup(uid)
        self.results.clear()
        self._unpark()
        try:
            self.generator.close()
        except Exception:
            pass
        if isinstance(error, OutOfMemory):
            self.host.relieve_memory()
        self._new_generator()

    def owned_nbytes(self) -> int:
        """Bytes of the caches this batch holds: those being prefilled and
        decoded, and those of queued requests whose images were prefilled at
        admission. Other requests still queued in the generator hold copies
        of stored entries, which share the store's buffers (MLX arrays are
        immutable, a fetch joins the tree's spans lazily), so counting them
        would count the same memory twice."""
        g = self.generator
        queued = sum(c.nbytes for uid, cache in queued_caches(g)
                     if self.results.get(uid, {}).get("prefilled") for c in cache)
        return (queued + sum(c.nbytes for c in in_flight_caches(g))
                + speculation.draft_nbytes(g))

    def enforce_budget(self):
        """The prompt cache's byte budget covers the caches in flight too (as
        upstream's --prompt-cache-bytes does): the store gives way as they
        grow."""
        store = self.host.store
        in_flight = self.host.in_flight_nbytes()
        if self.draft_prompts is not None:
            # (The draft's entries give way first: the model's cost more to
            # make again, and a draft's are of little use without them.)
            drafts = self.draft_prompts.store
            room = store.max_bytes - (in_flight - drafts.nbytes) - store.nbytes
            if drafts.nbytes > max(0, room):
                drafts.trim_to(max(0, room))
                in_flight = self.host.in_flight_nbytes()
        store.trim_to(store.max_bytes - in_flight)
