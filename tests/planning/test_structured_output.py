"""Structured output end to end: response_format and forced tool calls through
a live server on the tiny qwen3 fixture, on /v1/chat/completions,
/v1/completions, /v1/messages (the `anthropic` SDK) and /v1/responses (the
`openai` SDK).

A random model writes garbage; constrained, it must write JSON valid for the
schema (testkit/schema_corpus.py), whatever else shares its batch. Thinking is
off (the fixture's Qwen3 template lets the model open <think> itself, and a
random model never closes it) except in the test of thinking. The engine is
tested directly in tests/planning/test_constraints.py; here, the wiring.
"""

import asyncio
import json

import aiohttp
import anthropic
import jsonschema
import openai
import pytest

from compat.launch import OURS, ServerProcess, parse_sse
from testkit.engine_harness import SEQUENTIAL
from testkit.schema_corpus import SCHEMAS, UNSUPPORTED
from tests.planning.test_constraints import FORMATS

OFF = {"enable_thinking": False}
CORPUS = dict(SCHEMAS)
MAX_TOKENS = 300

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
PARAMS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"The {n} tool.",
                                           "parameters": p}} for n, p in PARAMS.items()]
ANTHROPIC_TOOLS = [{"name": n, "description": f"The {n} tool.", "input_schema": p}
                   for n, p in PARAMS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": f"The {n} tool.",
                    "parameters": p, "strict": True} for n, p in PARAMS.items()]


def schema_format(schema, name="corpus"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def validate(text, schema):
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=FORMATS)
    return value


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3")), "--max-tokens", "64",
                              "--decode-concurrency", "48"], log=log) as s:
        yield s


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def post_all(server, requests):
    """[(path, body)] sent concurrently -> [(status, answer)]; a streamed
    answer is folded into the non-streamed shape (content, finish_reason,
    tool_calls; an in-stream error as {"error": ...})."""

    async def one(session, path, body):
        async with session.post(server.url + path, json=body) as r:
            raw = await r.read()
            if r.status != 200 or not body.get("stream"):
                return r.status, json.loads(raw)
            return r.status, fold_stream(raw)

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*[one(session, p, b) for p, b in requests])

    return asyncio.run(run())


def fold_stream(raw):
    content, reasoning, finish, calls, text = "", "", None, {}, None
    for kind, event in parse_sse(raw):
        if kind != "data" or event == "[DONE]":
            continue
        if "error" in event:
            return {"error": event["error"]}
        for choice in event.get("choices", []):
            if "text" in choice:  # a text completion
                text = (text or "") + choice["text"]
            delta = choice.get("delta", {})
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    if text is not None:
        return {"choices": [{"finish_reason": finish, "text": text}]}
    message = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [{"type": "function", "function": calls[i]} for i in sorted(calls)]
    return {"choices": [{"finish_reason": finish, "message": message}]}


def chat_body(text, max_tokens=MAX_TOKENS, **kw):
    return {"messages": user(text), "max_tokens": max_tokens, "chat_template_kwargs": OFF, **kw}


def assert_serves(server):
    """The server is healthy and still answers a constrained request."""
    assert server.get("/health") == (200, {"status": "ok"})
    status, r = server.post("/v1/chat/completions", chat_body(
        "Still there?", response_format=schema_format(CORPUS["booleans"])))
    assert status == 200, r
    assert r["choices"][0]["finish_reason"] == "stop"
    validate(r["choices"][0]["message"]["content"], CORPUS["booleans"])


# -- 1. the corpus, concurrently ----------------------------------------------------


