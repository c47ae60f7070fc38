"""/v1/responses (OpenAI's Responses API), driven by the official `openai`
SDK against a live server on the tiny qwen3 fixture.

A random fixture never writes <think> or <tool_call> by itself, so the
shapes of reasoning and function_call items are checked by feeding the
assembler and the exchange scripted pieces, and the SDK reads the result
through a mock transport; everything else goes through the server.
"""

import json

import openai
try:  # the HTTP client the openai SDK is built on
    import httpx2 as httpx
except ImportError:  # older SDKs
    import httpx
import pytest
from mlx_lm.generate import make_text_state_machine
from mlx_lm.server import GenerationContext, Response as GenResponse
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from compat.launch import OURS, ServerProcess
from mlx_lm_plus.protocols.assembler import CompletionAssembler
from mlx_lm_plus.protocols.response_store import ResponseStore
from mlx_lm_plus.protocols.responses import ResponsesProtocol
from mlx_lm_plus.protocols.responses_input import output_messages, to_chat_body
from mlx_lm_plus.config import parse_args
from mlx_lm_plus.protocols.validation import RequestError
from mlx_lm_plus.protocols.base import Completion

SYSTEM = "You are a terse assistant. Answer in one line."
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))], log=log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(fixture_path):
    from mlx_lm import load

    return load(str(fixture_path("qwen3")))[1]


def sse_events(raw: bytes):
    """[(event name, data)] of an SSE body."""
    out = []
    for block in raw.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        name = next(line[7:] for line in lines if line.startswith("event: "))
        data = json.loads(next(line[6:] for line in lines if line.startswith("data: ")))
        out.append((name, data))
    return out


def check_events(events):
    """Every event is one the SDK knows, named as its type, numbered from 0."""
    for i, (name, data) in enumerate(events):
        assert data["type"] == name and data["sequence_number"] == i, (i, name, data)
        EVENTS.validate_python(data)


def chat(server, **body):
    status, r = server.post("/v1/chat/completions", body)
    assert status == 200, r
    return r


# -- over the server --


def test_text_response_shape(server, client):
    kw = dict(model="gpt-test", input="Tell me about boats.", instructions=SYSTEM,
              max_output_tokens=8, temperature=0, metadata={"k": "v"})
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.model == "gpt-test"  # the name asked for, echoed
    # A random model never ends by itself: the limit does.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == SYSTEM and r.metadata == {"k": "v"} and r.store is True
    assert r.temperature == 0 and r.max_output_tokens == 8 and r.error is None
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "incomplete"
    (part,) = message.content
    assert part.type == "output_text" and part.text and part.annotations == []
    assert r.output_text == part.text
    u = r.usage
    assert u.output_tokens == 8 and u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    # The raw body validates strictly against the SDK's model.
    status, raw = server.post("/v1/responses", {**kw, "model": "m"})
    assert status == 200
    Response.model_validate(raw)
    assert raw["output"][0]["content"][0]["text"] == part.text  # greedy: the same text


def stop_word(server, tokenizer, messages, max_tokens):
    """A one-token word the greedy answer to `messages` writes, to end it
    with stop (status completed) instead of max tokens."""
    r = chat(server, messages=messages, max_tokens=max_tokens, logprobs=True, temperature=0)
    ids = [c["id"] for c in r["choices"][0]["logprobs"]["content"]]
    for k in range(2, len(ids)):
        word = tokenizer.decode([ids[k]])
        if (word.strip() and tokenizer.encode(word, add_special_tokens=False) == [ids[k]]
                and word not in tokenizer.decode(ids[:k])):
            return word
    pytest.fail(f"no usable stop word in {ids}")


