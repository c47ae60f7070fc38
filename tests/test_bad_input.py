"""A corpus of bad requests: each gets a 4xx JSON error and harms nothing.

After every case the server is healthy and a valid request still succeeds.
Several of these kill upstream mlx_lm.server 0.32.2's generation thread for
good (stop that is not strings, an empty or list prompt, top_k beyond the
vocabulary, ...).
"""

import base64
import io
import json
import struct
import zlib

import pytest

from compat.launch import OURS, ServerProcess

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def png_url(width, height):
    """A data URL of a PNG whose header says width x height (no pixel data
    for the big ones: a decompression bomb is refused from its header)."""
    if width * height <= 64:
        from PIL import Image

        out = io.BytesIO()
        Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
        data = out.getvalue()
    else:
        def chunk(kind, payload):
            body = kind + payload
            return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_chat(url, count=1):
    parts = [{"type": "image_url", "image_url": {"url": url}}] * count
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, *parts]}], "max_tokens": 2}


def chat(**kw):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


CASES = [
    # field type confusions and ranges
    *[(CHAT, chat(**{field: value})) for field, value in [
        ("stream", "yes"), ("stream", 1), ("max_tokens", "ten"), ("max_tokens", 0),
        ("max_tokens", -5), ("max_tokens", 2.5), ("max_completion_tokens", "x"),
        ("temperature", "hot"), ("temperature", -1), ("top_p", 1.5), ("top_p", "a"),
        ("top_k", -1), ("top_k", 1.5), ("top_k", 10**9), ("min_p", -0.1), ("min_p", 2),
        ("num_draft_tokens", -1), ("num_draft_tokens", "3"), ("repetition_penalty", -1),
        ("repetition_context_size", -1), ("repetition_context_size", 1.5),
        ("presence_penalty", "a"), ("presence_context_size", -2),
        ("frequency_penalty", [1]), ("frequency_context_size", "x"),
        ("logprobs", "yes"), ("top_logprobs", 12), ("top_logprobs", -2),
        ("top_logprobs", "3"), ("xtc_probability", 1), ("xtc_probability", 2.0),
        ("xtc_threshold", -0.5), ("model", 5), ("model", None), ("adapters", 5),
        ("seed", "a"), ("seed", 1.5), ("logit_bias", [1]), ("logit_bias", {"a": 1}),
        ("logit_bias", {"1": "x"}), ("logit_bias", {"99999999": 1.0}),
        ("logit_bias", {"-1": 1.0}), ("stop", [1, 2]), ("stop", [None]), ("stop", 5),
        ("stop", {"a": 1}), ("stop", [["x"]]), ("stream_options", "yes"),
        ("stream_options", {"include_usage": "yes"}), ("chat_template_kwargs", "x"),
        ("chat_template_kwargs", [1]), ("tools", "x"), ("tools", {"a": 1}),
        ("tools", ["x"]), ("tools", [{"type": "function"}]),
        ("tools", [{"type": "function", "function": {"name": 5}}]),
    ]],
    # messages
    (CHAT, {"prompt": "x"}),
    (CHAT, {"messages": "hi"}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": [1, 2]}),
    (CHAT, {"messages": [{"content": "no role"}]}),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}),
    (CHAT, {"messages": [{"role": "user", "content": [5]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
    # images: remote, not data URLs, bad base64, not an image, a bomb, too many
    (CHAT, image_chat("https://example.com/cat.png")),
    (CHAT, image_chat("http://127.0.0.1:1/x.png")),
    (CHAT, image_chat("file:///etc/passwd")),
    (CHAT, image_chat(5)),
    (CHAT, image_chat("data:image/png;base64,@@@@")),
    (CHAT, image_chat("data:image/png;base64," + base64.b64encode(b"not an image").decode())),
    (CHAT, image_chat(png_url(100_000, 100_000))),
    (CHAT, image_chat(png_url(8_000, 8_000))),
    (CHAT, image_chat(png_url(6_000, 6_000), count=3)),  # 108 MP in all
    (CHAT, image_chat(png_url(2, 2), count=17)),
    (CHAT, image_chat(png_url(2, 2))),  # a real image, but a model without vision
    # text completions
    (TEXT, {"messages": []}),
    (TEXT, {"prompt": ""}),
    (TEXT, {"prompt": ["a", "b"]}),
    (TEXT, {"prompt": 5}),
    (TEXT, {"prompt": None}),
    (TEXT, {"prompt": "x", "max_tokens": 0}),
    # bodies
    (CHAT, b"{not json"),
    (CHAT, b"[1, 2]"),
    (CHAT, b'"just a string"'),
    (CHAT, b"42"),
    (CHAT, b"null"),
    (CHAT, b""),
    (CHAT, b"\xff\xfe\x00{"),
    (TEXT, b'{"prompt": "x", "max_tokens": }'),
    # fields that reach the model lookup or the template unchecked upstream
    *[(CHAT, chat(**{field: value})) for field, value in [
        ("draft_model", []), ("draft_model", {"a": 1}), ("draft_model", 5),
        ("role_mapping", 5), ("role_mapping", {"user": [1]}),
        # booleans are not numbers; NaN/Infinity are not values
        ("top_logprobs", True), ("max_tokens", True), ("seed", True), ("seed", -1),
        ("seed", 2**70), ("temperature", float("nan")), ("top_p", float("inf")),
        ("logit_bias", {"1": "nan"}),
        # values the samplers can't take (found by the fuzzer)
        ("stop", "\ud800"), ("temperature", 2**63), ("frequency_penalty", 10**20),
        ("presence_penalty", -1e300), ("repetition_penalty", 1e-300),
        ("xtc_threshold", 1.0), ("logit_bias", {"1": 1e300}),
        # names kept in the request history, logged and echoed: bounded
        ("model", "m" * 5000), ("draft_model", "d" * 5000), ("adapters", "a" * 5000),
    ]],
    # prompts longer than the fixture's context (32768 tokens) could hold at
    # 32 characters a token: refused before they are tokenized (a 100 MB one
    # had the server killed for memory)
    (CHAT, {"messages": [{"role": "user", "content": "the sea " * 140_000}], "max_tokens": 2}),
    (CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "description": "d" * 1_100_000}}])),
    (CHAT, chat(chat_template_kwargs={"date_string": "d" * 1_100_000})),
    (TEXT, {"prompt": "x" * 1_100_000, "max_tokens": 2}),
]

