"""The embedding runner alone (engine/embedding.py): which inputs share a
forward pass, a decoder's long input in chunks, clients that go, and a pass
that fails."""

from argparse import Namespace

import numpy as np
import pytest

from mlx_lm_plus.engine.embedding import EmbeddingOutput, EmbeddingRunner
from mlx_lm_plus.models.embedders import load_embedder
from mlx_lm_plus.models.folders import _mlx_lm_has
from mlx_lm_plus.planning.embedding import EmbeddingPlan
from testkit.engine_harness import Collect


@pytest.fixture(scope="module")
def models(fixture_path):
    out = {}
    for kind in ("bert_embed", "qwen3_embed"):
        embedder, _ = load_embedder(str(fixture_path(kind)), "embed", _mlx_lm_has)
        out[kind] = Namespace(key=(kind, None, None), embedder=embedder)
    return out


def plan(lm, inputs):
    return EmbeddingPlan(lm.key, "embed", tuple(tuple(i) for i in inputs), (0,) * len(inputs))


def runner(budget=64):
    beats = []
    return EmbeddingRunner(beats.append, budget=lambda: budget), beats


def answer(channel) -> EmbeddingOutput:
    item = channel.items.get_nowait()
    assert channel.items.get_nowait() is None
    return item


def ids(n, start=5):
    return [start + (k * 7) % 90 for k in range(n)]


def test_passes_stay_within_the_budget_and_take_the_oldest_input_first(models):
    lm = models["bert_embed"]
    run, _ = runner(budget=64)
    lengths = [30, 4, 5, 28, 6, 31, 3, 12]
    channels = [Collect() for _ in lengths]
    for channel, n in zip(channels, lengths):
        run.add(channel, lm, plan(lm, [ids(n)]))
    seen = []
    original = run._run

    def spy(lm_, inputs):
        seen.append([len(i) for i, _, _ in inputs])
        return original(lm_, inputs)

    run._run = spy
    while run.active:
        run.step()
    assert all(len(b) * max(b) <= 64 for b in seen), seen
    assert seen[0][0] == 30  # the oldest input leads the first pass
    assert sorted(n for b in seen for n in b) == sorted(lengths)
    assert len(seen) < len(lengths)  # (inputs shared passes)
    # Each answer is the input's vector alone (one pass of one input).
    alone, _ = runner(budget=64)
    for channel, n in zip(channels, lengths):
        check = Collect()
        alone.add(check, lm, plan(lm, [ids(n)]))
        alone.step()
        np.testing.assert_allclose(answer(channel).values, answer(check).values, atol=1e-5)


def test_a_decoders_long_input_runs_in_chunks_to_the_same_vector(models):
    lm = models["qwen3_embed"]
    tokens = ids(50)
    whole, chunked = Collect(), Collect()
    run, _ = runner(budget=1024)
    run.add(whole, lm, plan(lm, [tokens]))
    run.step()
    small, beats = runner(budget=8)
    small.add(chunked, lm, plan(lm, [tokens]))
    steps = 0
    while small.active:
        small.step()  # (one chunk a step: the loop turns between them)
        steps += 1
    assert steps == 7 and beats.count("an embedding batch") == 7  # (50 tokens in 8s)
    np.testing.assert_allclose(answer(chunked).values, answer(whole).values, atol=1e-5)


def test_jobs_take_turns_leading_a_pass(models):
    """A one-input request behind a 40-input one is answered after the
    second pass, not after all of the first's."""
    lm = models["bert_embed"]
    run, _ = runner(budget=64)
    big, small = Collect(), Collect()
    run.add(big, lm, plan(lm, [ids(30, start=k) for k in range(40)]))
    run.add(small, lm, plan(lm, [ids(31)]))
    run.step()
    run.step()
    assert answer(small).values.shape == (1, 64) and big.items.empty()
    while run.active:
        run.step()
    assert answer(big).values.shape == (40, 64)


def test_a_client_that_goes_mid_chunks_is_dropped(models):
    lm = models["qwen3_embed"]
    run, _ = runner(budget=8)
    gone = Collect()
    run.add(gone, lm, plan(lm, [ids(50)]))
    run.step()
    gone.cancel()
    run.step()
    assert not run.active and run.chunked is None and gone.removed_at is not None
    assert gone.items.empty()


def test_a_client_that_went_is_dropped_and_the_others_answered(models):
    lm = models["bert_embed"]
    run, _ = runner()
    gone, kept = Collect(), Collect()
    run.add(gone, lm, plan(lm, [ids(5), ids(6)]))
    run.add(kept, lm, plan(lm, [ids(7)]))
    gone.cancel()
    run.step()
    assert gone.removed_at is not None and gone.items.empty()
    assert answer(kept).values.shape == (1, 64)
    assert not run.active and run.inputs == 1


def test_a_failed_pass_answers_its_jobs_only(models):
    lm = models["bert_embed"]
    run, _ = runner(budget=16)
    first, second = Collect(), Collect()
    run.add(first, lm, plan(lm, [ids(10)]))
    run.add(second, lm, plan(lm, [ids(12)]))  # (10 + 12 padded past 16: a pass of its own)
    original = run._run
    calls = []

    def fail_once(lm_, inputs):
        calls.append(len(inputs))
        if len(calls) == 1:
            raise RuntimeError("a fault in the model")
        return original(lm_, inputs)

    run._run = fail_once
    run.step()
    error = first.items.get_nowait()
    assert isinstance(error, Exception) and "a fault in the model" in str(error)
    assert first.items.empty() and second.items.empty()
    run.step()
    assert answer(second).values.shape == (1, 64)
    assert not run.active


def test_a_chunk_that_fails_after_the_first_answers_its_job(models):
    lm = models["qwen3_embed"]
    run, _ = runner(budget=8)
    channel, other = Collect(), Collect()
    run.add(channel, lm, plan(lm, [ids(30)]))
    run.add(other, lm, plan(lm, [ids(5)]))
    original, calls = lm.embedder.hidden, []

    def fail_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a fault in chunk 2")
        return original(*a, **kw)

    lm.embedder.hidden = fail_second
    try:
        while run.active:
            run.step()  # (never raises: the failure is the job's)
    finally:
        lm.embedder.hidden = original
    error = channel.items.get_nowait()
    assert isinstance(error, Exception) and "chunk 2" in str(error) and channel.items.empty()
    assert answer(other).values.shape == (1, 64) and run.chunked is None


def test_a_job_of_another_model_leads_while_small_requests_keep_coming(models):
    """Jobs take turns by arrival, whatever finishes meanwhile: a job of
    one model is not starved by a stream of one-input requests of another."""
    bert, qwen = models["bert_embed"], models["qwen3_embed"]
    run, _ = runner(budget=100)
    waiting = Collect()
    run.add(waiting, bert, plan(bert, [ids(10)] * 50))  # 5 passes' worth
    run.add(Collect(), qwen, plan(qwen, [ids(10)] * 2000))
    run.step()
    run.step()  # (each has led once)
    for step in range(40):
        if step % 2 == 0:
            run.add(Collect(), qwen, plan(qwen, [ids(10)]))  # one every other step
        run.step()
        if not waiting.items.empty():
            break
    assert answer(waiting).values.shape == (50, 64), step
