"""Property-based fuzzing of the HTTP API (hypothesis) against a live server.

    python -m benchmarks.fuzz --examples 5000 [--kind qwen3] [--seed N]
                              [--allow-model-loading] [--model PATH] [--json out.json]
    python -m benchmarks.fuzz --embedders     # a chat model, an embedder and a reranker

Generates request bodies for every endpoint: completions bodies (every field
the server reads, set to valid values, to values of every JSON type, to
boundary numbers, to odd Unicode, with mixed content parts, broken base64 and
tiny real images), raw bodies (invalid JSON, non-UTF-8, empty, 10**5000,
NaN/Infinity literals, deep nesting, JSON that is not an object), bodies
of every protocol (chat, Messages, Responses; streamed or not) nesting
arrays at the server's bound and at json's own limit, and
GET/DELETE/OPTIONS/POST on the other routes. With --embedders the server
serves testkit/bad_input.py's EMBEDDING_SERVED (the chat fixture, an
embedder, a reranker), and /v1/embeddings and the rerank paths get bodies
too: every field valid, mutated to any JSON value, floods of 2,000 or more
inputs or documents, raw bodies nesting each field at the parser's edge,
and completions that name an embedder. Every FLOOD_EVERY batches, a
schema flood: FLOOD_SCHEMAS large distinct schemas at once, and a plain
request behind them that must be answered within FLOOD_PLAIN_SECONDS. One request in five carries an
odd header (Origin, Host, Content-Encoding...), one in eight sends its body
10 ms after its headers. The oracle, for each response:

  * the status is 2xx or 4xx: never 5xx (but upstream's 501 "Unsupported
    method" for DELETE/PUT/... on a path that doesn't take it), never a
    dropped connection, never a timeout (the client waits TIMEOUT seconds);
  * the body is strict JSON (no NaN/Infinity), with a string `error` on a 4xx;
    a 200 embeddings answer has a vector per input, of `dimensions` values;
    a 200 rerank answer has top_n results at most, best first, each
    scored in [0, 1] with a document's index (and its text by default);
    a 200 stream is SSE lines `data: <json>` / `data: [DONE]` / `: comment`,
    ending with [DONE] and without an error event (Messages and Responses:
    `event:` blocks ending with message_stop / response.completed or
    .incomplete), one response only; a 200 completion has
    choices and at most max_tokens completion tokens. The exceptions: 404
    bodies may be upstream's plain `Not Found` (api.py `not_found`), a request
    line or header over aiohttp's 8190 bytes gets its parser's plain 400,
    /metrics is Prometheus text and /dashboard HTML;
  * GET /health is 200 after every request;
  * every CHECK_EVERY requests, fixed greedy requests (a chat and a text
    completion; with --embedders, an embeddings and a rerank request too)
    get exactly the text (the first values, to 4 decimals) they got at the
    start.

A failure does not stop the run: each distinct one (by kind, status and the
exception the server logged) is kept with the smallest body that showed it,
then shrunk (keys, list items, string halves, simpler numbers) while it still
fails the same way. A server that is down, unhealthy or wedged is restarted
and the run goes on. Prints the requests tried per endpoint, the failures
with their minimal bodies, the health and canary checks and a verdict (exit
status 1 on any failure). tests/system/test_fuzz.py runs a short, seeded form.

The server gets --max-tokens-ceiling (64): a random fixture never stops by
itself, so a valid huge max_tokens would otherwise generate for hours.
HF_HUB_OFFLINE=1 keeps model names from reaching the network.
"""

import argparse
import base64
import http.client
import io
import json
import math
import re
import struct
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st

from compat.launch import OURS, ServerProcess
from testkit.bad_input import CROSS_MODEL, EMBED_MODEL, EMBEDDINGS, RERANK_MODEL, RERANK_PATHS

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
CHAT_ALIAS = "/chat/completions"
COMPLETION_PATHS = (CHAT, TEXT, CHAT_ALIAS)
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
# The server's bound on nesting (bodies.MAX_JSON_DEPTH), and json's own
# limit (the recursion limit, about 1,000): deep cases sit at both edges.
MAX_JSON_DEPTH = 128
TIMEOUT = 30.0
CHECK_EVERY = 25
TOKENS_CEILING = 64
SERVER_FLAGS = ["--max-tokens-ceiling", str(TOKENS_CEILING)]
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# Every field of a completions body the server reads (validation.py
# `_read_params`, `_stop_words`, `_completion_request`, `_validate_images`).
FIELDS = (
    "stream", "stream_options", "model", "draft_model", "adapters", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "repetition_context_size", "presence_penalty",
    "presence_context_size", "frequency_penalty", "frequency_context_size",
    "xtc_probability", "xtc_threshold", "logit_bias", "logprobs", "top_logprobs",
    "seed", "chat_template_kwargs", "stop", "messages", "tools", "role_mapping",
    "prompt", "num_draft_tokens",
)

# -- atoms ---------------------------------------------------------------------

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>"]
WEIRD_STRINGS = [
    "", " ", "\x00", "a\x00b", "\x00" * 8, "\t\r\n", "\u2028\u2029", "\x7f\x1b[31m",
    "\u202eevil\u202c", "\u200f\u05e9\u05dc\u05d5\u05dd\u200e", "\u0645\u0631\u062d\u0628\u0627",
    "\u200b\u200c\u200d\u2060\ufeff", "\ufeff", "\ufffd", "\uffff", "\U0010ffff", "\U000e0001",
    "\U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466", "\U0001f3f3\ufe0f\u200d\U0001f308",
    "\U0001f600", "e\u0301\u0301\u0301\u0301", "Z\u0334\u0327\u031b\u032d\u034ea\u0337l\u0338g\u0336o",
    "\u4f60\u597d\u4e16\u754c", "\u1100\u1161\u11a8", "\U0001d400\U0001d401", "\u00df\u0130\u0131",
    "null", "None", "NaN", "true", "0", "-1", "[]", "{}", "{{ 7 * 7 }}", "{% if %}", "%s%n%x",
    "\\u0000", "\\", "\"", "'", "</s>", "default_model", ".", "..", "/", "../../etc/passwd",
    "user", "assistant", "system", "tool", *SPECIAL_TOKENS,
]
LONG_UNITS = ["a", "ab ", "\u00e9", "\U0001f600", "\u200b", " ", "\n", "<|im_end|>", "\x00"]
BOUNDARY_NUMBERS = [
    0, 1, -1, 2, 3, 4, 0.0, -0.0, 0.5, 1.0, 1.5, -0.5, 0.1, 0.9, 11, 12, 20, 63, 64, 65,
    511, 512, 513, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63,
    -2**63 - 1, 10**18, 10**400, -10**400, 1e308, -1e308, 1.7976931348623157e308,
    5e-324, -5e-324, 1e-300, math.inf, -math.inf, math.nan,
]


def weird_text(max_size: int = 24, long: int = 200) -> st.SearchStrategy:
    """Surrogate-free strings: any code point, RTL and zero-width marks,
    emoji sequences, NUL, combining marks, chat special tokens, and repeats
    up to `long` units (tokenized strings stay short: prefill costs)."""
    return st.one_of(
        st.text(max_size=max_size),
        st.sampled_from(WEIRD_STRINGS),
        st.lists(st.sampled_from(WEIRD_STRINGS), min_size=2, max_size=5).map("".join),
        st.builds(lambda unit, n: unit * n, st.sampled_from(LONG_UNITS), st.integers(20, long)),
    )


def long_text() -> st.SearchStrategy:
    """Very long strings, only for fields that are never tokenized."""
    return st.builds(lambda unit, n: unit * n, st.sampled_from(LONG_UNITS),
                     st.integers(1000, 300_000))


numbers = st.one_of(st.sampled_from(BOUNDARY_NUMBERS), st.integers(), st.floats())
scalars = st.one_of(st.none(), st.booleans(), numbers, weird_text(long=100))
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(weird_text(8), st.sampled_from(FIELDS + ("type", "text"))),
                        children, max_size=4),
    ),
    max_leaves=8,
)

# -- images --------------------------------------------------------------------


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    body = kind + payload
    return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))


def _image_bytes() -> Dict[str, bytes]:
    """Tiny real images in several formats, and broken ones."""
    from PIL import Image

    images = {}
    for fmt, mode in (("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("GIF", "P"),
                      ("JPEG", "RGB"), ("BMP", "RGB"), ("WEBP", "RGB"), ("TIFF", "RGB")):
        out = io.BytesIO()
        try:
            Image.new(mode, (2, 2), 120).save(out, format=fmt)
        except Exception:
            continue
        images[f"{fmt.lower()}-{mode}"] = out.getvalue()
    png = images["png-RGB"]
    images["png-truncated"] = png[: len(png) // 2]
    images["png-corrupt-idat"] = png.replace(b"IDAT", b"IDAT\xff\xff", 1)
    images["png-signature-only"] = png[:8]
    images["not-an-image"] = b"not an image at all"
    # A header that says 50000x50000 (a decompression bomb) and no pixels.
    ihdr = struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0)
    images["png-bomb-header"] = (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
                                 + _png_chunk(b"IDAT", zlib.compress(b"")) + _png_chunk(b"IEND", b""))
    ihdr = struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)
    images["png-zero-size"] = (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
                               + _png_chunk(b"IEND", b""))
    return images


_IMAGES: Optional[Dict[str, bytes]] = None


def image_data(name: str) -> bytes:
    global _IMAGES
    if _IMAGES is None:
        _IMAGES = _image_bytes()
    return _IMAGES.get(name, b"")


IMAGE_NAMES = ["png-RGB", "png-RGBA", "png-L", "gif-P", "jpeg-RGB", "bmp-RGB", "webp-RGB",
               "tiff-RGB", "png-truncated", "png-corrupt-idat", "png-signature-only",
               "not-an-image", "png-bomb-header", "png-zero-size"]