MESSAGES = "/v1/messages"


def message(**kw):
    return {"model": "claude-x", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], **kw}


def tool_turns(result_id):
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": result_id, "content": "sun"}]}]


# Anthropic Messages bodies: each gets Anthropic's error shape.
MESSAGES_CASES = [
    *[(MESSAGES, body) for body in [
        message(system="z" * 1_100_000),
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
        message(max_tokens="many"), message(max_tokens=0), message(max_tokens=True),
        message(model=None), message(model=5), message(messages=[]), message(messages="hi"),
        message(messages=[{"role": "tool", "content": "x"}]),
        message(messages=[{"role": "user", "content": 5}]),
        message(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
        message(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        message(messages=[{"role": "user", "content": ["just a string"]}]),
        message(messages=[{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "x"}]}]),
        message(messages=tool_turns("toolu_2")),  # an unknown tool id
        message(messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]),
        message(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "%%% not base64"}}]}]),
        message(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/tiff", "data": "AAAA"}}]}]),
        message(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),  # not a PNG
        message(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "file", "file_id": "f"}}]}]),
        message(system=5), message(system=[{"type": "image"}]), message(model="m" * 5000),
        message(tools="all"), message(tools=[{"name": "f"}]),
        message(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        message(tools=[{"input_schema": {}}]),
        message(tool_choice={"type": "tool", "name": "missing"}),
        message(tool_choice={"type": "sometimes"}), message(tool_choice="auto"),
        message(thinking={"type": "enabled"}), message(thinking={"type": "maybe"}),
        message(thinking=True), message(output_config={"effort": "extreme"}),
        message(stop_sequences="END"), message(stop_sequences=[1]),
        message(temperature="hot"), message(top_k=-1), message(top_p=7),
        message(stream="yes"), message(metadata="m"),
        message(output_config={"effort": ["low"]}), message(output_config="high"),
        message(output_config={"format": {"type": "json_schema", "schema": {"type": "frob"}}}),
        message(tool_choice={"type": "any"}),  # no tools to call
    ]],
    (MESSAGES, b"{not json"), (MESSAGES, b"[]"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": []}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
]