def test_streaming_equals_non_streaming(server, client, tokenizer):
    question = "Write about the sea and a boat."
    word = stop_word(server, tokenizer, [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": question}], 16)
    kw = dict(model="m", input=question, instructions=SYSTEM, max_output_tokens=16,
              temperature=0, extra_body={"stop": [word]})
    full = client.responses.create(**kw)
    assert full.status == "completed" and full.incomplete_details is None
    assert full.completed_at is not None and full.output_text

    deltas, types = [], []
    with client.responses.stream(**kw) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == full.output_text
    assert final.status == "completed" and final.usage.output_tokens == full.usage.output_tokens
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]

    # The raw stream: named events, numbered in order, each valid for the SDK.
    body = {"model": "m", "input": question, "instructions": SYSTEM, "stream": True,
            "max_output_tokens": 5, "temperature": 0}
    status, headers, raw = server.request("POST", "/v1/responses", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert b"[DONE]" not in raw
    events = sse_events(raw)
    check_events(events)
    assert events[-1][0] == "response.incomplete"
    last = events[-1][1]["response"]
    assert last["status"] == "incomplete" and last["usage"]["output_tokens"] == 5
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert last["output"][0]["content"][0]["text"] == text
    assert text.startswith(full.output_text)  # that one ended at the stop word


def test_instructions_and_developer_messages(client):
    kw = dict(model="m", max_output_tokens=1)
    bare = client.responses.create(input="How far is the sea?", **kw)
    told = client.responses.create(input="How far is the sea?", instructions=SYSTEM, **kw)
    as_item = client.responses.create(input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "How far is "},
                     {"type": "input_text", "text": "the sea?"}]}], **kw)
    assert told.usage.input_tokens > bare.usage.input_tokens
    assert as_item.usage.input_tokens == told.usage.input_tokens
    assert bare.instructions is None and told.instructions == SYSTEM


def test_continuation_renders_the_chat_conversation(server, client):
    """previous_response_id continues with the stored conversation: the
    prompt is token for token the chat-completions conversation with the
    same messages, so either hits the other's cache."""
    kw = dict(model="m", instructions=SYSTEM, max_output_tokens=6, temperature=0)
    first = client.responses.create(input="Name a river in France.", **kw)
    # The same conversation on chat completions, first.
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Name a river in France."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And one in Japan?"}]
    on_chat = chat(server, messages=messages, max_tokens=6, temperature=0)
    assert on_chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
        first.usage.input_tokens - 1)
    second = client.responses.create(previous_response_id=first.id,
                                     input="And one in Japan?", **kw)
    assert second.previous_response_id == first.id
    prompt = on_chat["usage"]["prompt_tokens"]
    assert second.usage.input_tokens == prompt
    assert second.usage.input_tokens_details.cached_tokens == prompt - 1  # an exact hit
    assert second.output_text == on_chat["choices"][0]["message"]["content"]

    # A fresh conversation: the continuation reuses at least the first prompt.
    one = client.responses.create(input="Tell me a story about a dog.", **kw)
    two = client.responses.create(previous_response_id=one.id, input="Shorter.", **kw)
    assert two.usage.input_tokens_details.cached_tokens >= one.usage.input_tokens - 1

    # Replaying the output items as input is the same conversation.
    replayed = client.responses.create(
        input=[{"role": "user", "content": "Tell me a story about a dog."},
               *[item.model_dump(exclude_none=True) for item in one.output],
               {"role": "user", "content": "Shorter."}], **kw)
    assert replayed.usage.input_tokens == two.usage.input_tokens
    assert replayed.output_text == two.output_text

    # Instructions are not carried over: the continuation brings its own.
    bare = client.responses.create(previous_response_id=one.id, input="Shorter.",
                                   model="m", max_output_tokens=1)
    assert bare.usage.input_tokens < two.usage.input_tokens


