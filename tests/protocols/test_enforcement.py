"""Every field that asks for enforcement, on every protocol, is enforced or
refused: never accepted and ignored (found by six client libraries:
/v1/messages answered the top-level `output_format` of Anthropic's
structured-outputs beta, which litellm sends, with unconstrained text).

A random fixture model writes garbage: a 200 whose output holds to what
was asked is enforcement (an ignored field would show as invalid output),
a 4xx in the protocol's shape is a refusal. Each case says which it must be.
"""

import json

import jsonschema
import pytest

from compat.launch import OURS, ServerProcess, parse_sse
from mlx_lm_plus.protocols.assembler import partial_json

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
          "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": WEATHER}}
              for n in ("get_weather", "get_time")]
RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": WEATHER}
                   for n in ("get_weather", "get_time")]
MESSAGES_TOOLS = [{"name": n, "input_schema": WEATHER} for n in ("get_weather", "get_time")]
OFF = {"enable_thinking": False}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**kw):
    return {"messages": USER, "max_tokens": 60, "chat_template_kwargs": OFF, **kw}


def message(**kw):
    return {"model": "claude-x", "max_tokens": 60, "thinking": {"type": "disabled"},
            "messages": USER, **kw}


def response(**kw):
    return {"model": "gpt-x", "max_output_tokens": 60, "reasoning": {"effort": "none"},
            "input": "Weather in Paris?", **kw}


def json_text(schema):
    """Check: the text is JSON valid for `schema`."""
    def check(text):
        jsonschema.validate(json.loads(text), schema)
    return check


def an_object(text):
    """Check: a JSON object, or the start of one where max_tokens cut it
    (nothing bounds a json_object: a random model writes one for ever)."""
    assert text.startswith("{") and isinstance(partial_json(text), dict), text


def a_call(names, schema=WEATHER):
    """Check: one call or more, each to one of `names`, arguments valid."""
    def check(calls):
        assert calls, "no tool call"
        for name, arguments in calls:
            assert name in names, name
            jsonschema.validate(json.loads(arguments), schema)
    return check


# (what, path, body, "enforced" check on the answer's (text, calls), or "refused")
CASES = [
    # chat completions
    ("chat response_format json_object", "/v1/chat/completions",
     chat(response_format={"type": "json_object"}), ("text", an_object)),
    ("chat response_format json_schema", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {
         "name": "w", "schema": SCHEMA, "strict": True}}), ("text", json_text(SCHEMA))),
    ("chat response_format json_schema, strict false", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {
         "name": "w", "schema": SCHEMA, "strict": False}}), ("text", json_text(SCHEMA))),
    ("chat tool_choice required", "/v1/chat/completions",
     chat(tools=CHAT_TOOLS, tool_choice="required"),
     ("calls", a_call({"get_weather", "get_time"}))),
    ("chat tool_choice named", "/v1/chat/completions",
     chat(tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
     ("calls", a_call({"get_time"}))),
    ("chat tool_choice allowed_tools", "/v1/chat/completions",
     chat(tools=CHAT_TOOLS, tool_choice={"type": "allowed_tools", "allowed_tools": {
         "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}),
     "refused"),
    ("chat custom tool with a grammar", "/v1/chat/completions",
     chat(tools=[{"type": "custom", "custom": {"name": "patch", "format": {
         "type": "grammar", "grammar": {"syntax": "lark", "definition": "start: \"x\""}}}}]),
     "refused"),
    *[(f"chat {field}", "/v1/chat/completions", chat(**{field: value}), "refused")
      for field, value in [("guided_json", SCHEMA), ("guided_regex", "[0-9]+"),
                           ("guided_choice", ["a", "b"]), ("guided_grammar", "root ::= \"x\""),
                           ("structured_outputs", {"json": SCHEMA}), ("json_schema", SCHEMA),
                           ("grammar", "root ::= \"x\"")]],
    # text completions
    ("text response_format json_schema", "/v1/completions",
     {"prompt": "Weather in Paris:", "max_tokens": 60, "response_format": {
         "type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
     ("text", json_text(SCHEMA))),
    ("text guided_json", "/v1/completions",
     {"prompt": "x", "max_tokens": 8, "guided_json": SCHEMA}, "refused"),
    # Anthropic Messages
    ("messages output_config.format", "/v1/messages",
     message(output_config={"format": {"type": "json_schema", "schema": SCHEMA}}),
     ("text", json_text(SCHEMA))),
    ("messages output_format (structured-outputs beta)", "/v1/messages",
     message(output_format={"type": "json_schema", "schema": SCHEMA}),
     ("text", json_text(SCHEMA))),
    ("messages output_format and output_config.format differing", "/v1/messages",
     message(output_format={"type": "json_schema", "schema": SCHEMA},
             output_config={"format": {"type": "json_schema", "schema": WEATHER}}), "refused"),
    ("messages output_format of another type", "/v1/messages",
     message(output_format={"type": "json_object"}), "refused"),
    ("messages tool_choice any", "/v1/messages",
     message(tools=MESSAGES_TOOLS, tool_choice={"type": "any"}),
     ("calls", a_call({"get_weather", "get_time"}))),
    ("messages tool_choice tool", "/v1/messages",
     message(tools=MESSAGES_TOOLS, tool_choice={"type": "tool", "name": "get_time"}),
     ("calls", a_call({"get_time"}))),
    *[(f"messages {field}", "/v1/messages", message(**{field: value}), "refused")
      for field, value in [("response_format", {"type": "json_object"}),
                           ("guided_json", SCHEMA)]],
    ("messages a server tool", "/v1/messages",
     message(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "refused"),
    # OpenAI Responses
    ("responses text.format json_schema", "/v1/responses",
     response(text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}),
     ("text", json_text(SCHEMA))),
    ("responses text.format json_object", "/v1/responses",
     response(text={"format": {"type": "json_object"}}), ("text", an_object)),
    ("responses tool_choice required", "/v1/responses",
     response(tools=RESPONSES_TOOLS, tool_choice="required"),
     ("calls", a_call({"get_weather", "get_time"}))),
    ("responses tool_choice function", "/v1/responses",
     response(tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "get_time"}),
     ("calls", a_call({"get_time"}))),
    ("responses allowed_tools required, one tool", "/v1/responses",
     response(tools=RESPONSES_TOOLS, tool_choice={"type": "allowed_tools", "mode": "required",
                                                  "tools": [{"type": "function",
                                                             "name": "get_time"}]}),
     ("calls", a_call({"get_time"}))),
    ("responses allowed_tools required, all the tools", "/v1/responses",
     response(tools=RESPONSES_TOOLS, tool_choice={"type": "allowed_tools", "mode": "required",
                                                  "tools": [{"type": "function", "name": n}
                                                            for n in ("get_weather",
                                                                      "get_time")]}),
     ("calls", a_call({"get_weather", "get_time"}))),
    ("responses allowed_tools auto, some of the tools", "/v1/responses",
     response(tools=RESPONSES_TOOLS, tool_choice={"type": "allowed_tools", "mode": "auto",
                                                  "tools": [{"type": "function",
                                                             "name": "get_time"}]}),
     "refused"),
    ("responses allowed_tools required, no tools", "/v1/responses",
     response(tool_choice={"type": "allowed_tools", "mode": "required", "tools": []}),
     "refused"),
    *[(f"responses {field}", "/v1/responses", response(**{field: value}), "refused")
      for field, value in [("response_format", {"type": "json_object"}),
                           ("guided_json", SCHEMA)]],
    ("chat an empty grammar asks for nothing", "/v1/chat/completions",
     chat(grammar="", max_tokens=2), ("text", lambda text: None)),
    ("responses a custom tool", "/v1/responses",
     response(tools=[{"type": "custom", "name": "patch", "format": {"type": "text"}}]),
     "refused"),
]


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("enforcement") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))], log=log) as s:
        yield s