@st.composite
def image_urls(draw) -> str:
    """Data URLs of real tiny images, broken base64 and broken images, remote
    and local URLs, and strings that are no URL at all."""
    how = draw(st.sampled_from(["data", "data", "data", "broken-b64", "other"]))
    if how == "data":
        data = base64.b64encode(image_data(draw(st.sampled_from(IMAGE_NAMES)))).decode()
        mime = draw(st.sampled_from(["image/png", "image/jpeg", "image/gif",
                                     "application/octet-stream", "", "text/plain"]))
        mangle = draw(st.sampled_from(["", "", "strip-padding", "newlines", "spaces",
                                       "urlsafe", "no-base64-marker"]))
        if mangle == "strip-padding":
            data = data.rstrip("=")
        elif mangle == "newlines":
            data = "\n".join(data[i:i + 8] for i in range(0, len(data), 8))
        elif mangle == "spaces":
            data = " ".join(data[i:i + 5] for i in range(0, len(data), 5))
        elif mangle == "urlsafe":
            data = data.replace("+", "-").replace("/", "_")
        marker = "" if mangle == "no-base64-marker" else ";base64"
        return f"data:{mime}{marker},{data}"
    if how == "broken-b64":
        return "data:image/png;base64," + draw(st.sampled_from([
            "", "@@@@", "=", "====", "A", "AB", "ABC", "AAAA" * 3 + "=A", "iVBORw0KGgo",
            "iVBORw0KGgoAAAANSUhEUg", "\u00fc\u00fc\u00fc\u00fc", "\x00\x00\x00\x00",
            "iVBO Rw0K Ggo=", "%89PNG", "data:image/png;base64,iVBORw0KGgo=",
        ]))
    return draw(st.one_of(
        st.sampled_from([
            "https://example.com/cat.png", "http://127.0.0.1:1/x.png", "http://[::1]:1/",
            "file:///etc/passwd", "ftp://x/y.png", "data:", "data:,", "data:image/png",
            "data:image/png;base64", "data:;base64,", "javascript:alert(1)", "//x/y.png",
        ]),
        weird_text(),
    ))


@st.composite
def image_part(draw) -> dict:
    kind = draw(st.sampled_from(["image_url", "input_image", "image"]))
    url = draw(image_urls())
    shape = draw(st.sampled_from(["nested", "flat", "image-key", "detail"]))
    if shape == "nested":
        return {"type": kind, "image_url": {"url": url}}
    if shape == "detail":
        return {"type": kind, "image_url": {"url": url, "detail": draw(weird_text(8))}}
    if shape == "image-key":
        return {"type": kind, "image": url}
    return {"type": kind, "image_url": url}


valid_image_part = st.builds(
    lambda name, kind: {"type": kind, "image_url": {"url": "data:image/{};base64,{}".format(
        name.split("-")[0], base64.b64encode(image_data(name)).decode())}},
    st.sampled_from(["png-RGB", "png-RGBA", "png-L", "gif-P", "jpeg-RGB", "bmp-RGB",
                     "webp-RGB"]),
    st.sampled_from(["image_url", "input_image"]))

# -- completions bodies --------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """What the strategies know about the server under test."""

    model: Optional[str] = None  # the --model folder (a valid `model` value)
    # The server serves testkit/bad_input.py's EMBEDDING_SERVED: the
    # embedding endpoints have a model to run.
    embeddings: bool = False


text_part = st.fixed_dictionaries({"type": st.just("text"), "text": weird_text()})
odd_part = st.dictionaries(
    st.sampled_from(["type", "text", "image_url", "image", "url", "input_text"]),
    st.one_of(st.sampled_from(["text", "image_url", "input_image", "image", "input_text",
                               "audio", ""]), json_values),
    max_size=3,
)
content_parts = st.lists(st.one_of(text_part, text_part, image_part(), odd_part), max_size=4)


def tool_call_args() -> st.SearchStrategy:
    return st.one_of(
        st.dictionaries(weird_text(8), json_values, max_size=3).map(json.dumps),
        st.dictionaries(weird_text(8), json_values, max_size=3),
        weird_text(),  # mostly not JSON: the server json.loads string arguments
        st.sampled_from(["", "{", "null", "[]", "1e999", '{"a": NaN}', '"x"']),
    )


tool_call = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": weird_text(12)},
                                       optional={"arguments": tool_call_args()})},
    optional={"id": weird_text(12), "type": st.sampled_from(["function", "", "x"])},
)
tool_calls = st.one_of(st.lists(tool_call, max_size=3), st.lists(json_values, max_size=2),
                       json_values)
ROLES = ["user", "user", "system", "assistant", "tool", "developer", "function", ""]


@st.composite
def message(draw, valid: bool = True) -> dict:
    role = draw(st.sampled_from(ROLES)) if valid else draw(st.one_of(
        st.sampled_from(ROLES), weird_text(12), json_values))
    if valid:  # images come in through `with_images` (a model without vision refuses them)
        content = draw(st.one_of(weird_text(), weird_text(), st.lists(text_part, max_size=3),
                                 st.none()))
    else:
        content = draw(st.one_of(weird_text(), content_parts, st.none(), json_values))
    m = {"role": role, "content": content}
    if valid and role == "assistant" and draw(st.booleans()):
        m["tool_calls"] = draw(st.lists(tool_call, min_size=1, max_size=2))
    if not valid:
        extra = draw(st.dictionaries(
            st.sampled_from(["tool_calls", "name", "tool_call_id", "reasoning_content",
                             "thinking", "function_call", "role", "content"]),
            st.one_of(tool_calls, weird_text(), json_values), max_size=2))
        m.update(extra)
        if draw(st.booleans()):
            m.pop(draw(st.sampled_from(["role", "content"])), None)
    return m


def messages(valid: bool = True) -> st.SearchStrategy:
    return st.lists(message(valid), min_size=1, max_size=3)


json_schema = st.one_of(
    st.just({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}),
    st.dictionaries(weird_text(8), json_values, max_size=3),
)
tool = st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": weird_text(12)},
                                       optional={"description": weird_text(),
                                                 "parameters": json_schema})},
)


def valid_values(ctx: Context) -> Dict[str, st.SearchStrategy]:
    """Values each field accepts (generation stays short: 1..4 tokens)."""
    small_tokens = st.integers(1, 4)
    unit = st.floats(0, 1)
    models = ["default_model"] + ([ctx.model] if ctx.model else [])
    return {
        "stream": st.booleans(),
        "stream_options": st.one_of(st.none(),
                                    st.fixed_dictionaries({"include_usage": st.booleans()})),
        "model": st.sampled_from(models),
        "draft_model": st.sampled_from(models),
        "adapters": st.none(),
        "max_tokens": small_tokens,
        "max_completion_tokens": small_tokens,
        "temperature": st.one_of(st.just(0.0), st.floats(0, 2)),
        "top_p": unit,
        "top_k": st.integers(0, 40),
        "min_p": unit,
        "repetition_penalty": st.floats(0, 2),
        "repetition_context_size": st.integers(0, 64),
        "presence_penalty": st.floats(-2, 2),
        "presence_context_size": st.integers(0, 64),
        "frequency_penalty": st.floats(-2, 2),
        "frequency_context_size": st.integers(0, 64),
        "xtc_probability": unit,
        "xtc_threshold": unit,
        "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100),
                                      max_size=3),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 11),
        "seed": st.integers(0, 2**32),
        "chat_template_kwargs": st.one_of(
            st.fixed_dictionaries({"enable_thinking": st.booleans()}),
            st.dictionaries(weird_text(8), json_values, max_size=2)),
        "stop": st.one_of(weird_text(8), st.lists(weird_text(8), max_size=3)),
        "messages": messages(valid=True),
        "tools": st.lists(tool, max_size=2),
        "role_mapping": st.dictionaries(st.sampled_from(ROLES + ["stop", "system_prompt"]),
                                        weird_text(8), max_size=3),
        "prompt": weird_text().filter(bool) | st.just("Tell me about boats."),
        "num_draft_tokens": st.integers(0, 6),
    }


def any_values(ctx: Context) -> Dict[str, st.SearchStrategy]:
    """Anything at all for a field: every JSON type, boundary numbers, odd
    text, and the values closest to valid ones that are not."""
    base = st.one_of(json_values, numbers, weird_text())
    near = {
        "messages": st.one_of(messages(valid=False), st.lists(json_values, max_size=3)),
        "tools": st.one_of(st.lists(st.one_of(tool, json_values), max_size=2), json_values),
        "stop": st.lists(st.one_of(weird_text(8), json_values), max_size=3),
        "logit_bias": st.dictionaries(st.one_of(weird_text(6), numbers.map(str)),
                                      st.one_of(numbers, json_values), max_size=3),
        "stream_options": st.dictionaries(st.sampled_from(["include_usage", "x"]), json_values,
                                          max_size=2),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "tools", "messages", "add_generation_prompt",
                             "tokenize", "x"]), json_values, max_size=2),
        "role_mapping": st.dictionaries(weird_text(8), json_values, max_size=3),
        # Never tokenized: very long strings are cheap here.
        "model": long_text(),
        "draft_model": long_text(),
        "adapters": long_text(),
    }
    return {f: st.one_of(base, near[f]) if f in near else base for f in FIELDS}


def mutations(valid_body, fields, valid, anything, extra, max_fields: int):
    """(one_mutation, chaos) for an endpoint's bodies: a valid body with one
    field (of `fields` or `extra`) set to anything; and a body of up to
    `max_fields` fields, each valid or not, with unknown keys."""
    @st.composite
    def one_mutation(draw):
        body = draw(valid_body())
        f = draw(st.sampled_from(fields + extra))
        body[f] = draw(anything.get(f, json_values))
        return body

    @st.composite
    def chaos(draw):
        body = {}
        for f in draw(st.lists(st.sampled_from(fields), max_size=max_fields, unique=True)):
            body[f] = draw(st.one_of(valid[f], anything[f]))
        body.update(draw(st.dictionaries(weird_text(8), json_values, max_size=2)))
        return body

    return one_mutation, chaos


def completion_body(ctx: Context, path: str) -> st.SearchStrategy:
    valid, anything = valid_values(ctx), any_values(ctx)
    main = "prompt" if path == TEXT else "messages"
    optional = [f for f in FIELDS if f not in ("messages", "prompt", "draft_model",
                                               "num_draft_tokens", "model")]

    @st.composite
    def valid_body(draw):
        body = {main: draw(valid[main]), "max_tokens": draw(valid["max_tokens"])}
        for f in draw(st.lists(st.sampled_from(optional), max_size=5, unique=True)):
            body[f] = draw(valid[f])
        if draw(st.integers(0, 9)) == 0:
            body["model"] = draw(valid["model"])
        if draw(st.integers(0, 19)) == 0:
            # The served model as its own draft: speculative decoding where
            # models may be loaded (404 elsewhere). Rare: each switch reloads.
            body["draft_model"] = draw(valid["draft_model"])
            body["num_draft_tokens"] = draw(valid["num_draft_tokens"])
        return body

    one_mutation, chaos = mutations(valid_body, FIELDS, valid, anything,
                                    ("user", "n", "response_format", ""), max_fields=8)

    @st.composite
    def with_images(draw):
        body = draw(valid_body())
        parts = draw(st.one_of(st.lists(st.one_of(text_part, valid_image_part), min_size=1,
                                        max_size=3), content_parts))
        if main == "messages":
            body["messages"].append({"role": "user", "content": parts})
        else:
            body["messages"] = [{"role": "user", "content": parts}]
        return body

    @st.composite
    def huge_unknown(draw):
        body = draw(valid_body())
        body[draw(weird_text(8))] = draw(long_text())
        return body

    return st.one_of(valid_body(), valid_body(), valid_body(), one_mutation(), one_mutation(),
                     one_mutation(), with_images(), chaos(), huge_unknown(), json_values)


