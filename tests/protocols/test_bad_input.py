"""A corpus of bad requests: each gets a 4xx JSON error and harms nothing.

After every case the server is healthy and a valid request still succeeds.
Several of these kill upstream mlx_lm.server 0.32.2's generation thread for
good (stop that is not strings, an empty or list prompt, top_k beyond the
vocabulary, ...). The embedding and rerank cases run against a server that
serves an embedder and a reranker beside the chat model.
"""

import json
import threading
import time

import pytest

from compat.launch import OURS, ServerProcess
from testkit.bad_input import (
    CASES, CHAT, EMBEDDINGS, EMBEDDINGS_CASES, MESSAGES, MESSAGES_CASES, RERANK, RERANK_CASES,
    RESPONSES, RESPONSES_CASES, chat, embed, image_chat, message,
    models_config_file, png_url, rerank, response,
)

# Cases that reach model loading with --allow-model-loading.
LOADING_CASES = [(CHAT, chat(draft_model=value)) for value in ([], {"a": 1}, 5, None)]


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("bad") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))], log=log) as s:
        yield s


@pytest.fixture(scope="module")
def embedding_server(fixture_path, tmp_path_factory):
    """The chat fixture (the default), an embedder and a reranker, named as
    testkit/bad_input.py's EMBEDDING_SERVED."""
    root = tmp_path_factory.mktemp("bad-embeddings")
    config = models_config_file(fixture_path, root)
    with ServerProcess(OURS, ["--models-config", str(config)], log=root / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def loading_server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("bad") / "server.log"
    argv = ["--model", str(fixture_path("qwen3")), "--allow-model-loading"]
    with ServerProcess(OURS, argv, log=log) as s:
        yield s


@pytest.mark.parametrize("path,body", LOADING_CASES)
def test_bad_model_fields_with_model_loading(loading_server, path, body):
    """With --allow-model-loading, `draft_model: []` used to crash the
    generation loop and leave its own request waiting forever."""
    test_bad_request_is_4xx_and_harmless(loading_server, path, body)
    assert loading_server.get("/v1/stats")[1]["engine"]["restarts"] == 0


def test_corpus_is_large():
    assert len(CASES) >= 60


def send_bad(server, path, body) -> dict:
    """POST a bad body: a 4xx JSON answer (returned), and a healthy server."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, headers, data = server.request("POST", path, raw=raw)
    assert 400 <= status < 500, (status, data[:300])
    assert server.get("/health") == (200, {"status": "ok"})
    return json.loads(data)


@pytest.mark.parametrize("path,body", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_request_is_4xx_and_harmless(server, path, body):
    error = send_bad(server, path, body)["error"]
    assert isinstance(error, str) and error
    status, r = server.post(CHAT, chat())
    assert status == 200 and r["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path,body", MESSAGES_CASES,
                         ids=[f"messages-{i}" for i in range(len(MESSAGES_CASES))])
def test_bad_messages_request_is_anthropic_4xx_and_harmless(server, path, body):
    error = send_bad(server, path, body)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert isinstance(error["error"]["message"], str) and error["error"]["message"]
    status, r = server.post(MESSAGES, message())
    assert status == 200 and r["usage"]["output_tokens"] == 2


@pytest.mark.parametrize("path,body", RESPONSES_CASES,
                         ids=[f"responses-{i}" for i in range(len(RESPONSES_CASES))])
def test_bad_responses_request_is_openai_4xx_and_harmless(server, path, body):
    error = send_bad(server, path, body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    status, r = server.post(RESPONSES, response())
    assert status == 200 and r["usage"]["output_tokens"] == 2


def test_an_error_inside_the_engine_fails_only_that_request(fixture_path):
    """Past validation, a failure while adding a request leaves the thread alive."""
    from testkit.engine_harness import EngineRunner

    runner = EngineRunner(fixture_path("qwen3"))
    try:
        assert runner.run(chat())[0]
        good = runner.submit(chat())
        # A stop word that is not a string, as if validation had missed it.
        from mlx_lm_plus.protocols.validation import parse_request

        parsed = parse_request(CHAT, chat(), runner.args)
        parsed.args.stop_words = [1, 2]
        from testkit.engine_harness import Collect

        bad = Collect()
        runner.engine.submit(bad, parsed.request, parsed.args)
        with pytest.raises(Exception):
            bad.result(timeout=30)
        assert good.result(timeout=30)[0]
        assert runner.engine.is_healthy
        assert len(runner.run(chat())[0]) == 2
    finally:
        runner.close()


def test_a_request_that_breaks_admission_is_answered(fixture_path):
    """A value that raises in the engine's model lookup (an unhashable
    draft_model, as if validation had missed it) is answered with a 500
    InternalError; the loop neither crashes nor restarts."""
    from mlx_lm_plus.errors import InternalError
    from mlx_lm_plus.protocols.validation import parse_request
    from testkit.engine_harness import Collect, EngineRunner

    runner = EngineRunner(fixture_path("qwen3"), argv=["--allow-model-loading"])
    try:
        assert runner.run(chat())[0]
        parsed = parse_request(CHAT, chat(), runner.args)
        parsed.args.model.draft = []
        bad = Collect()
        runner.engine.submit(bad, parsed.request, parsed.args)
        with pytest.raises(InternalError, match="unhashable"):
            bad.result(timeout=30)
        assert runner.engine.restarts == 0 and runner.engine.is_healthy
        assert len(runner.run(chat())[0]) == 2
    finally:
        runner.close()


def test_stop_strings_and_penalty_look_backs_are_bounded():
    """A stop list's state machines cost as much as its text (a 2 MB list
    took 10 s to build, stalling every stream, and kept 900 MB); a look-back
    past 32-bit indices failed the whole batch step. Both are 400s."""
    from mlx_lm_plus.protocols.validation import (
        MAX_CONTEXT_SIZE,
        MAX_STOP_CHARACTERS,
        MAX_STOP_STRINGS,
        RequestError,
        parse_request,
    )
    from mlx_lm_plus.config import parse_args

    args = parse_args([])
    base = {"messages": [{"role": "user", "content": "hi"}]}
    for stop in ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)],
                 ["x" * (MAX_STOP_CHARACTERS // 2 + 1)] * 2):
        with pytest.raises(RequestError, match="stop: at most"):
            parse_request("/v1/chat/completions", {**base, "stop": stop}, args)
    parse_request("/v1/chat/completions", {**base, "stop": ["x"] * MAX_STOP_STRINGS}, args)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        with pytest.raises(RequestError, match=f"{name} must be at most"):
            parse_request("/v1/chat/completions", {**base, name: MAX_CONTEXT_SIZE + 1}, args)
        parse_request("/v1/chat/completions", {**base, name: MAX_CONTEXT_SIZE}, args)


def test_wire_protocol_items_are_bounded_before_they_are_translated():
    """Responses input items and Anthropic content blocks are translated
    into chat messages on the event loop, several into one (a turn's tool
    calls): 4 x --max-messages of them at most, checked first (800,000
    function_call items stalled every stream for 8 s to get a 400)."""
    from mlx_lm_plus.protocols.anthropic import AnthropicProtocol
    from mlx_lm_plus.protocols.responses import ResponsesProtocol
    from mlx_lm_plus.config import parse_args
    from mlx_lm_plus.protocols.validation import RequestError

    from mlx_lm_plus.protocols.validation import count_items

    class Unwalked(list):  # (a list the count must not walk once past its limit)
        def __iter__(self):
            raise AssertionError("walked past the limit")

    assert count_items([{"content": Unwalked(range(100))}], ("content",), 10) > 10
    cli = parse_args(["--max-messages", "2"])
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
             for i in range(9)]
    with pytest.raises(RequestError, match="Too many input items and parts: more than 8"):
        ResponsesProtocol().parse(RESPONSES, response(input=calls), cli, None)
    parts = [{"type": "input_text", "text": "x"}] * 8  # (nested: counted too)
    with pytest.raises(RequestError, match="Too many input items and parts: more than 8"):
        ResponsesProtocol().parse(RESPONSES, response(input=[
            {"type": "message", "role": "user", "content": parts}]), cli, None)
    ResponsesProtocol().parse(RESPONSES, response(input=[
        {"type": "message", "role": "user", "content": "hi"}] * 2), cli, None)
    uses = [{"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}} for i in range(8)]
    body = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": uses}]}
    with pytest.raises(RequestError, match="Too many messages and content blocks: more than 8"):
        AnthropicProtocol().parse(MESSAGES, body, cli, None)
    texts = [{"type": "text", "text": "x"}] * 8
    body = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": texts}]}]}
    with pytest.raises(RequestError, match="Too many messages and content blocks: more than 8"):
        AnthropicProtocol().parse(MESSAGES, body, cli, None)
    with pytest.raises(RequestError, match="Too many messages and content blocks: more than 8"):
        AnthropicProtocol().parse(MESSAGES, {**body, "messages": [
            {"role": "user", "content": "hi"}], "system": texts + texts[:1]}, cli, None)


def test_a_model_not_served_is_never_read(server, fixture_path):
    """The vocabulary check read config.json from any path a client named,
    before the check that the model is served: a 400 for a folder that
    exists, a 404 for one that doesn't, told a client which paths exist."""
    other = str(fixture_path("llama"))  # exists, not served
    for model in (other, "/nonexistent/model"):
        status, _, data = server.request("POST", CHAT, raw=json.dumps(
            chat(model=model, top_k=10**6)).encode())
        assert status == 404, data[:200]


