"""Each patch in patches/ fixes a bug that shows without it."""

import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

import patches
from patches import nemotron_h_ssm_lengths
from tests.test_fixtures import greedy, long_prompt


def batched(model, prompts, n):
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    out = {u: [] for u in uids}
    while any(len(v) < n for v in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


@pytest.fixture
def unpatched():
    nemotron_h_ssm_lengths.revert()
    yield
    patches.apply_all()


def _nemotron(fixture_path):
    model, tok = load(str(fixture_path("nemotron_h")))
    base = long_prompt(tok)
    return model, tok, [base[:60], base, base[:130]]


def test_nemotron_h_batched_equals_single_with_patch(fixture_path):
    patches.apply_all()
    model, tok, prompts = _nemotron(fixture_path)
    assert batched(model, prompts, 8) == [greedy(model, tok, p, 8) for p in prompts]


def test_nemotron_h_batched_differs_without_patch(fixture_path, unpatched):
    model, tok, prompts = _nemotron(fixture_path)
    assert batched(model, prompts, 8) != [greedy(model, tok, p, 8) for p in prompts]
