"""The compat suite: no unexplained difference from upstream mlx_lm.server."""

import pytest

from compat.run import compare, run_side_by_side


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_no_unexplained_difference(kind, fixture_path, tmp_path):
    results = run_side_by_side(str(fixture_path(kind)), tmp_path)
    unexplained, explained = compare(results["upstream"], results["ours"])
    assert unexplained == {}
    # The documented exceptions are real: these differ on every model.
    assert {"fatal_stop_ints", "fatal_empty_prompt", "fatal_top_k_over_vocab"} <= set(explained)
    if kind == "qwen3_5":
        assert "fatal_thinking_toggle" in explained


def test_compare_catches_a_difference():
    up = {"a": {"status": 200, "json": {"x": [1, 2]}}}
    ours = {"a": {"status": 200, "json": {"x": [1, 3]}}}
    assert compare(up, ours)[0] == {"a": [".json.x[1]: 2 != 3"]}
