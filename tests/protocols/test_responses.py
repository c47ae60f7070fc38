"""Text, reasoning and tool calls assembled from per-token responses.

A random fixture model never emits <think> or <tool_call> (their logits are
zeroed), so the assembly is tested here on scripted token texts, with the
fixture's real tokenizer, TextStateMachine and tool parser.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.generate import make_text_state_machine
from mlx_lm.server import GenerationContext, Response

from mlx_lm_plus.protocols.assembler import CompletionAssembler, ResponseBuilder


@pytest.fixture(scope="module")
def tokenizer(fixture_path):
    return load(str(fixture_path("qwen3")))[1]


def ctx_for(tokenizer, initial_state="normal"):
    return GenerationContext(
        has_tool_calling=tokenizer.has_tool_calling,
        has_thinking=tokenizer.has_thinking,
        tool_parser=tokenizer.tool_parser,
        text_sm=make_text_state_machine(tokenizer),
        initial_state=initial_state,
        prompt=[1, 2, 3],
    )


def feed(assembler, pieces, finish="stop"):
    chunks = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        if assembler.add(Response(piece, i, -0.5, finish if last else None, ())):
            chunks.append(assembler.take_delta())
    assembler.finish()
    return chunks


TOOL_PIECES = ["Let me", " check.", "<tool_call>", '\n{"name": "get_weather", ',
               '"arguments": {"city": "Paris"}}\n', "</tool_call>", ""]


def test_tool_call_non_streaming(tokenizer):
    a = CompletionAssembler(ctx_for(tokenizer), None, False, False, -1)
    feed(a, TOOL_PIECES)
    assert a.finish_reason == "tool_calls"
    assert a.text == "Let me check."
    (call,) = a.format_tool_calls(a.tool_calls)
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert "index" not in call


def test_tool_call_streaming_deltas(tokenizer):
    a = CompletionAssembler(ctx_for(tokenizer), None, True, False, -1)
    chunks = feed(a, TOOL_PIECES)
    text = "".join(c[0] for c in chunks)
    calls = [call for c in chunks for call in c[1]]
    assert text == "Let me check."
    (call,) = calls
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert a.finish_reason == "tool_calls"


def test_reasoning_split(tokenizer):
    a = CompletionAssembler(ctx_for(tokenizer), None, False, False, -1)
    feed(a, ["<think>", "The sky", " is blue.", "</think>", "Blue.", ""])
    assert (a.reasoning_text, a.text, a.finish_reason) == ("The sky is blue.", "Blue.", "stop")
    # A generation prompt that already opened <think> starts in "reasoning".
    a = CompletionAssembler(ctx_for(tokenizer, "reasoning"), None, False, False, -1)
    feed(a, ["Hmm.", "</think>", "Yes."], finish="length")
    assert (a.reasoning_text, a.text, a.finish_reason) == ("Hmm.", "Yes.", "length")


def test_message_shape_with_reasoning_and_tools():
    b = ResponseBuilder("chatcmpl-1", "chat.completion", "m", 1, "fp", False)
    r = b.response("", "tool_calls", 5, 2, 3, reasoning_text="why",
                   tool_calls=[{"id": "x", "type": "function", "function": {}}])
    msg = r["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": None, "reasoning": "why",
                   "tool_calls": [{"id": "x", "type": "function", "function": {}}]}
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": 3}}


@given(st.text(min_size=1))
@settings(max_examples=200, deadline=None)
def test_text_chunk_is_the_response_serialized(text):
    """The per-token fast path writes the same bytes as the general one."""
    for object_type in ("chat.completion.chunk", "text_completion"):
        builder = ResponseBuilder("chatcmpl-1", object_type, 'm"o\u00e9', 7, "fp", True)
        assert builder.text_chunk(text) == (
            f"data: {json.dumps(builder.response(text, None))}\n\n".encode())


def test_partial_json_of_what_was_cut_off():
    from mlx_lm_plus.protocols.assembler import PARTIAL_JSON_CHARS, partial_json

    assert partial_json('{"city": "Pa') == {"city": "Pa"}
    assert partial_json('{"city": "Paris", "days": [1, 2') == {"city": "Paris", "days": [1, 2]}
    assert partial_json('{"a": {"b": tr') == {"a": {}}
    assert partial_json('[{"a": 1, "b": 2}, [3, 4') == [{"a": 1, "b": 2}, [3, 4]]
    assert partial_json('{"a": "x\\') == {}  # (cut in an escape: the member goes)
    assert partial_json("nonsense") is None
    # Found in review: every place a cut could go was built and tried
    # (quadratic: a 120 KB text took 5 GB and 10 s), and deep nesting raised
    # RecursionError (a 500). Now a few places are tried, in linear time.
    assert partial_json('{"a": x, "b": [' + "1," * 100_000) == {}
    assert partial_json("[" * 3000) == []
    assert partial_json('{"values": [' + "12, " * 60_000)["values"][:2] == [12, 12]
    assert partial_json("[" + " " * PARTIAL_JSON_CHARS) is None


def test_a_cut_off_call_keeps_its_name():
    from mlx_lm_plus.protocols.assembler import TruncatedCall

    names = ["get_weather", "get_time"]
    call = TruncatedCall.of('\n{"name": "get_weather", "arguments": {"city": "Ro', names)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Ro')
    # Cut in the name: the one tool it begins; before the arguments: none.
    # Found in review: a prefix of several tools came back as a call named
    # "get_", which no tool is; now no call (the forced one's name, where
    # tool_choice forces one: the assembler passes that one alone).
    assert TruncatedCall.of('\n{"name": "get_wea', names) == TruncatedCall("get_weather", "")
    assert TruncatedCall.of('\n{"name": "get_', names) is None
    assert TruncatedCall.of('\n{"name": "get_', ["get_time"]) == TruncatedCall("get_time", "")
    assert TruncatedCall.of('\n{"name": "nope', names) is None
    # Cut before any of the name (spaced or not): the only tool, else no call.
    assert TruncatedCall.of('\n{"na', ["add"]) == TruncatedCall("add", "")
    assert TruncatedCall.of('{"name":', ["add"]) == TruncatedCall("add", "")
    assert TruncatedCall.of('\n{"na', names) is None


def test_tool_calls_of_any_json_the_model_wrote():
    """Found in review: a call without arguments (a tool that takes none)
    or JSON of another shape raised KeyError/TypeError (a 500)."""
    import json as json_module

    from mlx_lm_plus.protocols.assembler import ToolCalls

    calls = ToolCalls(lambda text, tools: json_module.loads(text), None)
    assert [c["function"] for c in calls(['{"name": "f"}'])] == [{"name": "f", "arguments": "{}"}]
    assert calls(['{"foo": 1}', "[1]", '"abc"', "{"]) == []