def test_chat_corpus_concurrently(server):
    """Every corpus schema and json_object at once (they share batches; every
    third one streamed): whatever finishes ("stop") is valid for its schema."""
    requests = [(name, chat_body(f"Answer in JSON, please ({i}).", stream=i % 3 == 0,
                                 response_format=schema_format(schema)))
                for i, (name, schema) in enumerate(SCHEMAS)]
    requests += [(f"json_object {i}", chat_body(f"Any JSON object ({i}).", stream=i == 1,
                                                response_format={"type": "json_object"}))
                 for i in range(3)]
    answers = post_all(server, [("/v1/chat/completions", b) for _, b in requests])
    finished = 0
    for (name, _), (status, r) in zip(requests, answers):
        assert status == 200 and "error" not in r, (name, r)
        choice = r["choices"][0]
        text = choice["message"]["content"]
        assert "reasoning" not in choice["message"], (name, choice)  # thinking is off
        if choice["finish_reason"] == "stop":
            finished += 1
            if name.startswith("json_object"):
                assert isinstance(json.loads(text), dict), (name, text)
            else:
                validate(text, CORPUS[name])
        else:
            assert choice["finish_reason"] == "length", (name, choice)
    # Not vacuous: constrained, a random model finishes nearly everything.
    assert finished >= 0.9 * len(requests), finished


def test_text_completion_json_schema(server):
    """/v1/completions reads response_format too, here on raw prompts that end
    with a closed think block (plain prompts: the next test)."""
    names = ["person", "nested_address", "refs_defs", "enum_strings", "array_of_objects"]
    answers = post_all(server, [("/v1/completions", {
        "prompt": f"Question {i}: give me a {name} as JSON.\nAnswer: <think>\n\n</think>\n\n",
        "max_tokens": MAX_TOKENS, "stream": i == 0,
        "response_format": schema_format(CORPUS[name])}) for i, name in enumerate(names)])
    for name, (status, r) in zip(names, answers):
        assert status == 200 and "error" not in r, r
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop", (name, choice)
        validate(choice["text"], CORPUS[name])


def test_text_completion_json_schema_plain_prompt(server):
    """A raw prompt is constrained from its first token: <think> is not
    offered (it was, and the fixture took it: text '' and "length")."""
    status, r = server.post("/v1/completions", {
        "prompt": "person please", "max_tokens": 200,
        "response_format": schema_format(CORPUS["person"])})
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    validate(choice["text"], CORPUS["person"])


# -- 2. batch independence ------------------------------------------------------------


def test_batch_independence(server):
    """Constrained and unconstrained requests sent together give what each
    gives alone (greedy), and the unconstrained ones stay free text."""
    bodies = [
        chat_body("Who is she? Reply in JSON.", 96,
                  response_format=schema_format(CORPUS["person"])),
        chat_body("Tell me a short story about the river and the boat at night.", 96),
        chat_body("Where does he live?", 96,
                  response_format=schema_format(CORPUS["nested_address"])),
        chat_body("Count the stars.", 96),
        chat_body("Any object.", 96, response_format={"type": "json_object"}),
        chat_body("A forced call.", 96, tools=TOOLS, tool_choice="required"),
    ]
    together = post_all(server, [("/v1/chat/completions", b) for b in bodies])
    alone = [server.post("/v1/chat/completions", b) for b in bodies]

    def key(answer):
        status, r = answer
        assert status == 200, r
        choice = r["choices"][0]
        return choice["finish_reason"], choice["message"].get("content"), json.dumps(
            [c["function"] for c in choice["message"].get("tool_calls") or []])

    assert [key(a) for a in together] == [key(a) for a in alone]
    (f0, t0, _), (_, free1, _), (f2, t2, _), (_, free3, _) = [key(a) for a in together[:4]]
    assert f0 == f2 == "stop", (t0, t2)
    validate(t0, CORPUS["person"])
    validate(t2, CORPUS["nested_address"])
    for free in (free1, free3):
        with pytest.raises(ValueError):
            json.loads(free)
    assert key(together[5])[0] == "tool_calls"


# -- 3. forced tool calls ---------------------------------------------------------------


def test_chat_forced_tool_calls(server):
    cases = [("required", "required", False), ("required", "required", True),
             ("get_weather", {"type": "function", "function": {"name": "get_weather"}}, False),
             ("add", {"type": "function", "function": {"name": "add"}}, True)]
    answers = post_all(server, [("/v1/chat/completions", chat_body(
        f"Use a tool ({i}).", 120, tools=TOOLS, tool_choice=choice, stream=stream))
        for i, (_, choice, stream) in enumerate(cases)])
    for (name, _, stream), (status, r) in zip(cases, answers):
        assert status == 200, r
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (name, stream, choice)
        (call,) = choice["message"]["tool_calls"]
        fn = call["function"]
        if name != "required":
            assert fn["name"] == name
        validate(fn["arguments"], PARAMS[fn["name"]])