# -- cases -----------------------------------------------------------------------

NO_BODY = object()
# The valid fields a raw body of each endpoint kind starts with (the
# recipe's field comes after, and wins: json keeps a key's last value).
RAW_VALID = {
    "": '"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 2',
    "embed": f'"model": "{EMBED_MODEL}", "input": ["hi", "the sea"]',
    "rerank": f'"model": "{RERANK_MODEL}", "query": "boats", "documents": ["a boat", "the sea"]',
}


@dataclass(frozen=True)
class Raw:
    """A raw request body made from a recipe, so it can shrink by its size."""

    kind: str
    n: int = 0
    field: str = "max_tokens"
    text: str = ""
    endpoint: str = ""  # a key of RAW_VALID: completions, embed or rerank

    def data(self) -> bytes:
        n, f = self.n, self.field
        valid = RAW_VALID[self.endpoint]
        if self.kind == "deep_array":
            return b"[" * n + b"]" * n
        if self.kind == "deep_object":
            return b'{"a": ' * n + b"0" + b"}" * n
        if self.kind == "deep_in_field":
            return ('{%s, "%s": %s%s}' % (valid, f, "[" * n, "]" * n)).encode()
        if self.kind == "deep_echo":
            # A value each protocol echoes or keeps (tools, tool_choice none:
            # never rendered) nesting n arrays; `field`: the protocol.
            body = deep_echo_body(f, self.text == "stream")
            return json.dumps(body).replace('"DEEP"', "[" * n + "]" * n).encode()
        if self.kind == "big_int":
            return b"1" * max(n, 1)
        if self.kind == "big_int_in_field":
            return ('{%s, "%s": %s}' % (valid, f, "1" * max(n, 1))).encode()
        if self.kind == "literal_in_field":
            return ('{%s, "%s": %s}' % (valid, f, self.text)).encode()
        if self.kind == "escape_in_field":
            # JSON string escapes Python turns into lone surrogates, NUL...
            if f in ("messages",) and not self.endpoint:
                return ('{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}'
                        % self.text).encode()
            return ('{%s, "%s": "%s"}' % (valid, f, self.text)).encode()
        if self.kind == "huge_string":
            return ('{%s, "x": "%s"}' % (valid, "a" * n)).encode()
        if self.kind == "many_keys":
            return ("{%s, %s}" % (valid, ", ".join(f'"k{i}": {i}' for i in range(n)))).encode()
        if self.kind == "bytes":
            return self.text.encode("latin-1")
        if self.kind == "text":
            return self.text.encode()
        if self.kind == "utf16":
            return ('{%s}' % valid).encode("utf-16")
        raise ValueError(self.kind)

    def smaller(self) -> Iterator["Raw"]:
        n = self.n
        for m in (0, 1, n // 2, n - 1, (3 * n) // 4):
            if 0 <= m < n:
                yield replace(self, n=m)
        if self.field not in ("max_tokens", "x"):
            yield replace(self, field="x")
        if len(self.text) > 1:
            yield replace(self, text=self.text[: len(self.text) // 2])

    def show(self) -> str:
        n = self.n
        if self.kind == "deep_echo":
            return f"{self.field} {self.text or 'not streamed'}: tools nesting {n} arrays"
        if self.kind == "deep_array":
            return f"'[' * {n} + ']' * {n}"
        if self.kind == "deep_object":
            return f"'{{\"a\": ' * {n} + '0' + '}}' * {n}"
        if self.kind in ("big_int",):
            return f"'1' * {n}"
        if self.kind == "huge_string":
            return f'{{..., "x": "a" * {n}}}'
        if self.kind == "many_keys":
            return f'{{..., {n} keys}}'
        data = self.data()
        if self.kind in ("deep_in_field", "big_int_in_field"):
            return (f"{self.kind}: field {self.field!r}, n={n}"
                    f"{' (' + self.endpoint + ')' if self.endpoint else ''}: {data[:160]!r}...")
        return repr(data[:400]) + ("..." if len(data) > 400 else "")


DEEP_PATHS = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}
# Schema floods (Fuzzer.flood): how many large schemas at once, every how
# many batches, and how long the plain request behind them may take.
FLOOD_SCHEMAS = 12
FLOOD_EVERY = 4
FLOOD_PLAIN_SECONDS = 1.0


def heavy_schema_body(salt: str, properties: int = 1500) -> dict:
    """A chat request whose response_format is a schema no other request
    has (its property names carry `salt`), over 64 KB of JSON."""
    props = {f"p{i}_{salt}": {"type": "string", "maxLength": 8} for i in range(properties)}
    schema = {"type": "object", "properties": props, "required": list(props)[:4],
              "additionalProperties": False}
    return {"messages": [{"role": "user", "content": "fill the form"}], "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "form", "schema": schema}}}


def deep_echo_body(protocol: str, stream: bool) -> dict:
    """A valid request of `protocol` with tools it keeps but never renders,
    their parameters holding "DEEP" (Raw.data nests arrays there)."""
    params = {"type": "object", "properties": {}, "x-deep": "DEEP"}
    if protocol == "chat":
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": stream, "tool_choice": "none",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}
    if protocol == "messages":
        return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                "stream": stream, "tool_choice": {"type": "none"},
                "tools": [{"name": "f", "input_schema": params}]}
    return {"model": "m", "max_output_tokens": 2, "input": "hi", "stream": stream,
            "tool_choice": "none", "tools": [{"type": "function", "name": "f",
                                              "parameters": params}]}


LITERALS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "-0", "1E+2",
            "0.0000001", "1.0", "2.5e0", "-0.0", "[NaN]", '{"0": Infinity}', "[-Infinity]"]
ESCAPES = ["\\ud800", "\\udfff", "hi\\ud83d", "\\ud83d\\ude00", "\\u0000", "a\\u0000b",
           "\\uffff", "\\ufeff", "\\ud800\\ud800", "\\u202e"]
INVALID_JSON = [
    "{", "}", "{not json", '{"a":}', "{'a': 1}", "[1,]", '{"a": 1,}', "nul", "tru", '"open',
    '{"a": 1}{"b": 2}', '{"a": 1} x', "1 2", "{\x00}", '{"messages": [', "\\u0000",
    '{"max_tokens": 01}', '{"max_tokens": 0x10}', '{"max_tokens": +1}', '{"a": .5}',
    '{"a": "\t"}', '{"a": "\\x41"}', '{"a": "\\u12"}', "//", "/* */ {}", "\ufeff{}",
]
JSON_NOT_OBJECT = ["null", "true", "false", "0", "-1", "1e999", '"x"', '""', "[]", "[{}]",
                   '[{"messages": [{"role": "user", "content": "hi"}]}]', "NaN", "Infinity"]
NOT_UTF8 = ["\xff", "\xc3(", '{"prompt": "\xff"}', "\xed\xa0\x80", "\xc0\xaf", "\xfe\xff\x00{",
            '{"messages": [{"role": "user", "content": "\x80"}]}', "\xf8\x88\x80\x80\x80"]
EMPTY = ["", " ", "\n\t\r ", "\x00"]

raw_sizes = st.one_of(st.integers(0, 40), st.sampled_from([500, 900, 990, 1000, 1100, 3000,
                                                          4300, 4301, 5000, 100_000]),
                      st.integers(0, 200_000))
raw_fields = st.sampled_from(FIELDS + ("x",))
raw_bodies = st.one_of(
    st.builds(Raw, st.sampled_from(["deep_array", "deep_object"]), raw_sizes),
    st.builds(Raw, st.just("deep_in_field"), raw_sizes, raw_fields),
    st.builds(Raw, st.just("big_int"), raw_sizes),
    st.builds(Raw, st.just("big_int_in_field"), raw_sizes, raw_fields),
    st.builds(Raw, st.just("literal_in_field"), st.just(0), raw_fields, st.sampled_from(LITERALS)),
    st.builds(Raw, st.just("escape_in_field"), st.just(0),
              st.sampled_from(["messages", "prompt", "stop", "model", "x"]),
              st.sampled_from(ESCAPES)),
    st.builds(Raw, st.just("huge_string"), st.integers(0, 3_000_000)),
    st.builds(Raw, st.just("many_keys"), st.integers(0, 50_000)),
    st.builds(Raw, st.just("text"), st.just(0), st.just("x"),
              st.sampled_from(INVALID_JSON + JSON_NOT_OBJECT + EMPTY)),
    st.builds(Raw, st.just("bytes"), st.just(0), st.just("x"), st.sampled_from(NOT_UTF8)),
    st.just(Raw("utf16")),
)


@dataclass(frozen=True)
class Case:
    """One request: a JSON body, a raw body, or none."""

    method: str
    path: str
    body: Any = NO_BODY
    raw: Optional[Raw] = None
    headers: Tuple[Tuple[str, str], ...] = ()
    # The body in a second write, after the headers have arrived (as clients
    # that stream their uploads send it): aiohttp takes another path then.
    split: bool = False

    @property
    def endpoint(self) -> str:
        route = self.path.split("?")[0]
        if route not in KNOWN_ROUTES and not route.startswith("/v1/models/"):
            route = "(other paths)"
        elif route.startswith("/v1/models/"):
            route = "/v1/models/*"
        what = "raw" if self.raw is not None else ("json" if self.body is not NO_BODY else "")
        return f"{self.method} {route}" + (f" [{what}]" if what and self.method == "POST" else "")

    def payload(self) -> Optional[bytes]:
        if self.raw is not None:
            return self.raw.data()
        if self.body is NO_BODY:
            return None
        return json.dumps(self.body).encode()  # NaN/Infinity literals on purpose

    def show(self, limit: int = 700) -> str:
        parts = [f"{self.method} {self.path}"]
        if self.headers:
            parts.append(" ".join(f"{k}: {v}" for k, v in self.headers))
        if self.split:
            parts.append("[body sent 10 ms after the headers]")
        if self.raw is not None:
            parts.append(self.raw.show())
        elif self.body is not NO_BODY:
            text = json.dumps(self.body, ensure_ascii=True)
            if len(text) > limit:
                text = text[:limit] + f"... ({len(text)} chars)"
            parts.append(text)
        return "  ".join(parts)


KNOWN_ROUTES = ("/v1/models", "/health", "/v1/cache/stats", "/v1/stats", "/metrics",
                "/dashboard", "/v1/cache", *COMPLETION_PATHS, MESSAGES, RESPONSES, EMBEDDINGS,
                *RERANK_PATHS)
HEADERS = [
    (("Origin", "http://evil.example"),), (("Origin", "null"),),
    (("Sec-Fetch-Site", "cross-site"),), (("Host", "evil.example"),),
    (("Content-Type", "text/plain"),), (("Content-Type", "application/json; charset=latin-1"),),
    (("Authorization", "Bearer nope"),), (("Accept", "text/event-stream"),),
    (("Content-Encoding", "gzip"),), (("Content-Encoding", "deflate"),),
    (("Content-Encoding", "br"),), (("Content-Encoding", "zstd"),),
    (("Content-Encoding", "identity"),), (("Content-Encoding", "x-unknown"),),
    (("Accept-Encoding", "gzip"),), (("Expect", "100-continue"),),
]
# Most requests carry no extra header (one in five does).
headers = st.sampled_from([()] * (4 * len(HEADERS)) + HEADERS)
# One request in eight sends its body after its headers.
splits = st.sampled_from([False] * 7 + [True])
QUERY_VALUES = ["", "0", "1", "-1", "10", "abc", "nan", "inf", "-inf", "1e999", "1e308",
                "9" * 5000, "%00", "%ff", "0x10", " 5 ", "1.5"]


@st.composite
def route_cases(draw) -> Case:
    method = draw(st.sampled_from(["GET", "GET", "GET", "DELETE", "OPTIONS", "POST"]))
    route = draw(st.sampled_from(["/v1/models", "/health", "/v1/cache/stats", "/v1/stats",
                                  "/metrics", "/dashboard", "/v1/cache", "/v1/models/",
                                  EMBEDDINGS, "/rerank", "other", "models-sub",
                                  "stats-query"]))
    if route == "other":
        route = "/" + draw(st.one_of(
            st.sampled_from(["", "v1", "v1/", "v1/chat", "v2/chat/completions", "V1/models",
                             "health/", "/health", "v1/completions/", "chat", "v1/cache/",
                             "v1/cache/stats/x", ".well-known/x", "%2e%2e/%2e%2e/etc/passwd",
                             "v1/chat/completions%00", "v1//completions", "index.html"]),
            weird_text(40, long=60)))
    elif route == "models-sub":
        route = "/v1/models/" + draw(st.one_of(
            st.sampled_from(["x", "org/model", "../..", "%2F", "default_model"]),
            weird_text(30, long=60)))
    elif route == "stats-query":
        q = draw(st.dictionaries(st.sampled_from(["limit", "since", "x"]),
                                 st.sampled_from(QUERY_VALUES), max_size=2))
        route = "/v1/stats?" + "&".join(f"{k}={v}" for k, v in q.items())
    path = urllib.parse.quote(route, safe="/?&=%:@")
    body = draw(st.one_of(st.just(NO_BODY), st.just(NO_BODY), json_values))
    return Case(method, path, body, headers=draw(headers), split=draw(splits))


def completion_cases(ctx: Context) -> st.SearchStrategy:
    return st.one_of(*[
        st.builds(Case, st.just("POST"), st.just(path), completion_body(ctx, path),
                  headers=headers, split=splits)
        for path in (CHAT, CHAT, TEXT, TEXT, CHAT_ALIAS)
    ])


def raw_cases() -> st.SearchStrategy:
    return st.builds(Case, st.just("POST"), st.sampled_from(COMPLETION_PATHS),
                     raw=raw_bodies, headers=headers, split=splits)


deep_sizes = st.sampled_from([*range(MAX_JSON_DEPTH - 8, MAX_JSON_DEPTH + 3),
                              *range(930, 1010, 3)])


@st.composite
def deep_cases(draw) -> Case:
    """Nesting at the server's bound and at json's edge, on every protocol,
    streamed or not (found in review: a stream that wrote a second HTTP
    response into itself)."""
    protocol = draw(st.sampled_from(sorted(DEEP_PATHS)))
    raw = Raw("deep_echo", draw(deep_sizes), protocol, draw(st.sampled_from(["", "stream"])))
    return Case("POST", DEEP_PATHS[protocol], raw=raw, headers=draw(headers))


# -- embeddings and rerank ------------------------------------------------------

EMBEDDING_FIELDS = ("model", "input", "encoding_format", "dimensions", "user", "prompt_name")
RERANK_FIELDS = ("model", "query", "documents", "top_n", "return_documents", "instruction")
# The embedder's (testkit/bad_input.py EMBEDDING_SERVED: bert_embed) width
# and vocabulary: valid `dimensions` and token ids stay within them.
EMBED_WIDTH, EMBED_VOCAB = 64, 195

token_ids = st.lists(st.integers(0, EMBED_VOCAB - 1), min_size=1, max_size=40)
# Texts the tokenizers see: never longer than a few hundred tokens (the
# reranker runs every document's prompt through a 32k context).
embed_texts = weird_text(max_size=24, long=120)
document = st.one_of(embed_texts, st.fixed_dictionaries({"text": embed_texts}))


def embedding_values() -> Dict[str, st.SearchStrategy]:
    """Values each embeddings and rerank field accepts."""
    return {
        "model": st.just(EMBED_MODEL),
        "input": st.one_of(embed_texts, st.lists(embed_texts, min_size=1, max_size=8),
                           token_ids, st.lists(token_ids, min_size=1, max_size=4)),
        "encoding_format": st.sampled_from(["float", "base64"]),
        "dimensions": st.integers(1, EMBED_WIDTH),
        "user": weird_text(12),
        "prompt_name": st.none(),  # (the embedder's folder names no prompts)
        "query": embed_texts,
        "documents": st.lists(document, min_size=1, max_size=6),
        "top_n": st.integers(1, 8),
        "return_documents": st.booleans(),
        "instruction": embed_texts,
    }


def embedding_anything() -> Dict[str, st.SearchStrategy]:
    """Anything for each field, and the values nearest the valid ones that
    are not (ids past the vocabulary, negative, bools; names of the other
    models; documents without a text)."""
    base = st.one_of(json_values, numbers, weird_text())
    ids = st.lists(st.one_of(st.integers(), st.booleans(), numbers, st.sampled_from(
        [EMBED_VOCAB - 1, EMBED_VOCAB, -1, 2**63, 10**30])), min_size=0, max_size=5)
    near = {
        "model": st.one_of(st.sampled_from([EMBED_MODEL, RERANK_MODEL, CROSS_MODEL, "chat",
                                            "default_model", "", None, [EMBED_MODEL]]),
                           long_text()),
        "input": st.one_of(ids, st.lists(st.one_of(ids, embed_texts, json_values), max_size=4)),
        "dimensions": st.one_of(numbers, st.integers(EMBED_WIDTH - 1, EMBED_WIDTH + 2)),
        "encoding_format": st.sampled_from(["float", "base64", "int8", "FLOAT", "", None]),
        "prompt_name": st.one_of(st.sampled_from(["query", "document", ""]), long_text()),
        "documents": st.lists(st.one_of(document, json_values, st.dictionaries(
            st.sampled_from(["text", "content", "title"]), json_values, max_size=2)),
            max_size=4),
        "top_n": numbers,
        "return_documents": st.one_of(st.booleans(), json_values),
    }
    return {f: st.one_of(base, near[f]) if f in near else base
            for f in EMBEDDING_FIELDS + RERANK_FIELDS}


def embedding_body(task: str) -> st.SearchStrategy:
    """/v1/embeddings (task "embed") or rerank bodies: valid ones, one field
    mutated, chaos, and floods: 2,000 inputs or documents or more (the
    bound is 2,048), and lists of thousands of token ids."""
    valid, anything = embedding_values(), embedding_anything()
    fields = EMBEDDING_FIELDS if task == "embed" else RERANK_FIELDS
    needed = ("input",) if task == "embed" else ("query", "documents")
    # (Rerank bodies go to the decoder reranker or the cross-encoder.)
    models = [EMBED_MODEL] if task == "embed" else [RERANK_MODEL, CROSS_MODEL]

    @st.composite
    def valid_body(draw):
        body = {"model": draw(st.sampled_from(models)), **{f: draw(valid[f]) for f in needed}}
        optional = [f for f in fields if f not in needed and f != "model"]
        for f in draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)):
            body[f] = draw(valid[f])
        return body

    one_mutation, chaos = mutations(valid_body, fields, valid, anything, ("extra", ""),
                                    max_fields=6)

    @st.composite
    def flood(draw):
        body = draw(valid_body())
        n = draw(st.one_of(st.sampled_from([2047, 2048, 2049, 4096, 20_000]),
                           st.integers(2000, 2100)))
        if task == "embed":
            unit = draw(st.one_of(embed_texts.filter(bool), token_ids.map(lambda t: t[:2])))
            body["input"] = draw(st.sampled_from([[unit] * n, [5] * n, [[5]] * n]))
        else:
            # (2,000 documents of the reranker's ~170-token prompt are past
            # the 300,000 tokens of a request: refused before any forward pass)
            body["documents"] = [draw(document)] * n
        return body

    return st.one_of(valid_body(), valid_body(), valid_body(), one_mutation(), one_mutation(),
                     one_mutation(), chaos(), flood(), json_values)


