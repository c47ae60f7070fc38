"""Every cache miss explained (Engine._explain_miss, api._with_message):
where a prompt departs from what the prompt cache stores, in the request's
log line and /v1/stats."""

import json

import pytest

from compat.launch import OURS, ServerProcess
from mlx_lm_plus.http.tracker import MISS_SEARCH_CHARS, _with_message

SYSTEM = "You are a helpful assistant for the weather desk. Today is 2026-11-28. " * 3
USER = {"role": "user", "content": "First question about the rain?"}


def _chat(server, messages, **kw):
    status, body = server.post("/v1/chat/completions", {
        "messages": messages, "max_tokens": 4, "temperature": 0, **kw})
    assert status == 200, body
    return body


def _misses(server):
    status, stats = server.get("/v1/stats")
    assert status == 200
    return [(r["prompt_tokens"], r["cached_tokens"], r.get("cache_miss"))
            for r in stats["requests"]]


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("miss") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3")), "--cache-miss-text"],
                       log=log) as s:
        s.log = log
        yield s


def test_a_changed_system_prompt_and_a_changed_reply(server):
    system = {"role": "system", "content": SYSTEM}
    first = _chat(server, [system, USER])
    _chat(server, [system, USER])  # the same again: all reused, nothing to explain
    _chat(server, [{"role": "system", "content": SYSTEM.replace("28", "29", 1)}, USER])
    # A reply sent back other than as generated (the fixture's is random text).
    reply = first["choices"][0]["message"]["content"]
    _chat(server, [system, USER, {"role": "assistant", "content": "Rain, then sun."},
                   {"role": "user", "content": "And tomorrow?"}])
    (p0, c0, m0), (p1, c1, m1), (p2, c2, m2), (p3, c3, m3) = _misses(server)[-4:]
    assert m0 is None and m1 is None and c1 == p1 - 1  # (nothing stored: no miss)
    assert m2["position"] == c2 == m2["reused"] > 0
    assert m2["part"] == "system prompt and tools"
    assert m2["prompt"].startswith("9") and m2["stored"].startswith("8")
    assert m2["message"] == {"index": 0, "role": "system"} and "system prompt" in m2["hint"]
    assert m3["part"] == "conversation" and m3["message"]["role"] == "assistant"
    assert "Rain" in m3["prompt"] and m3["stored"] and "Rain" not in m3["stored"]
    assert reply != "Rain, then sun."
    # The log line carries the same.
    lines = [json.loads(line.partition("Request ")[2]) for line in server.log.read_text()
             .splitlines() if " - INFO - Request {" in line]
    assert lines[-2]["cache_miss"] == m2


def test_shared_tokens_a_hybrid_model_cannot_resume(fixture_path, tmp_path):
    """On a model with recurrent layers the cache resumes only where a state
    was stored: an edit inside the last user message shares more tokens
    than it can reuse, and says how many. (Without --cache-miss-text.)"""
    long_user = {"role": "user", "content": "Tell me about rivers and their sources. " * 8}
    edited = {"role": "user", "content": long_user["content"].replace("sources", "mouths", 5)}
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3_5"))],
                       log=tmp_path / "server.log") as server:
        _chat(server, [long_user])
        _chat(server, [edited])
        (_, _, first), (prompt, cached, miss) = _misses(server)[-2:]
    assert first is None
    assert miss["shared_not_reused"] == miss["position"] - cached > 1
    assert miss["message"] == {"index": 0, "role": "user"}
    # Without --cache-miss-text no prompt's text: a stored one may be
    # another client's.
    assert not {"before", "prompt", "stored"} & set(miss), miss


def test_the_message_search_is_bounded():
    miss = {"position": 3, "reused": 3, "prompt": "needle here", "stored": "other"}
    messages = [{"role": "user", "content": "needle here"},
                {"role": "user", "content": "x" * MISS_SEARCH_CHARS}]
    assert _with_message(miss, messages)["message"] is None  # (searched from the end)
    assert _with_message(miss, messages[:1])["message"] == {"index": 0, "role": "user"}
    assert _with_message(miss, [{"role": "user", "content": [
        {"type": "text", "text": "a needle here"}]}])["message"]["index"] == 0
    # In the template's own text: no message.
    assert _with_message(miss, [{"role": "user", "content": "hay"}])["message"] is None
    assert _with_message(None, messages) is None
    assert _with_message(miss, messages[:1], keep_text=True)["stored"] == "other"
    assert "stored" not in _with_message(miss, messages[:1])
