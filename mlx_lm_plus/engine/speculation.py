"""Speculative decoding inside the batch: proposals from the row's own
tokens (prompt lookup, `--prompt-lookup-tokens`, lookup.py) or from a draft
model (`--draft-model`, drafting.py).

Agents and editors re-emit long stretches of their context (a file with a
few lines changed, tool arguments, quotes). Where a row's last few tokens
appeared before in its prompt or its answer, the tokens that followed them
then are proposed as its next ones (or a draft model's greedy tokens are);
the model checks every row's proposals in one forward pass (the row's
pending token and its proposals, k+1 positions), and each row keeps the
prefix it accepts plus one token of the model's own. A step where no row
has a proposal is upstream's step, as is.

Exactness, per row:
- Greedy: a proposal is kept while it equals the model's argmax there, so
  the text is the text without speculation (up to float rounding of a k+1
  token call against k+1 one-token calls, as upstream's own speculation).
- Sampling: a proposal d is a draw from a point mass, so it is kept with
  probability p(d) and, at the first one not kept, the token is drawn from p
  with d taken out and renormalized (the residual max(0, p - q) of
  speculative sampling for that q); p is the row's own distribution after
  its top_p / min_p / top_k filters and temperature, as make_sampler draws.
  The tokens are then distributed as without speculation.
- The KV of rejected positions is dropped per row (SpeculativeGenerationBatch
  ._drop): every row is trimmed alike, then rows that kept more carry what
  they lost to the next step or rows that rejected more are rolled into
  their left padding (what BatchKVCache.finalize does for right-padded
  prompts), whichever has cost less.

Recurrent layers (hybrid models, Mamba) have each row's state set back to
the one after what it kept, from taps at every position of the call
(rollback.py).

Structured output: a row with a grammar proposes while the grammar applies
(ConstraintProcessor.proposal_masks): its position after each proposal is
masked as the plain step would mask it there, from the grammar's state
after the proposals before it, which llguidance then rolls back; the kept
tokens are consumed at the next step, as any generated ones. Its proposals
stop at a token the grammar refuses or one that would end it or open or
close a strict tool call, and the row never carries (the grammar reads the
row's tokens in the KV). A row with a thinking budget still counting
proposes nothing (a count can't unsee a rejected token).

Sliding windows (batch_kv.py: trimmed and rolled right after the check's
call, its buffer put in order before it), vision models (M-RoPE positions
follow each row's offset) and --kv-bits layers (quantized_batch.py: a
float layer's check stays short of its start) propose too.

Rows that do not propose (in this version): seeded rows that sample (their
draws follow upstream's seeded text) and XTC; and no row of a model with
layers other than those, or under mx.distributed. Rows
that do not propose still share a verifying step: position 0 is theirs,
processed and sampled as the plain step does (patches/
batched_logits_processors.py's process_rows, then the row's sampler), the
rest of their KV dropped.

Written against mlx-lm 0.32.2's GenerationBatch (its pending token, counts
and matchers): on another version (upstream.generation_batch_as_written)
the flag is off, with a warning.

Proposal length adapts per row (one more than it last kept, up to the
flag) and per step (widest_paying: as many as give the most tokens a second
by the batch's measured step cost, StepCost); a row whose lookups find
nothing or whose proposals keep failing waits a growing number of steps
before it looks again, so text with nothing to copy pays almost nothing.
"""

import time
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

from mlx_lm_plus.engine import rollback, taps
from mlx_lm_plus.engine.batch_kv import (MAX_POSITIONS, in_temporal_order, roll_into_padding,
                                         trim_end)
from mlx_lm_plus.engine.drafting import DraftPrompts, DraftRows
from mlx_lm_plus.engine.lookup import RowLookup
from mlx_lm_plus.engine.quantized_batch import BatchQuantizedKVCache, widest_float_call
from mlx_lm_plus.engine.sampling import RowSampling
from mlx_lm_plus.logs import warn_once
from mlx_lm_plus.upstream import (WRITTEN_FOR, generation_batch, generation_batch_as_written,
                                  mlx_lm_version)
from mlx_lm_plus.patches.batched_logits_processors import process_rows

CARRY_MAX = 8  # tokens a row may carry to the next step (see _verify)
UNPAID_WAIT = 4  # steps a row waits after proposals not worth checking
EXPLORE_EVERY = 256  # steps without a check before one is made regardless
# How much longer than a plain step a checking step may be predicted to take
# while some row in it proposes nothing (it gains nothing from the check:
# its next token only comes later).
MAX_STEP_GROWTH = 1.5