def test_get_delete_and_store_false(server, client):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    status, raw = server.request("DELETE", f"/v1/responses/{r.id}")[::2]
    assert status == 200 and json.loads(raw) == {"id": r.id, "object": "response",
                                                 "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError, match="not found"):
            call(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", previous_response_id=r.id, input="x")

    unstored = client.responses.create(model="m", input="Hi", max_output_tokens=2,
                                       store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    status, body = server.get("/v1/responses/resp_nope")
    assert status == 404 and body == {"error": {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error", "param": None, "code": None}}


def test_stats_do_not_give_stored_response_ids_away(server, client):
    """An id is all it takes to read or continue a stored response: /v1/stats
    (which any local non-browser client may read without --api-key) and the
    request log show its end only."""
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    stats = server.get("/v1/stats")[1]
    assert r.id not in json.dumps(stats)
    assert f"resp_...{r.id[-6:]}" in [q["id"] for q in stats["requests"]]
    assert client.responses.retrieve(r.id).id == r.id


def test_a_replayed_cut_off_call_is_served(server):
    """A function_call item replayed with status incomplete (a call
    max_tokens cut off) goes back as far as its arguments parse; found in
    review: arguments nesting deeper than Python recurses were a 500."""
    for arguments in ('{"city": "Pa', "[" * 3000, '{"a": x, "b": [' + "1," * 20_000):
        status, r = server.post("/v1/responses", {
            "model": "m", "max_output_tokens": 2, "input": [
                {"type": "message", "role": "user", "content": "Weather?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather",
                 "arguments": arguments, "status": "incomplete"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
        assert status == 200, r


def test_cut_off_arguments_are_read_back_within_one_budget():
    """Each incomplete function_call item's arguments are read back as far
    as they parse, within one budget for the whole request (found in
    review: 20 items of 256 KB each cost 0.9 s): past it, none."""
    from mlx_lm_plus.protocols.assembler import PARTIAL_JSON_CHARS
    from mlx_lm_plus.protocols.responses_input import to_messages

    long = '{"a": "' + "x" * (PARTIAL_JSON_CHARS // 2)
    items = [{"type": "function_call", "call_id": f"c{i}", "name": "f",
              "arguments": text, "status": "incomplete"}
             for i, text in enumerate(['{"city": "Pa', long, long, '{"city": "Ro'])]
    messages, _ = to_messages(items)
    arguments = [c["function"]["arguments"] for c in messages[0]["tool_calls"]]
    assert json.loads(arguments[0]) == {"city": "Pa"}
    assert json.loads(arguments[1]) == {"a": "x" * (PARTIAL_JSON_CHARS // 2)}
    assert arguments[2:] == ["{}", "{}"]  # (the budget is spent)


def test_a_lone_surrogate_in_an_echoed_field_keeps_the_stream(server):
    """Found in review: a lone surrogate in metadata (echoed in every
    Responses event) raised UnicodeEncodeError writing the stream; it is
    escaped instead, as the non-streamed answer has it."""
    raw = json.dumps({"model": "m", "input": "Hi", "max_output_tokens": 2, "stream": True,
                      "metadata": {"k": "x\ud800"}}).encode()
    status, _, data = server.request("POST", "/v1/responses", raw=raw)
    events = sse_events(data)
    check_events(events)
    assert status == 200 and events[-1][0] in ("response.completed", "response.incomplete")
    assert events[0][1]["response"]["metadata"] == {"k": "x\ud800"}


def test_function_call_round_trip(server, client):
    """A tool result answered: the same prompt as chat completions' tool
    messages."""
    question = "What is the weather in Paris?"
    r = client.responses.create(
        model="m", tools=[WEATHER_TOOL], max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": question},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris"}'},
               {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                "arguments": '{"city": "Lyon"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
               {"type": "function_call_output", "call_id": "call_2",
                "output": [{"type": "input_text", "text": "rainy"}]}])
    assert r.output_text and r.tools[0].name == "get_weather"
    tool = {"type": "function", "function": {k: WEATHER_TOOL[k] for k in
                                             ("name", "description", "parameters")}}
    on_chat = chat(server, tools=[tool], max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rainy"}])
    assert r.usage.input_tokens == on_chat["usage"]["prompt_tokens"]
    assert r.output_text == on_chat["choices"][0]["message"]["content"]

    # tool_choice none: the model is told of no tools.
    none = client.responses.create(model="m", tools=[WEATHER_TOOL], tool_choice="none",
                                   input=question, max_output_tokens=1)
    plain = client.responses.create(model="m", input=question, max_output_tokens=1)
    assert none.usage.input_tokens == plain.usage.input_tokens < r.usage.input_tokens
    assert none.tool_choice == "none"


def test_reasoning_effort_switches_thinking(client):
    """The fixture's Qwen3-style template writes an empty think block when
    thinking is off; thinking is its default."""
    kw = dict(model="m", input="Why is the sky blue?", max_output_tokens=1)
    tokens = {effort: client.responses.create(reasoning={"effort": effort}, **kw)
              .usage.input_tokens for effort in ("none", "minimal", "low", "high")}
    default = client.responses.create(**kw).usage.input_tokens
    assert tokens["none"] == tokens["minimal"] > tokens["low"] == tokens["high"] == default


def test_input_tokens_count(client):
    kw = dict(model="m", instructions=SYSTEM, input="How far is the sea?",
              tools=[WEATHER_TOOL])
    counted = client.responses.input_tokens.count(**kw)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == client.responses.create(
        max_output_tokens=1, **kw).usage.input_tokens


@pytest.mark.parametrize("kw, match", [
    (dict(tools=[{"type": "custom", "name": "apply_patch"}]), "Tool type 'custom' is not supported"),
    (dict(tools=[{"type": "web_search"}], tool_choice={"type": "web_search"}), "'web_search'"),
    (dict(tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}],
          tool_choice={"type": "file_search"}), "file_search"),
    (dict(input=[{"type": "computer_call_output", "call_id": "c", "output": {}}]),
     "computer_call_output"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "item references"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]),
     "no tool call found"),
    (dict(input=[{"role": "robot", "content": "hi"}]), "role"),
    (dict(input=42), "input"),
    (dict(input="hi", max_output_tokens=0), "max_output_tokens"),
    (dict(input="hi", temperature="hot"), "temperature"),
    (dict(input="hi", reasoning={"effort": "extreme"}), "reasoning.effort"),
    (dict(input="hi", text={"format": {"type": "xml"}}), "text.format.type"),
    (dict(input="hi", metadata=[1]), "metadata"),
    (dict(input="hi", background=True), "background"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "https://x.test/a.png"}]}]),
     "remote image"),
])
def test_bad_requests_are_400(client, kw, match):
    kw = {"input": "hi", **kw}
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.responses.create(model="m", **kw)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"


def test_error_shapes(server):
    status, body = server.post("/v1/responses", {"model": "m"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "input" in body["error"]["message"]
    status, body = server.post("/v1/responses", [1, 2])
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = server.get("/v1/responses/resp_x/other")
    assert status == 404 and "error" in body
    # The server still answers.
    assert server.get("/health") == (200, {"status": "ok"})


def test_paths_without_v1(server):
    """An SDK whose base URL lacks /v1 calls /responses (as /chat/completions)."""
    sdk = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    r = sdk.responses.create(model="m", input="Hi", max_output_tokens=2)
    assert sdk.responses.retrieve(r.id).id == r.id
    assert sdk.responses.input_tokens.count(model="m", input="Hi").input_tokens == (
        r.usage.input_tokens)


def test_image_input_on_a_vision_model(fixture_path, tmp_path):
    """input_image parts are the chat's image_url parts: the same prompt, and
    the same cache entries (the vision tower runs once for both)."""
    from tests.models.test_vision import RED, image_part, user

    with ServerProcess(OURS, ["--model", str(fixture_path("qwen2_vl"))],
                       log=tmp_path / "server.log") as vision:
        sdk = openai.OpenAI(base_url=vision.url + "/v1", api_key="x", max_retries=0)
        r = sdk.responses.create(model="m", max_output_tokens=4, temperature=0, input=[
            {"role": "user", "content": [
                {"type": "input_image", "image_url": RED, "detail": "auto"},
                {"type": "input_text", "text": "What is it?"}]}])
        assert r.output_text and r.usage.input_tokens_details.cached_tokens == 0
        on_chat = chat(vision, max_tokens=4, temperature=0,
                       messages=[user(image_part(RED), "What is it?")])
        assert on_chat["usage"]["prompt_tokens"] == r.usage.input_tokens
        assert on_chat["usage"]["prompt_tokens_details"]["cached_tokens"] == (
            r.usage.input_tokens - 1)
        assert on_chat["choices"][0]["message"]["content"] == r.output_text
        status, stats = vision.get("/v1/stats")
        assert stats["engine"]["vision"] == {"images_encoded": 1, "images_from_cache": 1}
        with pytest.raises(openai.BadRequestError, match="Image 0"):
            sdk.responses.create(model="m", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])


# -- the exchange alone, on scripted pieces --


def ctx_for(tokenizer, initial_state="normal"):
    return GenerationContext(
        has_tool_calling=tokenizer.has_tool_calling, has_thinking=tokenizer.has_thinking,
        tool_parser=tokenizer.tool_parser, text_sm=make_text_state_machine(tokenizer),
        initial_state=initial_state, prompt=[1, 2, 3])


PIECES = ["<think>", "The user", " wants weather.", "</think>", "\n\n", "Let me", " check.",
          "<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n',
          "</tool_call>", "\n", "<tool_call>", '\n{"name": "get_weather", ',
          '"arguments": {"city": "Rome"}}\n', "</tool_call>", ""]


def run_exchange(tokenizer, pieces, stream, finish="stop", store=None, request=None):
    """Drive an exchange as api.py does; (its bytes, the Completion)."""
    protocol = ResponsesProtocol(store or ResponseStore())
    cli = parse_args(["--model", "m"])
    parsed = protocol.parse("/v1/responses", request or {
        "model": "gpt-test", "input": "Weather in Paris and Rome?", "stream": stream,
        "tools": [WEATHER_TOOL]}, cli, None)
    exchange = protocol.exchange(parsed, "abc")
    assembler = CompletionAssembler(ctx_for(tokenizer), parsed.request.tools, True,
                                    False, 0)
    out = exchange.start(3, 0) if stream else b""
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        if assembler.add(GenResponse(piece, i, -0.5, finish if last else None, ())):
            out += exchange.delta(*assembler.take_delta())
    assembler.finish()
    out += exchange.delta(*assembler.take_delta())
    completion = Completion(assembler.finish_reason, None, 3, len(assembler.tokens), 1)
    if stream:
        out += exchange.finish(completion)
        exchange.save()
        return out, completion, protocol
    body = exchange.body(completion)
    exchange.save()
    return body, completion, protocol


def mock_client(handler):
    return openai.OpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def test_reasoning_text_and_function_calls_body(tokenizer):
    body, completion, protocol = run_exchange(tokenizer, PIECES, False)
    assert completion.finish_reason == "tool_calls"
    r = Response.model_validate(body)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call",
                                                "function_call"]
    reasoning, message, paris, rome = r.output
    assert reasoning.content[0].text == "The user wants weather." and reasoning.summary == []
    assert message.content[0].text == "\n\nLet me check." and message.status == "completed"
    assert (paris.name, json.loads(paris.arguments)) == ("get_weather", {"city": "Paris"})
    assert json.loads(rome.arguments) == {"city": "Rome"} and rome.call_id != paris.call_id
    assert paris.id.startswith("fc_") and paris.status == "completed"
    assert r.status == "completed" and r.model == "gpt-test"
    assert r.usage.output_tokens_details.reasoning_tokens == 2  # the chunks with reasoning
    # The SDK's own client reads it, output_text included.
    sdk = mock_client(lambda request: httpx.Response(200, json=body))
    got = sdk.responses.create(model="gpt-test", input="x")
    assert got.output_text == "\n\nLet me check." and got.output[2].call_id == paris.call_id

    # Stored: the conversation continues as one assistant turn; the tool
    # results answer its calls.
    (stored,) = [protocol.store.get(key) for key in protocol.store._entries]
    assert stored.messages()[-1] == {
        "role": "assistant", "content": "\n\nLet me check.",
        "reasoning_content": "The user wants weather.",
        "tool_calls": [{"id": c.call_id, "type": "function",
                        "function": {"name": "get_weather", "arguments": c.arguments}}
                       for c in (paris, rome)]}
    chat, _ = to_chat_body({"previous_response_id": r.id, "input": [
        {"type": "function_call_output", "call_id": paris.call_id, "output": "sunny"},
        {"type": "function_call_output", "call_id": rome.call_id, "output": "rain"}]},
        protocol.store)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool", "tool"]
    # Replaying the output items instead gives the same messages.
    replayed, _ = to_chat_body({"input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        *[item.model_dump(exclude_none=True) for item in r.output],
        {"type": "function_call_output", "call_id": paris.call_id, "output": "sunny"},
        {"type": "function_call_output", "call_id": rome.call_id, "output": "rain"}]},
        ResponseStore())
    assert replayed["messages"] == chat["messages"]


def test_reasoning_text_and_function_calls_stream(tokenizer):
    raw, _, _ = run_exchange(tokenizer, PIECES, True)
    events = sse_events(raw)
    check_events(events)
    names = [n for n, _ in events]
    assert names == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        # "\n\n" waits for the text it starts.
        *["response.output_text.delta"] * 2,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        *["response.output_item.added", "response.function_call_arguments.delta",
          "response.function_call_arguments.done", "response.output_item.done"] * 2,
        "response.completed"]
    # The SDK's stream helper accumulates it into the same response.
    sdk = mock_client(lambda request: httpx.Response(
        200, content=raw, headers={"Content-Type": "text/event-stream"}))
    with sdk.responses.stream(model="gpt-test", input="x", tools=[WEATHER_TOOL]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "\n\nLet me check."
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call",
                                                    "function_call"]
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}
    assert final.output[0].content[0].text == "The user wants weather."
    assert events[-1][1]["response"]["output"] == [
        data["item"] for name, data in events if name == "response.output_item.done"]