RESPONSES = "/v1/responses"


def response(**kw):
    return {"model": "gpt-x", "max_output_tokens": 2, "input": "hi", **kw}


# OpenAI Responses bodies: each gets OpenAI's error object.
RESPONSES_CASES = [
    *[(RESPONSES, body) for body in [
        response(input="y" * 1_100_000),
        response(input=None), response(input=5), response(input=[]),
        response(input=[{"type": "message", "role": "user", "content": 5}]),
        response(input=[{"type": "message", "role": "robot", "content": "x"}]),
        response(input=[{"type": "message", "role": "user",
                         "content": [{"type": "input_video", "url": "x"}]}]),
        response(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]),
        response(input=[{"type": "function_call", "call_id": "c", "name": "f",
                         "arguments": 5}]),
        response(input=[{"type": "item_reference", "id": "msg_1"}]),
        response(input=[{"type": "mystery"}]),
        response(input=[{"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,%%%"}]}]),
        response(input=[{"type": "message", "role": "user", "content": [
            {"type": "input_image", "file_id": "file_1"}]}]),
        response(max_output_tokens=0), response(max_output_tokens="9"),
        response(temperature="hot"), response(top_p=3), response(stream="yes"),
        response(tools=[{"type": "custom", "name": "x"}]), response(tools=[{"type": "function"}]),
        response(tools=[{"type": "web_search"}], tool_choice={"type": "web_search"}),
        response(tools=[{"type": "namespace", "name": "n", "tools": [{"type": "mcp"}]}]),
        response(tools="all"), response(instructions=5), response(reasoning={"effort": "huge"}),
        response(reasoning="high"), response(text={"format": {"type": "yaml"}}),
        response(tool_choice=5), response(background=True), response(model=7),
        response(previous_response_id=5), response(reasoning={"effort": []}),
        response(reasoning={"summary": {}}), response(tool_choice="required"),
        response(input=[{"type": "function_call", "call_id": "c", "name": "f",
                         "arguments": "[" * 100000}]),
        response(text={"format": {"type": "json_schema", "name": "x",
                                  "schema": {"type": "frob"}}}),
    ]],
    (RESPONSES, b"{not json"), (RESPONSES, b"[]"),
]

# Cases that reach model loading with --allow-model-loading.
LOADING_CASES = [(CHAT, chat(draft_model=value)) for value in ([], {"a": 1}, 5, None)]


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("bad") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))], log=log) as s:
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
    from tests.engine_harness import EngineRunner

    runner = EngineRunner(fixture_path("qwen3"))
    try:
        assert runner.run(chat())[0]
        good = runner.submit(chat())
        # A stop word that is not a string, as if validation had missed it.
        from mlx_lm_plus.protocols.validation import parse_request

        parsed = parse_request(CHAT, chat(), runner.args)
        parsed.args.stop_words = [1, 2]
        from tests.engine_harness import Collect

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
    from tests.engine_harness import Collect, EngineRunner

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
    from mlx_lm_plus.models.provider import context_length
    from mlx_lm_plus.planning.prompt import DEFAULT_ROLE_CHARS, check_prompt_size, prompt_chars
    from tests.engine_harness import EngineRunner

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
    from tests.engine_harness import EngineRunner

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
