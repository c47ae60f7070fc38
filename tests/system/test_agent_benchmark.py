"""Agent traffic (benchmarks/agent.py) on /v1/messages and /v1/responses:
every turn after the first resumes exactly where the previous conversation
ends, as the turn renders it.

That end is prompt.py's last message boundary ("the end of this
conversation as the next turn renders it"), found here by
`checkpoint_positions` of the previous turn's messages in this turn's
prompt. In the previous turn's own prompt it falls at the very end: the
fixture's template opens the assistant turn with exactly the generation
prompt, so `checkpoint_positions` (positions < len(prompt) only) leaves it
out, and no "checkpoint" entry is stored there. What is reused instead:
  * qwen3 (attention): the previous request's generated entry, trimmed to
    the common prefix: the whole previous prompt;
  * qwen3_5 (hybrid, not trimmable): the entry at the end of the prompt's
    last segment, which BatchGenerator ends one token early (the last prompt
    token goes into the first decode step): the previous prompt but its last
    token.
Upstream is not run here (benchmarks only).
"""

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from benchmarks.agent import (
    agent_workload,
    api_form,
    measure,
    render,
    server_messages,
)
from mlx_lm_plus.planning.checkpoints import checkpoint_positions

TURNS, TOOLS, RESULT_CHARS = 4, 6, 600
# Tokens the server reuses short of the end of the previous conversation.
SHORT_OF_END = {"qwen3": 0, "qwen3_5": 1}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def kind_and_figures(request, fixture_path, tmp_path_factory):
    model = str(fixture_path(request.param))
    out = measure(model, apis=("messages", "responses"), upstream=False, turns=TURNS,
                  n_tools=TOOLS, result_chars=RESULT_CHARS, max_tokens=4,
                  log_dir=tmp_path_factory.mktemp("agent"))
    return request.param, model, out


def _end_of_previous(tokenizer, api, requests):
    """Per request from the 2nd: the end of the previous conversation in
    this prompt (the largest message-boundary position)."""
    ends = []
    for t in range(1, len(requests)):
        prev_messages, prev_tools = api_form(api, *requests[t - 1])
        tokens = render(tokenizer, *api_form(api, *requests[t]))
        kwargs = {"tools": prev_tools, "tokenize": True}
        found = checkpoint_positions(tokenizer, server_messages(prev_messages), tokens, kwargs)
        ends.append(max(p for p, kind in found if kind == "checkpoint"))
        # ... which is the previous prompt's whole length on this template.
        assert ends[-1] == len(render(tokenizer, prev_messages, prev_tools))
    return ends


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_each_turn_resumes_at_the_end_of_the_previous(kind_and_figures, api):
    kind, model, out = kind_and_figures
    label = "ours /v1/" + api
    if label in out["skipped"]:
        pytest.skip(out["skipped"][label])
    tokenizer = load_tokenizer(Path(model))
    figures = out["results"][label]
    requests = agent_workload(TURNS, TOOLS, RESULT_CHARS)
    ends = _end_of_previous(tokenizer, api, requests)
    assert figures["reused"][0] == 0
    expected = [end - SHORT_OF_END[kind] for end in ends]
    assert figures["reused"][1:] == expected, (kind, api, figures["reused"], ends)
    assert figures["ratio"] <= 1.05, figures


def test_volatile_header_defeats_the_prefix(fixture_path, tmp_path):
    """Claude Code's per-request billing header: nothing past it is reused
    (at most the few tokens before its random part, where the engine keeps a
    divergence checkpoint), unless the server strips it."""
    model = str(fixture_path("qwen3_5"))
    out = measure(model, apis=("messages",), upstream=False, turns=3, n_tools=TOOLS,
                  result_chars=RESULT_CHARS, max_tokens=4, volatile=(True,), log_dir=tmp_path)
    figures = out["results"]["ours /v1/messages +volatile"]
    for row in figures["rows"]:
        assert row["reused"] <= row["prompt"] - row["novel"] < 100, row
    assert figures["recomputed"] > 0.99 * figures["prompt"]
    stripped = out["results"].get("ours /v1/messages --strip-billing-header +volatile")
    if stripped is not None:  # the server has --strip-billing-header
        tokenizer = load_tokenizer(Path(model))
        requests = agent_workload(3, TOOLS, RESULT_CHARS)  # what it renders: no header
        ends = _end_of_previous(tokenizer, "messages", requests)
        assert stripped["reused"] == [0] + [end - SHORT_OF_END["qwen3_5"] for end in ends]


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_api_translations_render_as_chat_completions(fixture_path, api):
    tokenizer = load_tokenizer(Path(fixture_path("qwen3")))
    for messages, tools in agent_workload(3, TOOLS, RESULT_CHARS):
        assert render(tokenizer, *api_form(api, messages, tools)) == render(
            tokenizer, messages, tools)