def test_truncated_reasoning_is_incomplete(tokenizer):
    raw, completion, _ = run_exchange(tokenizer, ["<think>", "Hmm", ", rain?"], True,
                                      finish="length")
    events = sse_events(raw)
    check_events(events)
    (name, data) = events[-1]
    assert name == "response.incomplete"
    r = Response.model_validate(data["response"])
    assert r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "reasoning" and item.status == "incomplete"
    assert item.content[0].text == "Hmm, rain?"


def test_whitespace_between_calls_is_not_a_message(tokenizer):
    pieces = ['<tool_call>', '\n{"name": "get_weather", "arguments": {"city": "A"}}\n',
              "</tool_call>", "\n\n", ""]
    body, _, _ = run_exchange(tokenizer, pieces, False)
    assert [item["type"] for item in body["output"]] == ["function_call"]


def test_stream_error_before_and_after_start():
    protocol = ResponsesProtocol()
    parsed = protocol.parse("/v1/responses", {"input": "x", "stream": True},
                            parse_args(["--model", "m"]), None)
    exchange = protocol.exchange(parsed, "e1")
    events = sse_events(exchange.stream_error("model failed to load", 404))
    check_events(events)
    assert [n for n, _ in events] == ["response.created", "response.in_progress",
                                      "response.failed"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "server_error", "message": "model failed to load"}

    exchange = protocol.exchange(parsed, "e2")
    raw = exchange.start(3, 0) + exchange.delta("Hel", [], "")
    raw += exchange.stream_error("boom", 500)
    events = sse_events(raw)
    check_events(events)
    failed = Response.model_validate(events[-1][1]["response"])
    assert failed.status == "failed" and failed.output[0].status == "incomplete"
    assert failed.output[0].content[0].text == "Hel"
    assert protocol.store.get(failed.id) is None  # failures are not stored