def _strict(tools, strict=True):
    return [{**t, "function": {**t["function"], "strict": strict}} for t in tools]


def test_chat_strict_tools_when_the_model_chooses_to_call(server, fixture_path):
    """tool_choice auto with strict tools: the model writes freely and calls
    when it chooses (a logit_bias on <tool_call> makes the random model call
    at once and again after each call); every call it makes is valid for its
    tool's schema. Without strict the same calls are the random model's own
    garbage; with strict but no bias (and no call), the text is what
    tool_choice "none" (the same prompt, unconstrained) gives."""
    from mlx_lm.utils import load_tokenizer

    open_id = load_tokenizer(fixture_path("qwen3")).convert_tokens_to_ids("<tool_call>")
    bias = {str(open_id): 30}
    bodies = [chat_body(f"Call something ({i}).", 200, tools=_strict(TOOLS), logit_bias=bias,
                        stream=stream) for i, stream in enumerate([False, True])]
    bodies.append(chat_body("Call something (0).", 200, tools=_strict(TOOLS, False),
                            logit_bias=bias))
    bodies.append(chat_body("Just talk.", 60, tools=_strict(TOOLS)))
    bodies.append(chat_body("Just talk.", 60, tools=_strict(TOOLS), tool_choice="none"))
    # response_format text is no format: the calls are still held.
    bodies.append(chat_body("Call something (2).", 200, tools=_strict(TOOLS), logit_bias=bias,
                            response_format={"type": "text"}))
    answers = post_all(server, [("/v1/chat/completions", b) for b in bodies])
    for status, r in answers:
        assert status == 200, r
    for status, r in answers[:2] + answers[5:]:
        calls = r["choices"][0]["message"].get("tool_calls")
        assert calls, r
        if r["choices"][0]["finish_reason"] == "length":
            # (The call max_tokens cut off comes back as far as it went.)
            assert calls[-1]["function"]["name"] in PARAMS
            calls = calls[:-1]
        for call in calls:
            fn = call["function"]
            validate(fn["arguments"], PARAMS[fn["name"]])
    loose = answers[2][1]["choices"][0]["message"]
    assert loose.get("tool_calls") is None or not all(
        _valid_call(c["function"]) for c in loose["tool_calls"]), loose
    assert answers[3][1]["choices"][0]["message"] == answers[4][1]["choices"][0]["message"]


def test_chat_strict_tools_the_model_cant_hold_are_served(server):
    """Strict tools are best effort: a tool list the grammar can't take (a
    name with a dot) is served unconstrained, where forcing it is a 400."""
    odd = [{"type": "function", "function": {"name": "ns.tool", "parameters": ADD,
                                             "strict": True}}]
    status, r = server.post("/v1/chat/completions", chat_body("Call it.", 20, tools=odd))
    assert status == 200, r
    status, r = server.post("/v1/chat/completions", chat_body(
        "Call it.", 20, tools=odd, tool_choice="required"))
    assert status == 400 and "function name" in json.dumps(r), r
    assert_serves(server)


