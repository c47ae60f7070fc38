"""Structured output enforced: the per-request logits processor that holds
generation to a Grammar (compiled in grammars.py), and the LogitMask that
batched logits processors hand the step.

    proc = processor_for(constraint, tokenizer, prompt=prompt)  # or:
    proc = ConstraintProcessor(grammar, tokenizer, after_think=...)
    generator.insert(..., logits_processors=[[*others, proc]])     # ours last
    ...
    if proc.error: the request failed in the grammar (it was ended by EOS)

Its own room: this is the per-step work of generation (on the generation
thread, or the worker that makes a batch's masks), apart from compiling.
Building a processor raises ConstraintError; once generation has started
it never raises into the batch (see ConstraintProcessor).
"""

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher

from mlx_lm_plus.planning.grammars import (
    ConstraintError,
    ConstraintUnavailable,
    Grammar,
    Prepared,
    StrictToolCalls,
    grammar_for,
    ll_tokenizer,
)


# -- the logits processor ------------------------------------------------------

# States of a ConstraintProcessor.
_MAYBE_THINK = "maybe_think"  # grammar or the think-start token
_THINKING = "thinking"  # pass-through until the think-end token
_ACTIVE = "active"  # the grammar applies
_DONE = "done"  # grammar complete or failed: EOS only
_FREE = "free"  # strict tools: pass-through until the model opens a call

# What a request's row needs at one step.
_PASS = "pass"  # its logits unchanged (thinking)
_EOS = "eos"  # only the EOS ids (grammar complete, or failed)
_MASK = "mask"  # the matcher's mask (plus any extra ids)

