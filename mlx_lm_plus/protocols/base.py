"""What a wire protocol gives the server: chat and text completions
(chat.py), Anthropic Messages, OpenAI Responses, each one module.

A protocol translates its request body into the one `ParsedRequest` chat
completions make (messages, tools, sampling, thinking switch), so everything
behind it - the prompt plan, the batch, the cache and its checkpoints, the
limits, disconnects, metrics - is shared. On the way back, the server feeds
an `Exchange` the assembler's deltas (text, tool calls, reasoning) and the
end; the exchange writes the protocol's own SSE frames and final body. No
I/O happens in either, so both directions are testable alone. A protocol is
served once registered (`Server.add_protocol`, in app.build).
"""

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from mlx_lm_plus.protocols.assembler import CompletionAssembler
from mlx_lm_plus.protocols.tools import forced_tool


@dataclass
class Completion:
    """How a generation ended, and what it cost."""

    finish_reason: str  # the assembler's: "stop", "length", "tool_calls"
    stop_sequence: Optional[str]  # the stop word that ended it, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from the prompt cache


class Exchange:
    """One request's answer in one protocol, fed by the server's one drain
    loop (http/completion.py): `assembler` once the engine accepted the
    request, `delta` for each chunk the assembler has due, `last_delta` at
    the end, then `finish` or `body`. Streaming: `start`, the deltas and
    `finish` return the SSE frames to send, and `stream_error` ends a stream
    that failed; not streaming, the deltas only accumulate and `body` is
    the JSON answer."""

    id: str = ""

    # Whether the protocol's clients take an SSE comment as activity (their
    # idle timers count any bytes): then a prefill progress comment keeps
    # the stream alive too, and `keepalive` is only due after silence.
    comments_keep_alive: bool = False

    def assembler(self, ctx, parsed) -> CompletionAssembler:
        """What turns the engine's tokens into this answer's deltas: by
        default one delta as soon as one is due, streaming or not (a body
        is made of them), with no logprobs."""
        return CompletionAssembler(ctx, parsed.request.tools, True, False, 0,
                                   forced_tool=forced_tool(parsed.request))

    def start(self, prompt_tokens: int, cached_tokens: int) -> bytes:
        """The stream's first frames, once the engine accepted the request."""
        return b""

    def delta(self, text: str, tool_calls: List[dict], reasoning: str) -> bytes:
        raise NotImplementedError

    def last_delta(self, text: str, tool_calls: List[dict], reasoning: str) -> bytes:
        """What the assembler's end flushed (text held back, a call cut
        off), just before `finish` or `body`: by default one more delta."""
        return self.delta(text, tool_calls, reasoning)

    def finish(self, completion: Completion) -> bytes:
        raise NotImplementedError

    def body(self, completion: Completion) -> Dict[str, Any]:
        raise NotImplementedError

    def stream_error(self, message: str, status: int) -> bytes:
        raise NotImplementedError

    def keepalive(self) -> bytes:
        """What keeps a started stream alive while nothing else comes
        (prefill): a frame the protocol's clients read and ignore."""
        return b": keepalive\n\n"

    # Whether `save` has anything to do for this answer.
    keeps_answer: bool = False

    def save(self) -> None:
        """Keep what the protocol keeps of a finished answer (Responses:
        the stored response). Called once `finish` or `body` returned,
        before the answer is sent, in an executor: it may write JSON."""

    def count_body(self, input_tokens: int) -> Dict[str, Any]:
        """The answer to a request planned only (`Request.count_only`)."""
        return {"input_tokens": input_tokens}


class WireProtocol:
    """The request side of a protocol, and its error shape."""

    # The POST paths that generate (or count), and the prefix of every path
    # this protocol answers, whatever the method (`route`; its errors take
    # the protocol's shape). Without a prefix, only POSTs to `paths` are
    # the protocol's: other methods get the server's own answers.
    paths: tuple = ()
    prefix: str = ""
    # Whether its clients name models of their own (claude-..., gpt-...):
    # then a model this server doesn't serve means the default model, and
    # the name is echoed back.
    names_own_models: bool = False

    def serves(self, path: str) -> bool:
        return path in self.paths or (bool(self.prefix) and path.startswith(self.prefix))

    def route(self, method: str, path: str):
        """(status, body) for a request that doesn't generate, or None."""
        return None

    def parse(self, path: str, body: Any, cli, vocab_size: Optional[int]):
        """-> validation.ParsedRequest (raises RequestError)."""
        raise NotImplementedError

    def error_body(self, message: str, status: int) -> Dict[str, Any]:
        raise NotImplementedError

    def exchange(self, parsed, request_id: str) -> Exchange:
        raise NotImplementedError


def chat_content(parts: List[dict]):
    """Chat content of text and image_url parts: the text alone when there is
    no image (what mlx-lm's process_message_content makes of it anyway),
    else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def json_bytes(data: Any) -> bytes:
    """UTF-8 JSON: non-ASCII as it is, unless a lone surrogate (which a
    client may send in any string, and a stream echoes) makes that
    impossible: then escaped, as json.dumps does by default."""
    try:
        return json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(data).encode()


def sse(event: str, data: Dict[str, Any]) -> bytes:
    """One named server-sent event."""
    return b"event: " + event.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"
