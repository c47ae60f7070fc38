"""Recurrent states taken inside a model call ("taps").

A hybrid model's checkpoint at position p is its recurrent layers' state at p
over the attention KV up to p (cache.py). BatchGenerator ends a prompt chunk
at every segment end, so each checkpoint inside a prompt cost a model call of
its own: on a turn of a conversation, the state at the start of the last
user message (kept for edits) made the prefill two calls where upstream's is
one, and every weight was read twice.

With taps the prompt goes through in chunks cut by --prefill-step-size only.
Each recurrent mixer (the module of a layer whose cache is an ArraysCache:
GatedDeltaNet, the Mamba 1 and 2 mixers) runs its part of a chunk in pieces
cut at the checkpoint positions and keeps its state after each piece; the
attention layers, MLPs and everything else run once. A mixer is causal and
carries what it needs from piece to piece in its cache (conv window, scan
state, and the padding mask through the cache's lengths), so its pieces in a
row compute what one call does, as chunked prefill does. The attention KV at
p is a prefix of the row's KV after the call.

Upstream has no way to read a state inside a call, hence this module. It
applies only to models whose every layer is an ArraysCache or a KVCache (or
a subclass that stores as it does: a vision model's MRopeKVCache), and only
where a probe at load agrees (`install`); others keep
one call per checkpoint. A tap that did not get every recurrent layer's
state stores nothing (`TappingPromptBatch.prompt`).
"""

import inspect
import logging
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

class Recorder:
    """What the tapped mixers of one model read and write during a call:
    `cuts` (position in the call -> the rows that want their states there;
    None while no call is tapped) and `states` ((id of the layer's cache,
    position, row) -> that row's arrays after the piece ending there, copied
    out of the batch's: a view would keep every row's state alive; row None:
    the whole batch's arrays, as they are, for a checking step of
    speculation, rollback.py) and
    `sources` (the batch's arrays they were copied from, held until the
    copies are evaluated: a copy whose source nothing else holds any more
    takes over the source's buffer, every row of it, instead of copying)."""

    def __init__(self):
        self.cuts: Optional[Dict[int, List[int]]] = None
        self.states: Dict[Tuple[int, int, int], List[Any]] = {}
        self.sources: List[Any] = []


_TAPPED_CLASSES: Dict[type, type] = {}


def _tapped_class(cls: type) -> type:
    """`cls` with a __call__ that runs in pieces while its recorder has cuts."""
    tapped = _TAPPED_CLASSES.get(cls)
    if tapped is not None:
        return tapped
    signature = inspect.signature(cls.__call__)

    def __call__(self, *args, **kwargs):
        recorder = self.__dict__.get("_tap_recorder")
        if recorder is None or recorder.cuts is None:
            return cls.__call__(self, *args, **kwargs)
        return _in_pieces(self, cls.__call__, signature, recorder, args, kwargs)

    tapped = type(cls.__name__, (cls,), {"__call__": __call__,
                                         "__qualname__": cls.__qualname__,
                                         "__module__": cls.__module__})
    _TAPPED_CLASSES[cls] = tapped
    return tapped