def test_prompt_size_is_bounded_by_the_context_before_tokenizing(fixture_path, monkeypatch):
    """Everything a prompt is rendered from is counted (image data URLs
    aside where a template places them), and refused past 32 characters a
    token of the model's context, before anything is rendered or
    tokenized."""
    from mlx_lm.server import CompletionRequest

    from mlx_lm_plus.engine import planner as engine_module
    from mlx_lm_plus.models.folders import context_length
    from mlx_lm_plus.planning.prompt import DEFAULT_ROLE_CHARS, check_prompt_size, prompt_chars
    from testkit.engine_harness import EngineRunner

    url = "data:image/png;base64," + "A" * 9000
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "abc"}, {"type": "image_url", "image_url": {"url": url}}]}]
    request = CompletionRequest("chat", "", messages, [{"x": "yz"}], None)
    strings = ["role", "user", "content", "type", "text", "text", "abc", "x", "yz"]
    assert prompt_chars(request, {}, True) == sum(map(len, strings))
    # The template's arguments are rendered too (Llama's date_string).
    assert prompt_chars(request, {"date_string": "d" * 100}, True) == (
        sum(map(len, strings)) + len("date_string") + 100)
    # Upstream's plain format (no template) writes the image part out, and
    # each message's role prefix and stop (a client's mapping: its longest).
    plain = prompt_chars(request, {}, False)
    assert plain >= sum(map(len, strings)) + len(url) + 2 * DEFAULT_ROLE_CHARS
    mapped = CompletionRequest("chat", "", messages * 8, None, {"user": "u" * 1000})
    assert prompt_chars(mapped, {}, False) >= 9 * 2000
    # ... a list of parts as its repr, which writes a character as up to 10.
    from mlx_lm.server import convert_chat

    for c in ("a", "\x01", "\U000e0001", "'"):
        parts = [{"type": "text", "text": c * 1000, "n": 12345}] * 3
        listed = CompletionRequest("chat", "", [{"role": "user", "content": parts}], None, None)
        assert prompt_chars(listed, {}, False) >= len(convert_chat(listed.messages))
    # Nesting as deep as a body may have is walked, not recursed into.
    deep = [["x"]]
    for _ in range(100_000):
        deep = [deep]
    assert prompt_chars(CompletionRequest("chat", "", [{"role": "user", "content": deep}],
                                          None, None), {}, True) == 1 + len("roleusercontent")
    check_prompt_size(320, 10)
    with pytest.raises(ValueError, match="321 characters long.*context of 10 tokens"):
        check_prompt_size(321, 10)

    # The config's context, times its rope scaling factor; None where it
    # does not say (mlx-lm's Mamba 2 arguments default to 2056).
    assert context_length({"max_position_embeddings": 4096,
                           "rope_scaling": {"factor": 4.0, "type": "yarn"}}) == 16384
    assert context_length({"text_config": {"max_position_embeddings": 2048}}) == 2048
    assert context_length({"model_type": "mamba2"}) is None and context_length(None) is None

    built, build = [], engine_module.build_prompt
    monkeypatch.setattr(engine_module, "build_prompt",
                        lambda *a, **kw: built.append(1) or build(*a, **kw))
    runner = EngineRunner(fixture_path("qwen3"), max_bytes=0)
    try:
        assert runner.loaded.context_length == 32768
        n = 32 * 32768 + 1 - len("roleusercontent")
        with pytest.raises(Exception, match="1048577 characters long"):
            runner.submit({"messages": [{"role": "user", "content": "x" * n}]}).result()
        assert built == []
        assert len(runner.run({"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2})[0]) == 2
        assert built == [1]
    finally:
        runner.close()


def test_images_to_a_text_model_fail_without_waiting_for_the_batch(fixture_path):
    """An image request to a model with no vision is refused in planning,
    and at admission beside a running request: it used to be set aside for
    the sequential path, and answered its 400 only once the batch had
    drained (every running request finished)."""
    from mlx_lm_plus.errors import PromptError
    from mlx_lm_plus.protocols.validation import parse_request
    from testkit.engine_harness import EngineRunner

    runner = EngineRunner(fixture_path("qwen3"))
    try:
        runner.loaded  # (planned with the model loaded)
        parsed = parse_request(CHAT, image_chat(png_url(2, 2)), runner.args)
        with pytest.raises(PromptError, match="Only 'text' content type is supported"):
            runner.engine.plan(parsed.request, parsed.args)
        long = runner.submit({"messages": [{"role": "user", "content": "tell me"}],
                              "max_tokens": 2000})
        first = long.items.get(timeout=60)  # (running: its context came)
        with pytest.raises(Exception, match="Only 'text' content type is supported"):
            runner.submit(image_chat(png_url(2, 2))).result(timeout=60)
        running = long.removed_at is None
        long.cancel_and_drain()
        assert first is not None and running
    finally:
        runner.close()


def _deep_bodies():
    """(path, body, stream) with a value each protocol echoes or recurses
    into (a tool's parameters, a schema) that _deep() nests."""
    params = {"type": "object", "properties": {}, "x-deep": "DEEP"}
    chat_tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    for stream in (False, True):
        yield CHAT, chat(stream=stream, tools=[chat_tool]), stream
        # (tool_choice "none": the tools are echoed, or kept, but never
        # rendered, whose recursion refused deep ones first.)
        yield CHAT, chat(stream=stream, tools=[chat_tool], tool_choice="none"), stream
        yield MESSAGES, message(stream=stream, tools=[{"name": "f", "input_schema": params}],
                                tool_choice={"type": "none"}), stream
        yield RESPONSES, response(stream=stream, tool_choice="none", tools=[
            {"type": "function", "name": "f", "parameters": params}]), stream
        yield CHAT, chat(stream=stream, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": params}}), stream
        yield MESSAGES, message(stream=stream, tools=[
            {"name": "f", "input_schema": params}]), stream
        yield RESPONSES, response(stream=stream, tools=[
            {"type": "function", "name": "f", "parameters": params}]), stream
        yield RESPONSES, response(stream=stream, text={"format": {
            "type": "json_schema", "name": "s", "schema": params}}), stream


def _deep(body, levels: int) -> bytes:
    """`body` as JSON, its "DEEP" nesting `levels` arrays (written as text:
    this process's json can't write them)."""
    return json.dumps(body).replace('"DEEP"', "[" * levels + "]" * levels).encode()


def _check_stream_end(path, data: bytes):
    """A 200 stream ends in its protocol's way, and holds one response."""
    assert b"HTTP/1." not in data, data[-500:]
    text = data.decode()
    if path == CHAT:
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    elif path == MESSAGES:
        assert "event: message_stop" in text or "event: error" in text, text[-300:]
    else:
        assert any(f"event: response.{end}" in text
                   for end in ("completed", "incomplete", "failed")), text[-300:]


def test_nesting_at_the_parsers_edge_never_breaks_a_stream(server):
    """Found in review: a streamed /v1/responses whose tool parameters
    nested ~966 arrays got its 200 head, then json.dumps raised building
    response.created and a second HTTP response was written into the
    stream. On every protocol, streamed or not, with nesting around the
    server's bound (bodies.MAX_JSON_DEPTH) and around json's own limit: a
    4xx JSON error, or a 200 that ends in its protocol's way; the server
    stays healthy."""
    from mlx_lm_plus.http.bodies import MAX_JSON_DEPTH

    # (The bodies place the nested value 4 to 6 levels down.)
    depths = [MAX_JSON_DEPTH - 8, MAX_JSON_DEPTH - 4, MAX_JSON_DEPTH,
              *range(940, 1001, 3), 1200]
    seen = set()
    for levels in depths:
        for path, body, stream in _deep_bodies():
            raw = _deep(body, levels)
            status, headers, data = server.request("POST", path, raw=raw)
            seen.add(status)
            if status == 200:
                if stream:
                    _check_stream_end(path, data)
                else:
                    json.loads(data)
            else:
                assert 400 <= status < 500, (levels, path, stream, status, data[:300])
                assert headers.get("Content-Type", "").startswith("application/json")
                error = json.loads(data)
                if levels > MAX_JSON_DEPTH:
                    assert "levels deep" in str(error) or "recursion" in str(error), error
            assert server.get("/health") == (200, {"status": "ok"})
    assert 200 in seen and 400 in seen
    status, r = server.post(CHAT, chat())
    assert status == 200 and r["usage"]["completion_tokens"] == 2


def error_text(path: str, answer) -> str:
    """The message of an error body in the path's protocol's shape (the
    embedding endpoints' is upstream's: {"error": "..."})."""
    if not isinstance(answer, dict):
        return ""
    error = answer.get("error")
    if path.startswith((MESSAGES, RESPONSES)):
        if path.startswith(MESSAGES) and answer.get("type") != "error":
            return ""
        error = error.get("message") if isinstance(error, dict) else None
    return error if isinstance(error, str) else ""


def embedding_answers(server) -> None:
    """A good embeddings, rerank and chat request each get their 200."""
    status, r = server.post(EMBEDDINGS, embed(input=["hello", "green light"]))
    assert status == 200 and len(r["data"]) == 2 and len(r["data"][0]["embedding"]) == 64, r
    status, r = server.post(RERANK, rerank(top_n=1))
    assert status == 200 and len(r["results"]) == 1 and r["results"][0]["index"] in (0, 1), r
    status, r = server.post(CHAT, chat())
    assert status == 200 and r["usage"]["completion_tokens"] == 2, r


def test_embedding_corpus_is_large():
    assert len(EMBEDDINGS_CASES) >= 100 and len(RERANK_CASES) >= 100


@pytest.mark.parametrize("path,body", EMBEDDINGS_CASES + RERANK_CASES,
                         ids=[f"embeddings-{i}" for i in range(len(EMBEDDINGS_CASES))]
                         + [f"rerank-{i}" for i in range(len(RERANK_CASES))])
def test_bad_embedding_request_is_4xx_and_harmless(embedding_server, path, body):
    error = error_text(path, send_bad(embedding_server, path, body))
    assert error, path
    embedding_answers(embedding_server)


def test_a_query_repeated_into_every_prompt_is_refused_before_tokenizing(embedding_server):
    """A 20 KB rerank body (a 10 KB query, 2,048 one-letter documents) is
    2,048 prompts of 10 KB: 20 MB of text, 12.6 million tokens to refuse
    (more than 300,000 a request). Before the query was counted once, it
    took 5 s and 1.5 GB (a 50 KB body 25 s and 5.5 GB), and every chat,
    embeddings and rerank request sent meanwhile waited for it."""
    body = rerank(query="word " * 2000, documents=["d"] * 2048)
    answers = {}

    def big():
        start = time.monotonic()
        answers["big"] = (embedding_server.post(RERANK, body), time.monotonic() - start)

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    status, r = embedding_server.post(CHAT, chat())
    beside = time.monotonic() - start
    thread.join()
    (status_big, answer), took = answers["big"]
    assert status == 200 and status_big == 400, (status, status_big, answer)
    assert took < 2.0 and beside < 1.0, (took, beside)
