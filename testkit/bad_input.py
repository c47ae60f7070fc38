"""The bad-request corpus: bodies every server must answer with a 4xx JSON
error (in each protocol's shape) and survive.

CASES: chat and text completions (upstream's error shape); MESSAGES_CASES:
/v1/messages (Anthropic's); RESPONSES_CASES: /v1/responses (OpenAI's);
EMBEDDINGS_CASES: /v1/embeddings, and the chat endpoints asked of an
embedder; RERANK_CASES: /v1/rerank, /rerank and /v2/rerank. Each is a list
of (path, body), the body a dict or raw bytes. Used by
tests/protocols/test_bad_input.py, `python -m benchmarks.fuzz` (tried first)
and `python -m benchmarks.soak` (mixed into its traffic).

The first three name no model (or names no served one): the server's
default model answers, a chat model. The embedding cases name the models of
EMBEDDING_SERVED, the server they assume (`models_config_file` writes its
--models-config): "chat" first (the default), "embed" (bert_embed: an
encoder embedder, 64 dimensions, a 195-token vocabulary, a context of 128
tokens), "rerank" (qwen3_rerank: its prompt template alone is about 170
of its tokens) and "cross" (bert_rerank: a BERT cross-encoder, a context
of 128 tokens).
"""

import base64
import io
import json
import struct
import zlib
from pathlib import Path

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

EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
RERANK_PATHS = (RERANK, "/rerank", "/v2/rerank")
# The server the embedding cases assume: served name -> fixture kind
# (testkit/fixtures.py, testkit/embedding_fixtures.py), the default first.
EMBEDDING_SERVED = {"chat": "qwen3", "embed": "bert_embed", "rerank": "qwen3_rerank",
                    "cross": "bert_rerank"}
EMBED_MODEL, RERANK_MODEL, CROSS_MODEL = "embed", "rerank", "cross"
# The parser's bound on nesting (mlx_lm_plus/http/bodies.py MAX_JSON_DEPTH),
# and json's own limit (its recursion, about 1,000 levels).
MAX_JSON_DEPTH = 128


def models_config_file(path_of, folder, chat=None) -> Path:
    """Write the --models-config of EMBEDDING_SERVED into `folder`;
    `path_of(kind)` is a fixture's folder (tests/conftest.py fixture_path);
    `chat`, a model folder served as "chat" in place of its fixture."""
    paths = {name: chat if name == "chat" and chat else str(path_of(kind))
             for name, kind in EMBEDDING_SERVED.items()}
    path = Path(folder) / "embedding-models.json"
    path.write_text(json.dumps({"models": [{"name": name, "path": p}
                                           for name, p in paths.items()]}))
    return path


def embed(**kw):
    return {"model": EMBED_MODEL, "input": "hello", **kw}


def rerank(**kw):
    return {"model": RERANK_MODEL, "query": "q", "documents": ["a", "b"], **kw}


def deep(body: dict, levels: int, kind: str = "array") -> bytes:
    """`body` as JSON, its "DEEP" value nesting `levels` arrays (or objects)
    deep, written as text: json.dumps can't write the deep ones."""
    nested = ("[" * levels + "]" * levels if kind == "array"
              else '{"a": ' * levels + "0" + "}" * levels)
    return json.dumps(body).replace('"DEEP"', nested).encode()


# Past the parser's bound (a 400 however valid the rest), at json's own
# edge, and far past it; and just under the bound, where the body parses
# and each field's check refuses a list or an object where it wants a string
# or a number (the body sits a level or two up).
DEEP_LEVELS = (MAX_JSON_DEPTH - 4, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1,
               990, 1000, 100_000)
EMBED_DEEP_FIELDS = ("input", "model", "encoding_format", "dimensions", "user",
                     "prompt_name")
RERANK_DEEP_FIELDS = ("query", "documents", "model", "top_n", "return_documents",
                      "instruction")

