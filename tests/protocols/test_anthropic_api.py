"""/v1/messages and /v1/messages/count_tokens, driven by the official
`anthropic` SDK against a live server on the tiny fixtures.

A random fixture never writes <think> or <tool_call> by itself, so the
shapes of thinking and tool_use blocks are checked by feeding the exchange
scripted deltas; everything else goes through the server.
"""

import base64
import io
import json

import anthropic
import pytest

from compat.launch import OURS, ServerProcess
from mlx_lm_plus.protocols.anthropic import MessagesExchange, to_chat_body
from mlx_lm_plus.protocols.replay import open_sealed
from mlx_lm_plus.protocols.base import Completion

SYSTEM = "You are a terse assistant. Answer in one line."


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("anthropic") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3")), "--api-key", "sk-test",
                              "--strip-billing-header"], log=log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(fixture_path):
    from mlx_lm import load

    return load(str(fixture_path("qwen3")))[1]


def test_text_streaming_equals_non_streaming(client):
    kw = dict(model="local-coder", max_tokens=10, system=SYSTEM,
              extra_body={"temperature": 0, "top_k": 40, "top_p": 1.0},
              messages=user("Name three rivers of the north."))
    message = client.messages.create(**kw)
    assert message.model == "local-coder"  # the name asked for, echoed
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 10
    (block,) = message.content
    assert block.type == "text" and block.text

    events = []
    with client.messages.stream(**kw) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == block.text
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert final.stop_reason == "max_tokens"
    # The second identical request reuses all but the last prompt token.
    usage = final.usage
    assert usage.cache_read_input_tokens + usage.input_tokens == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens)
    assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0


def test_raw_stream_event_sequence(server):
    status, _, raw = server.request(
        "POST", "/v1/messages",
        {"model": "m", "max_tokens": 4, "stream": True, "messages": user("Hello")},
        headers={"x-api-key": "sk-test", "anthropic-version": "2023-06-01",
                 "anthropic-beta": "some-future-beta"})
    assert status == 200
    names = [line[len("event: "):] for line in raw.decode().splitlines()
             if line.startswith("event: ")]
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"]
                     * (len(names) - 6), "content_block_stop", "message_delta", "message_stop"]


