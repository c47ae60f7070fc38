"""GenerationBatch._step: one call for all rows of a batched logits processor.

mlx-lm 0.32.2 runs logits processors row by row: each row's logits are
sliced out, each row's token context is updated and handed to its
processors, and the rows are concatenated back. For a processor that must
read the token sampled at the previous step (a grammar matcher does), each
row then forces its own evaluation of a tiny graph and builds its own mask
ops: on the tiny fixture at batch 8 that cost 0.14 ms per row per step and
took constrained decoding to 0.57x of unconstrained. This version is
upstream's step with one change: a row whose LAST processor has a
`mask_batch` attribute (ConstraintProcessor) leaves that processor to
one call per step for all such rows (and so each of the row's last
processors that have it, a thinking budget before a grammar),

    mask = type(p).mask_batch(rows, logits.shape)   rows: [(row, processor, history, newest)]
    logits = mask.apply(logits)                     (None: unchanged)

where history is the row's tokens in the KV cache (a Python list, already
kept by the batch) and newest the token being fed now, read for all rows by
one evaluation. Earlier processors of the row (penalties, logit bias) run
per row first, as upstream runs them. Rows without processors are untouched.
A processor that also works alone (`__call__`) stays correct when this patch
is not applied: upstream then calls it per row.

The masks are made while the step's forward pass runs. On a GPU the step
queues the pass (`async_eval` returns at once) and makes them on this
thread. On the CPU `async_eval` returns only once the pass is nearly done
(MLX bounds the tasks in flight), so a mask made after it adds its whole
time to the step: there the step reads the previous tokens first and one
worker thread makes the masks while this thread waits in `async_eval`
(which drops the GIL). On the tiny CPU fixture that took constrained
decoding through the server from 0.785x of unconstrained to 0.83x at
batch 8, and from 0.85x to 0.93x at batch 1 (docs/structured-output.md).
"""

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import List, Tuple

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from ._guard import Patch


@functools.lru_cache(maxsize=None)
def _mask_worker() -> ThreadPoolExecutor:
    """The thread that makes masks while a CPU step's forward pass runs
    (one: a batch's masks are one call; one generation thread steps)."""
    return ThreadPoolExecutor(1, thread_name_prefix="mlx_lm_plus-masks")


# A forked child keeps the cached executor but not its thread, and a task
# submitted there would wait forever: the child makes its own.
os.register_at_fork(after_in_child=_mask_worker.cache_clear)


def masks_beside_the_pass() -> bool:
    """Whether a step's masks are made on the worker while its forward
    pass runs (on the CPU, where `async_eval` waits for the pass; see the
    module doc), or on this thread after queuing the pass (a GPU)."""
    return mx.default_device() == mx.cpu


def _masks(kinds, history, newest, shape) -> list:
    """Each batched processor type's mask for this step, in order (budgets
    before grammars: the types in the order of rows' lists)."""
    return [kind.mask_batch([(e, p, history[e], newest[e]) for e, p in rows], shape)
            for kind, rows in kinds]


def process_rows(batch, inputs: mx.array, logits: mx.array) -> Tuple[mx.array, List[mx.array]]:
    """Upstream's per-row loop, with batched processors taken out of it."""
    token_context = []
    grouped = {}  # processor type -> [(row, processor)]
    per_row = []  # [(row, the processors it runs alone)]
    for e, processors in enumerate(batch.logits_processors):
        processors = list(processors or ())
        # The row's last processors that work batched (a thinking budget,
        # then a grammar), each type in one call; one that is done for
        # good (`done`) drops out of the step.
        while processors and hasattr(processors[-1], "mask_batch"):
            p = processors.pop()
            if not getattr(p, "done", False):
                grouped.setdefault(type(p), []).insert(0, (e, p))
        if processors:
            per_row.append((e, processors))
    if per_row:  # sliced and joined only when some row needs it
        rows = [logits[e : e + 1] for e in range(len(batch.uids))]
        for e, processors in per_row:
            context = batch._token_context[e].update_and_fetch(inputs[e : e + 1])
            token_context.append(context)
            for processor in processors:
                rows[e] = processor(context, rows[e])
        logits = mx.concatenate(rows, axis=0)
    if grouped:
        kinds = sorted(grouped.items(), key=lambda kv: getattr(kv[0], "ORDER", 0))
        if masks_beside_the_pass():
            newest = inputs.tolist()  # one evaluation for every row
            making = _mask_worker().submit(_masks, kinds, batch.tokens, newest, logits.shape)
            mx.async_eval(logits)  # (the pass runs meanwhile; see the module doc)
            masks = making.result()
        else:
            # Queue this step's forward pass behind the previous step before
            # waiting for that step's tokens: the GPU never idles for the
            # masks' inputs, and they are made while the pass runs.
            mx.async_eval(logits)
            masks = _masks(kinds, batch.tokens, inputs.tolist(), logits.shape)
        for mask in masks:
            if mask is not None:
                logits = mask.apply(logits)
    return logits, token_context


def _step(self) -> Tuple[List[int], List[mx.array]]:
    """
    Perform a single generation step.

    Returns:
        Tuple of token list and logprobs list.
    """
    self._current_tokens = self._next_tokens
    self._current_logprobs = self._next_logprobs
    inputs = self._current_tokens

    # Forward pass
    logits = self.model(inputs[:, None], cache=self.prompt_cache)
    logits = logits[:, -1, :]

    # Logits processors (the one change: see the module doc)
    token_context = []
    if any(self.logits_processors):
        logits, token_context = process_rows(self, inputs, logits)

    # Normalize the logits
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    # One batched call when the batch shares a sampler.
    samplers = [
        self.fallback_sampler if s is None else s
        for s in (self.samplers or [None] * len(self.uids))
    ]
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate(
            [s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0
        )

    # Assign the next step to member variables and start computing it
    # asynchronously
    self._next_tokens = sampled
    self._next_logprobs = list(logprobs)
    mx.async_eval(self._next_tokens, self._next_logprobs, token_context)

    # Eval the current tokens and current logprobs. After that also add
    # them to self.tokens so that it always represents the tokens contained
    # in the KV Cache.
    mx.eval(inputs, self._current_logprobs)
    inputs = inputs.tolist()
    for sti, ti in zip(self.tokens, inputs):
        sti.append(ti)
    return inputs, self._current_logprobs


# GenerationBatch._step is replaced if its source is 0.32.2's.
PATCH = Patch(
    __name__,
    GenerationBatch,
    "_step",
    sha256="d7513c5031029194ca3820ae81d8966b792e66a90c39c1d7ad61d30bc9e8c5ad",
    replacement=_step,
)
apply, revert = PATCH.apply, PATCH.revert