# -- the request translation and the store --


def test_chat_body_translation():
    store = ResponseStore()
    chat, extra = to_chat_body({
        "model": "gpt-test", "instructions": "Be brief.", "max_output_tokens": 7,
        "temperature": 0.5, "top_p": 0.9, "stream": True, "parallel_tool_calls": False,
        "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "strict": True,
                            "schema": {"type": "object"}}},
        "reasoning": {"effort": "minimal"}, "store": False, "user": "u1",
        "include": ["reasoning.encrypted_content"], "truncation": "auto",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [
                {"type": "input_text", "text": "Look: "},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                 "detail": "low"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                             "text": "s"}],
             "content": [{"type": "reasoning_text", "text": "thinking"}],
             "encrypted_content": "opaque"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "On it.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "A"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "function_call_output", "call_id": "c2", "output": "2"},
            {"role": "user", "content": "Thanks"},
        ]}, store)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [
            {"type": "text", "text": "Look: "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "On it.", "reasoning_content": "thinking",
         "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "A"}'}},
             {"id": "c2", "type": "function",
              "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "user", "content": "Thanks"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER_TOOL["description"],
        "parameters": WEATHER_TOOL["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "w", "strict": True, "schema": {"type": "object"}}}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["stream"]) == (
        7, 0.5, 0.9, True)
    # The history kept for a continuation lacks the instructions.
    assert extra.history == chat["messages"][1:] and extra.store is False
    assert extra.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    # The engine normalizes its messages in place: they are not the history's.
    assert extra.history[2] is not chat["messages"][3]


def test_chat_body_rejections():
    store = ResponseStore()
    for body, match, status in [
        ({"input": "x", "tools": [{"type": "custom", "name": "s"}]}, "'custom'", 400),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "'web_search'", 400),
        ({"input": "x", "tools": [WEATHER_TOOL, {"type": "namespace", "name": "n", "tools": [
            {"type": "function", "name": "x"}]}, {**WEATHER_TOOL, "name": "n__x"}]},
         "two tools are named 'n__x'", 400),
        ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [
            {"type": "web_search"}]}]}, r"tools\[0\].tools\[0\]: must be a function tool", 400),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "nope", 400),
        ({"input": "x", "previous_response_id": "resp_zzz"}, "resp_zzz", 404),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                     "arguments": "{oops"}]}, "not valid JSON", 400),
        ({"input": [{"role": "user", "content": [{"type": "input_file",
                                                  "file_id": "f"}]}]}, "input_file", 400),
        ({"input": "x", "conversation": "conv_1"}, "conversation", 400),
        ({"input": []}, "must not be empty", 400),
    ]:
        with pytest.raises(RequestError, match=match) as e:
            to_chat_body(body, store)
        assert e.value.status == status