EMBEDDINGS_CASES = [
    # input: missing, empty, the wrong types, ids out of range, too many
    (EMBEDDINGS, {"model": EMBED_MODEL}),
    *[(EMBEDDINGS, embed(input=value)) for value in [
        "", [], [""], ["ok", ""], [[]], ["ok", []], [["x"]], [[1, "a"]], [1, "a"],
        ["a", 1], [1.5], [1, 2.5], [[1.5]], [[1.0]], 1.5, 5, 0, True, False, None,
        {"text": "x"}, [{"text": "x"}], [None], [True], [[True]], [True, 1], [[[1]]],
        [-1], [[-1]], [1, -1], [[0, -5]], [195], [10**6], [2**63], [[10**30]],
        [[1], [10**9]], ["x"] * (2048 + 1), [[1]] * (2048 + 1), ["x"] * 100_000,
    ]],
    # longer than the model's context (128 tokens): as text, as ids, one of many
    (EMBEDDINGS, embed(input="word " * 200)),
    (EMBEDDINGS, embed(input=["ok", "word " * 200])),
    (EMBEDDINGS, embed(input=[5] * 129)),
    (EMBEDDINGS, embed(input=[[5], [5] * 129])),
    (EMBEDDINGS, embed(input=[5] * 100_000)),
    (EMBEDDINGS, embed(input=["word " * 200] * 2048)),  # (2 MB: the large lane)
    # the other fields
    *[(EMBEDDINGS, embed(**{field: value})) for field, value in [
        ("encoding_format", "int8"), ("encoding_format", "FLOAT"),
        ("encoding_format", "binary"), ("encoding_format", 5), ("encoding_format", True),
        ("encoding_format", ["float"]), ("encoding_format", {"type": "float"}),
        ("encoding_format", "e" * 5000),
        ("dimensions", 0), ("dimensions", -1), ("dimensions", -(2**63)), ("dimensions", 1.5),
        ("dimensions", 8.0), ("dimensions", "8"), ("dimensions", [8]), ("dimensions", True),
        ("dimensions", False), ("dimensions", {}), ("dimensions", 65), ("dimensions", 10**6),
        ("dimensions", 2**64), ("dimensions", 10**100),
        ("user", 5), ("user", ["u"]), ("user", {"id": 1}), ("user", True),
        ("prompt_name", "query"),  # (BERT's folder has no prompts)
        ("prompt_name", "nope"), ("prompt_name", 5), ("prompt_name", ["query"]),
        ("prompt_name", {}), ("prompt_name", True), ("prompt_name", "p" * 5000),
        ("model", 5), ("model", ["embed"]), ("model", {"name": "embed"}), ("model", True),
        ("model", 1.5), ("model", "nope"), ("model", ""), ("model", "m" * 5000),
        ("model", "/nonexistent/model"), ("model", "../../etc"),
    ]],
    # the wrong kind of model: the chat model (named, or the default when
    # none is) and the reranker for embeddings; the embedder for generation
    (EMBEDDINGS, embed(model="chat")),
    (EMBEDDINGS, embed(model=None)),
    (EMBEDDINGS, {"input": "hello"}),
    (EMBEDDINGS, embed(model=RERANK_MODEL)),
    (CHAT, chat(model=EMBED_MODEL)),
    (CHAT, chat(model=EMBED_MODEL, stream=True)),
    (CHAT, chat(model=RERANK_MODEL)),
    (TEXT, {"model": EMBED_MODEL, "prompt": "x", "max_tokens": 2}),
    ("/v1/messages", {"model": EMBED_MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages/count_tokens", {"model": EMBED_MODEL,
                                   "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": EMBED_MODEL, "max_output_tokens": 2, "input": "hi"}),
    ("/v1/responses", {"model": RERANK_MODEL, "max_output_tokens": 2, "input": "hi",
                       "stream": True}),
    # bodies that are no JSON object, numbers JSON has not
    *[(EMBEDDINGS, raw) for raw in [
        b"", b"{not json", b"[]", b'[{"model": "embed", "input": "x"}]', b'"hello"',
        b"null", b"42", b"true", b"\xff\xfe\x00{", b'{"model": "embed", "input": "x"',
        b'{"model": "embed", "input": "x"}]]]', b'{"model": "embed", "input": NaN}',
        b'{"model": "embed", "input": [NaN]}', b'{"model": "embed", "input": [Infinity]}',
        b'{"model": "embed", "input": "x", "dimensions": NaN}',
        b'{"model": "embed", "input": "x", "dimensions": Infinity}',
        b'{"model": "embed", "input": "x", "dimensions": 1e400}',
        b'{"model": "embed", "input": "x", "dimensions": ' + b"1" * 5000 + b"}",
        b'{"model": "embed", "input": [' + b"1" * 5000 + b"]}",
    ]],
    # nesting: every field, arrays and objects, around the parser's bound
    *[(EMBEDDINGS, deep(embed(**{field: "DEEP"}), levels, kind))
      for field in EMBED_DEEP_FIELDS for levels in DEEP_LEVELS
      for kind in ("array", "object")],
    *[(EMBEDDINGS, deep(embed(input=["ok", "DEEP"]), levels))
      for levels in DEEP_LEVELS],
    *[(EMBEDDINGS, deep(embed(extra="DEEP"), levels))
      for levels in DEEP_LEVELS if levels > MAX_JSON_DEPTH - 1],
]

