"""Each patch in patches/ fixes a bug that shows without it."""

import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

import patches
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
    for patch in patches.PATCHES:
        patch.revert()
    yield
    patches.apply_all()


def _prompts(fixture_path, kind):
    model, tok = load(str(fixture_path(kind)))
    base = long_prompt(tok)
    return model, tok, [base[:60], base, base[:130]]


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba", "jamba", "olmo_hybrid"])
def test_batched_equals_single_with_patches(kind, fixture_path):
    patches.apply_all()
    model, tok, prompts = _prompts(fixture_path, kind)
    assert batched(model, prompts, 8) == [greedy(model, tok, p, 8) for p in prompts]


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba", "jamba", "olmo_hybrid"])
def test_batched_differs_without_patches(kind, fixture_path, unpatched):
    model, tok, prompts = _prompts(fixture_path, kind)
    assert batched(model, prompts, 8) != [greedy(model, tok, p, 8) for p in prompts]