embedding_raw_fields = {"embed": st.sampled_from(EMBEDDING_FIELDS + ("x",)),
                        "rerank": st.sampled_from(RERANK_FIELDS + ("x",))}


def embedding_raw(task: str) -> st.SearchStrategy:
    """Raw bodies of an embedding endpoint: each field nesting arrays at
    the parser's bound and at json's edge, NaN/Infinity, big integers and
    odd escapes in each field."""
    fields = embedding_raw_fields[task]
    return st.one_of(
        st.builds(Raw, st.just("deep_in_field"), deep_sizes, fields, endpoint=st.just(task)),
        st.builds(Raw, st.just("big_int_in_field"), raw_sizes, fields, endpoint=st.just(task)),
        st.builds(Raw, st.just("literal_in_field"), st.just(0), fields,
                  st.sampled_from(LITERALS), endpoint=st.just(task)),
        st.builds(Raw, st.just("escape_in_field"), st.just(0), fields,
                  st.sampled_from(ESCAPES), endpoint=st.just(task)),
        st.builds(Raw, st.just("many_keys"), st.integers(0, 50_000), endpoint=st.just(task)),
    )


def embedding_cases(ctx: Context = Context()) -> st.SearchStrategy:
    """/v1/embeddings and the rerank paths (JSON bodies and raw ones), and
    completions, Messages and Responses bodies naming the embedder or the
    reranker (each refuses them)."""
    kinds = {
        "embed": st.builds(Case, st.just("POST"), st.just(EMBEDDINGS), embedding_body("embed"),
                           headers=headers, split=splits),
        "rerank": st.builds(Case, st.just("POST"), st.sampled_from(RERANK_PATHS),
                            embedding_body("rerank"), headers=headers, split=splits),
        "raw": st.one_of(
            st.builds(Case, st.just("POST"), st.just(EMBEDDINGS), raw=embedding_raw("embed"),
                      headers=headers),
            st.builds(Case, st.just("POST"), st.sampled_from(RERANK_PATHS),
                      raw=embedding_raw("rerank"), headers=headers)),
        "wrong model": st.builds(
            lambda path, body, model: Case("POST", path, {**body, "model": model}
                                           if isinstance(body, dict) else body),
            st.sampled_from([CHAT, TEXT]), completion_body(ctx, CHAT),
            st.sampled_from([EMBED_MODEL, RERANK_MODEL])) | st.builds(
            lambda path, body, model: Case("POST", path, {**body, "model": model}),
            st.sampled_from([MESSAGES, RESPONSES]), st.sampled_from([
                {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                {"max_output_tokens": 2, "input": "hi", "stream": True}]),
            st.sampled_from([EMBED_MODEL, RERANK_MODEL])),
    }
    return st.sampled_from(["embed", "embed", "rerank", "rerank", "raw",
                            "wrong model"]).flatmap(kinds.__getitem__)


def cases(ctx: Context = Context()) -> st.SearchStrategy:
    """Every kind of request: mostly completions bodies, then raw bodies and
    the other routes (and, where the server serves the embedders, the
    embedding endpoints' bodies)."""
    # About 2/3 completions, 2/9 raw bodies, 1/9 other routes. (st.one_of
    # would flatten the branches of completion_cases into its own, and
    # hypothesis does not repeat a case, so the smaller spaces get more weight.)
    kinds = {"completion": completion_cases(ctx), "raw": raw_cases(), "route": route_cases(),
             "deep": deep_cases(), "embedding": embedding_cases(ctx)}
    return st.sampled_from(["raw", "raw", "raw", "route", "completion", "completion", "deep"]
                           + ["embedding"] * (2 if ctx.embeddings else 0)
                           ).flatmap(kinds.__getitem__)


# -- sending and judging --------------------------------------------------------


@dataclass
class Outcome:
    status: Optional[int] = None
    headers: Dict[str, str] = field(default_factory=dict)
    data: bytes = b""
    error: Optional[str] = None  # "timeout" / "dropped: ..." when no answer came
    seconds: float = 0.0


def _request_split(server: ServerProcess, case: Case, timeout: float):
    """ServerProcess.request, with the body written 10 ms after the headers."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json", "Connection": "close", **dict(case.headers)}
        payload = case.payload() or b""
        hdrs["Content-Length"] = str(len(payload))
        conn.putrequest(case.method, case.path, skip_host="Host" in hdrs,
                        skip_accept_encoding=True)
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.endheaders()
        time.sleep(0.01)
        conn.send(payload)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def send(server: ServerProcess, case: Case, timeout: float = TIMEOUT) -> Outcome:
    start = time.perf_counter()
    try:
        if case.split:
            status, hdrs, data = _request_split(server, case, timeout)
        else:
            status, hdrs, data = server.request(case.method, case.path, raw=case.payload(),
                                                headers=dict(case.headers), timeout=timeout)
        out = Outcome(status, {k.lower(): v for k, v in hdrs.items()}, data)
    except TimeoutError:
        out = Outcome(error="timeout")
    except (http.client.HTTPException, ConnectionError, urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            out = Outcome(error="timeout")
        else:
            out = Outcome(error=f"dropped: {type(reason).__name__}: {reason}")
    out.seconds = time.perf_counter() - start
    return out


class NotStrictJSON(ValueError):
    pass


def _reject_constant(name):
    raise NotStrictJSON(f"non-standard JSON constant {name}")


def strict_json(data: bytes) -> Any:
    """RFC 8259 JSON: UTF-8, no NaN/Infinity (which JavaScript clients reject)."""
    return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)


def constant_paths(data: bytes) -> List[str]:
    """Where NaN/Infinity appear in a JSON text: "choices[].logprobs.content[].logprob"."""
    marker = object()
    try:
        obj = json.loads(data.decode("utf-8", "replace"), parse_constant=lambda name: marker)
    except ValueError:
        return []
    found = []

    def walk(v, path):
        if v is marker:
            found.append(path or "(top)")
        elif isinstance(v, dict):
            for k, c in v.items():
                walk(c, f"{path}.{k}" if path else str(k))
        elif isinstance(v, list):
            for c in v:
                walk(c, f"{path}[]")

    walk(obj, "")
    return sorted(set(found))


def token_limit(case: Case) -> int:
    """The most completion tokens this request may get (ceiling applied)."""
    body = case.body if isinstance(case.body, dict) else {}
    asked = body.get("max_completion_tokens")
    if asked is None:
        asked = body.get("max_tokens")
    if isinstance(asked, int) and asked >= 1:
        return min(asked, TOKENS_CEILING)
    return TOKENS_CEILING


@dataclass
class Problem:
    kind: str
    detail: str


def judge(case: Case, out: Outcome) -> Optional[Problem]:
    """What is wrong with this answer (None: nothing)."""
    if out.error is not None:
        kind = "timeout" if out.error == "timeout" else "dropped connection"
        return Problem(kind, f"{out.error} after {out.seconds:.1f} s")
    status, data = out.status, out.data
    ctype = out.headers.get("content-type", "")
    # Upstream's own answer to a method a path doesn't take (http.server has
    # no do_DELETE/do_PUT...): 501 with a JSON error, kept for parity.
    upstream_501 = (status == 501 and case.method not in ("GET", "POST", "OPTIONS")
                    and b"Unsupported method" in data)
    if not (200 <= status < 300 or 400 <= status < 500 or upstream_501):
        return Problem(f"status {status}", _excerpt(data))
    if status == 204 or case.method == "OPTIONS":
        return None
    if status == 404 and data == b"Not Found":
        return None  # upstream's plain body (api.py not_found)
    if status in (400, 431) and data.startswith(b"Got more than"):
        # A request line or header past aiohttp's 8190-byte limit: refused
        # by its HTTP parser, before any handler (a 4xx, in plain text).
        return None
    route = case.path.split("?")[0]
    if status == 200 and case.method == "GET" and route == "/metrics":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return Problem("bad /metrics", "not UTF-8")
        return None
    if status == 200 and case.method == "GET" and route == "/dashboard":
        return None if ctype.startswith("text/html") else Problem("bad /dashboard", ctype)
    if status == 200 and ctype.startswith("text/event-stream"):
        return judge_stream(case, data)
    try:
        obj = strict_json(data)
    except NotStrictJSON:
        return Problem("non-standard JSON", "NaN/Infinity at " + ", ".join(constant_paths(data)))
    except ValueError:
        return Problem("body not JSON", f"{status} {ctype}: {_excerpt(data)}")
    if not ctype.startswith("application/json"):
        return Problem("JSON without a JSON content type", ctype)
    if status >= 400:
        if not (isinstance(obj, dict) and error_message(route, obj)):
            return Problem("4xx without an error message", _excerpt(data))
        return None
    if case.method == "POST" and route in COMPLETION_PATHS:
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not (isinstance(choices, list) and choices):
            return Problem("completion without choices", _excerpt(data))
        used = (obj.get("usage") or {}).get("completion_tokens", 0)
        if used > token_limit(case):
            return Problem("more tokens than max_tokens", f"{used} > {token_limit(case)}")
    elif case.method == "POST" and route in (EMBEDDINGS, *RERANK_PATHS):
        try:
            return judge_embedding(route, case, obj)
        except (AttributeError, KeyError, TypeError, IndexError) as e:
            return Problem("malformed embedding answer", f"{e!r}: {_excerpt(data)}")
    elif not isinstance(obj, dict):
        return Problem("JSON that is not an object", _excerpt(data))
    return None


def judge_embedding(route: str, case: Case, obj: dict) -> Optional[Problem]:
    """A 200 from /v1/embeddings: a vector per input, in order, each of
    `dimensions` values where asked (floats, or base64 of float32). From a
    rerank path: top_n results at most, best first, scores in [0, 1] (finite
    for the cross-encoder, whose scores are logits),
    distinct indices of the documents, each document's text unless
    return_documents is false. (KeyError and the like: malformed.)"""
    body = case.body if isinstance(case.body, dict) else None
    if route == EMBEDDINGS:
        data = obj["data"]
        widths = set()
        for i, item in enumerate(data):
            vector = item["embedding"]
            if item["index"] != i:
                return Problem("embeddings out of order", f"data[{i}].index {item['index']}")
            widths.add(len(base64.b64decode(vector)) // 4 if isinstance(vector, str)
                       else len(vector))
        given = body.get("input") if body else None
        if isinstance(given, list) and given and not all(isinstance(t, int) for t in given):
            if len(data) != len(given):
                return Problem("a vector per input", f"{len(data)} vectors, {len(given)} inputs")
        elif body is not None and len(data) != 1:
            return Problem("a vector per input", f"{len(data)} vectors for one input")
        dimensions = body.get("dimensions") if body else None
        if len(widths) > 1 or (dimensions is not None and widths != {dimensions}):
            return Problem("vectors of the wrong width", f"{sorted(widths)}, asked {dimensions}")
        return None
    results = obj["results"]
    scores = [r["relevance_score"] for r in results]
    # (Probabilities, but for a cross-encoder whose folder names raw logits:
    # testkit/bad_input.py's CROSS_MODEL, an ms-marco-like BERT.)
    raw = isinstance(body, dict) and body.get("model") == CROSS_MODEL
    if any(not (math.isfinite(s) if raw else 0 <= s <= 1) for s in scores) \
            or scores != sorted(scores, reverse=True):
        return Problem("rerank scores", f"not {'finite' if raw else 'in [0, 1]'}, best first: "
                       f"{scores[:10]}")
    if body is None:
        return None
    documents = body["documents"]
    top_n = body.get("top_n")
    if len(results) != min(len(documents), top_n or len(documents)):
        return Problem("rerank results", f"{len(results)} for {len(documents)} documents, "
                       f"top_n {top_n}")
    indices = [r["index"] for r in results]
    if len(set(indices)) != len(indices) or not all(0 <= i < len(documents) for i in indices):
        return Problem("rerank results", f"indices {indices[:10]}")
    for r in results:
        doc = documents[r["index"]]
        text = doc["text"] if isinstance(doc, dict) else doc
        if body.get("return_documents", True) and r["document"] != {"text": text}:
            return Problem("rerank results", f"document {r['index']} is {r['document']!r}")
        if not body.get("return_documents", True) and "document" in r:
            return Problem("rerank results", "a document with return_documents false")
    return None


def error_message(route: str, obj: dict) -> Optional[str]:
    """The message of an error body in the route's protocol's shape."""
    error = obj.get("error")
    if route.startswith((MESSAGES, RESPONSES, "/responses")):
        if route.startswith(MESSAGES) and obj.get("type") != "error":
            return None
        error = error.get("message") if isinstance(error, dict) else None
    return error if isinstance(error, str) and error else None


# How a 200 stream of each agent protocol ends, and the events that say it failed.
STREAM_ENDS = {MESSAGES: ({"message_stop"}, {"error"}),
               RESPONSES: ({"response.completed", "response.incomplete"},
                           {"response.failed", "error"})}


def judge_named_stream(case: Case, text: str) -> Optional[Problem]:
    """Messages and Responses streams: `event:` / `data:` blocks, one
    response, ended by its protocol's last event, no failure in it."""
    ends, failures = STREAM_ENDS[case.path.split("?")[0]]
    names = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        if len(lines) != 2 or not lines[0].startswith("event: ") or not lines[1].startswith(
                "data: "):
            return Problem("bad SSE", f"block {block[:200]!r}")
        try:
            event = strict_json(lines[1][len("data: "):].encode())
        except ValueError:
            return Problem("bad SSE", f"event not JSON: {lines[1][:200]!r}")
        name = lines[0][len("event: "):]
        if name in failures:
            return Problem("error event in a 200 stream", str(event)[:300])
        names.append(name)
    if not names or names[-1] not in ends or sum(n in ends for n in names) != 1:
        return Problem("bad SSE", f"not ended by one of {sorted(ends)}: {names[-3:]}")
    return None


def judge_stream(case: Case, data: bytes) -> Optional[Problem]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Problem("bad SSE", "not UTF-8")
    if "HTTP/1." in text:
        return Problem("a second response inside a stream", _excerpt(data[-300:]))
    if case.path.split("?")[0] in STREAM_ENDS:
        return judge_named_stream(case, text)
    events = []
    for line in text.split("\n"):
        if not line or line.startswith(":"):
            continue
        if not line.startswith("data: "):
            return Problem("bad SSE", f"line {line[:200]!r}")
        payload = line[len("data: "):]
        if payload == "[DONE]":
            events.append("[DONE]")
            continue
        try:
            events.append(strict_json(payload.encode()))
        except NotStrictJSON:
            return Problem("non-standard JSON", "NaN/Infinity in a stream event at "
                           + ", ".join(constant_paths(payload.encode())))
        except ValueError:
            return Problem("bad SSE", f"event not JSON: {payload[:200]!r}")
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return Problem("bad SSE", "not ended by exactly one data: [DONE]")
    for event in events[:-1]:
        if not isinstance(event, dict):
            return Problem("bad SSE", f"event is not an object: {str(event)[:200]}")
        if "error" in event:
            return Problem("error event in a 200 stream", str(event["error"])[:300])
        usage = event.get("usage")
        if usage and usage.get("completion_tokens", 0) > token_limit(case):
            return Problem("more tokens than max_tokens",
                           f"{usage['completion_tokens']} > {token_limit(case)}")
    return None


def _excerpt(data: bytes, n: int = 300) -> str:
    text = data[:n].decode("utf-8", "replace")
    return text + ("..." if len(data) > n else "")


# -- the server's log ------------------------------------------------------------

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b)(: .*)?$")