def answer_of(path, body) -> tuple:
    """(text, [(tool name, arguments JSON)]) of a 200 answer on `path`."""
    if path == "/v1/chat/completions":
        m = body["choices"][0]["message"]
        return m.get("content") or "", [(c["function"]["name"], c["function"]["arguments"])
                                        for c in m.get("tool_calls") or ()]
    if path == "/v1/completions":
        return body["choices"][0]["text"], []
    if path == "/v1/messages":
        return ("".join(b["text"] for b in body["content"] if b["type"] == "text"),
                [(b["name"], json.dumps(b["input"])) for b in body["content"]
                 if b["type"] == "tool_use"])
    text = "".join(p["text"] for o in body["output"] if o["type"] == "message"
                   for p in o["content"])
    return text, [(o["name"], o["arguments"]) for o in body["output"]
                  if o["type"] == "function_call"]


def refused_in_shape(path, status, body):
    assert 400 <= status < 500, (status, body)
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["message"]
    elif path == "/v1/responses":
        assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    else:
        assert isinstance(body["error"], str) and body["error"]


@pytest.mark.parametrize("what,path,body,expect", CASES, ids=[c[0] for c in CASES])
def test_enforced_or_refused(server, what, path, body, expect):
    status, answer = server.post(path, body)
    if expect == "refused":
        refused_in_shape(path, status, answer)
        return
    assert status == 200, (what, answer)
    kind, check = expect
    text, calls = answer_of(path, answer)
    check(text if kind == "text" else calls)


def test_the_streams_hold_to_output_format_too(server):
    """The beta's output_format streamed: the text deltas make valid JSON."""
    status, headers, raw = server.request("POST", "/v1/messages", message(
        stream=True, output_format={"type": "json_schema", "schema": SCHEMA}))
    assert status == 200
    text = "".join(e["delta"].get("text", "") for kind, e in parse_sse(raw)
                   if isinstance(e, dict) and e.get("type") == "content_block_delta")
    jsonschema.validate(json.loads(text), SCHEMA)


def test_an_ignored_field_would_be_caught(server):
    """The check is real: without enforcement the fixture writes no such
    JSON (the same request, no output_format)."""
    status, answer = server.post("/v1/messages", message())
    text, _ = answer_of("/v1/messages", answer)
    with pytest.raises(Exception):
        json_text(SCHEMA)(text)