def proposes_for(args) -> bool:
    """Whether a request's row may propose: not seeded (greedy, a seed
    draws nothing), no XTC. (A grammar or a thinking budget decides step by
    step: checked_proposal.)"""
    s = args.sampling
    return (args.seed is None or s.temperature == 0) and s.xtc_probability <= 0


def checked_proposal(processors, proposal: List[int], vocab: int):
    """How many of `proposal` a row with logits `processors` checks, and
    the masks of its grammar at the positions after them ([n, vocab] bool;
    None: no mask). Upstream's processors (penalties, logit_bias) are
    functions of the tokens they are handed and let every one through; a
    batched one (a thinking budget, a grammar: state kept from call to
    call) says what it can follow (proposal_masks)."""
    n, keep = len(proposal), None
    for processor in processors or ():
        if hasattr(processor, "mask_batch"):
            m, masks = processor.proposal_masks(proposal[:n], vocab)
            n = min(n, m)
            if masks is not None:
                keep = masks
    return n, None if keep is None else keep[:n]


def follows_proposals(processors) -> bool:
    """Whether a row's batched processors can follow proposals now (its
    grammar applies, its budget is done; before this step's token: the
    check itself decides, checked_proposal)."""
    return all(p.follows_proposals for p in processors or () if hasattr(p, "mask_batch"))


def _stateful(processors) -> bool:
    """Whether a row's processors keep state between steps (batched ones)."""
    return any(hasattr(p, "mask_batch") for p in processors or ())


class StepCost:
    """Seconds a decode step of P positions (rows x tokens each) takes,
    a + b * P, fitted by least squares to recent steps (each older step
    weighing FORGET as much). On a GPU b is near 0 (a step reads the
    weights whatever P); on a CPU each position costs its share, and
    checking proposals pays only when enough of them are kept. Until steps
    of two sizes were seen it predicts the same time for any P (so proposals
    get tried, and their cost seen)."""

    FORGET = 0.95

    def __init__(self):
        self._sums = [0.0] * 5  # weight, P, P^2, t, P*t

    def observe(self, positions: int, seconds: float):
        f = self.FORGET
        w, p, pp, t, pt = self._sums
        self._sums = [f * w + 1, f * p + positions, f * pp + positions * positions,
                      f * t + seconds, f * pt + positions * seconds]

    @property
    def seen(self) -> bool:
        return self._sums[0] > 0

    @property
    def spread(self) -> bool:
        """Whether steps of two sizes were seen (a slope known)."""
        w, p, pp, _, _ = self._sums
        return w > 0 and w * pp - p * p > 1e-9 * max(1.0, w * pp)

    def slope(self) -> float:
        """Seconds per position (0 until steps of two sizes were seen)."""
        if not self.spread:
            return 0.0
        w, p, pp, t, pt = self._sums
        return max(0.0, (w * pt - p * t) / (w * pp - p * p))

    def predict(self, positions: int) -> float:
        w, p, _, t, _ = self._sums
        if w == 0:
            return 1.0
        b = self.slope()
        return max(1e-6, (t - b * p) / w) + b * positions


class DraftCost(StepCost):
    """Seconds drafting W tokens a row takes (a + b * W: its catching-up
    call, then one call a token)."""


