"""Embedding and reranking on the generation thread: prefill only, batched
across inputs and requests.

A request admitted for an embedder waits here as a job. Each `step()` runs
one forward pass over pending inputs of one model: the oldest input, with
the others of about its length (the least padding), up to
`budget` padded tokens (--prefill-step-size) and MAX_ROWS inputs. A job is
answered once its last input is done. The loop calls `step()` once a turn,
after a step of each generating batch, so a stream of another model waits
for one embedding batch at most between two of its tokens.

A decoder's input longer than the budget runs alone, in chunks through a
prompt cache, as a long prompt's prefill does.
"""

import logging
from dataclasses import dataclass
from typing import Callable, List

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_plus.errors import OutOfMemory, request_error

# Inputs in one forward pass, at most.
MAX_ROWS = 256
# Pending inputs a pass is chosen from (the oldest first): the choice costs
# the same whether 1 or 200 requests of 2,048 inputs wait.
WINDOW = 4 * MAX_ROWS


@dataclass
class EmbeddingOutput:
    """A job's answer: its inputs' vectors ([N, H] float32) or scores
    ([N]), in input order; whether the vectors are L2-normalized (a
    truncation to `dimensions` is normalized again then)."""

    values: np.ndarray
    prompt_tokens: int
    normalized: bool


class _Job:
    def __init__(self, channel, lm, plan):
        self.channel = channel
        self.lm = lm
        self.plan = plan
        self.left = list(range(len(plan.inputs)))  # inputs not run yet, in order
        self.values: List = [None] * len(plan.inputs)
        self.done = 0  # inputs with their value


class EmbeddingRunner:
    """`beat(what)`: the watchdog's beat; `budget()`: padded tokens a
    forward pass may take."""

    def __init__(self, beat: Callable[[str], None], budget: Callable[[], int]):
        self.beat = beat
        self.budget = budget
        self.jobs: List[_Job] = []
        self.batches = 0  # forward passes run (/v1/stats)
        self.inputs = 0  # inputs run

    def add(self, channel, lm, plan) -> None:
        self.jobs.append(_Job(channel, lm, plan))

    @property
    def active(self) -> bool:
        return bool(self.jobs)

    def channels(self) -> list:
        return [job.channel for job in self.jobs]

    def uses(self, key) -> bool:
        return self.held_for(key) > 0

    def held_for(self, key) -> int:
        """Requests of model `key` held (safe from any thread)."""
        return sum(job.lm.key == key for job in list(self.jobs))

    def forget(self) -> None:
        """Let every job go (their channels were answered: Engine._fail_held)."""
        self.jobs = []

    def fail(self, error: Exception, key=None) -> None:
        """Answer the jobs (of model `key`; None: all) with `error`."""
        failed = [j for j in self.jobs if key is None or j.lm.key == key]
        self.jobs = [j for j in self.jobs if j not in failed]
        for job in failed:
            job.channel.put(error)

    def step(self) -> None:
        """One forward pass (module docstring)."""
        for job in [j for j in self.jobs if j.channel.cancelled]:
            self.jobs.remove(job)
            job.channel.removed()
        if not self.jobs:
            return
        lm = self.jobs[0].lm
        batch = self._choose(lm)
        self.beat("an embedding batch")
        try:
            values = self._run(lm, [(job.plan.inputs[i], job.plan.starts[i])
                                    for job, i in batch])
        except Exception as e:
            logging.exception("An embedding batch failed")
            error = request_error(e, "running the embedding model")
            if isinstance(error, OutOfMemory):
                mx.clear_cache()
            # The jobs of this batch lost inputs: they are answered; the
            # others go on.
            failed = {id(job) for job, _ in batch}
            for job in [j for j in self.jobs if id(j) in failed]:
                self.jobs.remove(job)
                job.channel.put(error)
            return
        self.batches += 1
        self.inputs += len(batch)
        for (job, i), value in zip(batch, values):
            job.values[i] = value
            job.done += 1
        for job in {id(job): job for job, _ in batch}.values():
            if job.done == len(job.values):
                self.jobs.remove(job)
                job.channel.put(EmbeddingOutput(
                    np.stack(job.values), job.plan.prompt_tokens,
                    job.lm.embedder.pooling.normalize))
                job.channel.put(None)

    def _choose(self, lm) -> list:
        """(job, input index) pairs for the next pass: the oldest pending
        input of the first job's model, then the inputs nearest its length
        while the padded batch stays within the budget."""
        pending = []
        for job in self.jobs:
            if job.lm is lm:
                pending += [(job, i) for i in job.left[:WINDOW - len(pending)]]
                if len(pending) >= WINDOW:
                    break
        first = len(pending[0][0].plan.inputs[pending[0][1]])
        by_nearness = sorted(pending[1:], key=lambda p: abs(len(p[0].plan.inputs[p[1]]) - first))
        budget = self.budget()
        chosen, longest = [pending[0]], first
        for job, i in by_nearness:
            n = len(job.plan.inputs[i])
            if len(chosen) >= MAX_ROWS or (len(chosen) + 1) * max(longest, n) > budget:
                break
            chosen.append((job, i))
            longest = max(longest, n)
        taken = {}
        for job, i in chosen:
            taken.setdefault(id(job), (job, set()))[1].add(i)
        for job, indices in taken.values():
            job.left = [i for i in job.left if i not in indices]
        return chosen

    def _run(self, lm, inputs) -> np.ndarray:
        """One padded forward pass: pooled vectors or scores, as numpy."""
        embedder = lm.embedder
        longest = max(len(ids) for ids, _ in inputs)
        if len(inputs) == 1 and embedder.decoder and longest > self.budget():
            hidden = self._in_chunks(embedder, inputs[0][0])
        else:
            tokens = np.zeros((len(inputs), longest), dtype=np.int32)
            for row, (ids, _) in enumerate(inputs):
                tokens[row, :len(ids)] = ids
            lengths = mx.array([len(ids) for ids, _ in inputs])
            hidden = embedder.hidden(mx.array(tokens), lengths)
        lengths = mx.array([len(ids) for ids, _ in inputs])
        starts = mx.array([start for _, start in inputs])
        if embedder.task == "rerank":
            last = hidden[mx.arange(len(inputs)), lengths - 1]
            out = embedder.score(last)
        else:
            out = embedder.pooling(hidden, lengths, starts)
        mx.eval(out)
        return np.array(out, dtype=np.float32)

    def _in_chunks(self, embedder, ids) -> mx.array:
        """A decoder's long input through a prompt cache, a chunk at a time:
        [1, L, H] hidden states."""
        cache = make_prompt_cache(embedder.model)
        step = self.budget()
        parts = []
        for at in range(0, len(ids), step):
            self.beat("an embedding batch")
            part = embedder.hidden(mx.array([ids[at:at + step]]), None, cache=cache)
            mx.eval(part)
            parts.append(part)
        return mx.concatenate(parts, axis=1)
