"""A draft model's proposals inside the batch (`--draft-model`, a request's
`draft_model`): the proposal source of speculation.py where the served model
has a draft.

The draft keeps a batched KV cache of its own for the batch's proposing rows
(a seeded sampled row, XTC or no `num_draft_tokens` have none; a row with
a grammar or a thinking budget has one, and proposes when they let it:
speculation.checked_proposal): its draft rows, in the order they joined,
each named by its batch row's uid. A draft row's KV holds a prefix of its
row's tokens: `fed` of them. A drafting step feeds every draft row what the
draft has not seen yet (the tokens kept since, what the row carries, its
pending token: one call, rows right-padded to one width and the padding then
rolled into their left padding, as BatchKVCache.finalize does after a
right-padded prompt), then draws `width` tokens greedily, one call each.
The proposals are the draft's argmax: a point mass, so speculation.py's
check (kept with probability p(d), else a draw from p without d) keeps the
model's distribution at any temperature, as for prompt lookup. A row with a
grammar drafts the argmax among what its grammar allows at each position
(ConstraintProcessor.draft_walk, rolled back after): what the check would
mask away is never drafted.

After the check (`settle`), every draft row is trimmed by one count: the
drafted positions past the fewest any draft row kept (a row that kept more
feeds them again next step: the draft is the cheap model), so no position
its row did not keep stays in a draft row's KV.

Drafts of other layers (a small Qwen3.5 or Nemotron-H drafting for a large
one, Gemma 3 270M for Gemma 3): the feeding call, rows right-padded, is
tapped at each row's own count of tokens where the draft has recurrent
layers (taps.py, as a checking step is: rollback.StateTaps), and each row's
state becomes the one after its own tokens, padding left out; each drafting
call's states are kept as they are (no copy: a recurrent layer's arrays are
replaced, never written into), and `settle` sets them back to those after
the positions kept. Those states stay within rollback.STATE_BUDGET_BYTES
(rows feed and draft at most rollback.widest positions a step). A sliding window's one-token updates write over the window's oldest
positions in place, so they can't be trimmed back: its layers are set back
to their state before the drafting calls (kept aside, its arrays rebound so
the calls write into copies), the whole draft's drafted positions dropped,
and the kept ones fed again next step with the row's other new tokens.

A row joining starts from the longest prefix of its prompt the draft's own
prompt store holds (`DraftPrompts`: a row that leaves stores its draft KV
there, so a conversation's next turn runs only its new tokens through the
draft, as through the model) and catches up the rest alone, one chunk a
step (`catch_up`, the chunk the model's prompts get while others decode):
no step stalls for a long prompt through the draft. It proposes once it
has joined the draft's batch. The draft's bytes count with the batch's
(`nbytes`: its batched KV, the rows catching up, its store).
"""

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (ArraysCache, BatchRotatingKVCache, KVCache,
                                  RotatingKVCache, make_prompt_cache)

from mlx_lm_plus.engine.batch_kv import MAX_POSITIONS, in_temporal_order, roll_into_padding
from mlx_lm_plus.engine import rollback, taps

# Most tokens a draft row feeds in one drafting step: a row behind by more
# (it waited many steps) catches up over several and proposes once caught
# up. Rows x width of a call stays within MAX_POSITIONS (its logits).
CATCH_UP_MAX = 64
# Most proposals a row of a draft makes in a step (a request's
# num_draft_tokens is cut to it: the row's lists and the check's widths
# follow it).
MAX_DRAFT_TOKENS = 32

# A batch row's tokens as (those in its KV, those it carries): lists of the
# batch's own, never copied whole (a long context's are long).
Tokens = Tuple[Sequence[int], Sequence[int]]


def _length(tokens: Tokens) -> int:
    return len(tokens[0]) + len(tokens[1])


def _span(tokens: Tokens, start: int, stop: int) -> List[int]:
    """tokens[start:stop] of the row's tokens (in its KV, then carried)."""
    kv, carried = tokens
    n = len(kv)
    out = list(kv[start:min(stop, n)]) if start < n else []
    if stop > n:
        out += carried[max(0, start - n):stop - n]
    return out