def test_store_limits():
    now = [0.0]
    store = ResponseStore(max_responses=2, max_bytes=10_000, ttl=60, clock=lambda: now[0])

    def put(key, size=100):
        return store.put({"id": key}, [{"role": "user", "content": "x" * size}])

    assert put("a") and put("b")
    store.get("a")  # a is now the most recently used
    assert put("c")
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    assert put("big", 9000)  # over the byte budget with the others: they go
    assert len(store) == 1 and store.get("big")
    assert 9000 < store.bytes <= 10_000
    assert not put("huge", 20_000) and store.get("huge") is None
    now[0] = 61
    assert store.get("big") is None and len(store) == 0 and store.bytes == 0
    assert put("d") and store.delete("d") and not store.delete("d")


def test_stored_conversations_come_back_as_they_went_in():
    """A conversation's big strings (data URLs) are kept apart from its
    JSON and put back; a client's string that looks like a mark is only a
    string."""
    url = "data:image/png;base64," + "QUJD" * 40_000
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "\x00mlx_lm_plus:0"}, {"type": "text", "text": "é → 世界"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]
    store = ResponseStore()
    assert store.put({"id": "r", "output": [], "tools": [{"a": [1, 2.5, None, True]}]},
                     messages)
    entry = store.get("r")
    assert entry.messages() == messages and entry.messages() is not entry.messages()
    assert json.loads(entry.response_json)["tools"] == [{"a": [1, 2.5, None, True]}]
    assert len(entry.messages_json) < 1000  # (the data URL is not in it)
    assert store.bytes >= len(url)


