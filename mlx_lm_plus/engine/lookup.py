"""Prompt lookup's proposals (`--prompt-lookup-tokens`): a row's next
tokens guessed from its own tokens. Where its last two tokens appeared
before, in its prompt or its answer, what followed them then is proposed
(speculation.py checks it). Also a row's proposal state whatever proposes
for it (its length, its waits, its acceptance rate): a draft model's rows
keep one too (drafting.py)."""

from dataclasses import dataclass, field
from typing import List

import numpy as np

from mlx_lm_plus.engine.sampling import RowSampling

NGRAM_MAX = 4  # the longest suffix a match is scored on (two at least)
CANDIDATES = 64  # earlier places of the last two tokens compared, latest first
MAX_BACKOFF = 16  # steps a row waits, at most, after failures or misses
# A row's acceptance rate before it has been checked (kept / checked), and
# how far a lower one moves back toward it each time the row's proposals
# were not worth checking: a rate learnt from a few failures (an answer
# that opens with a line of its own before copying its context) would
# otherwise keep it from being checked again until EXPLORE_EVERY steps
# without any check (speculation.py), whatever it proposes meanwhile.
PRIOR_KEPT, PRIOR_CHECKED = 1.0, 2.0
RECOVERY = 0.2


@dataclass
class RowLookup:
    """A speculating row: its tokens (as growing arrays, searched for its
    own suffix), its proposal length and what it has proposed and kept."""
    sampling: RowSampling
    max_tokens: int  # the flag's cap on proposals per step
    length: int = 0  # its current proposal length
    wait: int = 0  # steps to skip proposing (after failures, no match, or not paying)
    failures: int = 0  # steps in a row where nothing was accepted
    misses: int = 0  # lookups in a row that found nothing
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # verifying steps it proposed in
    # Recent proposals kept and checked (a proposal is checked when all
    # before it were kept), older steps weighing less: its acceptance rate.
    # From the prior's; a lower one drifts back toward it (unpaid).
    _kept: float = PRIOR_KEPT
    _checked: float = PRIOR_CHECKED
    # The row's tokens, and each pair of neighbours as one number (so that
    # one comparison over the row finds every earlier place of its last two
    # tokens: a 100,000-token row in well under a millisecond).
    _tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _pairs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _size: int = 0

    def __post_init__(self):
        self.length = self.max_tokens

    def _sync(self, tokens: List[int], tail: int):
        """Append what the row's tokens gained since the last call (a row's
        tokens only grow while it is in the batch), with room for `tail`
        more."""
        n = len(tokens)
        if n < self._size:  # (never expected; start over rather than lie)
            self._size = 0
        if n + tail > len(self._tokens):
            room = max(n + tail, 2 * len(self._tokens), 256)
            self._tokens = np.resize(self._tokens, room)
            self._pairs = np.resize(self._pairs, room)
        if n > self._size:
            start = self._size
            self._tokens[start:n] = tokens[start:n]
            first = max(0, start - 1)
            self._pairs[first:n - 1] = _pair(self._tokens[first:n - 1], self._tokens[first + 1:n])
            self._size = n

    def propose(self, tokens: List[int], tail: List[int], room: int) -> List[int]:
        """The tokens that followed an earlier place of the row's last two
        known tokens (`tokens`, those in its KV, then `tail`, those it
        carries): a guess at its pending token (sampled, not yet read: the
        step that computed it may still be running), then up to
        min(length, room) proposals after it. Of the latest CANDIDATES such
        places, the one whose match runs back furthest (up to NGRAM_MAX
        tokens), the latest on a tie."""
        k = min(self.length, room) + 1
        n, total = len(tokens), len(tokens) + len(tail)
        if k <= 0 or n < 1 or total < 3:
            return []
        self._sync(tokens, len(tail))
        h, pairs = self._tokens, self._pairs
        # (The tail and its pairs after the row's own, until the next sync.)
        h[n:total] = tail
        pairs[n - 1:total - 1] = _pair(h[n - 1:total - 1], h[n:total])
        found = np.flatnonzero(pairs[:total - 2] == pairs[total - 2])
        if not len(found):
            self.misses += 1
            self.wait = min(MAX_BACKOFF, self.misses)
            return []
        self.misses = 0
        best, best_run = None, -1
        for j in found[-CANDIDATES:][::-1].tolist():
            run = 0
            while (run < NGRAM_MAX - 2 and j - 1 - run >= 0
                   and h[j - 1 - run] == h[total - 3 - run]):
                run += 1
            if run > best_run:
                best, best_run = j, run
        start = best + 2  # (at most total - 1)
        return h[start:min(total, start + k)].tolist()

    def unpaid(self, wait: int):
        """Its proposals were not worth checking this step: it waits at
        least `wait` steps, and a rate under the prior's moves back toward
        it (a higher one is kept: the step may not have paid for other
        rows' sake)."""
        self.wait = max(self.wait, wait)
        if self._kept * PRIOR_CHECKED < PRIOR_KEPT * self._checked:
            self._kept += RECOVERY * (PRIOR_KEPT - self._kept)
            self._checked += RECOVERY * (PRIOR_CHECKED - self._checked)

    def ready(self) -> bool:
        """Whether it looks this step (else one step less to wait)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def rates(self, k: int) -> List[float]:
        """The chance that each of k proposals is kept (each with its rate,
        while all before it were)."""
        rate = self._kept / self._checked
        return [rate ** j for j in range(1, k + 1)]

    def verified(self, proposed: int, accepted: int):
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        self._kept = 0.8 * self._kept + accepted
        self._checked = 0.8 * self._checked + min(accepted + 1, proposed)
        self.length = max(1, min(self.max_tokens, accepted + 1))
        if accepted == 0:
            self.failures += 1
            self.wait = min(MAX_BACKOFF, 2 ** (self.failures - 1) - 1)
        else:
            self.failures = 0


def _pair(first, second):
    """Two neighbouring tokens as one number (token ids are under 2**31)."""
    return (np.asarray(first, np.int64) << 32) | np.asarray(second, np.int64)
