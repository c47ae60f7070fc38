"""Seeded requests in the batch (engine/sampling.py): a row's draws come from
its own random state, started and split as mx.random.seed(seed) starts and
splits the global one. So a seeded request writes the same text alone, in
a batch with unseeded traffic, after a restart, and as upstream's own
seeded generation writes it."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_lm_plus.engine import batch as batch_module
from testkit.engine_harness import SEQUENTIAL, EngineRunner

PROMPTS = 100
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40}


def seeded(i):
    return {"messages": [{"role": "user", "content": f"Tell a story, number {i % 13}."}],
            "max_tokens": 6, "seed": 1000 + i, **SAMPLING}


def unseeded(i):
    return {"messages": [{"role": "user", "content": f"Anything at all {i}."}],
            "max_tokens": 8, "temperature": 0.8}


@pytest.fixture(scope="module")
def alone(fixture_path):
    """Each seeded request's tokens, served one at a time."""
    runner = EngineRunner(fixture_path("qwen3"))
    try:
        yield [runner.run(seeded(i))[0] for i in range(PROMPTS)], runner
    finally:
        runner.close()


def test_a_seeded_request_writes_upstreams_text_for_its_seed(alone):
    """The same tokens as mlx-lm's own generation after mx.random.seed(seed)
    (what mlx_lm.server does for a seeded request), on the same model."""
    tokens, runner = alone
    lm = runner.loaded
    for i in (0, 1, 7):
        body = seeded(i)
        prompt = lm.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
        mx.random.seed(body["seed"])
        sampler = make_sampler(SAMPLING["temperature"], top_p=SAMPLING["top_p"],
                               top_k=SAMPLING["top_k"])
        theirs = [r.token for r in stream_generate(lm.model, lm.tokenizer, prompt,
                                                   max_tokens=6, sampler=sampler)]
        assert tokens[i] == theirs, i
    # Different seeds write different texts (the test would see a shared state).
    assert len({tuple(t) for t in tokens}) > PROMPTS // 2


def test_seeded_requests_are_batched_with_unseeded_traffic_and_keep_their_text(
        alone, monkeypatch):
    tokens, runner = alone
    widest = [0]
    step = batch_module._Batch.step

    def watched(self):
        widest[0] = max(widest[0], len(self.results))
        return step(self)

    monkeypatch.setattr(batch_module._Batch, "step", watched)
    order = list(range(PROMPTS))
    random.Random(5).shuffle(order)
    for start in range(0, PROMPTS, 4):
        group = order[start:start + 4]
        # Four seeded and four unseeded requests at once: a batch of eight.
        bodies = [seeded(i) for i in group] + [unseeded(start + j) for j in range(4)]
        results = runner.run_all(bodies)
        for i, got in zip(group, results):
            assert got == tokens[i], i
    assert widest[0] >= 6  # (they were in one batch, not served one at a time)


def test_the_same_text_after_a_restart(alone, fixture_path):
    tokens, _ = alone
    mx.random.seed(987654321)  # (whatever the global random state is now)
    mx.random.uniform(shape=(7,)).tolist()
    runner = EngineRunner(fixture_path("qwen3"))
    try:
        for i in range(0, PROMPTS, 9):
            assert runner.run(seeded(i))[0] == tokens[i], i
    finally:
        runner.close()


def test_only_a_seed_with_xtc_leaves_the_batch(alone):
    """Every seeded request so far went through the batch; a seeded request
    with XTC, whose draw is inside upstream's compiled sampler, is served
    alone as upstream serves it, and writes the same text each time. (This
    is testkit's SEQUENTIAL, which tests of the sequential path send: if it
    stops going there, they test nothing, and this fails.)"""
    _, runner = alone
    assert runner.sequential == 0
    greedy = {"messages": seeded(3)["messages"], "max_tokens": 6}
    assert runner.run({**greedy, **SEQUENTIAL})[0] == runner.run(greedy)[0]
    assert runner.sequential == 1
    body = {**seeded(3), **SEQUENTIAL}
    first = runner.run(body)[0]
    assert runner.run(body)[0] == first and runner.sequential == 3