def _valid_call(fn):
    try:
        validate(fn["arguments"], PARAMS[fn["name"]])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def test_anthropic_forced_tool_use_round_trip(claude):
    question = user("What is the weather in Paris?")
    message = claude.messages.create(
        model="m", max_tokens=100, thinking={"type": "disabled"}, tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"}, messages=question)
    assert message.stop_reason == "tool_use", message
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER, format_checker=FORMATS)

    # {"type": "any"}: some tool, valid for its own schema.
    anyone = claude.messages.create(
        model="m", max_tokens=100, thinking={"type": "disabled"}, tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"}, messages=user("Add two numbers."))
    assert anyone.stop_reason == "tool_use", anyone
    (other,) = [b for b in anyone.content if b.type == "tool_use"]
    jsonschema.validate(other.input, PARAMS[other.name], format_checker=FORMATS)

    # Streamed: the SDK assembles the same block from input_json deltas.
    with claude.messages.stream(
            model="m", max_tokens=100, thinking={"type": "disabled"}, tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"}, messages=question) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == \
        [(b.type, b.name, b.input) for b in message.content]

    # The round trip: the tool_use goes back with its result; a text answer.
    answer = claude.messages.create(
        model="m", max_tokens=24, thinking={"type": "disabled"}, tools=ANTHROPIC_TOOLS,
        messages=question + [
            {"role": "assistant", "content": message.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                          "content": "Sunny, 21 degrees."}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens"), answer
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    assert answer.usage.cache_read_input_tokens > 0  # the first exchange's prefix


def test_anthropic_output_format(claude):
    for name in ("nested_address", "refs_defs"):
        schema = CORPUS[name]
        message = claude.messages.create(
            model="m", max_tokens=MAX_TOKENS, thinking={"type": "disabled"},
            messages=user(f"Describe a {name}."),
            output_config={"format": {"type": "json_schema", "schema": schema}})
        assert message.stop_reason == "end_turn", message
        (block,) = message.content
        assert block.type == "text"
        validate(block.text, schema)


def test_responses_forced_function_call_round_trip(oai):
    response = oai.responses.create(
        model="m", max_output_tokens=100, reasoning={"effort": "none"}, tools=RESPONSES_TOOLS,
        tool_choice="required", input="What is the weather in Paris?")
    assert response.status == "completed", response
    (call,) = [o for o in response.output if o.type == "function_call"]
    validate(call.arguments, PARAMS[call.name])

    named = oai.responses.create(
        model="m", max_output_tokens=100, reasoning={"effort": "none"}, tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "add"}, input="Add them.")
    (add,) = [o for o in named.output if o.type == "function_call"]
    assert add.name == "add"
    validate(add.arguments, ADD)

    # Back with previous_response_id, and statelessly with the items.
    followup = oai.responses.create(
        model="m", max_output_tokens=16, reasoning={"effort": "none"}, tools=RESPONSES_TOOLS,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}])
    stateless = oai.responses.create(
        model="m", max_output_tokens=16, reasoning={"effort": "none"}, tools=RESPONSES_TOOLS,
        store=False, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}])
    for r in (followup, stateless):
        assert [o.type for o in r.output] == ["message"], r
        assert r.output_text
    assert followup.output_text == stateless.output_text  # the same prompt
    assert stateless.usage.input_tokens_details.cached_tokens > 0


def test_responses_text_format(oai):
    schema = CORPUS["openai_strict_style"]
    response = oai.responses.create(
        model="m", max_output_tokens=MAX_TOKENS, reasoning={"effort": "none"},
        input="Make a todo item.",
        text={"format": {"type": "json_schema", "name": "todo", "schema": schema,
                         "strict": True}})
    assert response.status == "completed", response
    validate(response.output_text, schema)
    assert response.text.format.type == "json_schema"  # echoed

    events = list(oai.responses.create(
        model="m", max_output_tokens=MAX_TOKENS, reasoning={"effort": "none"},
        input="Make a todo item.", stream=True,
        text={"format": {"type": "json_schema", "name": "todo", "schema": schema,
                         "strict": True}}))
    assert events[-1].type == "response.completed", events[-1]
    assert events[-1].response.output_text == response.output_text  # greedy: the same

    obj = oai.responses.create(model="m", max_output_tokens=MAX_TOKENS,
                               reasoning={"effort": "none"}, input="Any JSON object.",
                               text={"format": {"type": "json_object"}})
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    else:  # a random model may write one key for ever
        assert obj.output_text.startswith("{")


# -- 4. errors --------------------------------------------------------------------------


def test_chat_unsupported_schemas_are_400(server):
    for name, response_format, reason in UNSUPPORTED:
        status, r = server.post("/v1/chat/completions",
                                chat_body("x", 8, response_format=response_format))
        assert status == 400, (name, r)
        assert reason in r["error"], (name, r)
    # Text completions too, streamed or not.
    for stream in (False, True):
        status, r = server.post("/v1/completions", {
            "prompt": "x", "max_tokens": 8, "stream": stream,
            "response_format": schema_format({"type": "array", "uniqueItems": True})})
        assert status == 400 and "uniqueItems" in r["error"], r
    assert_serves(server)