class ConstraintProcessor:
    """A logits processor for one request: `processor(tokens, logits) ->
    logits` in mlx-lm's BatchGenerator (or generate_step / stream_generate),
    and `ConstraintProcessor.mask_batch(rows, shape)` for every
    constrained row of a batch at once (patches/batched_logits_processors).

    Each call sees the request's tokens so far (prompt, then generated) and
    its logits. The first call comes before any token was generated:
    everything seen then is prompt. Each later call consumes the tokens added
    since the previous one (one per step), then masks the logits with -inf
    outside what the grammar allows next. Once the grammar is complete only
    the EOS ids are allowed, so the request ends by EOS (finish_reason
    "stop"); max_tokens can still cut it ("length").

    after_think: for thinking models. The grammar starts after the think-end
    token (`</think>`) the model generates; until then logits pass unchanged.
    At the first call the prompt decides: if its last think marker is a
    think-start (the template opened the block), wait for </think>; if the
    prompt ends with a think-end (the template closed the block:
    enable_thinking=False), constrain at once; otherwise (no marker, or one
    from an earlier turn) the model may open a block itself: the first token
    may be the think-start (then wait for </think>) or start the grammar.
    So the engine can pass after_think=tokenizer.has_thinking always.

    Strict tools (a "strict_tools" grammar, see tool_call_grammar's
    after_open): the model writes freely (thinking included) until it emits
    the <tool_call> token; the call that follows is held to the grammar, and
    once it is closed the model is free again (for text, or another call).

    Errors: a grammar failure during generation (a token the matcher refuses,
    a llguidance limit) never raises into the batch: `self.error` gets the
    reason and only EOS is allowed from then on, so the request ends at the
    next step with finish_reason "stop". The engine must check `error` when the
    request finishes and fail that one request. Construction raises
    ConstraintError (before the request joins a batch).

    Cost: `mask_seconds` / `steps` is the CPU time per constrained step
    (consume + mask + the mask as a bool array; see stats()). The masks are
    computed while the step's forward pass runs: the step starts it
    (mx.async_eval) before handing the CPU to llguidance, which drops the GIL
    (in a batch on the CPU, on a worker thread: see patches/
    batched_logits_processors). In a batch, one call fills every row's mask
    (a LogitMask) and one `where` applies them all. What cannot be hidden:
    the mask needs
    the token sampled at the previous step, so the step waits for it (mlx-lm
    otherwise queues the next step before the previous one is done); that
    wait happens while thinking too.

    Speculative decoding: `proposal_masks` gives the masks of the positions
    after proposed tokens, leaving the grammar as it was; the tokens a
    check keeps are consumed at the next step, with the token sampled after
    them, as any generated ones. Called alone (`__call__`), it sees every
    token it is handed as kept. One processor per request, never shared or
    reused.
    """

    ORDER = 1  # (batched after a thinking budget: patches/batched_logits_processors)

    def __init__(self, grammar: Grammar, tokenizer, *, after_think: bool = False,
                 prompt: Optional[Sequence[int]] = None, may_open_think: bool = True,
                 matcher: Optional[LLMatcher] = None):
        self.grammar = grammar
        self._prompt = prompt
        # False for raw text prompts: no template asks the model to think,
        # so a prompt without markers is constrained from its first token.
        self._may_open_think = may_open_think
        self.ll = ll_tokenizer(tokenizer)
        # (`matcher`: one built ahead for this grammar and tokenizer, unused.)
        self.matcher = matcher or LLMatcher(self.ll, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.eos_ids = sorted(tokenizer.eos_token_ids)
        self.error: Optional[str] = None
        self.after_think = after_think and tokenizer.has_thinking
        self._think_start = tuple(tokenizer.think_start_tokens or ()) if self.after_think else ()
        self._think_end = tuple(tokenizer.think_end_tokens or ()) if self.after_think else ()
        self.state = _THINKING if self.after_think else _ACTIVE
        # Strict tools: the token that opens a call, which starts the grammar.
        self._trigger = (grammar.schema or {}).get("trigger") if grammar.kind == "strict_tools" else None
        if self._trigger is not None:
            self.after_think, self.state = False, _FREE
        self.calls = 0  # strict tools: the calls the model opened
        self._seen: Optional[int] = None  # tokens seen at the previous call
        self._recent: List[int] = []  # generated tokens, while looking for </think>
        self._words = (self.ll.vocab_size + 31) // 32  # of a bitmask row
        self._extra_ids: List[int] = []  # also allowed this step (think-start)
        self.steps = 0
        self.mask_seconds = 0.0

    @property
    def started(self) -> bool:
        """Whether the grammar applied at all (False: the model was still
        thinking when the request ended, so its output is unconstrained)."""
        return self.state in (_ACTIVE, _DONE) or self.calls > 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """One row, `tokens` its (1-d) context, `logits` of shape (1, vocab)."""
        # Start this step's forward pass: the mask is computed while it runs.
        mx.async_eval(logits)
        new = tokens[self._seen :].tolist() if self._seen is not None else None
        tic = time.perf_counter()
        if new is None:
            need = self._first(lambda: np.array(tokens).tolist())
        else:
            need = self._advance(new)
        self._seen = tokens.size
        return LogitMask.applied(logits, _mask(logits.shape, [(0, self, need)], tic))

    @staticmethod
    def mask_batch(rows, shape) -> Optional["LogitMask"]:
        """The mask of all constrained rows of a batch step, on the CPU
        alone (numpy and llguidance: any thread may make it while the step's
        forward pass runs). `rows`: (row index, processor, the row's tokens
        in the KV cache as a list, the token fed at this step); `shape`: the
        logits' (batch, vocab). Other rows pass unchanged; None: all do."""
        tic = time.perf_counter()
        needs = []
        for e, p, history, newest in rows:
            if p._seen is None:
                need = p._first(lambda: history + [newest])
            else:
                need = p._advance(history[p._seen :] + [newest])
            p._seen = len(history) + 1
            needs.append((e, p, need))
        return _mask(shape, needs, tic)

    @property
    def follows_proposals(self) -> bool:
        """Whether proposals may be checked now (see proposal_masks)."""
        return self.error is None and (self.state == _FREE or (
            self.state == _ACTIVE and not self.matcher.is_stopped()))

    def proposal_masks(self, proposal: Sequence[int], vocab: int
                       ) -> Tuple[int, Optional[np.ndarray]]:
        """For a speculative check of `proposal`, tokens proposed after
        the one this step's mask was made for (mask_batch consumed it): how
        many of them the row may check, and the allowed ids at the position
        after each of those ([n, vocab] bool; None: all allowed). The
        grammar is left as it was (llguidance rolls back what this consumed).

        A row checks none unless the grammar applies (not thinking, not
        complete or failed), and none from a token the grammar refuses (its
        position's mask, made before it, then decides) or one that would
        change the state: the token that ends the grammar (then EOS only),
        closes a strict tool call, or opens one (the model writes freely
        until then: no mask). Such a token is sampled at the last position
        checked, as a plain step would."""
        if self.error is not None:
            return 0, None
        if self.state == _FREE:
            n = proposal.index(self._trigger) if self._trigger in proposal else len(proposal)
            return n, None
        if self.state != _ACTIVE or self.matcher.is_stopped():
            return 0, None
        walk = GrammarWalk(self, vocab)
        bitmask = np.zeros((len(proposal), self._words), dtype=np.int32)
        checked = 0
        for token in proposal:
            if not walk.take(token):
                break
            walk.mask_into(bitmask[checked])
            checked += 1
        walk.close()
        if self.error is not None:  # (its rollback failed: the request ends)
            return 0, None
        return checked, _allowed(bitmask[:checked], vocab)

    def draft_walk(self, vocab: int, known: Sequence[int]) -> Optional["GrammarWalk"]:
        """The grammar walked along a draft model's tokens, so that the
        draft drafts what the grammar allows (drafting.py), from the row's
        tokens in its KV (`known`): those a check kept since the last
        mask_batch are taken first (the grammar reads them at the next
        step). None where no mask applies now (strict tools' free text: the
        draft drafts freely, proposal_masks cuts at the call's opening) or
        none may be proposed (thinking, complete, failed, or stopped by the
        tokens kept). `vocab`: the draft's logits' width."""
        if (self.error is not None or self.state != _ACTIVE or self._seen is None
                or self.matcher.is_stopped()):
            return None
        walk = GrammarWalk(self, vocab)
        for token in known[self._seen:]:
            if not walk.take(token):
                walk.close()
                return None
        return walk

    def _first(self, context) -> str:
        """The first call: the prompt sets the thinking state."""
        if self.after_think:
            # The whole prompt when known: the sequential path passes only
            # the tokens after the cached prefix to the processor.
            prompt = self._prompt if self._prompt is not None else context()
            self.state = self._thinking_state(list(prompt))
            if self.state == _MAYBE_THINK:
                self._extra_ids = [self._think_start[0]]
        return self._advance([])

    def _advance(self, new: List[int]) -> str:
        """Take the tokens generated since the previous call; what this
        step's row needs."""
        if self.state == _FREE:
            if self._trigger not in new:
                return _PASS
            new = new[new.index(self._trigger) + 1 :]
            self.state = _ACTIVE
            self.calls += 1
        if self.state == _THINKING:
            new = self._skip_thinking(new)
            if self.state == _THINKING:
                return _PASS
        elif self.state == _MAYBE_THINK and new:
            # Offered at the first step only: never inside the grammar.
            self._extra_ids = []
            if new[0] == self._think_start[0]:
                self.state = _THINKING
                new = self._skip_thinking(new[1:])
                if self.state == _THINKING:
                    return _PASS
            else:
                self.state = _ACTIVE
        matcher = self.matcher
        if self.state == _ACTIVE and new and not matcher.consume_tokens(new):
            return self._fail()
        if self.state == _DONE:
            return _EOS
        if self._trigger is not None and self.state == _ACTIVE and matcher.is_accepting():
            # The call is closed (nothing can follow it in its grammar).
            matcher.reset()
            self.state = _FREE
            return _PASS
        if matcher.is_stopped():
            if matcher.is_error():
                return self._fail()
            # Grammar complete: only EOS (whatever llguidance's own stop mask).
            self.state = _DONE
            return _EOS
        return _MASK

    def _thinking_state(self, prompt: List[int]) -> str:
        """Where the prompt leaves a thinking model (see the class doc)."""
        start = _rfind(prompt, self._think_start)
        end = _rfind(prompt, self._think_end)
        if start > end:
            return _THINKING
        tail = prompt[end + len(self._think_end) :] if end >= 0 else None
        if tail is not None and len(tail) <= 8 and not self.ll.decode_str(tail).strip():
            return _ACTIVE  # closed just now: "<think>\n\n</think>\n\n"
        # No marker, or one from an earlier turn (templates that keep recent
        # reasoning): the model may open a block itself, if its think-start
        # is one token (the mask can offer it); else constrain at once.
        if len(self._think_start) == 1 and self._may_open_think:
            return _MAYBE_THINK
        return _ACTIVE

    def _skip_thinking(self, new: List[int]) -> List[int]:
        """Pass tokens while thinking; returns those after the think-end."""
        self._recent.extend(new)
        at = _find(self._recent, self._think_end)
        if at < 0:
            del self._recent[: max(0, len(self._recent) - len(self._think_end))]
            return []
        self.state = _ACTIVE
        rest = self._recent[at + len(self._think_end) :]
        self._recent = []
        return rest

    def _fail(self) -> str:
        # Never raise inside the batch: remember why and end this request.
        if self.error is None:
            self.error = self.matcher.get_error() or "the output left the grammar"
        self.state = _DONE
        return _EOS

    def stats(self) -> Dict[str, float]:
        return {
            "steps": self.steps,
            "mask_seconds": self.mask_seconds,
            "mask_ms_per_step": 1e3 * self.mask_seconds / self.steps if self.steps else 0.0,
        }


class GrammarWalk:
    """A grammar walked ahead of what it has read, from the state
    mask_batch left: along a check's proposals (proposal_masks), or a
    draft's tokens before the check (draft_walk: the row's pending token,
    sampled under that mask, then each drafted one). `take(token)` consumes
    it and says whether proposals may go on after it: not after a token the
    grammar refuses, or one that completes it or closes a strict tool call.
    `after(token)` takes it and gives the allowed ids at the position after
    it ([vocab] bool; None where they stop). `close()` rolls back everything
    consumed (llguidance), leaving the grammar as it was."""

    def __init__(self, processor: ConstraintProcessor, vocab: int):
        self.processor = processor
        self.vocab = vocab
        self.consumed = 0
        self.stopped = False
        self._row = np.zeros((1, processor._words), dtype=np.int32)

    def take(self, token: int) -> bool:
        """Consume `token`; whether drafting may go on after it."""
        p = self.processor
        matcher = p.matcher
        # (An id past the tokenizer's puts the matcher in error even to
        # validate: proposal_masks cuts it the same way.)
        if self.stopped or not 0 <= token < p.ll.vocab_size \
                or matcher.validate_tokens([token]) != 1 or not matcher.consume_token(token):
            self.stopped = True
            return False
        self.consumed += 1
        if matcher.is_stopped() or (p._trigger is not None and matcher.is_accepting()):
            self.stopped = True
        return not self.stopped

    def mask_into(self, row: np.ndarray):
        """The bitmask of the position after the tokens taken, into `row`."""
        self.processor.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def after(self, token: int) -> Optional[np.ndarray]:
        if not self.take(token):
            return None
        self.mask_into(self._row[0])
        return _allowed(self._row, self.vocab)[0]

    def close(self):
        if self.consumed and not self.processor.matcher.rollback(self.consumed):
            # (The grammar can't be trusted from here: end the request, as
            # for any grammar failure.)
            self.processor._fail()
        self.consumed, self.stopped = 0, True


@dataclass
class LogitMask:
    """What batched logits processors do to a step's logits: made on the
    CPU with numpy (on any thread), applied on the generation thread in one
    or two `where`s. Logits outside `keep` become -inf, then those in `fill`
    0 (a row limited to a few ids samples one of them whatever their logits,
    never from a row of -inf). Both (batch, vocab) bool arrays."""

    keep: np.ndarray
    fill: Optional[np.ndarray] = None

    def apply(self, logits: mx.array) -> mx.array:
        # (-inf and 0.0 are weak scalars: a bf16 batch stays bf16.)
        out = mx.where(mx.array(self.keep), logits, -mx.inf)
        if self.fill is not None:
            out = mx.where(mx.array(self.fill), 0.0, out)
        return out

    @staticmethod
    def applied(logits: mx.array, mask: Optional["LogitMask"]) -> mx.array:
        return logits if mask is None else mask.apply(logits)


def _mask(shape, needs, tic: float) -> Optional[LogitMask]:
    """The mask of the rows `needs` names ((row, processor, need)) in
    logits of `shape`: every _MASK row's bitmask filled by its matcher,
    then one bool array for the whole batch (rows not in `needs`, and _PASS
    rows, all allowed). `tic`: when the step's work for them began."""
    if all(need == _PASS for _, _, need in needs):
        return None
    eos = [(e, p) for e, p, need in needs if need == _EOS]
    masked = [(e, p) for e, p, need in needs if need == _MASK]
    batch, vocab = shape
    allowed = np.ones((batch, vocab), dtype=bool)
    if masked:
        words = masked[0][1]._words  # one tokenizer per batch
        bitmask = np.zeros((len(masked), words), dtype=np.int32)
        # One row after another: llguidance's thread pool (LLExecutor) was
        # slower here (0.63-0.68x vs 0.68-0.79x of unconstrained at batch 8
        # on the CPU fixture): a mask takes microseconds, a handoff more.
        for i, (_, p) in enumerate(masked):
            row = bitmask[i]
            p.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        rows = _allowed(bitmask, vocab)
        for i, (e, p) in enumerate(masked):
            if p.matcher.is_error():
                p._fail()
                eos.append((e, p))
                continue
            allowed[e] = rows[i]
            for t in p._extra_ids:
                if t < vocab:
                    allowed[e, t] = True
    # EOS only, at logit 0: whatever the model (or a logit_bias) gave the
    # EOS ids, the row samples one of them, never from an all -inf row. (A
    # row whose EOS ids all lie past the logits can't stop: max_tokens ends it.)
    at_eos = np.zeros((batch, vocab), dtype=bool) if eos else None
    for e, p in eos:
        at_eos[e, [t for t in p.eos_ids if t < vocab]] = True
        if at_eos[e].any():
            allowed[e] = False
    work = [p for _, p, need in needs if need != _PASS]
    for p in work:
        p.steps += 1
        p.mask_seconds += (time.perf_counter() - tic) / len(work)
    return LogitMask(allowed, at_eos)


def _allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's bitmasks ([n, words] int32, a bit per tokenizer id) as
    [n, vocab] bool: ids past the tokenizer's vocabulary (padded
    embeddings) never."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(bool)
    out = np.zeros((len(bitmask), vocab), dtype=bool)
    known = min(vocab, bits.shape[1])
    out[:, :known] = bits[:, :known]
    return out


