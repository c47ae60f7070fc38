"""OpenAI's Responses API: POST /v1/responses, GET and DELETE
/v1/responses/{id}, POST /v1/responses/input_tokens.

The request is translated into a chat-completions body and validated by the
same `parse_request`, so the prompt plan, cache and batch are those of chat
completions: the same conversation sent on either API renders the same
tokens and reuses the same cache entries. The answer is written from the
assembler's deltas as Responses output items and stream events.

What the Responses fields become:
  instructions                       -> a system message, first (not carried
                                        over by previous_response_id)
  input: a string                    -> one user message
  message items (developer: system)  -> messages; input_text / output_text
                                        parts joined, input_image ->
                                        image_url parts
  reasoning, message (assistant),    -> one assistant message (as the
  function_call items in a row          assistant turn they came from):
                                        reasoning_content, content, tool_calls
                                        (arguments as JSON text, id = call_id)
  function_call_output               -> a "tool" message
  previous_response_id               -> the stored conversation (its messages
                                        and its output) before `input`
  tools (function)                   -> chat tools; tool_choice "none" -> no
                                        tools in the prompt
  max_output_tokens, temperature, top_p: max_tokens, temperature, top_p
  reasoning.effort                   -> chat_template_kwargs.enable_thinking
                                        (none / minimal: off, others: on)
  text.format json_schema/json_object -> response_format (passed along)
Usage: input_tokens is the whole prompt, input_tokens_details.cached_tokens
the part reused from the prompt cache; output_tokens_details.reasoning_tokens
counts the assembler's chunks that carried reasoning (one per token as the
server drives an exchange).

Stored responses (store, default true) live in a bounded in-memory store:
`ResponseStore` (count, bytes, time to live; least recently used first
out), each as the JSON it is (a Python dict held 5 to 30 times its JSON
length), its conversation's data URLs kept apart, so that what the budget
counts is what the store holds.
"""

import copy
import json
import logging
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from mlx_lm_plus.protocols.replay import seal
from mlx_lm_plus.protocols.validation import (
    RequestError,
    check_item_count,
    parse_request,
)
from mlx_lm_plus.protocols.base import Completion, Exchange, WireProtocol, json_bytes, sse
from mlx_lm_plus.protocols.response_store import ResponseStore
from mlx_lm_plus.protocols.responses_input import (
    ResponsesRequest,
    not_found,
    output_messages,
    parses_as_json,
    to_chat_body,
)

RESPONSES = "/v1/responses"
INPUT_TOKENS = "/v1/responses/input_tokens"
# The same without /v1, as chat completions has /chat/completions (an SDK
# whose base URL lacks /v1 calls these).
ALIASES = ("/responses", "/responses/input_tokens")

# The error codes a failed response may carry (the SDK's ResponseError.code).
FAILED_CODES = {400: "invalid_prompt", 404: "server_error"}


def _hex() -> str:
    return uuid.uuid4().hex






# -- the protocol --


class ResponsesProtocol(WireProtocol):
    paths = (RESPONSES, INPUT_TOKENS, *ALIASES)
    prefix = RESPONSES
    names_own_models = True

    def __init__(self, store: Optional[ResponseStore] = None, *,
                 max_responses: int = 1000, max_bytes: int = 256 * 1024**2,
                 ttl: Optional[float] = 24 * 3600.0):
        self.store = store if store is not None else ResponseStore(
            max_responses=max_responses, max_bytes=max_bytes, ttl=ttl)

    def serves(self, path):
        return path in self.paths or path.startswith((RESPONSES + "/", "/responses/"))

    def route(self, method, path):
        rest = path.split("/responses/", 1)[1] if "/responses/" in path else ""
        parts = rest.split("/")
        if len(parts) == 1 and parts[0] and parts[0] != "input_tokens":
            key = parts[0]
            if method == "GET":
                entry = self.store.get(key)
                if entry is None:
                    return 404, self.error_body(str(not_found(key)), 404)
                return 200, entry.response_json
            if method == "DELETE":
                if not self.store.delete(key):
                    return 404, self.error_body(str(not_found(key)), 404)
                return 200, {"id": key, "object": "response", "deleted": True}
        if len(parts) == 2 and parts[1] == "cancel" and method == "POST":
            if self.store.get(parts[0]) is None:
                return 404, self.error_body(str(not_found(parts[0])), 404)
            return 400, self.error_body(
                "Only background responses can be cancelled, and this server makes "
                "none: this response is already complete.", 400)
        return None

    def parse(self, path, body, cli, vocab_size):
        count_only = path.endswith("/input_tokens")
        ceiling = cli.max_tokens_ceiling
        if (isinstance(body, dict) and ceiling is not None
                and isinstance(body.get("max_output_tokens"), int)
                and body["max_output_tokens"] > ceiling):
            raise RequestError(f"max_output_tokens: must be at most {ceiling} on this server "
                        "(--max-tokens-ceiling)")
        if isinstance(body, dict):
            check_item_count([body.get("input")], ("content", "output"), cli,
                             "input items and parts")
        chat, extra = to_chat_body(body, self.store, count_only)
        parsed = parse_request("/v1/chat/completions", chat, cli, vocab_size)
        # The sampling actually used (the server's defaults when not given).
        extra.echo["temperature"] = parsed.args.sampling.temperature
        extra.echo["top_p"] = parsed.args.sampling.top_p
        parsed.extra = extra
        parsed.carried_bytes = extra.carried_bytes
        if count_only:
            parsed.request.count_only = True
            parsed.stream = False
        return parsed

    def error_body(self, message, status):
        kind = "server_error" if status >= 500 else "invalid_request_error"
        code = "invalid_api_key" if status == 401 else None
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}

    def exchange(self, parsed, request_id):
        return ResponsesExchange(f"resp_{request_id}", parsed.extra, parsed.stream,
                                 self.store)