def test_count_tokens_matches_the_prompt(client):
    kw = dict(model="m", system=SYSTEM, messages=user("How far is the sea?"))
    counted = client.messages.count_tokens(**kw).input_tokens
    message = client.messages.create(max_tokens=2, **kw)
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_stop_sequences(server, client, tokenizer):
    """Stop words end generation when their tokens are generated (as on
    chat completions); the one that did is named."""
    messages = user("Count the boats.")
    # The same prompt on chat completions, for the generated token ids.
    _, r = server.post("/v1/chat/completions",
                       {"messages": messages, "max_tokens": 16, "logprobs": True},
                       headers={"Authorization": "Bearer sk-test"})
    ids = [c["id"] for c in r["choices"][0]["logprobs"]["content"]]
    text = r["choices"][0]["message"]["content"]
    for k in range(3, len(ids) - 2):  # two tokens whose text encodes back to them
        word = tokenizer.decode(ids[k:k + 2])
        if tokenizer.encode(word, add_special_tokens=False) == ids[k:k + 2] and word.strip():
            break
    else:
        pytest.fail(f"no usable stop word in {ids}")
    kw = dict(model="m", max_tokens=16, messages=messages)
    assert client.messages.create(**kw).content[0].text == text
    stopped = client.messages.create(stop_sequences=["never written", word], **kw)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text and text.startswith(stopped.content[0].text)
    with client.messages.stream(stop_sequences=[word], **kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    assert final.content[0].text == stopped.content[0].text
    ended = client.messages.create(stop_sequences=["never written"], **kw)
    assert ended.stop_reason == "max_tokens" and ended.stop_sequence is None


def test_thinking_switch_changes_the_prompt(client, tokenizer):
    """The fixture's Qwen3 template writes an empty think block when
    thinking is off: the prompt grows by its tokens."""
    kw = dict(model="m", messages=user("Why is the sky blue?"))
    on = client.messages.count_tokens(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    off = client.messages.count_tokens(thinking={"type": "disabled"}, **kw)
    default = client.messages.count_tokens(**kw)
    empty_block = len(tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off.input_tokens - on.input_tokens == empty_block
    assert default.input_tokens == on.input_tokens
    low = client.messages.count_tokens(output_config={"effort": "low"}, **kw)
    assert low.input_tokens == off.input_tokens
    message = client.messages.create(max_tokens=3, thinking={"type": "disabled"}, **kw)
    assert [b.type for b in message.content] == ["text"]


def test_tool_result_round_trip(client):
    """The client sends the model's tool call back with its result; the
    model answers, and the tools and the call are in the prompt."""
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
    ]
    answer = client.messages.create(model="m", max_tokens=4, tools=tools, messages=messages)
    assert answer.content[0].type == "text" and answer.usage.output_tokens == 4
    with_tools = client.messages.count_tokens(model="m", tools=tools, messages=messages)
    without = client.messages.count_tokens(model="m", messages=messages)
    assert with_tools.input_tokens > without.input_tokens + 20
    # tool_choice none: the model is told of no tools.
    none = client.messages.count_tokens(model="m", tools=tools, tool_choice={"type": "none"},
                                        messages=messages)
    assert none.input_tokens == without.input_tokens


def test_tool_messages_render_as_chat_completions_would(tokenizer):
    body = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "S1"},
                                                      {"type": "text", "text": "S2"}],
            "messages": [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {"type": "tool_use", "id": "a", "name": "f", "input": {"x": 1}},
                    {"type": "tool_use", "id": "b", "name": "g", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "a", "content": [
                        {"type": "text", "text": "one"}]},
                    {"type": "tool_result", "tool_use_id": "b", "content": "two",
                     "is_error": True},
                    {"type": "text", "text": "go on"}]}]}
    chat = to_chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "S1\n\nS2"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": "Error: two"},
        {"role": "user", "content": "go on"},
    ]


def _scripted(stream):
    exchange = MessagesExchange("msg_1", "m", stream)
    frames = exchange.start(10, 4) if stream else b""
    frames += exchange.delta("", [], "let me think")
    frames += exchange.delta("It is", [], "")
    frames += exchange.delta(" sunny.", [{"id": "x", "type": "function", "index": 0,
                                          "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Paris"}'}}], "")
    done = Completion("tool_calls", None, 10, 7, 4)
    return exchange, frames, done


def test_thinking_text_and_tool_use_blocks():
    exchange, _, done = _scripted(False)
    message = anthropic.types.Message.model_validate(exchange.body(done))
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "let me think"
    # Signed (replay.py): what Claude Code hands back with the block.
    assert open_sealed(message.content[0].signature) == "let me think"
    assert message.content[1].text == "It is sunny."
    assert message.content[2].input == {"city": "Paris"} and message.content[2].id
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (6, 4)


def test_streamed_blocks_accumulate_in_the_sdk():
    """The SDK's own stream accumulator rebuilds the same message."""
    from anthropic._models import construct_type
    from anthropic.lib.streaming._messages import accumulate_event

    exchange, frames, done = _scripted(True)
    frames += exchange.finish(done)
    snapshot, buffers = None, {}
    for block in frames.decode().split("\n\n"):
        if not block:
            continue
        event, data = block.split("\n")
        assert event.startswith("event: ")
        payload = json.loads(data[len("data: "):])
        if payload["type"] == "ping":
            continue
        snapshot = accumulate_event(
            event=construct_type(type_=anthropic.types.RawMessageStreamEvent, value=payload),
            current_snapshot=snapshot, json_bufs=buffers)
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use"]
    assert open_sealed(snapshot.content[0].signature) == "let me think"
    assert snapshot.content[2].input == {"city": "Paris"}
    assert snapshot.content[1].text == "It is sunny."
    assert snapshot.stop_reason == "tool_use"


def _png():
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_image_on_the_vision_fixture(fixture_path, tmp_path):
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen2_vl"))],
                       log=tmp_path / "server.log") as vision:
        client = anthropic.Anthropic(base_url=vision.url, api_key="x", max_retries=0)
        content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                "data": _png()}},
                   {"type": "text", "text": "What is this?"}]
        first = client.messages.create(model="m", max_tokens=4,
                                       messages=[{"role": "user", "content": content}])
        again = client.messages.create(model="m", max_tokens=4,
                                       messages=[{"role": "user", "content": content}])
        assert again.content == first.content
        assert again.usage.cache_read_input_tokens == (
            first.usage.input_tokens + first.usage.cache_read_input_tokens - 1)
        counted = client.messages.count_tokens(model="m",
                                               messages=[{"role": "user", "content": content}])
        assert counted.input_tokens == first.usage.input_tokens
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "not base64!"}}]}])