def test_chat_bad_tool_choice_is_400(server):
    status, r = server.post("/v1/chat/completions", chat_body("x", 8, tool_choice="required"))
    assert status == 400 and "no tools" in r["error"], r
    for stream in (False, True):
        status, r = server.post("/v1/chat/completions", chat_body(
            "x", 8, stream=stream, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}}))
        assert status == 400 and "'nope'" in r["error"], (stream, r)
    status, r = server.post("/v1/chat/completions", chat_body(
        "x", 8, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "a b"}}))
    assert status == 400, r
    assert_serves(server)


def test_a_bad_request_beside_good_ones(server):
    """A 400 does not disturb requests decoding at the same time."""
    good = chat_body("Who?", response_format=schema_format(CORPUS["person"]))
    bad = chat_body("x", response_format=schema_format({"type": "array", "contains": {}}))
    answers = post_all(server, [("/v1/chat/completions", b) for b in (good, bad, good)])
    assert [s for s, _ in answers] == [200, 400, 200]
    assert answers[0][1]["choices"] == answers[2][1]["choices"]
    validate(answers[0][1]["choices"][0]["message"]["content"], CORPUS["person"])


def test_anthropic_errors(server, claude):
    for name, response_format, reason in UNSUPPORTED:
        schema = (response_format.get("json_schema") or {}).get("schema") \
            if isinstance(response_format, dict) else None
        if not isinstance(schema, dict) or name in ("bad_name", "bad_strict"):
            continue  # malformed OpenAI bodies: no Anthropic equivalent
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="m", max_tokens=8, messages=user("x"),
                                   output_config={"format": {"type": "json_schema",
                                                             "schema": schema}})
        assert reason in e.value.message, (name, e.value.message)
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        claude.messages.create(model="m", max_tokens=8, messages=user("x"),
                               output_config={"format": {"type": "json_object"}})
    with pytest.raises(anthropic.BadRequestError, match="no tools"):
        claude.messages.create(model="m", max_tokens=8, messages=user("x"),
                               tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="nope"):
        claude.messages.create(model="m", max_tokens=8, messages=user("x"),
                               tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert_serves(server)


def test_responses_errors(server, oai):
    unique = {"type": "array", "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", max_output_tokens=8, input="x", text={"format": {
            "type": "json_schema", "name": "bad", "schema": unique}})
    assert "uniqueItems" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", max_output_tokens=8, input="x", text={"format": {
            "type": "json_schema", "name": "bad", "schema": {"$ref": "#/$defs/missing"}}})
    assert "does not exist" in e.value.message
    with pytest.raises(openai.BadRequestError, match="nope"):
        oai.responses.create(model="m", max_output_tokens=8, input="x", tools=RESPONSES_TOOLS,
                             tool_choice={"type": "function", "name": "nope"})
    assert_serves(server)


def test_responses_required_without_tools_is_400(oai):
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="m", max_output_tokens=8, input="x",
                             reasoning={"effort": "none"}, tool_choice="required")


# -- 5. max_tokens too small -------------------------------------------------------------


def test_max_tokens_too_small_gives_length(server):
    address = schema_format(CORPUS["nested_address"])
    answers = post_all(server, [
        ("/v1/chat/completions", chat_body("Where?", 6, response_format=address)),
        ("/v1/chat/completions", chat_body("Where?", 6, stream=True, response_format=address)),
        ("/v1/chat/completions", chat_body("Call.", 4, tools=TOOLS, tool_choice="required")),
    ])
    for status, r in answers:
        assert status == 200, r
        assert r["choices"][0]["finish_reason"] == "length", r
    assert answers[0][1]["usage"]["completion_tokens"] == 6
    assert answers[0][1]["choices"][0]["message"]["content"].startswith('{"name": "')
    assert answers[0][1]["choices"][0]["message"]["content"] == \
        answers[1][1]["choices"][0]["message"]["content"]


