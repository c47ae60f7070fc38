"""The reuse figures the README quotes, as counts (not timings).

Recomputed / novel prompt tokens on the hybrid fixture: at most 1.05 for us
on branches and interleaved conversations, where upstream recomputes the
history after the system prompt.
"""

from benchmarks.cache_reuse import measure
from compat.launch import OURS, UPSTREAM


def test_hybrid_branch_and_interleaved(fixture_path, tmp_path):
    from mlx_lm import load

    model = str(fixture_path("qwen3_5"))
    tokenizer = load(model)[1]
    names = ["branch", "interleaved"]
    skip = {"interleaved": 6}
    ours = measure(OURS, model, tokenizer, names, tmp_path, 8, skip)
    upstream = measure(UPSTREAM, model, tokenizer, names, tmp_path, 8, skip)
    for name in names:
        assert ours[name]["ratio"] <= 1.05, (name, ours[name])
        assert upstream[name]["ratio"] > 1.3, (name, upstream[name])