RERANK_CASES = [
    # query
    (RERANK, {"model": RERANK_MODEL, "documents": ["a"]}),
    *[(RERANK, rerank(query=value)) for value in [
        "", None, 5, 1.5, True, ["q"], {"text": "q"}, [],
    ]],
    # documents
    (RERANK, {"model": RERANK_MODEL, "query": "q"}),
    *[(RERANK, rerank(documents=value)) for value in [
        [], None, "doc", 5, True, {"text": "a"}, {"0": "a"}, [5], [1.5], [None], [True],
        [["a"]], [{}], [{"text": 5}], [{"text": None}], [{"text": ["a"]}],
        [{"content": "a"}], [{"text": {"text": "a"}}], ["a", 5], ["a", {"title": "b"}],
        ["d"] * (2048 + 1), [{"text": "d"}] * (2048 + 1), ["d"] * 100_000,
    ]],
    # past the reranker's context (32,768 tokens), as the query or a document
    (RERANK, rerank(query="word " * 40_000)),
    (RERANK, rerank(documents=["ok", "word " * 40_000])),
    # past the tokens of a request (300,000): 2,048 prompts of ~470 tokens
    (RERANK, rerank(documents=["word " * 100] * 2048)),
    # the cross-encoder: no instruction; a pair past its 128 tokens; a
    # query of whitespace (no tokens for BERT, but work in every pair) or
    # past the context
    *[(path, rerank(model=CROSS_MODEL, **fields)) for path in RERANK_PATHS for fields in [
        {"instruction": "Find boats"}, {"documents": ["ok", "word " * 200]},
        {"query": "boats" + " " * 200_000, "documents": ["d"] * 2048},
        {"query": "word " * 200}, {"query": "\t\n " * 50_000},
    ]],
    # the other fields
    *[(path, rerank(**{field: value})) for path in RERANK_PATHS for field, value in [
        ("top_n", 0), ("top_n", -1), ("top_n", 1.5), ("top_n", 2.0), ("top_n", "2"),
        ("top_n", True), ("top_n", False), ("top_n", [1]), ("top_n", {}),
        ("return_documents", "yes"), ("return_documents", "false"), ("return_documents", 1),
        ("return_documents", 0), ("return_documents", [True]), ("return_documents", {}),
        ("instruction", 5), ("instruction", ["x"]), ("instruction", {"a": 1}),
        ("instruction", True),
        ("model", 5), ("model", ["rerank"]), ("model", {}), ("model", "nope"),
        ("model", "r" * 5000),
    ]],
    # the wrong kind of model: the embedder and the chat model (named, or
    # the default when none is)
    *[(path, rerank(model=model)) for path in RERANK_PATHS
      for model in (EMBED_MODEL, "chat", None)],
    (RERANK, {"query": "q", "documents": ["a"]}),
    # bodies
    *[(path, raw) for path in RERANK_PATHS for raw in [
        b"", b"{not json", b"[]", b'[{"query": "q", "documents": ["a"]}]', b'"q"', b"null",
        b"0", b"\xc3(", b'{"model": "rerank", "query": "q", "documents": ["a"]',
        b'{"model": "rerank", "query": "q", "documents": ["a"], "top_n": NaN}',
        b'{"model": "rerank", "query": "q", "documents": ["a"], "top_n": -Infinity}',
        b'{"model": "rerank", "query": "q", "documents": ["a"], "top_n": 1e400}',
        b'{"model": "rerank", "query": "q", "documents": [NaN]}',
    ]],
    # nesting: every field, and beside a document's text (valid under the
    # bound: only past it)
    *[(RERANK, deep(rerank(**{field: "DEEP"}), levels, kind))
      for field in RERANK_DEEP_FIELDS for levels in DEEP_LEVELS
      for kind in ("array", "object")],
    *[(RERANK, deep(rerank(documents=[{"text": "a", "meta": "DEEP"}]), levels))
      for levels in DEEP_LEVELS if levels > MAX_JSON_DEPTH],
    *[(RERANK, deep(rerank(documents=["a", "DEEP"]), levels)) for levels in DEEP_LEVELS],
]

# Lone surrogates (JSON's "\ud800" escapes: json.dumps writes them so) in
# every text the embedders tokenize: no tokenizer takes one (they got a 500
# from its TypeError before they were refused as chat refuses them).
EMBEDDINGS_CASES += [
    (EMBEDDINGS, embed(input="\ud800")),
    (EMBEDDINGS, embed(input=["ok", "a\udfffb"])),
]
RERANK_CASES += [
    (RERANK, rerank(query="\ud800")),
    (RERANK, rerank(documents=["a", "\udc00"])),
    (RERANK, rerank(documents=[{"text": "\ud83d"}])),
    (RERANK, rerank(instruction="\ud800")),
]
