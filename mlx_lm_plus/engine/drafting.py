"""A draft model's proposals inside the batch (`--draft-model`, a request's
`draft_model`): the proposal source of speculation.py where the served model
has a draft.

The draft keeps a batched KV cache of its own whose rows are the decode
batch's, in the same order (`extend` and `filter` follow the batch's). A
row's draft KV holds a prefix of the row's tokens: `fed[i]` of them. A
drafting step feeds every proposing row what its draft has not seen yet
(the tokens kept since, what the row carries, its pending token: one call,
rows right-padded to one width and the padding then rolled into their left
padding, as BatchKVCache.finalize does after a right-padded prompt), then
draws `width` tokens greedily, one call each. The proposals are the draft's
argmax: a point mass, so speculation.py's check (kept with probability
p(d), else a draw from p without d) keeps the target's distribution at any
temperature, as for prompt lookup.

After the check (`settle`), every row's draft KV is trimmed by one count:
the drafted positions past the fewest any row kept (a row that kept more
feeds them again next step: the draft is the cheap model), so no position
the row did not keep stays in its draft KV.

A row joins with its prompt run through the draft at once (`extend`, in
chunks of --prefill-step-size), from the longest prefix of it the prompt
store holds for the draft (`DraftPrompts`: the draft's KV under a model
key of its own, in the same byte budget); a row that leaves stores its
draft KV there, so a conversation's next turn prefills only its new
tokens through the draft, as through the model. Rows that never
propose (a grammar, a thinking budget, a seeded sampled row, no
`num_draft_tokens`) have no draft row: the draft runs on the proposing rows
alone. Its bytes count with the batch's (`nbytes`).
"""

import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache

from mlx_lm_plus.engine.batch_kv import roll_into_padding

# Most tokens a row feeds the draft in one step: a row behind by more (it
# waited many steps) catches up over several and proposes once caught up.
CATCH_UP_MAX = 64


def drafts_in_batch(model, draft, tapped: bool) -> bool:
    """Whether `draft` can propose for `model`'s batch: the draft's layers
    plain KV (rolled back per row by trimming and rolling), the model's too
    or, where its recurrent mixers are `tapped` (taps.py), recurrent
    (rollback.py)."""
    def kinds(m):
        try:
            return {type(c) for c in make_prompt_cache(m)}
        except Exception:
            return {None}
    return kinds(draft) == {KVCache} and kinds(model) in (
        {KVCache}, {KVCache, ArraysCache}, {ArraysCache}) and (tapped or kinds(model) == {KVCache})


@dataclass
class DraftPrompts:
    """Where a draft's KV is kept between requests: the prompt store, under
    `model_key` (the served model's key, tagged: its entries never meet the
    model's own), stored through `store_entry` (the engine's: a failure
    loses only that entry)."""
    store: Any  # a PromptStore
    store_entry: Callable
    model_key: Any

    def fetch(self, tokens: List[int]):
        """(the draft's cache of the longest stored prefix, or None; its tokens)."""
        found = self.store.fetch(self.model_key, tokens)
        return found.cache, found.cached

    def put(self, tokens: List[int], cache: List[Any]):
        self.store_entry(self.model_key, tokens, cache, "generated")


