"""OpenAI's chat completions and text completions, as mlx_lm.server 0.32.2
answers them: POST /v1/chat/completions (and /chat/completions) and
/v1/completions.

The body is validated by `parse_request` as it comes (the other protocols
translate theirs into this form). The answer is upstream's shapes
(assembler.ResponseBuilder): one `chat.completion` or `text_completion`
object; or a stream of `data: {chunk}` events, the last chunk carrying the
finish reason, then a usage chunk if `stream_options.include_usage`, then
`data: [DONE]`. A stream that fails ends with `data: {"error": ...}` and
`data: [DONE]`.
"""

import json
import time
import uuid
from typing import Any, Dict

from mlx_lm_plus.protocols.assembler import CompletionAssembler, ResponseBuilder
from mlx_lm_plus.protocols.base import Completion, Exchange, WireProtocol
from mlx_lm_plus.protocols.tools import forced_tool
from mlx_lm_plus.protocols.validation import parse_request

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
COMPLETION_PATHS = (TEXT, CHAT, "/chat/completions")
DONE = b"data: [DONE]\n\n"


def data_event(obj) -> bytes:
    """An SSE data event as upstream writes it (json.dumps' defaults:
    non-ASCII escaped)."""
    return f"data: {json.dumps(obj)}\n\n".encode()


class ChatCompletionsProtocol(WireProtocol):
    paths = COMPLETION_PATHS

    def __init__(self, system_fingerprint: str):
        self.system_fingerprint = system_fingerprint

    def parse(self, path, body, cli, vocab_size):
        return parse_request(path, body, cli, vocab_size)

    def error_body(self, message, status):
        return {"error": message}

    def exchange(self, parsed, request_id):
        return ChatExchange(parsed, request_id, self.system_fingerprint)


class ChatExchange(Exchange):
    """One chat or text completion: its chunks as they come, or its object."""

    # Chat clients' idle timers count any bytes: a progress comment is a
    # keepalive too.
    comments_keep_alive = True

    def __init__(self, parsed, request_id: str, system_fingerprint: str):
        # (The server's hex id, written as upstream writes its uuid4s.)
        uid = uuid.UUID(hex=request_id)
        if parsed.request.request_type == "text":
            self.id, object_type = f"cmpl-{uid}", "text_completion"
        else:
            self.id = f"chatcmpl-{uid}"
            object_type = "chat.completion.chunk" if parsed.stream else "chat.completion"
        self.stream = parsed.stream
        options = parsed.stream_options
        self.include_usage = bool(options is not None and options.get("include_usage"))
        self.logprobs = parsed.args.logprobs
        self.top_logprobs = parsed.args.top_logprobs
        self.builder = ResponseBuilder(
            request_id=self.id,
            object_type=object_type,
            model=parsed.requested_model,
            created=int(time.time()),
            system_fingerprint=system_fingerprint,
            stream=parsed.stream,
        )
        self._assembler = None
        self._last = ("", [], "")  # (text, tool calls, reasoning) at the end

    def assembler(self, ctx, parsed) -> CompletionAssembler:
        # Its own: a stream's chunks as they are due (none for a body, which
        # is made at the end, logprobs and all, from this assembler).
        self._assembler = CompletionAssembler(
            ctx,
            parsed.request.tools,
            self.stream,
            self.logprobs,
            self.top_logprobs,
            forced_tool=forced_tool(parsed.request),
        )
        return self._assembler

    def delta(self, text, tool_calls, reasoning):
        if text and not tool_calls and not reasoning:  # most tokens
            return self.builder.text_chunk(text)
        return data_event(self.builder.response(
            text, None, tool_calls=tool_calls, reasoning_text=reasoning))

    def last_delta(self, text, tool_calls, reasoning):
        # (It goes out with the finish reason, in finish's chunk or the body.)
        self._last = (text, tool_calls, reasoning)
        return b""

    def finish(self, completion: Completion) -> bytes:
        text, tool_calls, reasoning = self._last
        frames = data_event(self.builder.response(
            text, completion.finish_reason, tool_calls=tool_calls, reasoning_text=reasoning))
        if self.include_usage:
            frames += data_event(self.builder.usage_response(
                completion.prompt_tokens, completion.completion_tokens,
                self._assembler.ctx.prompt_cache_count))
        return frames + DONE

    def body(self, completion: Completion) -> Dict[str, Any]:
        text, tool_calls, reasoning = self._last
        assembler = self._assembler
        return self.builder.response(
            text,
            completion.finish_reason,
            completion.prompt_tokens,
            completion.completion_tokens,
            # (As the engine left it: upstream's -1 is no cached count.)
            assembler.ctx.prompt_cache_count,
            token_logprobs=assembler.token_logprobs,
            top_tokens=assembler.top_tokens,
            tokens=assembler.tokens,
            reasoning_text=reasoning,
            tool_calls=tool_calls,
        )

    def stream_error(self, message: str, status: int) -> bytes:
        return data_event({"error": message}) + DONE