def _find(seq: List[int], sub: Sequence[int]) -> int:
    n = len(sub)
    if n == 0:
        return -1
    for i in range(len(seq) - n + 1):
        if seq[i] == sub[0] and tuple(seq[i : i + n]) == tuple(sub):
            return i
    return -1


def _rfind(seq: List[int], sub: Sequence[int]) -> int:
    n = len(sub)
    if n == 0:
        return -1
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == sub[0] and tuple(seq[i : i + n]) == tuple(sub):
            return i
    return -1


# -- measuring -----------------------------------------------------------------


def mask_cost(grammar: Grammar, tokenizer, text: str, repeat: int = 3) -> Dict[str, float]:
    """Time llguidance's per-token work on a valid output `text` (e.g. a
    json.dumps of an instance of the schema): for each of its tokens, one mask
    computation plus one consume, as the processor does per step.
    Returns microseconds per token: median, p90, max, and the token count."""
    ll = ll_tokenizer(tokenizer)
    ids = ll.tokenize_str(text, parse_special=True)
    bitmask = np.zeros((1, (ll.vocab_size + 31) // 32), dtype=np.int32)
    times = []
    for _ in range(repeat):
        matcher = LLMatcher(ll, grammar.text, log_level=0)
        for t in ids:
            tic = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            ok = matcher.consume_token(t)
            times.append(time.perf_counter() - tic)
            if not ok:
                raise ConstraintError(f"text does not match the grammar: {matcher.get_error()}")
    us = np.array(times) * 1e6
    return {
        "tokens": len(ids),
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "max_us": float(us.max()),
    }


# -- a request's processor -----------------------------------------------------


def processor_for(constraint, tokenizer, prompt=None,
                  chat: bool = True) -> Optional["ConstraintProcessor"]:
    """The logits processor of a request's constraint, for the request whose
    prompt is `prompt` (its token ids; `chat`: from a chat template, which may
    have the model open a thinking block). Raises ConstraintError."""
    try:
        grammar = grammar_for(constraint, tokenizer)
    except ConstraintUnavailable:
        source = constraint.source if isinstance(constraint, Prepared) else constraint
        if isinstance(source, StrictToolCalls):
            return None  # best effort, as the API decided for the loaded model
        raise
    if grammar is None:
        return None
    matcher = constraint.take_matcher(tokenizer) if isinstance(constraint, Prepared) else None
    return ConstraintProcessor(grammar, tokenizer, after_think=True, prompt=prompt,
                               may_open_think=chat, matcher=matcher)