def test_errors_are_the_sdks_own_types(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=0, messages=user("hi"))
    assert e.value.status_code == 400
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.post("/v1/messages", cast_to=object, body={"model": "m", "messages": user("hi")})
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0
                            ).messages.create(model="m", max_tokens=2, messages=user("hi"))
    with pytest.raises(anthropic.NotFoundError):
        client.get("/v1/messages/batches", cast_to=object)
    assert server.get("/health") == (200, {"status": "ok"})


def billing(cch):
    return {"type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.42.834; cc_entrypoint=cli; "
                    f"cch={cch};"}


def test_billing_header_is_kept_unless_stripped():
    body = {"model": "m", "max_tokens": 2, "messages": user("hi"),
            "system": [billing("65abc"), {"type": "text", "text": "You are Claude Code."}]}
    kept = to_chat_body(body)["messages"][0]["content"]
    assert kept.startswith("x-anthropic-billing-header: ") and kept.endswith("Claude Code.")
    stripped = to_chat_body(body, strip_billing_header=True)["messages"][0]
    assert stripped == {"role": "system", "content": "You are Claude Code."}
    inline = {**body, "system": billing("1") ["text"] + "\nRules.", "messages": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [billing("2"), {"type": "text", "text": "Note."}]},
        {"role": "ctx", "content": "b"}]}
    assert to_chat_body(inline, strip_billing_header=True)["messages"] == [
        {"role": "system", "content": "Rules."}, {"role": "user", "content": "a"},
        {"role": "system", "content": "Note."}, {"role": "user", "content": "b"}]


def test_stripped_billing_header_lets_the_cache_work(client):
    """Claude Code's per-request hash, stripped (--strip-billing-header):
    the second request of a session reuses its whole prompt but one token."""
    system = [None, {"type": "text", "text": SYSTEM * 4}]
    sizes = []
    for cch in ("65abc", "0f3e1"):
        system[0] = billing(cch)
        m = client.messages.create(model="m", max_tokens=2, system=system,
                                   messages=user("List the files."))
        sizes.append((m.usage.input_tokens, m.usage.cache_read_input_tokens))
    assert sizes[1] == (1, sum(sizes[0]) - 1)


def test_billing_header_removed_by_default_kept_on_request():
    """The server strips Claude Code's billing line unless told to keep it
    (--keep-billing-header): the line differs between sessions, and a
    session's shared system prompt is only reused by the next without it."""
    from mlx_lm_plus.protocols.anthropic import AnthropicProtocol
    from mlx_lm_plus.app import build
    from mlx_lm_plus.config import parse_args

    body = {"model": "m", "max_tokens": 2, "messages": user("hi"),
            "system": [billing("65abc"), {"type": "text", "text": "You are Claude Code."}]}
    for argv, kept in (([], False), (["--strip-billing-header"], False),
                       (["--keep-billing-header"], True)):
        _, server = build(parse_args(["--model", "m", *argv]))
        (protocol,) = [p for p in server.protocols if isinstance(p, AnthropicProtocol)]
        chat = to_chat_body(body, strip_billing_header=protocol.strip_billing_header)
        assert chat["messages"][0]["content"].startswith("x-anthropic-billing-header") == kept