def log_exception(text: str) -> Optional[Tuple[str, str, str]]:
    """(exception type, where, message) of the first traceback in `text`:
    where is the innermost frame of this project (else the innermost)."""
    start = text.find("Traceback (most recent call last):")
    if start < 0:
        return None
    frames, lines = [], text[start:].split("\n")[1:]
    for line in lines:
        m = _FRAME.match(line)
        if m:
            frames.append(m.groups())
            continue
        m = _EXCEPTION.match(line.strip())
        if m and frames:
            ours = [f for f in frames if "/mlx_lm_plus/" in f[0] or "/patches/" in f[0]]
            path, lineno, func = (ours or frames)[-1]
            # Line numbers of other packages are left out: they do not move.
            where = f"{'/'.join(Path(path).parts[-2:])}{':' + lineno if ours else ''} in {func}"
            return m.group(1).split(".")[-1], where, (m.group(2) or "")[2:][:300]
    return None


def _normalize(message: str) -> str:
    message = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", message)
    message = re.sub(r"\d+", "N", message)
    return message[:90]


# -- the fuzzer ------------------------------------------------------------------


@dataclass
class Failure:
    signature: str
    problem: Problem
    case: Case
    status: Optional[int]
    response: str
    logged: str
    count: int = 1
    endpoints: Counter = field(default_factory=Counter)
    minimal: Optional[Case] = None
    shrink_tries: int = 0
    replays: int = 0  # sent again before shrinking...
    reproduced: bool = False  # ...and failed the same way again

    def describe(self) -> str:
        lines = [f"{self.signature}  (seen {self.count}x on "
                 + ", ".join(f"{e} x{n}" for e, n in self.endpoints.most_common()) + ")",
                 f"    minimal: {(self.minimal or self.case).show()}"]
        if self.minimal is not None and self.minimal != self.case:
            lines.append(f"    (shrunk in {self.shrink_tries} tries from: {self.case.show(300)})")
        if self.replays and not self.reproduced:
            lines.append(f"    intermittent: did not fail the same way in {self.replays} replays")
        lines.append(f"    got: {self.problem.kind}: {self.problem.detail[:400]}")
        if self.logged:
            lines.append(f"    server log: {self.logged}")
        return "\n".join(lines)