def _in_pieces(module, call, signature, recorder: Recorder, args, kwargs):
    """One mixer call cut at `recorder.cuts`, its cache's arrays kept after
    each piece. The input is the first argument after self, (B, S, ...); a
    mask argument, if any, is (B, S)."""
    bound = signature.bind(module, *args, **kwargs)
    arguments = bound.arguments
    names = list(arguments)
    x, cache = arguments[names[1]], arguments.get("cache")
    mask = arguments.get("mask")
    length = x.shape[1]
    if not isinstance(cache, ArraysCache) or (
            mask is not None and (not isinstance(mask, mx.array) or mask.shape != x.shape[:2])):
        return call(*bound.args, **bound.kwargs)  # (no states kept: the tap stores nothing)
    bounds = sorted({0, length, *(c for c in recorder.cuts if 0 < c < length)})
    # A right-padded chunk's cache has each row's real length in it, and the
    # mixers read it as at most the call's length (mamba2's SSD takes the
    # state at position lengths - 1). Each piece gets its own: the row's
    # real tokens in that piece.
    lengths = cache.lengths
    outputs = []
    for start, stop in zip(bounds, bounds[1:]):
        piece = dict(arguments)
        piece[names[1]] = x[:, start:stop]
        if mask is not None:
            piece["mask"] = mask[:, start:stop]
        if lengths is not None:
            cache.lengths = mx.clip(lengths - start, 0, stop - start)
        outputs.append(call(**piece))
        rows = recorder.cuts.get(stop, ())
        for row in rows:
            recorder.states[(id(cache), stop, row)] = list(cache.cache) if row is None else [
                None if a is None else mx.array(a[row : row + 1]) for a in cache.cache]
        if any(row is not None for row in rows):
            recorder.sources.append(list(cache.cache))
    if lengths is not None:
        cache.lengths = lengths - length  # (as one call's advance leaves it)
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)


def _takes_cache(module) -> bool:
    try:
        return "cache" in inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False


def _innermost_cache_takers(model) -> List[Any]:
    """The modules called with a layer's cache that call no such module
    themselves: the mixers and attention modules, not the decoder layers
    around them (pieces of a whole layer would run its MLP in pieces too,
    and pieces inside pieces would cut at the wrong places)."""
    takers = [m for _, m in model.named_modules() if _takes_cache(m)]
    ids = {id(m) for m in takers}
    return [m for m in takers
            if not any(id(d) in ids for _, d in m.named_modules() if d is not m)]


def install(model) -> Optional[Recorder]:
    """Make `model`'s recurrent mixers tappable; returns their recorder, or
    None when the model has no recurrent layer or taps do not apply to it
    (then each checkpoint keeps a model call of its own).

    Applies only where a probe agrees (`_probe`): cutting a call at taps
    changes nothing in it, and the states kept are those of calls cut there."""
    recorder = getattr(model, "_tap_recorder", None)
    if recorder is not None or hasattr(model, "_tap_recorder"):
        return recorder
    recorder = None
    kinds = _cache_kinds(model)
    if ArraysCache in kinds and not _tappable(kinds):
        logging.info("Checkpoints inside prompt chunks: off for layers of kinds "
                     f"{sorted({k.__name__ for k in kinds})}; one model call each")
    elif ArraysCache in kinds:
        recorder = Recorder()
        mixers = _innermost_cache_takers(model)
        originals = _tap(mixers, recorder)
        try:
            agrees = _probe(model, recorder)
        except Exception as e:
            logging.warning(f"Taps left off ({type(e).__name__}: {e})")
            agrees = False
        if agrees:
            logging.info(f"Checkpoints inside prompt chunks: {len(mixers)} modules tapped")
        else:
            logging.info("Checkpoints inside prompt chunks: off (cutting this model's calls "
                         "changes them); one model call each")
            for mixer, cls in zip(mixers, originals):
                mixer.__class__ = cls
                del mixer.__dict__["_tap_recorder"]
            recorder = None
    object.__setattr__(model, "_tap_recorder", recorder)
    return recorder


def install_for_checking(model, prompts: bool = True) -> Optional[Recorder]:
    """Taps for speculation's checking steps (rollback.py), which cut each
    recurrent mixer's part of a call at every position: one token a piece,
    the call a plain decode step makes, so they need no probe. The prompt
    recorder where `install` made one (`prompts`: not for a draft model,
    whose prompts are not cut at checkpoints); else one of their own
    (mamba2's chunked scan, whose pieces of a prompt the probe refused: its
    prompt chunks stay whole). None: no recurrent layer, or layers of
    other kinds."""
    recorder = install(model) if prompts else None
    if recorder is not None:
        return recorder
    if hasattr(model, "_check_recorder"):
        return model._check_recorder
    kinds = _cache_kinds(model)
    if ArraysCache in kinds and _tappable(kinds):
        recorder = Recorder()
        _tap(_innermost_cache_takers(model), recorder)
    object.__setattr__(model, "_check_recorder", recorder)
    return recorder