def test_a_forced_call_cut_off_is_returned_as_far_as_it_goes(server, claude, oai):
    """Found by openai-agents: a forced tool call cut off by max_tokens came
    back as content null, no tool_calls, finish_reason "length" (the tokens
    lost). On every protocol, streamed or not, the call comes back as far
    as the model wrote it, as OpenAI and Anthropic return one: its name,
    and arguments that are a prefix of the whole call's (greedy: the same
    tokens), with the protocol's length stop."""
    forced = {"tools": TOOLS, "tool_choice": {"type": "function",
                                              "function": {"name": "get_weather"}}}
    whole, cut, cut_stream = post_all(server, [
        ("/v1/chat/completions", chat_body("Weather?", 100, **forced)),
        ("/v1/chat/completions", chat_body("Weather?", 25, **forced)),
        ("/v1/chat/completions", chat_body("Weather?", 25, stream=True, **forced))])
    full = whole[1]["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    validate(full, WEATHER)
    for status, r in (cut, cut_stream):
        choice = r["choices"][0]
        assert status == 200 and choice["finish_reason"] == "length", r
        (call,) = choice["message"]["tool_calls"]
        partial = call["function"]["arguments"]
        assert call["function"]["name"] == "get_weather"
        assert 0 < len(partial) < len(full) and full.startswith(partial), (partial, full)
        assert choice["message"]["content"] is None

    # Cut in the forced tool's name, of a prefix two tools share ("get_"):
    # the forced one's name, never a made-up one (found in review).
    names = set()
    for n in range(6, 12):
        status, r = post_all(server, [("/v1/chat/completions", chat_body(
            "Time?", n, tools=TOOLS + [{"type": "function", "function": {
                "name": "get_time", "parameters": WEATHER}}],
            tool_choice={"type": "function", "function": {"name": "get_time"}}))])[0]
        names |= {c["function"]["name"] for c in r["choices"][0]["message"].get("tool_calls") or ()}
        assert r["choices"][0]["message"]["content"] is None, r  # (no markup as text)
    assert names == {"get_time"}

    # Responses: the function_call item, incomplete; the response incomplete.
    for stream in (False, True):
        kw = dict(model="m", max_output_tokens=25, reasoning={"effort": "none"},
                  tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                  input="Weather?")
        if stream:  # (the SDK's stream helper waits for response.completed only)
            ends = [e.response for e in oai.responses.create(stream=True, **kw)
                    if e.type in ("response.completed", "response.incomplete")]
            (response,) = ends
        else:
            response = oai.responses.create(**kw)
        assert response.status == "incomplete", response
        assert response.incomplete_details.reason == "max_output_tokens"
        (item,) = [o for o in response.output if o.type == "function_call"]
        assert item.name == "get_weather" and item.status == "incomplete"
        assert item.arguments and not item.arguments.endswith("}")
        # ... and a continuation of it is served (its arguments as far as they parse).
        more = oai.responses.create(model="m", max_output_tokens=2, previous_response_id=
                                    response.id, reasoning={"effort": "none"},
                                    input=[{"type": "function_call_output",
                                            "call_id": item.call_id, "output": "sunny"}])
        assert more.status in ("completed", "incomplete"), more

    # Messages: a tool_use block with the input so far; stop_reason max_tokens.
    kw = dict(model="m", max_tokens=25, thinking={"type": "disabled"}, tools=ANTHROPIC_TOOLS,
              tool_choice={"type": "tool", "name": "get_weather"}, messages=user("Weather?"))
    message = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as events:
        streamed = events.get_final_message()
    for m in (message, streamed):
        assert m.stop_reason == "max_tokens", m
        (block,) = [b for b in m.content if b.type == "tool_use"]
        assert block.name == "get_weather" and isinstance(block.input, dict)
        assert set(block.input) <= set(WEATHER["properties"])
    assert [b.input for b in message.content] == [b.input for b in streamed.content]
    assert_serves(server)


# -- 6. the prompt cache ----------------------------------------------------------------------


def test_constrained_prompt_reuses_the_cache(server):
    prompt = "A unique question about the cache and the grammar, number 7731."
    status, free = server.post("/v1/chat/completions", chat_body(prompt, 4))
    assert status == 200, free
    status, r = server.post("/v1/chat/completions", chat_body(
        prompt, 40, response_format=schema_format(CORPUS["booleans"])))
    assert status == 200, r
    u = r["usage"]
    assert u["prompt_tokens"] == free["usage"]["prompt_tokens"]
    assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] - 1
    validate(r["choices"][0]["message"]["content"], CORPUS["booleans"])

    # And the other way round, with tools: forced call first, then "auto".
    body = chat_body("Another unique question, 99121.", 60, tools=TOOLS)
    status, forced = server.post("/v1/chat/completions", {**body, "tool_choice": "required"})
    assert forced["choices"][0]["finish_reason"] == "tool_calls", forced
    status, auto = server.post("/v1/chat/completions", {**body, "max_tokens": 4})
    u = auto["usage"]
    assert u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] - 1