def drafts_in_batch(model, draft, tapped: bool, draft_tapped: bool) -> bool:
    """Whether `draft` can propose for `model`'s batch: each model's layers
    plain KV (rolled back per row by trimming and rolling), sliding windows
    (batch_kv.py; a draft's set back, see the module doc) or, where its
    recurrent mixers are tapped (`tapped`, `draft_tapped`: taps.py),
    recurrent (rollback.py)."""
    def fits(m, is_tapped):
        try:
            layers = {type(c) for c in make_prompt_cache(m)}
        except Exception:
            return False
        # (KV layers: a KVCache or one that stores as it does, windows of
        # any RotatingKVCache class: a vision model's, vlm_text.py.)
        return bool(layers) and all(k is ArraysCache or issubclass(k, RotatingKVCache)
                                    or taps.holds_prefix(k) for k in layers) \
            and (is_tapped or ArraysCache not in layers)
    return fits(model, tapped) and fits(draft, draft_tapped)


class DraftPrompts:
    """The draft's KV between requests: a prompt store of its own (its
    entries never meet the model's, nor count in its store's figures or
    sequence limit), a quarter of the prompt cache's byte budget; its bytes
    count in the batch's, which the model's store gives way to."""

    def __init__(self, store):
        self.store = store

    def fetch(self, tokens: List[int]):
        """(the draft's cache of the longest stored prefix, or None; its
        tokens). A failure (out of memory) is a miss."""
        try:
            found = self.store.fetch("draft", tokens)
        except Exception:
            logging.exception(f"Could not read a draft entry for {len(tokens)} tokens")
            return None, 0
        return found.cache, found.cached

    def put(self, tokens: List[int], cache: List[Any]):
        """Store a draft row's KV; a failure (out of memory) loses only that."""
        try:
            self.store.insert("draft", tokens, cache, "generated")
        except Exception:
            logging.exception(f"Could not store a draft entry of {len(tokens)} tokens")

    @property
    def nbytes(self) -> int:
        return self.store.nbytes


