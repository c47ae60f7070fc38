"""Thinking budgets (reasoning.py): the think block closed for the model at
its budget, in the batch and through every protocol's field."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from compat.launch import OURS, ServerProcess
from mlx_lm_plus import patches
from mlx_lm_plus.planning.constraints import LogitMask
from mlx_lm_plus.planning.reasoning import EFFORT_BUDGETS, ThinkingBudget, thinking_budget
from testkit.engine_harness import SEQUENTIAL
from tests.planning.test_constraints import prompt_of, run_batch


@pytest.fixture(scope="module")
def qwen3(fixture_path):
    patches.apply_all()
    return load(str(fixture_path("qwen3")))


def test_budget_closes_the_block_in_a_batch(qwen3):
    """Rows whose prompt opened a think block: past its budget each row gets
    the think-end token, then goes on freely; a row without a budget, and one
    whose prompt has no open block, generate what they generate alone."""
    model, tok = qwen3
    end = tok.think_end_tokens[0]
    opened = [prompt_of(tok, f"question {i}") + list(tok.think_start_tokens) for i in range(3)]
    plain = prompt_of(tok, "no block", enable_thinking=False)
    alone = run_batch(model, tok, [opened[2], plain], [None, None], [12, 12])
    budgets = [ThinkingBudget(0, tok, opened[0]), ThinkingBudget(5, tok, opened[1]), None,
               ThinkingBudget(3, tok, plain, may_open=False)]
    out = run_batch(model, tok, [opened[0], opened[1], opened[2], plain], budgets,
                    [12, 12, 12, 12])
    (zero, _), (five, _), (free, _), (unopened, _) = out
    assert zero[0] == end and end not in zero[1:]  # (a random model never closes it)
    assert five[5] == end and end not in five[:5]
    assert budgets[1].closed_early and budgets[1].spent == 5
    assert (free, unopened) == (alone[0][0], alone[1][0])
    assert end not in free  # without a budget it never closes
    assert not budgets[3].closed_early


def test_a_block_the_model_closes_itself_is_left_alone(qwen3):
    _, tok = qwen3
    start, end = list(tok.think_start_tokens), list(tok.think_end_tokens)
    budget = ThinkingBudget(4, tok, [1, 2] + start)
    logits = mx.zeros((1, 64))
    context = [1, 2] + start
    for token in [7, end[0], 9, 9, 9, 9, 9]:
        out = budget(mx.array(context), logits)
        assert out is logits  # (the first call, then the block closed at step 2)
        context.append(token)
    assert not budget.closed_early and budget.spent == 2
    # The model may open one itself: counted from there.
    budget = ThinkingBudget(1, tok, [1, 2])
    assert budget(mx.array([1, 2]), logits) is logits
    assert budget(mx.array([1, 2] + start), logits) is logits
    forced = budget(mx.array([1, 2] + start + [7]), logits)
    assert forced[0, end[0]].item() == 0 and mx.isinf(forced[0, 7]).item()


def test_budgets_of_each_field():
    assert thinking_budget(None, 100, False) is None
    assert thinking_budget(500, 100, False) == 500
    # A grammar after the thinking keeps half of max_tokens for the answer.
    assert thinking_budget(None, 100, True) == 50 and thinking_budget(20, 100, True) == 20
    assert EFFORT_BUDGETS["low"] < EFFORT_BUDGETS["medium"] and EFFORT_BUDGETS["high"] is None


# A template that opens the think block, as Qwen3.5's and DeepSeek-R1's do
# (the fixtures' own leave it to the model, which a random one never opens).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3")),
                              "--chat-template", THINKING_TEMPLATE], log=log) as s:
        yield s




def _reasoning_of(server, max_tokens, **extra):
    status, body = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
        "temperature": 0, **extra})
    assert status == 200, body
    message = body["choices"][0]["message"]
    return message.get("reasoning") or "", message["content"], body["usage"]


def test_every_protocols_budget_field(server):
    """The template opens the think block; a random model never closes it.
    A budget of B: the reasoning is exactly the first B tokens the model
    writes without one, then </think> (the (B+1)-th token), then the answer."""
    free, content, _ = _reasoning_of(server, 24)
    assert content in ("", None) and free  # never closed: all reasoning
    first_six, _, _ = _reasoning_of(server, 6)
    for extra in ({"thinking_budget": 6}, {"thinking_budget": 6, **SEQUENTIAL}):
        # (the sequential path; the batch)
        closed, content, usage = _reasoning_of(server, 7, **extra)
        assert closed == first_six and content in ("", None), (extra, closed, content)
        assert usage["completion_tokens"] == 7
        closed, content, _ = _reasoning_of(server, 10, **extra)
        assert closed == first_six and content, (extra, content)
    for extra in ({"reasoning_effort": "minimal"}, {"thinking_budget": 0}):
        closed, content, _ = _reasoning_of(server, 4, **extra)
        assert closed == "" and content, (extra, closed, content)
    status, body = server.post("/v1/messages", {
        "model": "m", "max_tokens": 10, "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 6},
        "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, body
    kinds = [b["type"] for b in body["content"]]
    assert kinds == ["thinking", "text"] and body["content"][0]["thinking"] == first_six
    # Responses' effort, and Anthropic's when `thinking` is absent: "minimal"
    # / "low" (Anthropic's lowest) have budgets the fixture can show.
    status, body = server.post("/v1/responses", {
        "model": "m", "input": "Hi", "max_output_tokens": 4, "temperature": 0,
        "reasoning": {"effort": "minimal"}})
    assert status == 200, body
    assert [i["type"] for i in body["output"]] == ["message"], body["output"]
    status, body = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "huge"})
    assert status == 400 and "reasoning_effort" in json.dumps(body)


def test_budgets_of_the_effort_fields():
    """Each protocol's effort field reaches the budget (the fixture can't
    show budgets of 1,024 tokens and more)."""
    from mlx_lm_plus.protocols.anthropic import to_chat_body as anthropic_chat
    from mlx_lm_plus.protocols.response_store import ResponseStore
    from mlx_lm_plus.protocols.responses_input import to_chat_body as responses_chat
    from mlx_lm_plus.config import parse_args
    from mlx_lm_plus.protocols.validation import parse_request

    cli = parse_args(["--model", "m"])
    for effort in ("low", "medium", "high"):
        chat, _ = responses_chat({"input": "x", "reasoning": {"effort": effort}},
                                 ResponseStore())
        parsed = parse_request("/v1/chat/completions", chat, cli)
        assert parsed.request.thinking_budget == EFFORT_BUDGETS[effort]
        chat = anthropic_chat({"model": "m", "max_tokens": 9, "output_config": {"effort": effort},
                               "messages": [{"role": "user", "content": "x"}]})
        parsed = parse_request("/v1/chat/completions", chat, cli)
        assert parsed.request.thinking_budget == EFFORT_BUDGETS[effort]
    chat = anthropic_chat({"model": "m", "max_tokens": 9, "messages": [
        {"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 77},
        "output_config": {"effort": "low"}})
    assert parse_request("/v1/chat/completions", chat, cli).request.thinking_budget == 77


def test_structured_output_keeps_room_for_the_answer(server):
    """With thinking on, a json_schema request ends with JSON content: the
    reasoning is closed at half of max_tokens."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    status, body = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": schema}}})
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["reasoning"] and message["content"].startswith('{"a": ')


def test_a_row_being_closed_leaves_the_batch_dtype_alone(qwen3):
    """The batched budget's masks keep the logits' dtype: a bf16 batch
    where one row's block is being closed stays bf16 for every row."""
    from mlx_lm_plus.planning.reasoning import ThinkingBudget as Budget

    _, tok = qwen3
    prompt = prompt_of(tok, "x") + list(tok.think_start_tokens)
    budget = Budget(0, tok, prompt)
    logits = mx.zeros((2, 64), dtype=mx.bfloat16)
    out = LogitMask.applied(
        logits, Budget.mask_batch([(0, budget, prompt[:-1], prompt[-1])], logits.shape))
    assert out.dtype == mx.bfloat16
    assert out[0, tok.think_end_tokens[0]].item() == 0 and mx.isinf(out[0, 5]).item()
    assert mx.array_equal(out[1], logits[1])
