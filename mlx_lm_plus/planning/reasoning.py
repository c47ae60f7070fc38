"""Thinking budgets: a model's reasoning bounded in tokens.

    budget = thinking_budget(request, args, has_constraint)   # None: unbounded
    processor = ThinkingBudget(budget, tokenizer, prompt)     # a logits processor

Where budgets come from:
  thinking_budget (our field, any endpoint)   the number of tokens
  reasoning_effort (chat completions), reasoning.effort (Responses),
  output_config.effort (Anthropic)            EFFORT_BUDGETS
  thinking.budget_tokens (Anthropic)          the number of tokens
  structured output (a grammar that starts     at most half of max_tokens:
  after the thinking)                          the answer keeps the other half

Past its budget, the processor closes the think block for the model, as
llama.cpp's --reasoning-budget does: the think-end token(s) are the only
ones allowed, one per step, and the model then answers. A model that
closes the block itself within the budget is left alone. The tokens forced
count in max_tokens like any other.

In a batch the budgeted rows are handled in one call per step, beside the
grammars' (patches/batched_logits_processors: the step reads every row's
previous token once), and a row whose block is closed drops out of it.
Not on the sequential path with a draft model (upstream's speculative
generation calls processors on draft tokens it may reject, which a count
can't follow: the budget is then not applied). In the batch, a row with a
budget proposes only once the budget is done (engine/speculation.py).
"""

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_lm_plus.planning.constraints import LogitMask, _rfind

# reasoning effort -> thinking tokens (None: unbounded). OpenAI documents no
# numbers; these leave "low" a short think, "medium" (the default effort of
# OpenAI's reasoning models) room for most problems, and high and above the
# model's own judgement. "none" and "minimal" close the block at once
# (Responses and Anthropic also switch the template's thinking off for them).
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 8192,
                  "high": None, "xhigh": None, "max": None}

_WAIT, _THINKING, _DONE = "may open", "thinking", "done"


def thinking_budget(requested: Optional[int], max_tokens: int,
                    constrained: bool) -> Optional[int]:
    """A request's budget: the one asked for, and with structured output at
    most half of max_tokens (a grammar that starts after the thinking must
    have room: a model that kept thinking would end with no answer)."""
    if constrained:
        half = max(0, max_tokens // 2)
        return half if requested is None else min(requested, half)
    return requested


class ThinkingBudget:
    """A logits processor: `processor(tokens, logits) -> logits`, tokens the
    row's context (the prompt, then what was generated). See the module doc."""

    def __init__(self, budget: int, tokenizer, prompt: Optional[Sequence[int]] = None,
                 may_open: bool = True):
        self.budget = budget
        self._start: List[int] = list(tokenizer.think_start_tokens or ())
        self._end: List[int] = list(tokenizer.think_end_tokens or ())
        self.spent = 0  # tokens generated inside the think block
        self.forcing = False  # past the budget: closing the block
        self.forced = 0  # think-end tokens forced so far
        self._recent: List[int] = []
        self._calls = 0
        if not self._start or not self._end:
            self.state = _DONE
        elif prompt is not None and _rfind(list(prompt), self._start) > _rfind(
                list(prompt), self._end):
            self.state = _THINKING  # the template opened the block
        elif may_open and len(self._start) == 1:
            self.state = _WAIT  # the model may open one itself
        else:
            self.state = _DONE

    ORDER = 0  # (batched before a grammar's: patches/batched_logits_processors)

    @property
    def done(self) -> bool:
        """Nothing left to do for this row (the batched step drops it)."""
        return self.state == _DONE

    @property
    def follows_proposals(self) -> bool:
        return self.done

    def proposal_masks(self, proposal, vocab):
        """For a speculative check (ConstraintProcessor.proposal_masks):
        a budget still counting checks nothing (its count can't unsee a
        rejected token); a done one lets every proposal through."""
        return (len(proposal), None) if self.done else (0, None)

    @staticmethod
    def mask_batch(rows, shape) -> Optional[LogitMask]:
        """The mask of all budgeted rows of a batch step (mlx_lm_plus/
        patches/batched_logits_processors), with numpy alone: `rows` (row
        index, processor, the row's tokens in the KV cache, the token fed at
        this step), `shape` the logits' (batch, vocab). The rows being
        closed get their think-end token, the others pass; None: all do."""
        forced = []
        for e, p, _, newest in rows:
            token = p._step(newest)
            if token is not None:
                forced.append((e, token))
        if not forced:
            return None
        batch, vocab = shape
        keep = np.ones((batch, vocab), dtype=bool)
        only = np.zeros((batch, vocab), dtype=bool)
        for e, token in forced:
            if token < vocab:  # (else it can't be forced: max_tokens ends it)
                keep[e] = False
                only[e, token] = True
        return LogitMask(keep, only)

    @property
    def closed_early(self) -> bool:
        """Whether the budget closed the block (the model did not)."""
        return self.forcing

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.state == _DONE:
            return logits
        # (A batch of one: the token sampled at the last step, read now.)
        newest = tokens[-1].item() if self._calls else None
        return LogitMask.applied(
            logits, ThinkingBudget.mask_batch([(0, self, None, newest)], logits.shape))

    def _step(self, newest: Optional[int]) -> Optional[int]:
        """Take the token fed at this step (the one sampled at the last;
        at the first call, the prompt's last: not counted); the token to
        force now, or None."""
        if self.state == _DONE:
            return None
        if self._calls:
            self._see(newest)
        self._calls += 1
        if self.state == _THINKING and self.spent >= self.budget:
            self.forcing = True
        if self.state == _THINKING and self.forcing:
            return self._end[self.forced]
        return None

    def _see(self, token: int) -> None:
        if self.state == _WAIT:
            self.state = _THINKING if token == self._start[0] else _DONE
        elif self.forcing:
            self.forced += 1
            if self.forced == len(self._end):
                self.state = _DONE
        else:
            self.spent += 1
            self._recent = (self._recent + [token])[-len(self._end):]
            if self._recent == self._end:  # the model closed it itself
                self.state = _DONE