class DraftRows:
    """The draft model and its KV for the proposing rows of one decode batch."""

    def __init__(self, model, chunk: int, cost, vocab: Optional[int] = None,
                 prompts: Optional[DraftPrompts] = None):
        self.model = model
        # (Tokens the served model has logits for: a draft with a larger
        # vocabulary never proposes one past them.)
        self.vocab = vocab
        # Tokens a step catches up (catch_up): the chunk a prompt gets this
        # step (the runner sets it each step; 0 where a first token is due).
        self.chunk = chunk
        self.prompts = prompts
        self.cost = cost  # (a StepCost) seconds of drafting by tokens drafted
        self.cache: Optional[List[Any]] = None  # (a batch cache of each layer's kind)
        kinds = {type(c) for c in make_prompt_cache(model)}
        # (Recurrent layers: their feeding calls tapped, facts.drafts_in_batch.)
        self.recorder = (taps.install_for_checking(model, prompts=False)
                         if ArraysCache in kinds else None)
        # (The draft's own embedding rows, where it says: `vocab` may be
        # the model's where the draft doesn't.)
        self.rows = getattr(getattr(model, "args", None), "vocab_size", None)
        # Of the drafting step being checked: each recurrent layer's arrays
        # after each drafted position fed (0: none), each sliding window's
        # state before them.
        self._states: List[List[List[Any]]] = []
        self._windows: List[tuple] = []
        self.order: List[int] = []  # the uid of each draft row
        self.fed: List[int] = []  # per draft row: its row's tokens in its KV
        # Rows catching up alone: uid -> [their draft cache, tokens in it].
        self.joining: Dict[int, list] = {}
        # What the store gave each row that joined (not stored again as is).
        self.fetched: Dict[int, int] = {}
        self._drafted = 0  # tokens each draft row drafted in the step being checked
        self._proposing: List[bool] = []  # per draft row, in that step

    @property
    def nbytes(self) -> int:
        held = sum(c.nbytes for c in self.cache) if self.cache else 0
        held += sum(c.nbytes for cache, _ in self.joining.values() for c in cache)
        return held + (self.prompts.nbytes if self.prompts is not None else 0)

    def extend(self, uids: List[int], tokens: List[List[int]], proposes: List[bool]):
        """Rows joining the batch: each proposing row starts from what the
        draft's store holds of its tokens (those in its KV: the prompt); the
        rest is caught up a chunk a step (catch_up)."""
        for uid, row, proposing in zip(uids, tokens, proposes):
            if not proposing:
                continue
            cache, cached = None, 0
            if self.prompts is not None and row:
                cache, cached = self.prompts.fetch(list(row))
            if cache is None:
                cache, cached = make_prompt_cache(self.model), 0
            self.joining[uid] = [cache, cached]
            self.fetched[uid] = cached

    def catch_up(self, uids: List[int], tokens: List[Tokens]) -> bool:
        """Up to one chunk of tokens through the draft for the rows still
        catching up, in the order they came (each alone); one within
        CATCH_UP_MAX of its tokens joins the draft's batch. Whether the
        draft ran."""
        at = {uid: i for i, uid in enumerate(uids)}
        budget, ran = self.chunk, False
        for uid in [u for u in self.joining if u in at]:
            if budget <= 0:
                break
            cache, fed = self.joining[uid]
            row = tokens[at[uid]]
            stop = min(_length(row), fed + budget)
            if stop > fed:
                self.model(self._known(mx.array(_span(row, fed, stop))[None]), cache=cache)
                mx.eval([c.state for c in cache])
                budget -= stop - fed
                ran = True
            if _length(row) - stop >= CATCH_UP_MAX:
                self.joining[uid][1] = stop
                continue
            del self.joining[uid]
            joined = [type(c).merge([c]) for c in cache]
            if self.cache is None:
                self.cache = joined
            else:
                for c, j in zip(self.cache, joined):
                    c.extend(j)
            self.order.append(uid)
            self.fed.append(stop)
        return ran

    def filter(self, uids: List[int], keep: List[int], tokens: Optional[List[Tokens]] = None):
        """Only batch rows `keep` of `uids` stay, as the batch's filter; with
        `tokens` (each batch row's), the draft KV of those leaving is stored
        (DraftPrompts)."""
        staying = {uids[i] for i in keep}
        rows = {uid: i for i, uid in enumerate(uids)}
        storing = self.prompts is not None and tokens is not None

        def leaves(uid, cache, fed):
            # (Stored where it holds more than the store gave it.)
            if storing and uid in rows and fed > self.fetched.get(uid, 0):
                self._store(cache(), fed, tokens[rows[uid]])
            self.fetched.pop(uid, None)

        for uid in [u for u in self.joining if u not in staying]:
            cache, fed = self.joining.pop(uid)
            leaves(uid, lambda: cache, fed)
        stays = [j for j, uid in enumerate(self.order) if uid in staying]
        for j, uid in enumerate(self.order):
            if uid not in staying:
                leaves(uid, lambda: [c.extract(j) for c in self.cache], self.fed[j])
        if len(stays) == len(self.order):
            return
        self.order = [self.order[j] for j in stays]
        self.fed = [self.fed[j] for j in stays]
        if not stays:
            self.cache = None
            return
        for c in self.cache:
            c.filter(stays)

    def _store(self, cache: List[Any], fed: int, tokens: Tokens):
        """A leaving row's draft KV (`fed` of its tokens; its pending token
        too once fed, not among `tokens`: cut off) into the draft's store.
        (Not where that would cut a recurrent state or a sliding window:
        neither can be cut back.)"""
        held = min(fed, _length(tokens))
        plain = all(isinstance(c, KVCache) for c in cache)
        if not held or (held < fed and not plain):
            return
        if plain:
            for c in cache:
                c.trim(c.offset - held)
        self.prompts.put(_span(tokens, 0, held), cache)

    def propose(self, uids: List[int], tokens: List[Tokens], pending: mx.array,
                lengths: List[int], grammars: Optional[List[Any]] = None
                ) -> List[List[int]]:
        """Each batch row's proposals (lengths[i] of them, 0: none; the
        longest drafted for every proposing draft row). tokens[i]: the row's
        tokens but its pending one (in its KV, then carried); pending: the
        pending tokens (an array, one per batch row); grammars[i]: the
        row's ConstraintProcessor or None (its draft then drafts, greedily,
        what the grammar allows: draft_walk). Every draft row feeds what it
        has not seen (so that rows stay alike); one still behind after that
        proposes nothing."""
        none = [[] for _ in uids]
        if not self.order:
            self._drafted, self._proposing = 0, []
            return none
        at = {uid: i for i, uid in enumerate(uids)}
        rows = [at[uid] for uid in self.order]  # (KeyError: a row the batch lost)
        drafts = self._draft([tokens[b] for b in rows], pending[mx.array(rows)],
                             [lengths[b] for b in rows],
                             [grammars[b] for b in rows] if grammars else None)
        for b, d in zip(rows, drafts):
            none[b] = d
        return none

    def _draft(self, tokens: List[Tokens], pending, lengths,
               grammars: Optional[List[Any]] = None) -> List[List[int]]:
        """propose(), over the draft rows."""
        tic, rows = time.perf_counter(), len(tokens)
        cap = max(1, min(CATCH_UP_MAX, MAX_POSITIONS // rows))
        # (Recurrent layers: a feeding call keeps a batch's states at each
        # distinct feed, and drafting one after each drafted position, both
        # within rollback.STATE_BUDGET_BYTES, as a checking step's.)
        most = rollback.widest(self.cache) if self.cache else None
        if most is not None:
            cap = min(cap, most)
            lengths = [min(n, most) for n in lengths]
        feeds, drafting = [], []
        for j in range(rows):
            unseen = _length(tokens[j]) + 1 - self.fed[j]
            feed = min(unseen, cap)
            feeds.append(feed)
            drafting.append(lengths[j] > 0 and feed == unseen)
        self._drafted, self._proposing = 0, drafting
        width = max((n for n, d in zip(lengths, drafting) if d), default=0)
        wide = max(feeds)
        # Row j: its unseen tokens (the pending one last, from the array
        # that holds it, where it is reached), then padding to `wide`.
        ids, at = [], []
        for j in range(rows):
            start = self.fed[j]
            known = _span(tokens[j], start, start + feeds[j])
            ids.append(known + [0] * (wide - len(known)))
            at.append(feeds[j] - 1 if len(known) < feeds[j] else -1)
        is_pending = mx.arange(wide)[None, :] == mx.array(at)[:, None]
        inputs = self._known(mx.where(is_pending, pending[:, None].astype(mx.uint32),
                                      mx.array(ids, dtype=mx.uint32)))
        padding = [wide - f for f in feeds]
        in_temporal_order(self.cache)
        logits, state_taps = rollback.tapped_call(
            self.model, inputs, self.cache, self.recorder,
            self.recorder is not None and any(padding), cuts=feeds)
        last = mx.array([f - 1 for f in feeds])[:, None, None]
        first = mx.take_along_axis(logits, last, axis=1)[:, 0, :]
        if any(padding):  # (drafted tokens follow each row's own)
            roll_into_padding([c for c in self.cache if not isinstance(c, ArraysCache)],
                              padding)
            if state_taps is not None:  # (each row's state after its own tokens)
                state_taps.restore(feeds)
                state_taps = None  # (its states let go before drafting)
        for j in range(rows):
            self.fed[j] += feeds[j]
        if not width:  # (only catching up)
            mx.eval([c.state for c in self.cache])
            return [[] for _ in range(rows)]
        # Rows with a grammar: each drafted position masked as the grammar
        # would mask it there (its walk from the pending token on), a row's
        # drafting cut where its grammar stops it; rolled back after.
        vocab = min(self.vocab or first.shape[-1], first.shape[-1])
        walks = [g.draft_walk(vocab, tokens[j][0]) if g is not None and drafting[j] else None
                 for j, g in enumerate(grammars or [None] * rows)]
        limits = [n if d else 0 for n, d in zip(lengths, drafting)]
        try:
            if any(walks):
                pending_ids = pending.tolist()
                first = self._masked(first, walks, pending_ids, limits, 0)
            token = self._greedy(first)
            drafted = [token]
            if width > 1:
                self._set_aside()
            for s in range(1, width):
                logits = self.model(token[:, None], cache=self.cache)[:, -1, :]
                if any(walks):  # (the token just drafted, to walk the grammar on)
                    logits = self._masked(logits, walks, token.tolist(), limits, s)
                token = self._greedy(logits)
                drafted.append(token)
                self._states.append(self._recurrent())
            drafted = mx.stack(drafted, axis=1).tolist()  # (one evaluation)
            for j, walk in enumerate(walks):
                # (A row's last drafted token, not walked on yet: cut where
                # it completes the grammar or closes a strict call.)
                if walk is not None and limits[j] >= width and not walk.take(drafted[j][-1]):
                    limits[j] = width - 1
        finally:
            for walk in walks:
                if walk is not None:
                    walk.close()
        self._drafted = width
        self.cost.observe(width, time.perf_counter() - tic)
        out = [drafted[j][:limits[j]] for j in range(rows)]
        if not any(out):
            # (Every row's grammar cut its drafts: no check follows, nor its
            # settle. The drafted positions go now.)
            self._keep_drafted(0)
        return out

    def _masked(self, logits: mx.array, walks, last: List[int], limits: List[int],
                drafted: int) -> mx.array:
        """The draft rows' logits at their next drafted position (`drafted`
        drafted before it), each walking row's masked by its grammar after
        `last[j]`, its pending or last drafted token. A row whose walk
        stops drafts no further (limits[j]: what it keeps): not the drafted
        token that stopped it (one that completes the grammar or closes a
        strict call), which the check would cut (proposal_masks)."""
        logits = logits[:, :self.vocab] if self.vocab else logits
        keep = None
        for j, walk in enumerate(walks):
            if walk is None or walk.stopped or drafted >= limits[j]:
                continue
            allowed = walk.after(last[j])
            if allowed is None:
                limits[j] = min(limits[j], max(0, drafted - 1))
                continue
            if not allowed.any():  # (none it can draft)
                limits[j] = min(limits[j], drafted)
                continue
            if keep is None:
                keep = np.ones(logits.shape, dtype=bool)
            keep[j] = allowed
        return logits if keep is None else mx.where(mx.array(keep), logits, -mx.inf)

    def _recurrent(self) -> List[List[Any]]:
        return [list(c.cache) for c in self.cache if isinstance(c, ArraysCache)]

    def _set_aside(self):
        """Before the drafting calls: the recurrent states (kept as they
        are), each sliding window's state, its arrays rebound so that the
        calls' in-place writes go to copies (mlx arrays written in place
        change for every holder)."""
        self._states = [self._recurrent()]
        self._windows = []
        for c in self.cache:
            if isinstance(c, BatchRotatingKVCache) and c.keys is not None:
                self._windows.append((c, c.state))
                c.keys, c.values = c.keys[...], c.values[...]
                c.left_padding, c.offset = c.left_padding[...], c.offset[...]

    def _known(self, ids: mx.array) -> mx.array:
        """A row's tokens as the draft takes them: an id past the vocabulary
        both models share (a model's wider than its draft's: only a warning
        at load) as its last, which the draft's embedding holds (MLX does
        not check: it would read past the table). Its proposals are then
        only less often kept."""
        known = [n for n in (self.vocab, self.rows) if n]
        return ids if not known else mx.minimum(ids, min(known) - 1)

    def _greedy(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits[:, :self.vocab] if self.vocab else logits, axis=-1)

    def settle(self, uids: List[int], kept: List[int]):
        """After the check: kept[i] of batch row i's proposals kept. The
        drafted positions (inputs: all drafted tokens but the last) past
        the fewest any draft row kept are trimmed from every draft row."""
        fed_drafts = self._drafted - 1  # (the last drafted token was not fed)
        at = {uid: i for i, uid in enumerate(uids)}
        valid = min((min(kept[at[uid]], fed_drafts) if proposing else 0
                     for uid, proposing in zip(self.order, self._proposing)), default=0)
        self._keep_drafted(valid)

    def _keep_drafted(self, valid: int):
        """The drafting calls' positions past the first `valid` taken out
        of every draft row (trimmed, states set back; a window set back
        whole, `valid` then 0), and the step's drafting forgotten."""
        fed_drafts = self._drafted - 1  # (the last drafted token was not fed)
        states, windows = self._states, self._windows
        self._drafted, self._states, self._windows = 0, [], []
        if fed_drafts <= 0 or not self.cache:
            return
        if windows:  # (set back to before the drafting calls: module doc)
            valid = 0
            for c, state in windows:
                c.state = state
        recurrent = iter(states[valid]) if states else None
        for c in self.cache:
            if isinstance(c, ArraysCache):
                c.cache = next(recurrent)
            elif not isinstance(c, BatchRotatingKVCache):
                c.trim(fed_drafts - valid)
        self.fed = [f + valid for f in self.fed]