def _cache_kinds(model) -> List[type]:
    try:
        return [type(c) for c in make_prompt_cache(model)]
    except Exception:
        return []


def _tappable(kinds: List[type]) -> bool:
    """Recurrent layers beside layers holding a prefix of the sequence
    (rotating windows and chunked KV do not hold a prefix of the end)."""
    return all(k is ArraysCache or holds_prefix(k) for k in kinds)


def _tap(mixers, recorder: Recorder) -> List[type]:
    """Make `mixers` tappable by `recorder`; their classes before."""
    originals = [type(m) for m in mixers]
    for mixer in mixers:
        mixer.__class__ = _tapped_class(type(mixer))
        object.__setattr__(mixer, "_tap_recorder", recorder)
    return originals


def holds_prefix(kind: type) -> bool:
    """A KVCache, or a subclass that stores and trims as it does (a vision
    model's MRopeKVCache, which only carries its M-RoPE delta along): its
    keys up to a position are the layer's cache at that position."""
    return issubclass(kind, KVCache) and all(
        getattr(kind, name) is getattr(KVCache, name) for name in ("update_and_fetch", "trim"))


PROBE_TOKENS, PROBE_CUTS = 9, (3, 5)


def _probe(model, recorder: Recorder) -> bool:
    """Whether a call of PROBE_TOKENS tokens tapped at PROBE_CUTS gives the
    logits and end states of the same call untapped, bit for bit, and keeps
    at each cut the states that calls ending there leave (close: those
    calls run attention over other shapes).

    Bit for bit, because in a batch a row is cut at every row's positions:
    a mixer whose pieces change its sums (mamba2's chunked SSD scan, in
    bfloat16 by whole tokens) would make a request's reply depend on the
    requests prefilled beside it. Recurrences run token by token
    (GatedDeltaNet, Mamba 1) are cut exactly."""
    x = mx.arange(1, PROBE_TOKENS + 1)[None]
    whole = make_prompt_cache(model)
    untapped = model(x, cache=whole)[:, -1]
    tapped = make_prompt_cache(model)
    recorder.cuts, recorder.states = {c: [0] for c in PROBE_CUTS}, {}
    try:
        logits = model(x, cache=tapped)[:, -1]
        mx.eval(untapped, logits, recorder.states, [c.state for c in whole + tapped])
    finally:
        states, recorder.cuts, recorder.states = recorder.states, None, {}
        recorder.sources = []  # (the probe's own arrays: kept until a tapped chunk otherwise)
    if not _same(logits, untapped):
        return False
    for a, b in zip(tapped, whole):
        if isinstance(a, ArraysCache) and not all(map(_same, a.cache, b.cache)):
            return False
    cut = make_prompt_cache(model)
    bounds = (0, *PROBE_CUTS)
    for start, stop in zip(bounds, bounds[1:]):
        model(x[:, start:stop], cache=cut)
        for a, b in zip(tapped, cut):
            if isinstance(a, ArraysCache):
                kept = states.get((id(a), stop, 0))
                if kept is None or len(kept) != len(b.cache) or not all(map(_close, kept, b.cache)):
                    return False
    return True


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and mx.array_equal(a, b).item()


def _close(a, b) -> bool:
    """Within 1% of the larger array's scale."""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape:
        return False
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    scale = max(mx.abs(b).max().item(), 1e-6)
    return (mx.abs(a - b).max() <= 1e-2 * scale).item()