def widest_paying(rows: List[RowLookup], proposals: List[List[int]], fed: List[int],
                  cost: StepCost, drafting: Optional[StepCost] = None,
                  probe: bool = False) -> int:
    """How many proposals a row may check this step (each row's own, cut to
    that), for the most tokens a second: row i feeds fed[i] tokens before
    its proposals (what it carries and its pending token) and writes one
    token more than it keeps; 0 when checking none is best. With a draft
    model, `drafting` is what drafting a width costs (by width; nothing
    until seen, so that it gets tried). A probe takes every width as
    costing the same. Where a row proposes nothing, no width whose step is
    predicted to take over MAX_STEP_GROWTH times a plain step's (that
    row's tokens are not held back for the others'), and no more than one
    while the costs are not known (a narrow check first, to learn them)."""
    count = len(proposals)
    # (Each row's expected kept tokens for every width, once: O(rows x k).)
    kept = [np.cumsum([0.0] + r.rates(len(p))) if r is not None and p else np.zeros(1)
            for r, p in zip(rows, proposals)]
    widest = min(max(map(len, proposals)), MAX_POSITIONS // count - max(fed))
    best, best_rate = 0, -1.0
    plain = cost.predict(count * max(fed))
    bounded = not all(proposals)
    known = cost.spread and (drafting is None or drafting.seen)
    for width in range(max(0, widest) + 1):
        tokens = count + sum(k[min(width, len(k) - 1)] for k in kept)
        feeds = max(f + min(width, len(p)) for f, p in zip(fed, proposals))
        seconds = cost.predict(count * feeds)
        if width and drafting is not None and drafting.seen:
            seconds += drafting.predict(width)
        if width and bounded and (seconds > MAX_STEP_GROWTH * plain
                                  or (width > 1 and not known)):
            break
        rate = tokens / (1.0 if probe else seconds)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


def speculates(prompt_cache, recorder=None) -> bool:
    """Whether a batch's layers can be rolled back per row here: plain
    BatchKVCache, sliding windows (BatchRotatingKVCache: batch_kv.py), and
    recurrent layers (ArraysCache) where the model's mixers are tapped
    (rollback.py; `recorder`, taps.install)."""
    return bool(prompt_cache) and all(
        isinstance(c, (BatchKVCache, BatchRotatingKVCache, BatchQuantizedKVCache))
        or (type(c) is ArraysCache and recorder is not None)
        for c in prompt_cache)


class SpeculativeGenerationBatch(GenerationBatch):
    """GenerationBatch whose rows may propose tokens (`lookups`: uid ->
    RowLookup, set by the batch runner); see the module's docstring.

    `carried` (uid -> tokens): tokens a row has written (and handed out)
    whose KV was dropped with the positions other rows rejected; the next
    step feeds them again, before the row's pending token. `self.tokens`
    keeps upstream's meaning: the tokens in a row's KV."""

    lookups: Dict[int, RowLookup]
    carried: Dict[int, List[int]]

    def next(self):
        if not self.uids or (not self.carried and (
                not self.lookups or not speculates(self.prompt_cache, self.recorder))):
            return super().next()
        if self.draft is not None and self.draft.catch_up(self.uids, self._row_tokens()):
            self.after_check = True  # (this step's time has the draft's chunk in it)
        tic, rows = time.perf_counter(), len(self.uids)
        lookups = [self.lookups.get(uid) for uid in self.uids]
        processors = self.logits_processors or [None] * rows
        # (A row whose grammar or budget can't follow proposals now waits,
        # without counting a miss.)
        looking = [lookup is not None and lookup.ready() and follows_proposals(procs)
                   for lookup, procs in zip(lookups, processors)]
        if self.draft is not None:  # (rows still catching up propose nothing)
            joined = set(self.draft.order)
            looking = [look and uid in joined for look, uid in zip(looking, self.uids)]
        if not any(looking) and not self.carried:
            # (Upstream's step, its next token computed while this returns:
            # the pending tokens are not waited for.)
            return self._plain(rows, tic)
        rooms = [self.max_tokens[i] - self._num_tokens[i] - 1 for i in range(rows)]
        if self.draft is None:
            proposals = self._looked_up(lookups, looking, rooms)
        else:  # (their lengths: the draft drafts once the width is chosen)
            proposals = [[0] * min(lookup.length, room) if look else []
                         for lookup, look, room in zip(lookups, looking, rooms)]
        fed = [len(self.carried.get(uid, ())) + 1 for uid in self.uids]
        # (Recurrent states held per position; a --kv-bits layer still
        # float quantizes after the call that takes a row past its start.)
        caps = [rollback.widest(self.prompt_cache) if self.recorder is not None else None,
                widest_float_call(self.prompt_cache)]
        if any(cap is not None for cap in caps):
            cap = min(cap for cap in caps if cap is not None)
            proposals = [p[:max(0, cap - max(fed))] for p in proposals]
        if any(proposals):
            # (Every EXPLORE_EVERY steps without a check, one is made as if
            # checking cost nothing, within the bound a row proposing nothing
            # sets: costs and rates seen long ago, or one slow step, would
            # otherwise stop checks for good.)
            width = widest_paying(lookups, proposals, fed, self.cost,
                                  None if self.draft is None else self.draft.cost,
                                  probe=self.unchecked >= EXPLORE_EVERY)
            if width == 0:  # (not worth it now: look again in a few steps)
                for lookup, p in zip(lookups, proposals):
                    if p:
                        lookup.unpaid(UNPAID_WAIT)
            proposals = [p[:width] for p in proposals]
        # (Timed from here: the wait for the step before, still running, is
        # that step's time, not this one's.)
        if self.draft is not None and any(proposals):
            mx.eval(self._next_tokens)
            proposals = self.draft.propose(
                self.uids, self._row_tokens(), self._next_tokens, list(map(len, proposals)),
                [next((q for q in procs or () if hasattr(q, "draft_walk")), None)
                 for procs in processors])
            if not any(proposals):  # (only caught up: not a plain step's time)
                self.after_check = True
        if not any(proposals) and not self.carried:
            return self._plain(rows, tic)
        positions = len(self.uids) * max(len(self.carried.get(uid, ())) + 1 + len(p)
                                         for uid, p in zip(self.uids, proposals))
        mx.eval(self._next_tokens)
        tic = time.perf_counter()
        responses = self._verify(proposals)
        self.cost.observe(positions, time.perf_counter() - tic)
        self.unchecked, self.after_check = 0, True
        return responses

    def _looked_up(self, lookups, looking, rooms) -> List[List[int]]:
        """Prompt lookup's proposals, from the known tokens, the pending one
        guessed: its step may still be running, and is not waited for here.
        A wrong guess costs only proposals rejected: each is checked against
        the model's own token after the real pending one."""
        proposals = []
        for i, (uid, lookup) in enumerate(zip(self.uids, lookups)):
            if not looking[i]:
                proposals.append([])
                continue
            following = lookup.propose(self.tokens[i], self.carried.get(uid, []), rooms[i])
            proposals.append(following[1:])
        return proposals

    def _plain(self, rows: int, tic: float):
        """Upstream's step. Its time is the step before's (it waits for that
        one's tokens, and leaves its own computing): not recorded right after
        a checking step, which left nothing to wait for."""
        responses = super().next()
        if not self.after_check:
            self.cost.observe(rows, time.perf_counter() - tic)
        self.after_check = False
        self.unchecked += 1
        return responses

    def _verify(self, proposals: List[List[int]]):
        rows = len(self.uids)
        carried = [self.carried.get(uid, []) for uid in self.uids]
        # Row i's input: what it carries, its pending token (at position
        # at[i], put in from the array that holds it), its proposals; padded
        # to one width (the padding's positions are dropped).
        fed = [c + [0] + p for c, p in zip(carried, proposals)]
        width = max(map(len, fed))
        at = [len(c) for c in carried]
        known = mx.array([f + [0] * (width - len(f)) for f in fed], dtype=mx.uint32)
        is_pending = mx.arange(width)[None, :] == mx.array(at)[:, None]
        inputs = mx.where(is_pending, self._next_tokens[:, None].astype(mx.uint32), known)
        in_temporal_order(self.prompt_cache)
        logits, taps = rollback.tapped_call(
            self.model, inputs, self.prompt_cache, self.recorder,
            self.recorder is not None and bool(rollback.recurrent_layers(self.prompt_cache)))
        pending = self._next_tokens.tolist()
        at_pending = mx.array(at)[:, None, None]
        pending_logits = mx.take_along_axis(logits, at_pending, axis=1)[:, 0, :]

        # At each row's pending token, as the plain step runs it: its logits
        # processors (patches/batched_logits_processors.py's process_rows,
        # which also feeds the pending token to each row's token context),
        # then, for rows not proposing, the row's sampler (rows sharing a
        # sampler in one call).
        if any(self.logits_processors):
            pending_logits, contexts = process_rows(self, self._next_tokens, pending_logits)
        else:
            contexts = []
        # Rows with a grammar or a budget, now that this step's token is in
        # them: what they check of their proposals (the rest is rejected, as
        # any), and their grammar's masks at the positions after each.
        masks, made = {}, list(map(len, proposals))
        for i, p in enumerate(proposals):
            if p and self.logits_processors and _stateful(self.logits_processors[i]):
                n, keep = checked_proposal(self.logits_processors[i], p, logits.shape[-1])
                proposals[i] = p[:n]
                if keep is not None and n:
                    masks[i] = keep
                if not n:  # (refused whole: counted as a failure, so the row backs off)
                    self.lookups[self.uids[i]].verified(len(p), 0)
        first = pending_logits - mx.logsumexp(pending_logits, axis=-1, keepdims=True)
        plain = [i for i in range(rows) if not proposals[i]]
        samplers = [self.fallback_sampler if s is None else s
                    for s in (self.samplers or [None] * rows)]
        plain_next = {}
        by_sampler: Dict[int, List[int]] = {}
        for i in plain:
            by_sampler.setdefault(id(samplers[i]), []).append(i)
        for members in by_sampler.values():
            drawn = samplers[members[0]](first[mx.array(members)])
            for i, token in zip(members, drawn):
                plain_next[i] = token

        # A proposing row's logprobs at its pending token and each proposal.
        # Its own processors (penalties, logit_bias: functions of the tokens
        # before a position, nothing kept between calls) see at position j
        # the pending token and the j proposals before it; then its grammar's
        # mask there.
        row_logprobs = {}
        for i, p in enumerate(proposals):
            if not p:
                continue
            processors = [q for q in (self.logits_processors[i] if self.logits_processors
                                      else ()) if not hasattr(q, "mask_batch")]
            after = logits[i, at[i] + 1:at[i] + 1 + len(p), :]
            if processors:
                context = self._token_context[i].update_and_fetch(mx.array([], mx.int32))
                # (One copy of the context with the proposals; each position
                # sees a prefix of it.)
                known = mx.concatenate([context, mx.array(p, context.dtype)])
                rows_after = []
                for j in range(len(p)):
                    seen = known[:context.size + j + 1]
                    row = after[j:j + 1]
                    for processor in processors:
                        row = processor(seen, row)
                    rows_after.append(row)
                after = mx.concatenate(rows_after, axis=0)
            if i in masks:
                after = mx.where(mx.array(masks[i]), after, -mx.inf)
            after = after - mx.logsumexp(after, axis=-1, keepdims=True)
            row_logprobs[i] = mx.concatenate([first[i:i + 1], after], axis=0)
        checks = {i: self._check(self.lookups[self.uids[i]].sampling, lp, proposals[i])
                  for i, lp in row_logprobs.items()}
        mx.eval(first, list(plain_next.values()), contexts,
                [v for c in checks.values() for v in c.values()])

        next_tokens, next_logprobs, emitted, valid, kept_by_row = [], [], [], [], []
        for i in range(rows):
            p = proposals[i]
            if not p:
                kept, token, lp = 0, plain_next[i], first[i]
                logprobs = [self._next_logprobs[i]]
            else:
                kept, token = self._outcome(checks[i], p)
                lp = row_logprobs[i][kept]
                logprobs = [self._next_logprobs[i]] + [row_logprobs[i][j] for j in range(kept)]
                self.lookups[self.uids[i]].verified(made[i], kept)
                if kept and self.logits_processors and self.logits_processors[i]:
                    # (The pending token is in already, from process_rows.)
                    self._token_context[i].update_and_fetch(mx.array(p[:kept], mx.int32))
            emitted.append(([pending[i]] + p[:kept], logprobs))
            valid.append(carried[i] + [pending[i]] + p[:kept])
            kept_by_row.append(kept)
            next_tokens.append(token)
            next_logprobs.append(lp)

        # Rows rejected different numbers of positions. Every row's KV is
        # trimmed by `drop` (no copy); a row that rejected fewer loses some
        # of what it kept, fed again next step (carried, at most CARRY_MAX:
        # each costs a position of every row next step); a row that
        # rejected more has the rest rolled into its left padding (masked,
        # overwritten later: a copy of the batch's KV, so only past
        # CARRY_MAX).
        # (Recurrent layers: each row's state is the one after the positions
        # its KV keeps, from the taps; rollback.py.)
        rejected = [width - len(v) for v in valid]
        drop = self._drop(rejected)
        # (Never carried: a grammar or budget reads the row's tokens in the KV.)
        stateful = [rejected[i] for i in range(rows)
                    if self.logits_processors and _stateful(self.logits_processors[i])]
        drop = min([drop] + stateful)
        rolled = [max(0, r - drop) for r in rejected]
        kv = self._kv_layers()
        for c in kv:
            if drop:
                trim_end(c, drop)
        if any(rolled) and kv:
            tic = time.perf_counter()
            held = rows * kv[0].size()
            roll_into_padding(kv, rolled)
            mx.eval([(c.keys, c.values) for c in kv])
            self.roll_cost.observe(held, time.perf_counter() - tic)
        self.carried = {}
        stays = [len(tokens) - max(0, drop - rejected[i]) for i, tokens in enumerate(valid)]
        for i, tokens in enumerate(valid):
            self.tokens[i].extend(tokens[:stays[i]])
            if stays[i] < len(tokens):
                self.carried[self.uids[i]] = tokens[stays[i]:]
        if taps is not None:
            taps.restore(stays)
        self._next_tokens = mx.array([int(t.item()) if isinstance(t, mx.array) else int(t)
                                      for t in next_tokens], dtype=mx.uint32)
        self._next_logprobs = next_logprobs
        self._current_tokens = mx.array([e[0][-1] for e in emitted], dtype=mx.uint32)
        if self.draft is not None:  # (before rows that finished leave)
            self.draft.settle(self.uids, kept_by_row)
        return self._finish(emitted, taps, stays)

    def _kv_layers(self) -> list:
        return [c for c in self.prompt_cache if not isinstance(c, ArraysCache)]

    def _drop(self, rejected: List[int]) -> int:
        """Positions to trim from every row: as many as the row that kept
        most rejected (the others' extra kept tokens carried: positions of
        every row next step) or as the one that kept least (rows that
        rejected more rolled: a copy of the batch's KV), whichever costs
        less by what such steps took (a roll first, to learn its cost)."""
        least, most = min(rejected), max(rejected)
        rows = len(rejected)
        # (Not twice in a row: a row that carries feeds its carried tokens
        # and proposals next step, and carrying again would only grow that.
        # Nor where next step's positions, with rows that may join, could
        # pass MAX_POSITIONS.)
        # (Nor without KV layers, a Mamba: no positions, nothing to roll.)
        # (Nor on a --kv-bits layer still float: carried tokens would be fed
        # whatever widest_float_call allows.)
        if (most == least or most - least > CARRY_MAX or self.carried
                or 4 * rows * (most - least + 1) > MAX_POSITIONS or not self._kv_layers()
                or widest_float_call(self.prompt_cache) is not None):
            return least
        carry = self.cost.slope() * rows * (most - least)
        roll = self.roll_cost.predict(rows * self._kv_layers()[0].size()) \
            if self.roll_cost.seen else 0.0
        return most if carry < roll else least

    @staticmethod
    def _check(sampling: RowSampling, logprobs: mx.array, proposal: List[int]):
        """The arrays that decide a row (one eval for the whole batch)."""
        if sampling.temperature == 0:
            return {"argmax": mx.argmax(logprobs, axis=-1)}
        # (float32: in bfloat16 an acceptance probability has 8 bits.)
        weights = sampling.log_weights(logprobs.astype(mx.float32))  # (k+1, V)
        probs = mx.softmax(weights, axis=-1)
        drafted = mx.array(proposal)
        k = len(proposal)
        p_draft = mx.take_along_axis(probs[:k], drafted[:, None], axis=-1)[:, 0]
        # The residual at each position: the proposal taken out.
        taken_out = mx.put_along_axis(weights[:k], drafted[:, None],
                                      mx.array(-mx.inf, dtype=weights.dtype), axis=-1)
        return {"p_draft": p_draft, "u": mx.random.uniform(shape=(k,)),
                "residual": mx.random.categorical(taken_out),
                "bonus": mx.random.categorical(weights[k:k + 1])[0]}

    @staticmethod
    def _outcome(check, proposal: List[int]):
        """(proposals kept, the row's next token)."""
        if "argmax" in check:
            targets = check["argmax"].tolist()
            kept = 0
            while kept < len(proposal) and proposal[kept] == targets[kept]:
                kept += 1
            return kept, targets[kept]
        p_draft, u = check["p_draft"].tolist(), check["u"].tolist()
        for j in range(len(proposal)):
            if u[j] >= p_draft[j]:
                return j, check["residual"].tolist()[j]
        return len(proposal), check["bonus"].item()

    def _finish(self, emitted, taps=None, stays=None):
        """Upstream's next() for several tokens a row: count, stop, finish.
        A row that stops before its last token of the step hands back its
        KV without the tokens after the stop (those carried are dropped;
        the rest trimmed; a recurrent layer's state the one at the stop,
        `taps` at `stays[i]` less those); one whose stop token was carried
        hands back the KV it has (shorter: its stored entry covers less)."""
        keep, responses = [], []
        for i, (tokens, logprobs) in enumerate(emitted):
            finish_reason, n = None, 0
            for n, token in enumerate(tokens, 1):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish_reason = "length"
                if self._matchers[i].advance(token):
                    finish_reason = "stop"
                if finish_reason is not None:
                    break
                responses.append(self.Response(self.uids[i], token, logprobs[n - 1],
                                               None, None, None))
            if finish_reason is None:
                keep.append(i)
                continue
            uid = self.uids[i]
            if len(tokens) > n and uid in self.lookups:
                # (Kept past the stop: not handed out, not counted kept.)
                self.lookups[uid].accepted -= len(tokens) - n
            extra = max(0, len(tokens) - n - len(self.carried.pop(uid, ())))
            cache = self.extract_cache(i)
            if extra:
                del self.tokens[i][-extra:]
                recurrent = 0
                for c in cache:
                    if isinstance(c, ArraysCache):  # (its state at the stop)
                        c.cache = taps.row_at(recurrent, i, stays[i] - extra)
                        recurrent += 1
                    else:
                        trim_end(c, extra)
            responses.append(self.Response(self.uids[i], tokens[n - 1], logprobs[n - 1],
                                           finish_reason, cache, self.tokens[i]))
        if len(keep) < len(self.uids):
            self.filter(keep)  # (the runner forgets a finished row's lookup)
        return responses

    def _row_tokens(self):
        """Each row's tokens but its pending one: (in its KV, carried)."""
        return [(t, self.carried.get(uid, ())) for t, uid in zip(self.tokens, self.uids)]

    def extend(self, batch):
        """Rows joining (prefilled): with a draft model, the proposing
        ones start catching up through the draft (drafting.py)."""
        if self.draft is not None:
            self.draft.extend(batch.uids, batch.tokens,
                              [uid in self.lookups for uid in batch.uids])
        super().extend(batch)

    def filter(self, keep: List[int]):
        if self.draft is not None:  # (those leaving store their draft KV)
            self.draft.filter(self.uids, keep, self._row_tokens())
        super().filter(keep)
        if self.carried:  # (rows that left: finished, or removed by the runner)
            live = set(self.uids)
            self.carried = {u: t for u, t in self.carried.items() if u in live}


def install(generator, draft_model=None, draft_chunk: int = 512,
            draft_prompts: Optional[DraftPrompts] = None,
            vocab: Optional[int] = None) -> Optional[Dict[int, RowLookup]]:
    """Make `generator`'s decode batch a speculating one, its proposals
    from `draft_model` (drafting.py: rows catch up `draft_chunk` tokens a
    step, its KV kept between requests in `draft_prompts`, never a token
    past `vocab`) or else from prompt lookup; returns its uid -> RowLookup
    map for the runner to fill (None, and a warning once, where mlx-lm's
    GenerationBatch is not the one this was written for: facts.py keeps a
    draft's model on the sequential path there)."""
    if not generation_batch_as_written():
        warn_once("prompt lookup", (
            f"--prompt-lookup-tokens is off: mlx-lm {mlx_lm_version()}'s GenerationBatch "
            f"is not the one it was written for ({WRITTEN_FOR})"))
        return None
    batch = generation_batch(generator)
    batch.__class__ = SpeculativeGenerationBatch
    batch.lookups, batch.carried = {}, {}
    batch.cost, batch.roll_cost = StepCost(), StepCost()
    batch.unchecked, batch.after_check = 0, False
    # (Hybrid models: their recurrent mixers tapped; rollback.py.)
    batch.recorder = taps.install_for_checking(generator.model)
    batch.draft = None if draft_model is None else DraftRows(
        draft_model, draft_chunk, DraftCost(), vocab, draft_prompts)
    return batch.lookups


def draft_nbytes(generator) -> int:
    """Bytes of a speculating batch's draft KV (0 without a draft)."""
    draft = getattr(generation_batch(generator), "draft", None)
    return draft.nbytes if draft is not None else 0


def summary(lookup: Optional[RowLookup]) -> Optional[dict]:
    """A row's figures for its request's log line and usage."""
    if lookup is None or not lookup.steps:
        return None
    return {"proposed": lookup.proposed, "accepted": lookup.accepted,
            "verify_steps": lookup.steps,
            "acceptance": round(lookup.accepted / max(1, lookup.proposed), 3)}
