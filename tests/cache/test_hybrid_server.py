"""Hybrid (non-trimmable) models: cache hits give the same greedy text as no cache."""

import pytest

from compat.launch import OURS, ServerProcess

SYSTEM = "You are a helpful assistant. Answer briefly and clearly."


@pytest.fixture(scope="module")
def servers(fixture_path, tmp_path_factory):
    model = str(fixture_path("qwen3_5"))
    logs = tmp_path_factory.mktemp("hybrid")
    cached = ServerProcess(OURS, ["--model", model], log=logs / "cached.log")
    cold = ServerProcess(OURS, ["--model", model, "--prompt-cache-size", "0"],
                         log=logs / "cold.log")
    with cached, cold:
        yield cached, cold


def answer(server, messages, **kw):
    status, r = server.post("/v1/chat/completions",
                            {"messages": messages, "max_tokens": 12, **kw})
    assert status == 200, r
    return r["choices"][0]["message"]["content"], r["usage"]


def test_thinking_toggle_exact_hit(servers):
    """enable_thinking=false stores a checkpoint equal to the thinking prompt."""
    cached, cold = servers
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is a lake, and why is it blue?"}]
    answer(cached, messages, chat_template_kwargs={"enable_thinking": False})
    text, usage = answer(cached, messages)
    assert text == answer(cold, messages)[0]
    assert cached.get("/health") == (200, {"status": "ok"})


def test_multi_turn_and_repeats_equal_cold(servers):
    cached, cold = servers
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me about boats."})
        for _ in range(2):  # the same request twice: the second one hits
            text, usage = answer(cached, messages)
            assert text == answer(cold, messages)[0], turn
        messages.append({"role": "assistant", "content": text})
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