class TappingPromptBatch(PromptProcessingBatch):
    """A prompt batch whose rows may want checkpoints inside a chunk:
    `wanted` (uid -> sorted absolute positions, shared with the generator);
    what the taps produce goes to `tapped` (uid -> [(position, cache, or
    None where a layer kept no state)])."""

    recorder: Recorder
    wanted: Dict[int, List[int]]
    tapped: Dict[int, List[Tuple[int, List[Any]]]]

    def _copy(self):
        new = super()._copy()
        new.recorder, new.wanted, new.tapped = self.recorder, self.wanted, self.tapped
        return new

    def prompt(self, tokens: List[List[int]]):
        cuts: Dict[int, List[Tuple[int, int]]] = {}  # row -> [(position in the call, absolute)]
        for row, (uid, chunk) in enumerate(zip(self.uids, tokens)):
            start = len(self.tokens[row])
            inside = [(p - start, p) for p in self.wanted.get(uid, ())
                      if start < p <= start + len(chunk)]
            if inside:
                cuts[row] = inside
        if not cuts:
            return super().prompt(tokens)
        # (One model call for the chunk, as upstream makes when the chunk is
        # at most its step: the positions are in that call.)
        self.prefill_step_size = max(self.prefill_step_size, max(map(len, tokens)))
        recorder = self.recorder
        recorder.cuts, recorder.states = {}, {}
        for row, inside in cuts.items():
            for cut, _ in inside:
                recorder.cuts.setdefault(cut, []).append(row)
        try:
            super().prompt(tokens)
        finally:
            states, recorder.cuts, recorder.states = recorder.states, None, {}
            sources, recorder.sources = recorder.sources, []
        for row, inside in cuts.items():
            uid = self.uids[row]
            wanted = self.wanted[uid]
            for cut, position in inside:
                wanted.remove(position)
                # (None: a layer kept no state there; the engine still hears
                # of it, for the requests waiting for that checkpoint.)
                self.tapped.setdefault(uid, []).append(
                    (position, self._checkpoint(row, cut, position, states)))
            if not wanted:
                del self.wanted[uid]
        # The copies now: until then each holds its whole batch's state.
        mx.eval([a for kept in states.values() for a in kept if a is not None])
        del sources

    def _checkpoint(self, row: int, cut: int, position: int, states) -> Optional[List[Any]]:
        """Row `row`'s cache at `position` (the call's position `cut`): its
        recurrent layers' states kept there, its KV cut to the position."""
        layers = []
        total = len(self.tokens[row])
        for c in self.prompt_cache:
            if isinstance(c, ArraysCache):
                kept = states.get((id(c), cut, row))
                if kept is None:
                    _warn_once(type(c))
                    return None
                layer = ArraysCache(len(kept))
                layer.cache = kept
            else:
                layer = c.extract(row)
                layer.trim(total - position)
            layers.append(layer)
        return layers


_warned = set()


def _warn_once(what):
    if what not in _warned:
        _warned.add(what)
        logging.warning(f"A recurrent layer kept no state at a tap ({what.__name__}): "
                        "that checkpoint is not stored")


class TappingBatchGenerator(BatchGenerator):
    """BatchGenerator whose requests may have checkpoints inside their
    prompt segments (`insert_segments(..., taps=...)`), taken by the model's
    recorder (`install`) in the chunk that passes them; `take_tapped()` hands
    out what the last steps took."""

    def __init__(self, model, recorder: Recorder, **kwargs):
        super().__init__(model, **kwargs)
        batch = self._prompt_batch
        batch.__class__ = TappingPromptBatch
        batch.recorder, batch.wanted, batch.tapped = recorder, {}, {}

    def insert_segments(self, segments, *args, taps: Optional[List[List[int]]] = None, **kwargs):
        uids = super().insert_segments(segments, *args, **kwargs)
        for uid, positions in zip(uids, taps or ()):
            if positions:
                self._prompt_batch.wanted[uid] = sorted(positions)
        return uids

    def remove(self, uids, return_prompt_caches=False):
        for uid in uids:
            self._prompt_batch.wanted.pop(uid, None)
            self._prompt_batch.tapped.pop(uid, None)
        return super().remove(uids, return_prompt_caches)

    def take_tapped(self) -> Dict[int, List[Tuple[int, Optional[List[Any]]]]]:
        tapped = self._prompt_batch.tapped
        if not tapped:  # (every step: no dict made for nothing)
            return {}
        out = dict(tapped)
        tapped.clear()
        return out