def test_the_store_holds_what_its_budget_says():
    """Found in review: responses echoing 1.8 MB of tools each grew the
    server by ~24 times --responses-store-bytes (Python objects counted as
    their JSON length). What the store really holds, measured by
    tracemalloc after 16 such responses, is within 1.5x of its budget."""
    import gc
    import tracemalloc

    tools = [{"type": "function", "name": f"tool_{i}", "description": "d" * 40,
              "parameters": {"type": "object", "properties": {
                  f"p{j}": {"type": "string", "description": "x" * 10, "enum": ["a", "b"]}
                  for j in range(30)}, "required": ["p0"]}} for i in range(700)]
    echo = json.dumps(tools)
    echo_bytes = len(echo)
    assert 1.5e6 < echo_bytes < 2.5e6
    budget = 8 << 20
    store = ResponseStore(max_bytes=budget)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(16):
            response = {"id": f"resp_{i}", "object": "response", "tools": json.loads(echo),
                        "output": [{"type": "message", "content": [{"text": "hi"}]}]}
            assert store.put(response, [{"role": "user", "content": f"question {i}"}])
            del response
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    print(f"held {held / 2**20:.1f} MiB for a budget of {budget / 2**20:.0f} MiB, "
          f"counted {store.bytes / 2**20:.1f} MiB in {len(store)} entries")
    assert len(store) >= 3  # (entries were kept: the budget is what limits them)
    assert held <= 1.5 * budget
    assert store.bytes <= budget and held >= 0.9 * store.bytes


def test_output_messages_of_empty_output():
    # An answer with no output still takes its turn in the conversation.
    assert output_messages([]) == [{"role": "assistant", "content": ""}]


# Codex 0.171's default tools: function tools, a namespace of function tools,
# and the hosted web_search.
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "task": {"type": "string"}}, "required": ["task"], "additionalProperties": False}}
CODEX_TOOLS = [
    {**WEATHER_TOOL, "strict": False},
    {"type": "namespace", "name": "multi_agent_v1",
     "description": "Tools for spawning and managing sub-agents.", "tools": [SPAWN]},
    {"type": "web_search", "external_web_access": False},
]


