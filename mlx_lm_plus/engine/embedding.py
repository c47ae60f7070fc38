"""Embedding and reranking on the generation thread: prefill only, batched
across inputs and requests.

A request admitted for an embedder waits here as a job. Each `step()` runs
one forward pass over pending inputs of one model: the next input of the
job whose turn it is (jobs take turns, so a small request never waits for
all of a large one), with the inputs of that model nearest its length (the
least padding), up to `budget` padded tokens (--prefill-step-size) and
MAX_ROWS inputs. A job is answered once its last input is done.

A decoder's input longer than the budget runs alone, a chunk a step through
a prompt cache, as a long prompt's prefill does. The loop calls `step()`
once a turn, after a step of each generating batch, so a stream waits for
one pass or chunk at most between two of its tokens.
"""

import logging
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_plus.errors import OutOfMemory, PromptError, request_error
from mlx_lm_plus.planning.embedding import (
    EMBEDDING_REQUESTS, EmbeddingPlan, PlanFirst, plan_embedding_request,
)

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
        self.chunked: Optional[_Chunked] = None  # a long input under way

    def add(self, channel, lm, plan) -> None:
        self.jobs.append(_Job(channel, lm, plan))

    def admit(self, channel, lm, request, planned) -> bool:
        """An embedding or rerank request (or any request for an embedder,
        `lm`) taken off the queue: joins the jobs if it was planned for
        `lm` (True); else it is answered here: a request of the wrong kind
        for the model is the client's 400, and one planned before its model
        was loaded goes back to be planned in a lane (PlanFirst: nothing is
        tokenized on this thread)."""
        if not isinstance(request, EMBEDDING_REQUESTS):
            try:  # (a chat request for an embedder: its 400, nothing tokenized)
                plan_embedding_request(lm, request)
            except PromptError as e:
                channel.put(e)
            return False
        if not isinstance(planned, EmbeddingPlan) or planned.model_key != lm.key:
            channel.put(PlanFirst(lm))
            return False
        self.add(channel, lm, planned)
        return True

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
        self.jobs, self.chunked = [], None

    def fail(self, error: Exception, key=None) -> None:
        """Answer the jobs (of model `key`; None: all) with `error`."""
        failed = [j for j in self.jobs if key is None or j.lm.key == key]
        self.jobs = [j for j in self.jobs if j not in failed]
        if self.chunked is not None and self.chunked.job in failed:
            self.chunked = None
        for job in failed:
            job.channel.put(error)

    def step(self) -> None:
        """One forward pass (module docstring)."""
        for job in [j for j in self.jobs if j.channel.cancelled]:
            self.jobs.remove(job)
            job.channel.removed()
        if self.chunked is not None and self.chunked.job not in self.jobs:
            self.chunked = None  # (its client went)
        if not self.jobs:
            return
        if self.chunked is None:
            # Jobs take turns leading a pass (the leader goes to the back):
            # a small request never waits for all of a large one's inputs.
            lead = self.jobs.pop(0)
            self.jobs.append(lead)
            batch = self._choose(lead)
            job, i = batch[0]
            if len(batch) == 1 and job.lm.embedder.decoder \
                    and len(job.plan.inputs[i]) > self.budget():
                self.chunked = _Chunked(job, i, make_prompt_cache(job.lm.embedder.model))
        else:
            batch = [(self.chunked.job, self.chunked.index)]  # (what a failure fails)
            job = self.chunked.job
        self.beat("an embedding batch")
        try:
            if self.chunked is not None:
                batch, values = self._next_chunk()
            else:
                values = self._run(job.lm, [(j.plan.inputs[i], j.plan.starts[i],
                                             j.plan.segments[i] if j.plan.segments else None)
                                            for j, i in batch])
        except Exception as e:
            logging.exception("An embedding batch failed")
            error = request_error(e, "running the embedding model")
            if isinstance(error, OutOfMemory):
                mx.clear_cache()
            self.chunked = None
            # The jobs of this pass lost inputs: they are answered; the
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

    def _choose(self, lead: _Job) -> list:
        """(job, input index) pairs for the next pass: `lead`'s next input,
        then the pending inputs of its model nearest its length (oldest
        jobs first, within WINDOW) while the padded batch stays within the
        budget."""
        lm = lead.lm
        pending = [(lead, lead.left[0])]
        for job in self.jobs:
            if job.lm is lm:
                pending += [(job, i) for i in job.left[:WINDOW - len(pending)]
                            if (job, i) != pending[0]]
                if len(pending) >= WINDOW:
                    break
        first = len(lead.plan.inputs[pending[0][1]])
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
        """One padded forward pass of `inputs` ((ids, pooling start, where
        a BERT pair's second part starts or None) triples): pooled vectors
        or scores, as numpy."""
        longest = max(len(ids) for ids, _, _ in inputs)
        tokens = np.zeros((len(inputs), longest), dtype=np.int32)
        types = None
        if lm.embedder.token_types:
            types = np.zeros((len(inputs), longest), dtype=np.int32)
        for row, (ids, _, second) in enumerate(inputs):
            tokens[row, :len(ids)] = ids
            if types is not None:
                types[row, second:len(ids)] = 1
        lengths = mx.array([len(ids) for ids, _, _ in inputs])
        hidden = lm.embedder.hidden(mx.array(tokens), lengths,
                                    token_types=None if types is None else mx.array(types))
        return _outputs(lm.embedder, hidden, inputs)

    def _next_chunk(self):
        """The next chunk of the long input being run: ([], []) until its
        last, then ([(job, index)], [its value])."""
        run = self.chunked
        embedder = run.job.lm.embedder
        ids = run.job.plan.inputs[run.index]
        step = self.budget()
        part = embedder.hidden(mx.array([ids[run.at:run.at + step]]), None, cache=run.cache)
        mx.eval(part)
        run.parts.append(part)
        run.at += step
        if run.at < len(ids):
            return [], []
        self.chunked = None
        inputs = [(ids, run.job.plan.starts[run.index], None)]
        return [(run.job, run.index)], _outputs(embedder, mx.concatenate(run.parts, axis=1),
                                                 inputs)


@dataclass
class _Chunked:
    """A decoder's input longer than the budget, run a chunk a step through
    its own prompt cache (as a long prompt's prefill is)."""

    job: _Job
    index: int
    cache: list
    parts: list = field(default_factory=list)  # [1, chunk, H] hidden states
    at: int = 0  # tokens run


def _outputs(embedder, hidden, inputs) -> np.ndarray:
    """[B, L, H] hidden states of `inputs` ((ids, pooling start, _)) ->
    their pooled vectors or rerank scores, as numpy float32."""
    lengths = mx.array([len(ids) for ids, _, _ in inputs])
    if embedder.task == "rerank":
        out = embedder.scores(hidden, lengths)
    else:
        out = embedder.pooling(hidden, lengths, mx.array([start for _, start, _ in inputs]))
    mx.eval(out)
    return np.array(out, dtype=np.float32)