def _size(case: Case) -> Tuple[int, int]:
    data = case.payload() or b""
    if case.raw is not None:
        return (len(data) + case.split, case.raw.n)
    return (len(data) + len(case.path) + sum(len(k) + len(v) for k, v in case.headers)
            + case.split, 0)


CANARIES = [
    (CHAT, {"messages": [{"role": "user", "content": "Tell me about boats."}],
            "max_tokens": 8, "temperature": 0.0}),
    (TEXT, {"prompt": "The river and the sea", "max_tokens": 8, "temperature": 0.0,
            "stream": True}),
]
# Where the server serves the embedders: their answers to fixed requests,
# the first values to 4 decimals. (Each runs alone, as the fuzzer sends one
# request at a time: the same batch every time, the same numbers.)
EMBEDDING_CANARIES = [
    (EMBEDDINGS, {"model": EMBED_MODEL, "input": ["Tell me about boats.", "the river"]}),
    ("/v1/rerank", {"model": RERANK_MODEL, "query": "boats",
                    "documents": ["a boat on the sea", "the river", "a green light"]}),
    ("/v1/rerank", {"model": CROSS_MODEL, "query": "boats",
                    "documents": ["a boat on the sea", "the river", "a green light"]}),
]


def canary_text(path: str, body: dict, data: bytes) -> str:
    """What a canary's answer is compared by."""
    if path == EMBEDDINGS:
        return " | ".join(" ".join(f"{v:.4f}" for v in item["embedding"][:8])
                          for item in json.loads(data)["data"])
    if path in RERANK_PATHS:
        return " ".join(f"{r['index']}:{r['relevance_score']:.4f}"
                        for r in json.loads(data)["results"])
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in data.decode().split("\n")
                  if line.startswith("data: {")]
        return "".join(e["choices"][0].get("text") or "" for e in events)
    return json.loads(data)["choices"][0]["message"]["content"]