# -- 7. thinking -------------------------------------------------------------------------------


def test_thinking_on_with_a_schema(server):
    """Thinking left on: the grammar applies after </think>. The fixture may
    open <think> itself (offered next to the JSON's first token) and then
    never close it: such an answer is all reasoning (unconstrained), cut by
    max_tokens; else the content is the JSON, valid once finished. Either way
    a well-formed answer, never an error."""
    schema = CORPUS["person"]
    answers = post_all(server, [("/v1/chat/completions", {
        "messages": user(f"Think first, then answer ({i})."), "max_tokens": 60, "stream": i == 0,
        "response_format": schema_format(schema)}) for i in range(6)])
    shapes = []
    for status, r in answers:
        assert status == 200 and "error" not in r, r
        choice = r["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] in ("stop", "length"), choice
        if message.get("content"):
            assert message["content"].startswith("{"), choice  # constrained
            if choice["finish_reason"] == "stop":
                validate(message["content"], schema)
            shapes.append("json")
        else:  # still thinking when it ended: the grammar never applied
            assert message.get("reasoning"), choice
            shapes.append("reasoning")
    assert len(shapes) == 6  # (how many of each depends on the fixture's weights)


# -- the sequential path (SEQUENTIAL) ----------------------------------------------------------------


def test_seeded_response_format(server):
    """On the engine's sequential path."""
    names = ["person", "booleans", "refs_defs"]
    for name in names:
        status, r = server.post("/v1/chat/completions", chat_body(
            f"Give me {name}", 120, **SEQUENTIAL, response_format=schema_format(CORPUS[name])))
        assert status == 200, r
        assert r["choices"][0]["finish_reason"] == "stop", r
        validate(r["choices"][0]["message"]["content"], CORPUS[name])


def test_seeded_forced_tool_call_after_a_cache_hit(server):
    body = chat_body("Use a tool, the seeded one.", 100, tools=TOOLS)
    status, warm = server.post("/v1/chat/completions", {**body, "max_tokens": 2})
    assert status == 200, warm
    status, r = server.post("/v1/chat/completions", {**body, **SEQUENTIAL, "tool_choice": "required"})
    assert status == 200, r
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == r["usage"]["prompt_tokens"] - 1
    assert r["choices"][0]["finish_reason"] == "tool_calls", r


# -- the benchmark, short form ------------------------------------------------------------------


def test_benchmark_smoke(fixture_path, capsys):
    """benchmarks/structured.py runs end to end (timings are not asserted)."""
    from benchmarks.structured import main

    report = main(["--model", str(fixture_path("qwen3")), "--repeats", "1",
                   "--max-tokens", "12", "--batch", "2"])
    (row,) = report["rows"]
    assert row["constrained json ok"]
    assert row["constrained tokens"] == row["free tokens"] == [12]
    assert row["ratio per request"] and row["ratio aggregate"] and row["ratio e2e"]
    assert report["mask_cost_llguidance"]["tokens"] > 100
    assert report["mask_cost_processor"]["steps"] >= 11
    assert "| batch |" in capsys.readouterr().out