# -- the answer --


class ResponsesExchange(Exchange):
    """One response: output items in the order generated (reasoning,
    message, function calls), as a Response object or as its stream of
    events. Whitespace before any other text is held back, and dropped if
    no message follows it (between or after function calls)."""

    def __init__(self, response_id: str, request: ResponsesRequest, stream: bool,
                 store: Optional[ResponseStore] = None):
        self.id = response_id
        self.request = request
        self.stream = stream
        self.store = store
        self.created_at = int(time.time())
        self.output: List[dict] = []
        self._open: Optional[str] = None  # "reasoning" / "message": the item streamed
        self._held = ""  # whitespace that may start a message
        self._seq = 0
        self._started = False
        self._snapshot = b""  # the response at the start (JSON)
        self._finished: Optional[dict] = None  # the response once it ended, to store
        self.keeps_answer = store is not None and request.store
        self.reasoning_chunks = 0

    # -- shapes --

    def response(self, status: str, usage=None, error=None, incomplete=None) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": incomplete,
            "output": [copy.deepcopy(item) for item in self.output],
            "usage": usage,
            **self.request.echo,
        }

    @staticmethod
    def usage(completion: Completion, reasoning_tokens: int) -> dict:
        return {
            "input_tokens": completion.prompt_tokens,
            "input_tokens_details": {"cached_tokens": completion.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": completion.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        }

    def _event(self, kind: str, **fields) -> bytes:
        if not self.stream:
            return b""
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(kind, data)

    # -- items --

    def _close(self, status: str = "completed") -> bytes:
        if self._open is None:
            return b""
        index = len(self.output) - 1
        item = self.output[index]
        item["status"] = status
        if item["type"] == "reasoning" and self.request.sealed_reasoning:
            # Given back in the next request's input (replay.py).
            item["encrypted_content"] = seal(item["content"][0]["text"])
        self._open = None
        if not self.stream:
            return b""
        part = item["content"][0]
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=part["text"])
        else:
            done = self._event("response.output_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=part["text"],
                               logprobs=[])
        return (done
                + self._event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=dict(part))
                + self._event("response.output_item.done", output_index=index,
                              item=copy.deepcopy(item)))

    def _append(self, kind: str, piece: str) -> bytes:
        out = b""
        if self._open != kind:
            out += self._close()
            if kind == "reasoning":
                item = {"id": f"rs_{_hex()}", "type": "reasoning", "summary": [],
                        "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": f"msg_{_hex()}", "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.output.append(item)
            self._open = kind
            index = len(self.output) - 1
            out += self._event("response.output_item.added", output_index=index,
                               item=copy.deepcopy(item))
            item["content"].append(part)
            out += self._event("response.content_part.added", item_id=item["id"],
                               output_index=index, content_index=0, part=dict(part))
        item = self.output[-1]
        item["content"][0]["text"] += piece
        index = len(self.output) - 1
        if kind == "reasoning":
            return out + self._event("response.reasoning_text.delta", item_id=item["id"],
                                     output_index=index, content_index=0, delta=piece)
        return out + self._event("response.output_text.delta", item_id=item["id"],
                                 output_index=index, content_index=0, delta=piece,
                                 logprobs=[])

    def _function_call(self, call: dict) -> bytes:
        out = self._close()
        self._held = ""
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {},
                                   ensure_ascii=False)
        item = {"id": f"fc_{_hex()}", "type": "function_call", "status": "in_progress",
                "call_id": str(call.get("id") or f"call_{_hex()}"),
                "name": function.get("name", ""), "arguments": ""}
        if item["name"] in self.request.namespaced:
            item["namespace"], item["name"] = self.request.namespaced[item["name"]]
        self.output.append(item)
        index = len(self.output) - 1
        out += self._event("response.output_item.added", output_index=index,
                           item=dict(item))
        item["arguments"] = arguments
        out += self._event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=arguments)
        out += self._event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=arguments)
        # (Arguments that don't parse: a call max_tokens cut off, as far as
        # the model wrote it: responses.TruncatedCall.)
        item["status"] = "completed" if parses_as_json(arguments) else "incomplete"
        return out + self._event("response.output_item.done", output_index=index,
                                 item=dict(item))

    # -- the Exchange --

    def start(self, prompt_tokens: int = 0, cached_tokens: int = 0) -> bytes:
        self._started = True
        # The snapshot (echoing the request's tools, megabytes of them for
        # some clients) is written once for both events, on the event loop.
        self._snapshot = json_bytes(self.response("in_progress"))
        return (self._snapshot_event("response.created")
                + self._snapshot_event("response.in_progress"))

    def _snapshot_event(self, kind: str) -> bytes:
        """An event carrying the response: as it was at the start (written
        once: it echoes the request's tools), or as it is once it has output."""
        if self.output:
            self._snapshot = json_bytes(self.response("in_progress"))
        head = json.dumps({"type": kind, "sequence_number": self._seq})[:-1].encode()
        self._seq += 1
        return (b"event: " + kind.encode() + b"\ndata: " + head + b', "response": '
                + self._snapshot + b"}\n\n")

    def keepalive(self) -> bytes:
        # An event, not a comment: Codex's SSE reader drops comments and its
        # idle timer (5 minutes) counts events only; a repeated
        # response.in_progress is one Codex and OpenAI's SDKs take (the SDK
        # replaces the output items it names: the response as it is now).
        if not (self.stream and self._started):
            return super().keepalive()
        return self._snapshot_event("response.in_progress")

    def delta(self, text, tool_calls, reasoning) -> bytes:
        out = b""
        if reasoning:
            self.reasoning_chunks += 1
            out += self._append("reasoning", reasoning)
        if text:
            if self._open != "message" and not (self._held + text).strip():
                self._held += text
            else:
                text, self._held = self._held + text, ""
                out += self._append("message", text)
        for call in tool_calls or ():
            out += self._function_call(call)
        return out

    def _end(self, completion: Completion) -> Tuple[bytes, str, dict]:
        """Close the last item: (its frames, the status, the response)."""
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        frames = self._close(status)
        reasoning_tokens = min(self.reasoning_chunks, completion.completion_tokens)
        response = self.response(status, self.usage(completion, reasoning_tokens),
                                 incomplete=incomplete)
        self._finished = response
        return frames, status, response

    def finish(self, completion: Completion) -> bytes:
        frames, status, response = self._end(completion)
        return frames + self._event(f"response.{status}", response=response)

    def body(self, completion: Completion) -> Dict[str, Any]:
        return self._end(completion)[2]

    def stream_error(self, message: str, status: int) -> bytes:
        code = FAILED_CODES.get(status, "server_error")
        error = {"code": code, "message": message}
        try:
            out = b"" if self._started else self.start()
            if self._open is not None:
                self.output[-1]["status"] = "incomplete"
                self._open = None
            return out + self._event("response.failed",
                                     response=self.response("failed", error=error))
        except Exception:
            # What failed may be the response itself (its echo): the event
            # then says what the error is, with the Response's required
            # fields at their defaults.
            logging.exception("Could not write a failed response in full")
            model = self.request.echo.get("model")
            return self._event("response.failed", response={
                "id": self.id, "object": "response", "created_at": self.created_at,
                "status": "failed", "error": error, "incomplete_details": None,
                "output": [], "model": model if isinstance(model, str) else "",
                "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
                "instructions": None, "metadata": {}, "temperature": None, "top_p": None})

    def count_body(self, input_tokens: int) -> Dict[str, Any]:
        return {"object": "response.input_tokens", "input_tokens": input_tokens}

    def save(self) -> None:
        """Store the finished response (store: true)."""
        response = self._finished
        if self.store is None or not self.request.store or response is None:
            return
        try:
            messages = self.request.history + output_messages(response["output"])
            self.store.put(response, messages)
        except Exception:
            # The answer stands; only a continuation of it will not find it.
            logging.exception(f"Could not store response ...{str(response.get('id'))[-6:]}")