def test_codex_default_tools_are_served(tokenizer):
    """A namespace's tools reach the model as function tools named
    namespace__name; hosted tools are left out (not refused); the model's call
    comes back as a function_call with its name and namespace, and that item
    replayed renders the same conversation as the stored one."""
    chat, extra = to_chat_body({"model": "gpt-test", "input": "Go.", "tools": CODEX_TOOLS,
                                "tool_choice": "auto", "store": False,
                                "include": ["reasoning.encrypted_content"],
                                "prompt_cache_key": "k", "reasoning": {"summary": "auto"},
                                "client_metadata": {"session_id": "s"}}, ResponseStore())
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "get_weather", "multi_agent_v1__spawn_agent"]
    assert chat["tools"][1]["function"]["parameters"] == SPAWN["parameters"]
    assert extra.echo["tools"] == CODEX_TOOLS  # echoed as sent
    assert extra.namespaced == {"multi_agent_v1__spawn_agent": ("multi_agent_v1", "spawn_agent")}

    pieces = ["<tool_call>", '\n{"name": "multi_agent_v1__spawn_agent", ',
              '"arguments": {"task": "look"}}\n', "</tool_call>", ""]
    for stream in (False, True):
        request = {"model": "gpt-test", "input": "Go.", "tools": CODEX_TOOLS, "stream": stream}
        out, completion, protocol = run_exchange(tokenizer, pieces, stream, request=request)
        assert completion.finish_reason == "tool_calls"
        if stream:
            events = [json.loads(b.partition(b"data: ")[2]) for b in out.split(b"\n\n") if b]
            assert events[-1]["type"] == "response.completed"
            out = events[-1]["response"]
        (call,) = [i for i in out["output"] if i["type"] == "function_call"]
        assert (call["name"], call.get("namespace"), json.loads(call["arguments"])) == (
            "spawn_agent", "multi_agent_v1", {"task": "look"})
        (stored,) = [protocol.store.get(key) for key in protocol.store._entries]
        replayed, _ = to_chat_body({"input": [
            {"role": "user", "content": "Go."},
            {k: call[k] for k in ("type", "name", "namespace", "arguments", "call_id")},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "done"}],
            "tools": CODEX_TOOLS}, ResponseStore())
        assert replayed["messages"][:2] == stored.messages()
        assert replayed["messages"][1]["tool_calls"][0]["function"]["name"] == (
            "multi_agent_v1__spawn_agent")
    # A forced call to a namespaced tool names both.
    chat, _ = to_chat_body({"input": "Go.", "tools": CODEX_TOOLS, "tool_choice": {
        "type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}},
        ResponseStore())
    assert chat["tool_choice"] == {"type": "function",
                                   "function": {"name": "multi_agent_v1__spawn_agent"}}
    chat, extra = to_chat_body({"input": "Go.", "tools": CODEX_TOOLS, "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [
            {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}]}},
        ResponseStore())
    assert chat["tool_choice"] == {"type": "function",
                                   "function": {"name": "multi_agent_v1__spawn_agent"}}
    # The echo is the choice as validated, nothing else the client added.
    _, extra = to_chat_body({"input": "Go.", "tools": CODEX_TOOLS, "tool_choice": {
        "type": "function", "name": "get_weather", "junk": "x" * 100}}, ResponseStore())
    assert extra.echo["tool_choice"] == {"type": "function", "name": "get_weather"}


def test_sealed_reasoning_comes_back_as_the_model_wrote_it(tokenizer):
    """With include: ["reasoning.encrypted_content"] a reasoning item
    carries its text sealed; replayed with only that (Codex, store: false)
    the template gets the same reasoning back, as from the content itself.
    A value the server did not seal, or one changed, is left out: no error."""
    from mlx_lm_plus.protocols.replay import seal

    for stream in (False, True):
        request = {"model": "gpt-test", "input": "Weather in Paris and Rome?", "stream": stream,
                   "tools": [WEATHER_TOOL], "store": False,
                   "include": ["reasoning.encrypted_content"]}
        out, _, _ = run_exchange(tokenizer, PIECES, stream, request=request)
        if stream:
            events = [json.loads(b.partition(b"data: ")[2]) for b in out.split(b"\n\n") if b]
            done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            assert done[0]["type"] == "reasoning" and done[0]["encrypted_content"]
            out = events[-1]["response"]
        reasoning = out["output"][0]
        assert reasoning["type"] == "reasoning"
        sealed = reasoning["encrypted_content"]
        later = [item for item in out["output"][1:]]
        outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"}
                   for c in later if c["type"] == "function_call"]

        def replay(item):
            return to_chat_body({"input": [{"role": "user", "content": "Weather?"}, item,
                                           *later, *outputs]}, ResponseStore())[0]["messages"]

        with_text = replay(reasoning)
        assert with_text[1]["reasoning_content"] == "The user wants weather."
        # Codex's form: the summary and the sealed value, no content.
        assert replay({"type": "reasoning", "summary": [], "content": None,
                       "encrypted_content": sealed}) == with_text
        tampered = sealed[:-3] + ("AAA" if not sealed.endswith("AAA") else "BBB")
        for foreign in (tampered, seal("x")[:-1], "gAAAAABopaque-openai-value", 7):
            messages = replay({"type": "reasoning", "summary": [],
                               "encrypted_content": foreign})
            assert "reasoning_content" not in messages[1], foreign
    # Not asked for: not sent.
    out, _, _ = run_exchange(tokenizer, PIECES, False)
    assert "encrypted_content" not in out["output"][0]