class DraftRows:
    """The draft model and its KV for the proposing rows of one decode
    batch (`members`: per batch row, whether it has a draft row; the draft
    rows are those rows, in the batch's order)."""

    def __init__(self, model, prefill_step_size: int, cost, vocab: Optional[int] = None,
                 prompts: Optional[DraftPrompts] = None):
        self.model = model
        self.prompts = prompts
        # (Tokens the served model has logits for: a draft with a larger
        # vocabulary never proposes one past them.)
        self.vocab = vocab
        self.prefill_step_size = max(1, prefill_step_size)
        self.cache: Optional[List[BatchKVCache]] = None
        self.members: List[bool] = []  # per batch row
        self.fed: List[int] = []  # per draft row: its row's tokens in the draft KV
        self.cost = cost  # (a StepCost) seconds of drafting by tokens drafted
        self._drafted = 0  # tokens each row drafted in the step being checked
        self._proposing: List[bool] = []  # per draft row, in that step

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) if self.cache else 0

    def row_of(self, i: int) -> Optional[int]:
        """Batch row i's draft row (None: it has none)."""
        return sum(self.members[:i]) if self.members[i] else None

    def extend(self, tokens: List[List[int]], proposes: List[bool]):
        """Rows joining the batch (at its end): each proposing row's tokens
        (those in its KV: the prompt) run through the draft."""
        rows = []
        for row, proposing in zip(tokens, proposes):
            self.members.append(proposing)
            if not proposing:
                continue
            cache, cached = None, 0
            if self.prompts is not None and row:
                cache, cached = self.prompts.fetch(row)
            if cache is None:
                cache, cached = make_prompt_cache(self.model), 0
            for start in range(cached, len(row), self.prefill_step_size):
                chunk = mx.array(row[start:start + self.prefill_step_size])[None]
                self.model(chunk, cache=cache)
                mx.eval([c.state for c in cache])
            rows.append(cache)
            self.fed.append(len(row))
        if not rows:
            return
        joined = [BatchKVCache.merge(list(layer)) for layer in zip(*rows)]
        if self.cache is None:
            self.cache = joined
        else:
            for c, j in zip(self.cache, joined):
                c.extend(j)

    def filter(self, keep: List[int], tokens: Optional[List[List[int]]] = None):
        """Only batch rows `keep` stay (in that order), as the batch's
        filter; with `tokens` (each batch row's, in its KV and carried), the
        draft KV of those leaving is stored (DraftPrompts)."""
        index = [self.row_of(i) for i in range(len(self.members))]
        if self.prompts is not None and tokens is not None:
            staying = set(keep)
            for i, j in enumerate(index):
                if j is not None and i not in staying:
                    self._store(j, tokens[i])
        stays = [index[i] for i in keep if index[i] is not None]
        self.members = [self.members[i] for i in keep]
        if not stays:
            self.cache, self.fed = None, []
            return
        for c in self.cache:
            c.filter(stays)
        self.fed = [self.fed[j] for j in stays]

    def _store(self, j: int, tokens: List[int]):
        """Draft row j's KV, under the tokens it holds (its pending token
        too once fed: not among `tokens`, so cut off)."""
        held = min(self.fed[j], len(tokens))
        if not held:
            return
        cache = [c.extract(j) for c in self.cache]
        for c in cache:
            c.trim(c.offset - held)
        self.prompts.put(list(tokens[:held]), cache)

    def propose(self, known: List[List[int]], pending: mx.array,
                lengths: List[int]) -> List[List[int]]:
        """Each batch row's proposals (lengths[i] of them, 0: none; the
        longest drafted for every proposing row). known[i]: the row's tokens
        but its pending one (in its KV, then carried); pending: the pending
        tokens (an array, one per batch row). A row still catching up feeds
        the draft and proposes nothing."""
        if len(known) != len(self.members):
            raise RuntimeError(f"draft members {len(self.members)} for a batch of {len(known)}")
        index = [i for i, member in enumerate(self.members) if member]
        self._drafted, self._proposing = 0, [False] * len(index)
        none = [[] for _ in known]
        if not index:
            return none
        if len(index) < len(known):
            pending = pending[mx.array(index)]
        drafts = self._draft([known[i] for i in index], pending, [lengths[i] for i in index])
        for i, d in zip(index, drafts):
            none[i] = d
        return none

    def _draft(self, known, pending, lengths) -> List[List[int]]:
        """propose(), over the draft rows."""
        tic, rows = time.perf_counter(), len(known)
        feeds, drafting = [], []
        for i in range(rows):
            unseen = len(known[i]) + 1 - self.fed[i]
            feed = min(unseen, CATCH_UP_MAX) if lengths[i] else 0
            feeds.append(feed)
            drafting.append(feed > 0 and feed == unseen)
        self._proposing = drafting
        if not any(feeds):
            return [[] for _ in range(rows)]
        width = max(n for n, d in zip(lengths, drafting) if d) if any(drafting) else 0
        wide = max(feeds)
        # Row i: its unseen tokens (the pending one last, from the array
        # that holds it), then padding to `wide`.
        ids, at = [], []
        for i in range(rows):
            row = known[i][self.fed[i]:self.fed[i] + feeds[i]]
            ids.append(row + [0] * (wide - len(row)))
            at.append(feeds[i] - 1 if drafting[i] else -1)
        is_pending = mx.arange(wide)[None, :] == mx.array(at)[:, None]
        inputs = mx.where(is_pending, pending[:, None].astype(mx.uint32),
                          mx.array(ids, dtype=mx.uint32))
        logits = self.model(inputs, cache=self.cache)
        last = mx.array([max(0, f - 1) for f in feeds])[:, None, None]
        token = self._greedy(mx.take_along_axis(logits, last, axis=1)[:, 0, :])
        padding = [wide - f for f in feeds]
        if any(padding):  # (drafted tokens follow each row's own)
            roll_into_padding(self.cache, padding)
        for i in range(rows):
            self.fed[i] += feeds[i]
        if not width:  # (only catching up)
            mx.eval([c.state for c in self.cache])
            return [[] for _ in range(rows)]
        drafted = [token]
        for _ in range(width - 1):
            logits = self.model(token[:, None], cache=self.cache)
            token = self._greedy(logits[:, -1, :])
            drafted.append(token)
        drafted = mx.stack(drafted, axis=1).tolist()  # (one evaluation)
        self._drafted = width
        self.cost.observe(width, time.perf_counter() - tic)
        return [drafted[i][:lengths[i]] if drafting[i] else [] for i in range(rows)]

    def _greedy(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits[:, :self.vocab] if self.vocab else logits, axis=-1)

    def settle(self, kept: List[int]):
        """After the check: kept[i] of batch row i's proposals kept. The
        drafted positions (inputs: all drafted tokens but the last) past
        the fewest any draft row kept are trimmed from every draft row."""
        fed_drafts = self._drafted - 1  # (the last drafted token was not fed)
        self._drafted = 0
        if fed_drafts <= 0 or not self.cache:
            return
        kept = [k for k, member in zip(kept, self.members) if member]
        valid = min(min(k, fed_drafts) if proposing else 0
                    for k, proposing in zip(kept, self._proposing))
        for c in self.cache:
            c.trim(fed_drafts - valid)
        self.fed = [f + valid for f in self.fed]
