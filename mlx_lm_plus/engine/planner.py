"""Planning a request for a model: its prompt (template, tokens, checkpoint
segments, images), its constraint and thinking budget, and its context
(stop sequences, the state machine of its output). Run off the generation
thread where it can be (`plan`, on the HTTP side's planning lanes), else at
admission (`for_model`). Also what the store says of a plan: how far it is
shared, and why a request reused less than it shares (`explain_miss`)."""

import copy
import itertools
import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Dict, Optional, Tuple

from mlx_lm.generate import make_stop_sequences, make_text_state_machine
from mlx_lm.server import GenerationContext

from mlx_lm_plus.engine.handoffs import Planned
from mlx_lm_plus.errors import PromptError
from mlx_lm_plus.models.provider import own_vision, serves_images
from mlx_lm_plus.models.vision import VisionPrompt
from mlx_lm_plus.planning.constraints import processor_for
from mlx_lm_plus.planning.grammars import ConstraintError
from mlx_lm_plus.planning.prompt import (
    PromptPlan, build_prompt, check_prompt_size, prompt_chars, template_kwargs,
)
from mlx_lm_plus.planning.reasoning import ThinkingBudget, thinking_budget
from mlx_lm_plus.upstream import image_parts


class Planner:
    """Plans requests for the provider's loaded models against `store`
    (`group`: the ranks of mx.distributed, which plan at admission, each
    its own)."""

    def __init__(self, provider, store, group):
        self.provider = provider
        self.store = store
        self.group = group
        self._state_machines = {}
        # Image requests planned ahead and not admitted yet (their plans hold
        # the processor's pixel arrays, larger than the decoded images):
        # at most --prompt-concurrency; the rest are planned at admission.
        self.image_plans = weakref.WeakSet()
        self._image_planning = 0  # image plans being made (in the planning lanes)
        self._image_lock = threading.Lock()
        self.planned_at_admission = 0  # requests planned on the generation thread

    def forget(self, model_key):
        """Model `model_key` was unloaded: what was kept for it goes."""
        self._state_machines = {k: v for k, v in self._state_machines.items()
                                if k[0] != model_key}

    def plan(self, request, args) -> Optional[Planned]:
        """Plan a request for the model it names, on the caller's thread (the
        HTTP layer's planning thread): the template renders, tokenizing, the
        image processor and the constraint's matcher stay off the generation
        thread. None: the engine plans it at admission (that model not
        loaded yet, or images for one of mlx-lm's own vision models, served
        one at a time). Raises PromptError."""
        provider = self.provider
        key = provider.key_for(args.model)
        lm = provider.get(key)
        # (Under mx.distributed requests are pickled to the other ranks,
        # which plan them themselves.)
        if self.group.is_distributed or lm is None:
            return None
        images = request.request_type == "chat" and any(image_parts(request.messages))
        if images and own_vision(lm):
            return None
        # (A model without a processor refuses images here, in planning.)
        pixels = images and serves_images(lm)
        if pixels:
            with self._image_lock:  # (planning lanes run side by side)
                if (len(self.image_plans) + self._image_planning
                        >= self.provider.cli_args.prompt_concurrency):
                    return None
                self._image_planning += 1
        planned = None
        try:
            plan = self.build(lm, request, args)
            constraint = self._constraint(request, lm.tokenizer, plan)
            planned = Planned(key, plan, constraint,
                              self._budget(request, args, lm.tokenizer, plan, constraint),
                              on_disk=self.store.disk_for(key) is not None)
        finally:
            if pixels:
                with self._image_lock:
                    self._image_planning -= 1
                    if planned is not None:
                        # The pixels are in the plan now: the request, which
                        # its handler holds to the end, lets the decoded ones
                        # go. (The plan leaves the set at admission, or when
                        # the client's going drops it.)
                        request.images = None
                        self.image_plans.add(planned)
        return planned

    def read_ahead(self, planned: Planned) -> Optional[Future]:
        """Read a planned request's entry from the disk tier on the caller's
        thread (an HTTP handler's executor), when it covers more of the
        prompt than memory: the generation thread then takes it from memory
        (PromptStore.read_ahead). Returns the Future of another handler's
        read of that entry, for the caller to wait for, or None. Errors are
        left to the fetch, which reads again and answers for them."""
        try:
            read = self.store.read_ahead(planned.model_key, planned.plan.cache_key)
        except Exception:
            logging.exception("Prompt cache: reading ahead from disk failed")
            return None
        return read if isinstance(read, Future) else None

    def for_model(self, lm, request, args, planned: Optional[Planned] = None) -> Planned:
        """The request's plan for model `lm`: `planned`, the one made off this
        thread, if it was made for that model, else one made now."""
        if planned is not None:
            # Admitted: no longer one planned ahead, however long something
            # holds it (a sequential request, until it ends).
            with self._image_lock:
                self.image_plans.discard(planned)
        if planned is None or planned.model_key != lm.key:
            self.planned_at_admission += 1
            try:
                plan = self.build(lm, request, args)
            finally:
                # The decoded pixels are in the plan now (or not needed): the
                # request, which its handler holds to the end, lets them go.
                if getattr(request, "images", None) is not None:
                    request.images = None
            constraint = self._constraint(request, lm.tokenizer, plan)
            planned = Planned(lm.key, plan, constraint,
                              self._budget(request, args, lm.tokenizer, plan, constraint))
        return planned

    def build(self, lm, request, args) -> PromptPlan:
        kwargs = template_kwargs(self.provider.cli_args.chat_template_args, args.chat_template_kwargs)
        try:
            check_prompt_size(prompt_chars(request, kwargs, lm.tokenizer.has_chat_template),
                              lm.context_length)
            return build_prompt(lm.tokenizer, lm.processor, request, kwargs)
        except Exception as e:
            raise PromptError(str(e) or type(e).__name__) from e

    @staticmethod
    def _constraint(request, tokenizer, plan):
        """The request's constraint processor (structured output), or None."""
        try:
            return processor_for(getattr(request, "constraint", None), tokenizer,
                                 plan.tokens, request.request_type == "chat")
        except ConstraintError as e:
            raise PromptError(str(e)) from e

    @staticmethod
    def _budget(request, args, tokenizer, plan, constraint):
        """The request's thinking budget's processor (reasoning.py), or None."""
        if not tokenizer.has_thinking:
            return None
        budget = thinking_budget(getattr(request, "thinking_budget", None), args.max_tokens,
                                 constraint is not None and constraint.after_think)
        if budget is None:
            return None
        return ThinkingBudget(budget, tokenizer, plan.tokens,
                              may_open=request.request_type == "chat")

    def _state_machine(self, model_key, tokenizer, stop_words):
        key = (model_key, tuple(stop_words))
        if key not in self._state_machines:
            if len(self._state_machines) > 100:
                self._state_machines.clear()
            self._state_machines[key] = (
                make_stop_sequences(tokenizer, stop_words),
                make_text_state_machine(tokenizer, stop_words),
                [(w, tuple(tokenizer.encode(w, add_special_tokens=False)))
                 for w in stop_words],
            )
        return self._state_machines[key]

    def context(self, lm, plan, args):
        """(GenerationContext, StopSequences) of a planned request."""
        tokenizer = lm.tokenizer
        stop_sequences, text_sm, stop_word_tokens = self._state_machine(
            lm.key, tokenizer, args.stop_words)
        ctx = GenerationContext(
            has_tool_calling=tokenizer.has_tool_calling,
            has_thinking=tokenizer.has_thinking,
            tool_parser=tokenizer.tool_parser,
            text_sm=text_sm,
            initial_state=plan.initial_state,
            prompt=plan.tokens,
        )
        ctx.images = len(plan.vision.starts) if plan.vision is not None else 0
        # Which stop word ended a generation (Anthropic's stop_sequence).
        ctx.stop_word_tokens = stop_word_tokens
        return ctx, stop_sequences

    def shared_depth(self, lm, plan: PromptPlan) -> Tuple[int, int]:
        """How far the store's paths follow this prompt (not into an image),
        and where a divergence checkpoint is worth storing (0: nowhere; see
        PromptStore.divergence)."""
        depth, worth_it = self.store.divergence(lm.key, plan.cache_key)
        if isinstance(plan.vision, VisionPrompt):
            depth = plan.vision.safe_prefix(depth)
        return depth, depth if worth_it else 0

    def explain_miss(self, lm, plan: PromptPlan, reused: int) -> Optional[Dict[str, Any]]:
        """Why a request reused fewer prompt tokens than the store shares
        with it, or None: where its prompt departs from a stored sequence
        (the position, the part of the prompt, a few tokens of both sides
        there), and shared tokens it could not resume from. For the
        request's log line and /v1/stats (metrics.RequestRecord.cache_miss);
        api.py adds the message it found the departure in. A trie walk and
        three short decodes, on misses only."""
        try:
            return self._departure(lm, plan, reused)
        except Exception:  # (an explanation never fails a request)
            logging.exception("Prompt cache: explaining a miss failed")
            return None

    def _departure(self, lm, plan: PromptPlan, reused: int) -> Optional[Dict[str, Any]]:
        depth, stored = self.store.departure(lm.key, plan.cache_key)
        # (The last prompt token is fed with the first decode step: a stored
        # prompt is one token short of its key on some models.)
        unreused = depth - reused if depth - reused > 1 else 0
        if depth == 0 or not (stored or unreused):
            return None
        miss: Dict[str, Any] = {"position": depth, "reused": reused}
        if stored:
            ends = list(itertools.accumulate(map(len, plan.segments)))
            part = next(i for i, end in enumerate(ends) if depth < end or i == len(ends) - 1)
            miss["part"] = ("system prompt and tools" if plan.segment_types[part] == "system"
                            else "last message and generation prompt"
                            if part == len(ends) - 1 else "conversation")

            def text(ids):  # (an image's place in a cache key is a negative id)
                return lm.tokenizer.decode([i for i in ids if i >= 0])

            key = plan.cache_key
            miss["before"] = text(key[max(0, depth - 8):depth])
            miss["prompt"] = text(key[depth:depth + len(stored)])
            miss["stored"] = text(stored)
        if unreused:
            # Shared tokens the store could not resume from: models with
            # recurrent layers resume only where a whole state was stored.
            miss["shared_not_reused"] = unreused
        return miss

    def count_prompt(self, request, args) -> Optional[int]:
        """The prompt size of a request for a loaded model, planned on the
        caller's thread (count_tokens: the template and the image processor
        never run between batch steps). None: not answerable here (that
        model not loaded, or images for one of mlx-lm's own vision models)."""
        lm = self.provider.get(self.provider.key_for(args.model))
        if lm is None or (own_vision(lm) and request.request_type == "chat"
                          and any(image_parts(request.messages))):
            return None
        # A copy: templating converts the messages in place (the decoded
        # images are only read: not copied).
        images = getattr(request, "images", None)
        plan = self.build(lm, copy.deepcopy(request, {id(images): images}), args)
        return len(plan.tokens)