class Fuzzer:
    """Runs cases against one server, judges them, keeps distinct failures.

    `server` is a ServerProcess this fuzzer may restart (stop/start) when it
    is down, unhealthy or wedged.
    """

    def __init__(self, server: ServerProcess, *, check_every: int = CHECK_EVERY,
                 timeout: float = TIMEOUT, log: Callable[[str], None] = lambda s: None,
                 flood_every: int = FLOOD_EVERY, flood_schemas: int = FLOOD_SCHEMAS,
                 embeddings: bool = False):
        self.server = server
        # (embeddings: the server serves testkit/bad_input.py's EMBEDDING_SERVED)
        self.canaries = CANARIES + (EMBEDDING_CANARIES if embeddings else [])
        self.check_every = check_every
        self.flood_every = flood_every  # batches between two floods (0: none)
        self.flood_schemas = flood_schemas
        self.floods = 0
        self.timeout = timeout
        self.say = log
        self.failures: Dict[str, Failure] = {}
        self.per_endpoint: Dict[str, Counter] = defaultdict(Counter)
        self.seconds: Counter = Counter()
        self.notes: Dict[str, Tuple[int, Case, str]] = {}
        self.reasons: Dict[str, Counter] = defaultdict(Counter)  # 4xx messages
        self.health_checks = self.health_failures = 0
        self.canary_checks = self.canary_failures = 0
        self.restarts = 0
        self.tried = 0
        self.batch: List[Case] = []
        self.baseline: Optional[List[str]] = None
        self._log_offset = self._log_size()

    # -- the server --

    def _log_size(self) -> int:
        try:
            return Path(self.server.log_path).stat().st_size
        except (TypeError, OSError):
            return 0

    def _new_log(self) -> str:
        """What the server logged since the last call."""
        try:
            with open(self.server.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read()
        except (TypeError, OSError):
            return ""
        self._log_offset += len(text)
        return text.decode("utf-8", "replace")

    def health(self) -> Optional[str]:
        """None when /health is 200 {"status": "ok"}, else what it was."""
        self.health_checks += 1
        out = send(self.server, Case("GET", "/health"), timeout=10)
        if out.error is not None:
            return out.error
        if out.status != 200:
            return f"{out.status} {_excerpt(out.data, 200)}"
        return None

    def canary(self) -> List[str]:
        texts = []
        for path, body in self.canaries:
            out = send(self.server, Case("POST", path, body), timeout=self.timeout)
            if out.error is not None or out.status != 200:
                texts.append(f"<{out.error or out.status}: {_excerpt(out.data, 200)}>")
                continue
            try:
                texts.append(canary_text(path, body, out.data))
            except Exception as e:  # noqa: BLE001 - reported as the canary's text
                texts.append(f"<unreadable: {e!r}>")
        return texts

    def restart(self, why: str) -> None:
        self.say(f"  restarting the server ({why})")
        self.restarts += 1
        self.server.stop()
        self.server.start()
        self._log_offset = self._log_size()

    def ensure_healthy(self) -> None:
        if self.server.proc is None or self.server.proc.poll() is not None:
            self.server.start() if self.server.proc is None else self.restart("it exited")
            return
        if self.health() is not None:
            self.restart("/health is not 200")

    def start(self) -> List[str]:
        """Record the canaries' answers (the run compares against them)."""
        self.ensure_healthy()
        self.baseline = self.canary()
        if any(t.startswith("<") for t in self.baseline):
            raise RuntimeError(f"the canary requests fail before fuzzing: {self.baseline}")
        self._new_log()
        return self.baseline

    # -- one case --

    def examine(self, case: Case) -> Tuple[Outcome, Optional[Problem], Optional[str]]:
        """Send it, judge the answer, check /health: (outcome, problem, signature)."""
        out = send(self.server, case, timeout=self.timeout)
        problem = judge(case, out)
        unhealthy = self.health()
        if unhealthy is not None:
            self.health_failures += 1
        if unhealthy is not None and problem is None:
            problem = Problem("unhealthy afterwards", f"/health: {unhealthy}")
        logs = self._new_log()  # this request's log lines, read after every request
        if problem is None:
            return out, None, None
        time.sleep(0.05)  # let the server finish its log lines
        logged = log_exception(logs + self._new_log())
        # The log names the exception behind a 500, a hang or a drop; other
        # answers (501, a plain-text 400 from aiohttp) are told by their text.
        server_side = (problem.kind == "status 500" or problem.kind in (
            "timeout", "dropped connection", "unhealthy afterwards",
            "error event in a 200 stream"))
        if logged is not None and server_side:
            exc, where, message = logged
            sig = f"{problem.kind}: {exc} at {where}"
            problem.detail += f"  [log: {exc}: {message}]"
        else:
            detail = problem.detail
            try:
                detail = strict_json(out.data).get("error", detail)
            except Exception:  # noqa: BLE001
                pass
            if problem.kind == "non-standard JSON":
                detail = problem.detail
            sig = f"{problem.kind}: {_normalize(str(detail))}"
        if unhealthy is not None or problem.kind in ("timeout", "dropped connection"):
            self.ensure_healthy_or_restart()
        return out, problem, sig

    def ensure_healthy_or_restart(self) -> None:
        """After a hang or a dropped connection: the server may be wedged."""
        if self.server.proc.poll() is not None or self.health() is not None:
            self.restart("unhealthy after a failure")
            return
        texts = self.canary()
        if texts != self.baseline:
            self.restart("the canary fails after a hang")

    def try_case(self, case: Case) -> None:
        self.tried += 1
        out, problem, sig = self.examine(case)
        self.seconds[case.endpoint] += out.seconds
        counts = self.per_endpoint[case.endpoint]
        counts["tried"] += 1
        counts[str(out.status // 100) + "xx" if out.status else out.error.split(":")[0]] += 1
        if problem is not None:
            counts["failed"] += 1
            self.record(sig, problem, case, out)
        else:
            self.note(case, out)
            if out.status and out.status >= 400 and case.method == "POST":
                try:
                    reason = _normalize(strict_json(out.data)["error"])
                except Exception:  # noqa: BLE001
                    reason = _excerpt(out.data, 60)
                self.reasons[case.endpoint][reason] += 1
        self.batch.append(case)
        if len(self.batch) >= self.check_every:
            self.check_batch()

    def note(self, case: Case, out: Outcome) -> None:
        """Answers that pass the oracle but look wrong: a completion answered
        404 for something else than the model (upstream's status for any
        error before generation)."""
        if (out.status == 404 and case.method == "POST"
                and case.path in COMPLETION_PATHS and out.data != b"Not Found"):
            try:
                message = strict_json(out.data)["error"]
            except Exception:  # noqa: BLE001
                return
            if "Model not served" in message or "load" in message.lower():
                return
            key = _normalize(message)
            n, best, _ = self.notes.get(key, (0, case, message))
            if _size(case) < _size(best):
                best = case
            self.notes[key] = (n + 1, best, message)

    def record(self, sig: str, problem: Problem, case: Case, out: Outcome) -> None:
        failure = self.failures.get(sig)
        response = (f"{out.status} {_excerpt(out.data, 300)}" if out.status
                    else str(out.error))
        logged = problem.detail.split("[log: ")[-1].rstrip("]") if "[log: " in problem.detail else ""
        if failure is None:
            self.failures[sig] = failure = Failure(sig, problem, case, out.status, response, logged)
            self.say(f"  new failure #{len(self.failures)}: {sig}\n    {case.show(300)}")
        else:
            failure.count += 1
            if _size(case) < _size(failure.case):
                failure.case, failure.problem, failure.response = case, problem, response
        failure.endpoints[case.endpoint] += 1

    def flood(self) -> None:
        """Large distinct schemas sent at once (each a body for the large
        constraint lane), and a plain request behind them: the plain one is
        answered within FLOOD_PLAIN_SECONDS (found in review: it waited
        17-26 s behind 30 of them), each large one gets a 200, a 4xx or a
        503 (the lane full or past --planning-timeout), never another 5xx
        or no answer."""
        import threading

        self.floods += 1
        salt = f"{time.monotonic_ns():x}"
        heavy = [Case("POST", CHAT, heavy_schema_body(f"{salt}_{i}"))
                 for i in range(self.flood_schemas)]
        outs: List[Optional[Outcome]] = [None] * len(heavy)

        def one(i):
            outs[i] = send(self.server, heavy[i], timeout=self.timeout)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(heavy))]
        for t in threads:
            t.start()
        time.sleep(0.2)
        plain = Case("POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 3})
        out = send(self.server, plain, timeout=self.timeout)
        for t in threads:
            t.join()
        counts = self.per_endpoint["schema flood"]
        counts["tried"] += len(heavy) + 1
        if out.status != 200 or out.seconds > FLOOD_PLAIN_SECONDS:
            counts["failed"] += 1
            self.record("plain request slow or failed during a schema flood",
                        Problem("flood", f"{out.status} {out.error or ''} after "
                                         f"{out.seconds:.2f} s"), plain, out)
        for case, got in zip(heavy, outs):
            counts[str(got.status // 100) + "xx" if got.status else "dropped"] += 1
            if got.status is None or not (got.status < 500 or got.status == 503):
                counts["failed"] += 1
                self.record(f"schema flood: {got.status or got.error}",
                            Problem("flood", _excerpt(got.data) if got.status else got.error),
                            case, got)

    def check_batch(self) -> None:
        """The canaries still get their first answers; else find the request
        of this batch after which they changed. Every flood_every batches,
        a schema flood (flood())."""
        batch, self.batch = self.batch, []
        if self.flood_every and self.canary_checks % self.flood_every == self.flood_every - 1:
            self.flood()
        self.canary_checks += 1
        texts = self.canary()
        if texts == self.baseline:
            return
        self.canary_failures += 1
        self.say(f"  canary changed: {texts} != {self.baseline}")
        self.restart("the canary changed")
        if self.canary() != self.baseline:
            self.record("canary differs even after a restart",
                        Problem("canary", f"{texts} != {self.baseline}"), batch[-1], Outcome())
            return
        for case in batch:
            send(self.server, case, timeout=self.timeout)
            after = self.canary()
            if after != self.baseline:
                self.record(f"canary changed after {case.endpoint}",
                            Problem("canary", f"{after} != {self.baseline}"), case, Outcome())
                self.restart("replayed the culprit")
                return
        self.record("canary changed (not reproduced request by request)",
                    Problem("canary", f"{texts} != {self.baseline}"), batch[-1], Outcome())

    def finish(self) -> None:
        if self.batch:
            self.check_batch()
        if self.health() is not None:
            self.health_failures += 1
            self.record("unhealthy at the end", Problem("unhealthy", "/health"),
                        Case("GET", "/health"), Outcome())

    # -- shrinking --

    def reproduces(self, case: Case, sig: str) -> bool:
        self.ensure_healthy()
        if sig.startswith("canary"):
            send(self.server, case, timeout=self.timeout)
            same = self.canary() == self.baseline
            if not same:
                self.restart("shrinking a canary failure")
            return not same
        _, problem, got = self.examine(case)
        return got == sig

    def shrink(self, failure: Failure, seconds: float, max_tries: int = 400) -> None:
        deadline = time.monotonic() + seconds
        while failure.replays < 3 and time.monotonic() < deadline:
            failure.replays += 1
            if self.reproduces(failure.case, failure.signature):
                failure.reproduced = True
                break
        if not failure.reproduced:
            return
        best, tries = failure.case, 0
        improved = True
        while improved and tries < max_tries and time.monotonic() < deadline:
            improved = False
            for candidate in case_candidates(best):
                if _size(candidate) >= _size(best):
                    continue
                if tries >= max_tries or time.monotonic() >= deadline:
                    break
                tries += 1
                if self.reproduces(candidate, failure.signature):
                    best, improved = candidate, True
                    break
        failure.minimal, failure.shrink_tries = best, tries

    def shrink_all(self, seconds_each: float, total: float) -> None:
        deadline = time.monotonic() + total
        for failure in self.failures.values():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.say(f"  shrinking: {failure.signature}")
            self.shrink(failure, min(seconds_each, left))

    # -- report --

    def report(self, elapsed: Optional[float] = None, reasons: int = 0) -> str:
        lines = []
        if reasons:
            total = Counter()
            for counter in self.reasons.values():
                total.update(counter)
            lines.append(f"Most frequent 4xx answers to POSTs (of {sum(total.values())}):")
            lines += [f"  {n:5} {reason}" for reason, n in total.most_common(reasons)]
        lines += ["Requests per endpoint:",
                 f"  {'endpoint':44} {'tried':>6} {'2xx':>6} {'4xx':>6} {'failed':>6} {'ms/req':>7}"]
        for endpoint in sorted(self.per_endpoint):
            c = self.per_endpoint[endpoint]
            ms = 1000 * self.seconds[endpoint] / max(c["tried"], 1)
            lines.append(f"  {endpoint:44} {c['tried']:6} {c['2xx']:6} {c['4xx']:6} "
                         f"{c['failed']:6} {ms:7.1f}")
        lines.append(f"  {'total':44} {self.tried:6}")
        lines.append(f"/health checks: {self.health_checks} ({self.health_failures} failed); "
                     f"canary checks: {self.canary_checks} ({self.canary_failures} changed); "
                     f"server restarts: {self.restarts}")
        if elapsed is not None:
            lines.append(f"time: {elapsed:.0f} s ({1000 * elapsed / max(self.tried, 1):.0f} ms/request)")
        if self.notes:
            lines.append("Notes (pass the oracle, look odd): completions answered 404 for:")
            for key, (n, case, message) in sorted(self.notes.items(), key=lambda kv: -kv[1][0]):
                lines.append(f"  {n}x {message[:150]!r}\n     e.g. {case.show(200)}")
        lines.append(f"Distinct failures: {len(self.failures)}")
        for i, failure in enumerate(self.failures.values(), 1):
            lines.append(f"{i:2}. {failure.describe()}")
        lines.append("VERDICT: " + ("PASS" if not self.failures
                                    else f"FAIL ({len(self.failures)} distinct failures)"))
        return "\n".join(lines)

    def summary(self, elapsed: float) -> dict:
        return {
            "tried": self.tried, "seconds": elapsed,
            "per_endpoint": {e: dict(c) for e, c in self.per_endpoint.items()},
            "health_checks": self.health_checks, "health_failures": self.health_failures,
            "canary_checks": self.canary_checks, "canary_failures": self.canary_failures,
            "restarts": self.restarts,
            "failures": [{"signature": f.signature, "count": f.count,
                          "endpoints": dict(f.endpoints),
                          "minimal": (f.minimal or f.case).show(2000),
                          "problem": f"{f.problem.kind}: {f.problem.detail}",
                          "response": f.response,
                          "reproduced": f.reproduced if f.replays else None}
                         for f in self.failures.values()],
        }


def json_candidates(v: Any) -> Iterator[Any]:
    """Simpler JSON values than v, roughly simplest first."""
    if isinstance(v, dict):
        keys = list(v)
        if len(keys) > 1:
            half = len(keys) // 2
            yield {k: v[k] for k in keys[:half]}
            yield {k: v[k] for k in keys[half:]}
        for k in keys:
            yield {kk: vv for kk, vv in v.items() if kk != k}
        for k in keys:
            for c in json_candidates(v[k]):
                yield {**v, k: c}
        for k in keys:
            if isinstance(k, str) and len(k) > 1:
                yield {(k[: len(k) // 2] if kk == k else kk): vv for kk, vv in v.items()}
    elif isinstance(v, list):
        n = len(v)
        if n > 1:
            yield v[: n // 2]
            yield v[n // 2:]
        for i in range(n):
            yield v[:i] + v[i + 1:]
        for i in range(n):
            for c in json_candidates(v[i]):
                yield v[:i] + [c] + v[i + 1:]
        if n == 1 and not isinstance(v[0], (list, dict)):
            yield v[0]
    elif isinstance(v, str):
        if v:
            yield ""
        if len(v) > 1:
            yield v[: len(v) // 2]
            yield v[len(v) // 2:]
            yield v[0]
            yield v[:-1]
        if v and v != "a" and len(v) == 1:
            yield "a"
    elif isinstance(v, bool):
        if v:
            yield False
    elif isinstance(v, int):
        for c in (0, 1, -1):
            if c != v:
                yield c
        digits = str(abs(v))
        if len(digits) > 1:
            yield int(digits[: len(digits) // 2]) * (1 if v > 0 else -1)
            yield int(digits[:-1]) * (1 if v > 0 else -1)
    elif isinstance(v, float):
        for c in (0, 1, 0.0, 1.0):
            if c != v or type(c) is not float:
                yield c
        if math.isfinite(v) and v != int(v):
            yield float(int(v))
    if isinstance(v, (list, dict)) and v:
        yield [] if isinstance(v, list) else {}
        for child in (v.values() if isinstance(v, dict) else v):
            if isinstance(child, (list, dict)):
                yield child


def case_candidates(case: Case) -> Iterator[Case]:
    if case.headers:
        yield replace(case, headers=())
    if case.split:
        yield replace(case, split=False)
    if case.raw is not None:
        for raw in case.raw.smaller():
            yield replace(case, raw=raw)
        return
    if "?" in case.path:
        yield replace(case, path=case.path.split("?")[0])
    if case.body is not NO_BODY:
        if case.method != "POST":
            yield replace(case, body=NO_BODY)
        for body in json_candidates(case.body):
            yield replace(case, body=body)
    if case.method != "POST" and case.path.count("/") > 1:
        yield replace(case, path=case.path.rsplit("/", 1)[0] or "/")


# -- running ---------------------------------------------------------------------


def run(fuzzer: Fuzzer, examples: int, *, seed: Optional[int] = None,
        ctx: Context = Context(), strategy: Optional[st.SearchStrategy] = None,
        progress_every: int = 0) -> None:
    """`examples` hypothesis-generated cases through the fuzzer. Failures are
    recorded, never raised: the run goes on and every distinct one is kept.
    A seed makes the run reproducible."""
    strategy = strategy if strategy is not None else cases(ctx)
    started = time.monotonic()

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              derandomize=False, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(case):
        fuzzer.try_case(case)
        if progress_every and fuzzer.tried % progress_every == 0:
            fuzzer.say(f"  {fuzzer.tried} requests, {time.monotonic() - started:.0f} s, "
                       f"{len(fuzzer.failures)} distinct failures")

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    one()


def corpus_cases(corpora=("chat",)) -> List[Case]:
    """testkit/bad_input.py's hand-written corpora, tried first: "chat"
    (CASES) and "embeddings" (EMBEDDINGS_CASES and RERANK_CASES, for a
    server serving its EMBEDDING_SERVED)."""
    from testkit.bad_input import CASES, EMBEDDINGS_CASES, RERANK_CASES

    chosen = {"chat": CASES, "embeddings": EMBEDDINGS_CASES + RERANK_CASES}
    out = []
    for path, body in [case for name in corpora for case in chosen[name]]:
        if isinstance(body, bytes):
            out.append(Case("POST", path, raw=Raw("bytes", text=body.decode("latin-1"))))
        else:
            out.append(Case("POST", path, body))
    return out


def server_for(model: Optional[str], log: Path, extra: List[str] = (),
               models_config: Optional[Path] = None) -> ServerProcess:
    """The server under test: `model`, or a --models-config's models."""
    served = ["--models-config", str(models_config)] if models_config else ["--model", model]
    return ServerProcess(OURS, [*served, *SERVER_FLAGS, *extra], log=log, env=SERVER_ENV)


def fixture_builder(root: Path) -> Callable[[str], Path]:
    """kind -> its fixture's folder under `root`, built on first use (chat,
    vision and embedding kinds)."""
    from testkit.embedding_fixtures import EMBEDDING_KINDS, build_embedding_fixture
    from testkit.fixtures import VISION_KINDS, build_fixture, build_vision_fixture

    def build(kind):
        if kind in EMBEDDING_KINDS:
            return build_embedding_fixture(kind, root)
        return (build_vision_fixture if kind in VISION_KINDS else build_fixture)(kind, root)

    return build


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fuzz", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--examples", type=int, default=5000)
    parser.add_argument("--kind", default="qwen3", help="fixture kind (testkit/fixtures.py)")
    parser.add_argument("--model", help="a model folder instead of a fixture")
    parser.add_argument("--fixtures", help="where fixtures are built "
                        "(default: $MLX_LM_PLUS_FIXTURES or a temporary folder)")
    parser.add_argument("--seed", type=int, default=None,
                        help="hypothesis seed (default: random; printed)")
    parser.add_argument("--allow-model-loading", action="store_true",
                        help="start the server with --allow-model-loading")
    parser.add_argument("--embedders", action="store_true",
                        help="serve testkit/bad_input.py's EMBEDDING_SERVED (the qwen3 chat "
                        "fixture, an embedder, a reranker; not --kind or --model) and fuzz "
                        "/v1/embeddings and the rerank paths too")
    parser.add_argument("--server-args", default="", help="more server flags")
    parser.add_argument("--check-every", type=int, default=CHECK_EVERY,
                        help="requests between canary checks (/health: after every one)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT)
    parser.add_argument("--flood-every", type=int, default=FLOOD_EVERY,
                        help="batches of --check-every requests between two schema floods "
                        "(0: none)")
    parser.add_argument("--shrink-seconds", type=float, default=90,
                        help="time to shrink each distinct failure (0: no shrinking)")
    parser.add_argument("--no-corpus", action="store_true",
                        help="skip testkit/bad_input.py's corpus before generating")
    parser.add_argument("--log", help="server log file (default: in a temporary folder)")
    parser.add_argument("--json", help="write the figures and failures here")
    args = parser.parse_args(argv)

    import os
    import random
    import shlex

    os.environ.update(SERVER_ENV)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    root = Path(args.fixtures or os.environ.get("MLX_LM_PLUS_FIXTURES") or work)
    root.mkdir(parents=True, exist_ok=True)
    models_config = None
    if args.embedders:
        from testkit.bad_input import EMBEDDING_SERVED, models_config_file

        build = fixture_builder(root)
        models_config = models_config_file(build, work)
        model = str(build(EMBEDDING_SERVED["chat"]))  # (the default model)
    elif args.model:
        model = args.model
    else:
        model = str(fixture_builder(root)(args.kind))
    extra = (["--allow-model-loading"] if args.allow_model_loading else []) + shlex.split(
        args.server_args)
    log = Path(args.log) if args.log else work / "server.log"
    server = server_for(model, log, extra, models_config=models_config)
    print(f"fuzz: {args.examples} examples, seed {seed}, model {model}\n"
          f"server: {' '.join(server.command)}\nserver log: {log}", flush=True)

    fuzzer = Fuzzer(server, check_every=args.check_every, timeout=args.timeout,
                    log=lambda s: print(s, flush=True), flood_every=args.flood_every,
                    embeddings=args.embedders)
    start = time.monotonic()
    with server:
        baseline = fuzzer.start()
        print(f"canary answers: {baseline}", flush=True)
        if not args.no_corpus:
            corpus = corpus_cases(("chat", "embeddings") if args.embedders else ("chat",))
            print(f"corpus: {len(corpus)} cases from testkit/bad_input.py", flush=True)
            for case in corpus:
                fuzzer.try_case(case)
        ctx = Context(model=model, embeddings=args.embedders)
        run(fuzzer, args.examples, seed=seed, ctx=ctx, progress_every=500)
        fuzzer.finish()
        fuzz_seconds = time.monotonic() - start
        if args.shrink_seconds > 0 and fuzzer.failures:
            print(f"shrinking {len(fuzzer.failures)} failures...", flush=True)
            fuzzer.shrink_all(args.shrink_seconds, total=args.shrink_seconds * len(fuzzer.failures))
    elapsed = time.monotonic() - start
    print(f"\nfuzzing took {fuzz_seconds:.0f} s, shrinking {elapsed - fuzz_seconds:.0f} s "
          f"(seed {seed})")
    print(fuzzer.report(fuzz_seconds, reasons=25))
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, **fuzzer.summary(elapsed)}, indent=1))
    return 1 if fuzzer.failures else 0


if __name__ == "__main__":
    sys.exit(main())
