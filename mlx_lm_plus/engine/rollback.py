"""Recurrent states rolled back per row after a checking step of speculation
(speculation.py), for hybrid models (Qwen3.5's GatedDeltaNet, Mamba 1).

A checking step runs each row's carried tokens, pending token and proposals
through the model in one call; a row then keeps a prefix of them. Its
attention KV is cut to that prefix (trimmed, or rolled into its left
padding), but a recurrent layer's state has no positions to cut: after the
call it holds every position's update, rejected ones included. So the
step's call is tapped (taps.install_for_checking) at every position: each
recurrent mixer runs the call's positions one token a piece, the call a
plain decode step makes, so each state is the one decoding without
speculation reaches, and its whole-batch state after each piece is kept
(the arrays as they are: no copy). Row i's state then becomes the one after
the positions it keeps (`restore`), and a row that ends on a stop word
inside what it kept hands back the state at the stop (`row_at`).

The states of one step are held until it ends: (width - 1) copies of the
batch's recurrent state, bounded by STATE_BUDGET_BYTES (`widest`).
"""

from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

# Most bytes of recurrent states a checking step holds (every row, every
# position but its last): not in any budget, like its logits.
STATE_BUDGET_BYTES = 512 << 20


def recurrent_layers(prompt_cache) -> List[ArraysCache]:
    return [c for c in prompt_cache if isinstance(c, ArraysCache)]


def widest(prompt_cache) -> Optional[int]:
    """The most positions a checking step may have so that its states stay
    within STATE_BUDGET_BYTES (None: no recurrent layer, no bound)."""
    layers = recurrent_layers(prompt_cache)
    if not layers:
        return None
    state = sum(a.nbytes for c in layers for a in c.cache if a is not None)
    return 1 + STATE_BUDGET_BYTES // max(1, state)


def tapped_call(model, inputs: mx.array, prompt_cache, recorder, tap: bool,
                cuts: Optional[List[int]] = None):
    """model(inputs, cache=prompt_cache), each recurrent layer's states
    after every position of the call (or only at `cuts`) kept where `tap`
    (StateTaps, its width the call's); returns (logits, the taps or None)."""
    taps = StateTaps(recorder, prompt_cache, inputs.shape[1], cuts) if tap else None
    if taps is not None:
        taps.open()
    try:
        logits = model(inputs, cache=prompt_cache)
    finally:
        if taps is not None:
            taps.close()
    return logits, taps


class StateTaps:
    """One checking step's recurrent states: each layer's arrays before the
    call, after each of its positions, and after it (`open` before the call,
    `close` after it)."""

    def __init__(self, recorder, prompt_cache, width: int, cuts: Optional[List[int]] = None):
        self.recorder = recorder
        self.layers = recurrent_layers(prompt_cache)
        self.width = width
        # (Positions whose states are kept: every one, or those asked for,
        # the call cut into pieces only there.)
        self.cuts = sorted({c for c in (range(1, width) if cuts is None else cuts)
                            if 0 < c < width})
        self.before = [list(c.cache) for c in self.layers]
        self.after: List[List[Any]] = []
        self.states = {}

    def open(self):
        self.recorder.cuts = {p: [None] for p in self.cuts}
        self.recorder.states = {}

    def close(self):
        recorder = self.recorder
        self.states, recorder.cuts, recorder.states = recorder.states, None, {}
        self.after = [list(c.cache) for c in self.layers]

    def _at(self, k: int, position: int) -> List[Any]:
        """Layer k's whole-batch arrays after `position` positions."""
        if position <= 0:
            return self.before[k]
        if position >= self.width:
            return self.after[k]
        kept = self.states.get((id(self.layers[k]), position, None))
        if kept is None:  # (taps.py's probe said pieces are exact: never expected)
            raise RuntimeError(f"no recurrent state at position {position} of a checking step")
        return kept

    def restore(self, stays: List[int]):
        """Row i's state: the one after its first stays[i] positions."""
        if all(s >= self.width for s in stays):
            return  # (every row kept all: the state after the call)
        for k, c in enumerate(self.layers):
            picks = [self._at(k, s) for s in stays]
            c.cache = [None if a is None else mx.concatenate(
                [pick[j][i:i + 1] for i, pick in enumerate(picks)])
                for j, a in enumerate(c.cache)]

    def row_at(self, k: int, row: int, position: int) -> List[Any]:
        """Layer k's arrays of one row after `position` positions."""
        return [None if a is None else a[row:row + 1] for a in self._at(k, position)]
