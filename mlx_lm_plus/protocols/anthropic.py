"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

The request is translated into a chat-completions body (system and
messages, tools, thinking switch, sampling) and validated by the same
`parse_request`, so the prompt plan, cache and batch are those of chat
completions: the same conversation sent on either API renders the same
tokens and reuses the same cache entries. The answer is written from the
assembler's deltas as Anthropic's content blocks and stream events.

What Anthropic's fields become:
  system (string or text blocks)    -> a system message
  text / image (base64 or url)      -> text and image_url parts
  tool_use (assistant)              -> tool_calls (arguments as JSON text)
  tool_result (user)                -> a "tool" message per result
  thinking (assistant)              -> reasoning_content (templates drop or
                                       keep it as they do for their own
                                       replies); redacted_thinking is dropped
  thinking / output_config.effort   -> chat_template_kwargs.enable_thinking
  tool_choice none                  -> no tools in the prompt
  stop_sequences, temperature, top_p, top_k, max_tokens: as named
Usage: input_tokens counts the prompt tokens computed for this request,
cache_read_input_tokens those reused from the prompt cache (their sum is the
prompt); every computed token is cached as it is computed, at no extra cost,
so cache_creation_input_tokens is 0.
"""

import binascii
import json
import re
import uuid
from typing import Any, Dict, List, Optional

from mlx_lm_plus.codec import b64decode
from mlx_lm_plus.logs import warn_once
from mlx_lm_plus.protocols.replay import seal
from mlx_lm_plus.protocols.assembler import partial_json
from mlx_lm_plus.protocols.validation import (
    FOREIGN_ENFORCEMENT,
    RequestError,
    check_item_count,
    parse_request,
    refuse_foreign_enforcement,
)
from mlx_lm_plus.protocols.base import Completion, Exchange, WireProtocol, chat_content, sse
from mlx_lm_plus.protocols.tools import (
    MESSAGES_THINKING_BY_EFFORT,
    chat_tool,
    has_tool,
    named_tool,
    thinking_switch,
)

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"

# Anthropic's error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    411: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Claude Code's attribution line, in the first system block: billing metadata
# for Anthropic's servers, nothing a local model needs. Its text differs
# between sessions (2.1.197: `cc_version=2.1.197.6e2; cc_entrypoint=sdk-cli;`,
# the same for a whole session) and in earlier versions between requests (a
# `cch=` hash), so kept, no session's prompt is reused by the next. Removed
# by default (--keep-billing-header keeps it).
BILLING_HEADER = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)", re.MULTILINE)


def _text_of(blocks, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise RequestError(f"{where}: must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise RequestError(f"{where}.{i}: only text blocks are allowed here")
        if not isinstance(block.get("text"), str):
            raise RequestError(f"{where}.{i}.text: Field required (a string)")
        parts.append(block["text"])
    return "\n\n".join(parts)


def _image_part(block: dict, where: str) -> dict:
    source = block.get("source")
    if not isinstance(source, dict):
        raise RequestError(f"{where}.source: Field required")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_TYPES:
            raise RequestError(f"{where}.source.media_type: must be one of {', '.join(IMAGE_TYPES)}")
        if not isinstance(data, str):
            raise RequestError(f"{where}.source.data: Field required (base64 text)")
        try:
            b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RequestError(f"{where}.source.data: invalid base64 data ({e})") from e
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise RequestError(f"{where}.source.url: Field required (a string)")
    else:
        raise RequestError(f"{where}.source.type: must be 'base64' or 'url'")
    return {"type": "image_url", "image_url": {"url": url}}


def _content_part(block: dict, at: str) -> Optional[dict]:
    """A text or image block as a chat part (None: another kind of block)."""
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise RequestError(f"{at}.text: Field required (a string)")
        return {"type": "text", "text": block["text"]}
    if kind == "image":
        return _image_part(block, at)
    return None


def _user_parts(blocks: list, where: str, tool_ids: set, messages: list) -> None:
    """A user turn's blocks: tool results first (one "tool" message each),
    then the text and images as one user message."""
    parts = []
    for i, block in enumerate(blocks):
        at = f"{where}.content.{i}"
        if not isinstance(block, dict):
            raise RequestError(f"{at}: must be an object")
        kind = block.get("type")
        part = _content_part(block, at)
        if part is not None:
            parts.append(part)
        elif kind == "tool_result":
            tool_id = block.get("tool_use_id")
            if not isinstance(tool_id, str):
                raise RequestError(f"{at}.tool_use_id: Field required (a string)")
            if tool_id not in tool_ids:
                raise RequestError(
                    f"{at}: unexpected tool_use_id found in tool_result blocks: {tool_id}. "
                    "Each tool_result block must have a corresponding tool_use block in "
                    "the previous message.")
            content = block.get("content", "")
            if isinstance(content, list):
                content = _tool_result_parts(content, at)
            elif not isinstance(content, str):
                raise RequestError(f"{at}.content: must be a string or a list of blocks")
            if block.get("is_error") is True and isinstance(content, str):
                content = f"Error: {content}"
            messages.append({"role": "tool", "tool_call_id": tool_id, "content": content})
        else:
            raise RequestError(f"{at}.type: a user message takes text, image and tool_result "
                        f"blocks, not {kind!r}")
    if parts:
        messages.append({"role": "user", "content": chat_content(parts)})


def _tool_result_parts(blocks: list, where: str):
    parts = []
    for i, block in enumerate(blocks):
        at = f"{where}.content.{i}"
        part = _content_part(block, at) if isinstance(block, dict) else None
        if part is None:
            raise RequestError(f"{at}: a tool_result takes text and image blocks")
        parts.append(part)
    return chat_content(parts)


def _assistant_message(blocks: list, where: str) -> dict:
    text, reasoning, calls = [], [], []
    for i, block in enumerate(blocks):
        at = f"{where}.content.{i}"
        if not isinstance(block, dict):
            raise RequestError(f"{at}: must be an object")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise RequestError(f"{at}.text: Field required (a string)")
            text.append(block["text"])
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise RequestError(f"{at}.thinking: Field required (a string)")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque to anyone but Anthropic
        elif kind == "tool_use":
            tool_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(tool_id, str) or not tool_id:
                raise RequestError(f"{at}.id: Field required (a string)")
            if not isinstance(name, str) or not name:
                raise RequestError(f"{at}.name: Field required (a string)")
            if not isinstance(args, dict):
                raise RequestError(f"{at}.input: must be an object")
            calls.append({"id": tool_id, "type": "function",
                          "function": {"name": name,
                                       "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise RequestError(f"{at}.type: an assistant message takes text, thinking, "
                        f"redacted_thinking and tool_use blocks, not {kind!r}")
    message = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _system_text(blocks, where: str, strip_billing_header: bool) -> str:
    if isinstance(blocks, list) and strip_billing_header:
        # Blocks left empty by the stripping go, with their separator.
        blocks = [b for b in blocks if not (
            isinstance(b, dict) and isinstance(b.get("text"), str)
            and not BILLING_HEADER.sub("", b["text"]).strip())]
    text = _text_of(blocks, where)
    if BILLING_HEADER.search(text):
        if strip_billing_header:
            return BILLING_HEADER.sub("", text)
        warn_once("billing header", (
            "A system prompt starts with Claude Code's x-anthropic-billing-header, kept "
            "(--keep-billing-header). It differs between Claude Code sessions (and in "
            "versions before 2.1.19x, whose line carries a cch= hash, between requests): "
            "the prompt cache can't reuse a system prompt across them. Run without "
            "--keep-billing-header, or run Claude Code with "
            "CLAUDE_CODE_ATTRIBUTION_HEADER=0."))
    return text


def to_messages(body: dict, strip_billing_header: bool = False) -> List[dict]:
    """Anthropic's system + messages as chat-completions messages."""
    messages = []
    system = body.get("system")
    if system is not None:
        text = _system_text(system, "system", strip_billing_header)
        if text:
            messages.append({"role": "system", "content": text})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError("messages: Field required (a non-empty list)")
    tool_ids: set = set()  # the tool_use ids of the previous assistant turn
    for i, turn in enumerate(turns):
        where = f"messages.{i}"
        if not isinstance(turn, dict):
            raise RequestError(f"{where}: must be an object")
        role, content = turn.get("role"), turn.get("content")
        if role == "system":
            # Newer Claude Code sends system messages inside the conversation:
            # they stay where they are (moving them up would change the
            # prefix of every earlier turn).
            text = _system_text(content, f"{where}.content", strip_billing_header)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        if role in ("ctx", "msg"):  # Claude Code's context roles: user text
            role = "user"
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}.role: must be 'user' or 'assistant'")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise RequestError(f"{where}.content: must be a string or a list of blocks")
        if role == "user":
            _user_parts(content, where, tool_ids, messages)
            tool_ids = set()
        else:
            message = _assistant_message(content, where)
            tool_ids = {c["id"] for c in message.get("tool_calls", ())}
            messages.append(message)
    return messages


def to_tools(tools) -> Optional[List[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools: must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools.{i}: must be an object")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise RequestError(f"tools.{i}: tool type {kind!r} is not supported by this server "
                        "(only client tools with an input_schema)")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools.{i}.name: Field required (a string)")
        if not isinstance(schema, dict):
            raise RequestError(f"tools.{i}.input_schema: Field required (an object)")
        description = tool.get("description")
        out.append(chat_tool(name, description if isinstance(description, str) else None,
                             schema, tool.get("strict") is True))
    return out or None


def _tool_choice(choice, tools) -> Optional[Any]:
    """Anthropic's tool_choice in chat-completions terms (None: auto)."""
    if choice is None:
        return None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise RequestError("tool_choice.type: must be one of 'auto', 'any', 'tool', 'none'")
    kind = choice["type"]
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise RequestError("tool_choice.name: Field required (a string)")
        if not has_tool(tools, name):
            raise RequestError(f"tool_choice.name: no tool named {name!r} in tools")
        return named_tool(name)
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def _thinking(body: dict) -> Optional[bool]:
    """The template's thinking switch: `thinking` if given, else the effort."""
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise RequestError("thinking.type: must be 'enabled', 'disabled' or 'adaptive'")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise RequestError("thinking.budget_tokens: Field required (a positive integer)")
        return kind != "disabled"
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise RequestError("output_config: must be an object")
    # (When `thinking` is not given: the effort's.)
    return thinking_switch(config.get("effort"), MESSAGES_THINKING_BY_EFFORT,
                           "output_config.effort:")


def to_chat_body(body: Any, count_only: bool = False,
                 strip_billing_header: bool = False) -> Dict[str, Any]:
    """An Anthropic request as a chat-completions body (raises RequestError)."""
    if not isinstance(body, dict):
        raise RequestError("Request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model: Input should be a valid string")
    if not model:
        raise RequestError("model: Field required")
    refuse_foreign_enforcement(body, ("response_format", *FOREIGN_ENFORCEMENT),
                               "output_config.format ({'type': 'json_schema', 'schema': {...}})")
    chat: Dict[str, Any] = {"model": model}
    if not count_only:
        if "max_tokens" not in body:
            raise RequestError("max_tokens: Field required")
        chat["max_tokens"] = body["max_tokens"]
        chat["stream"] = body.get("stream", False)
    tools = to_tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    if choice == "none":
        tools = None  # the model is told of no tools
    elif choice is not None:
        chat["tool_choice"] = choice
    chat["messages"] = to_messages(body, strip_billing_header)
    if tools:
        chat["tools"] = tools
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError("stop_sequences: must be a list of strings")
        chat["stop"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("metadata: must be an object")
    thinking = _thinking(body)
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    # The budget (reasoning.py): budget_tokens, else the effort's.
    if isinstance(body.get("thinking"), dict) and body["thinking"].get("type") == "enabled":
        chat["thinking_budget"] = body["thinking"]["budget_tokens"]
    elif body.get("thinking") is None and isinstance(body.get("output_config"), dict) \
            and body["output_config"].get("effort") is not None:
        chat["reasoning_effort"] = body["output_config"]["effort"]
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError("output_config: must be an object")
    # Structured outputs: {"type": "json_schema", "schema": {...}}, in
    # output_config.format, or top-level output_format as the beta
    # (structured-outputs-2025-11-13) had it, which litellm still sends.
    formats = [(where, value) for where, value in (
        ("output_config.format", (config or {}).get("format")),
        ("output_format", body.get("output_format"))) if value is not None]
    if len(formats) == 2 and formats[0][1] != formats[1][1]:
        raise RequestError("output_format and output_config.format differ: send one of them")
    for where, output_format in formats[:1]:
        if not (isinstance(output_format, dict) and output_format.get("type") == "json_schema"
                and isinstance(output_format.get("schema"), dict)):
            raise RequestError(f"{where}: must be {{'type': 'json_schema', 'schema': {{...}}}}")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": output_format["schema"]}}
    return chat


class AnthropicProtocol(WireProtocol):
    paths = (MESSAGES, COUNT_TOKENS)
    prefix = MESSAGES
    names_own_models = True

    def __init__(self, strip_billing_header: bool = True):
        self.strip_billing_header = strip_billing_header

    def parse(self, path, body, cli, vocab_size):
        count_only = path == COUNT_TOKENS
        if isinstance(body, dict):
            check_item_count([body.get("messages"), body.get("system")], ("content",), cli,
                             "messages and content blocks")
        chat = to_chat_body(body, count_only, self.strip_billing_header)
        parsed = parse_request("/v1/chat/completions", chat, cli, vocab_size)
        if count_only:
            parsed.request.count_only = True
            parsed.stream = False
        return parsed

    def error_body(self, message, status):
        kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def exchange(self, parsed, request_id):
        return MessagesExchange(f"msg_{request_id}", parsed.requested_model, parsed.stream)


class MessagesExchange(Exchange):
    """One /v1/messages answer: content blocks in the order generated
    (thinking, text, tool_use), as a Message or as its stream of events."""

    def __init__(self, message_id: str, model: str, stream: bool):
        self.id = message_id
        self.model = model
        self.stream = stream
        self.blocks: List[dict] = []
        self._open: Optional[str] = None  # the type of the block being streamed

    def _message(self, content, usage, stop_reason=None, stop_sequence=None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    @staticmethod
    def _usage(prompt_tokens, cached_tokens, output_tokens) -> dict:
        return {
            "input_tokens": prompt_tokens - cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens,
            "output_tokens": output_tokens,
        }

    def start(self, prompt_tokens, cached_tokens):
        message = self._message([], self._usage(prompt_tokens, cached_tokens, 0))
        return (sse("message_start", {"type": "message_start", "message": message})
                + sse("ping", {"type": "ping"}))

    def keepalive(self):
        # An event, not a comment: Anthropic's SDKs drop comments, and Claude
        # Code's idle timer counts events.
        return sse("ping", {"type": "ping"})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        index = len(self.blocks) - 1
        out = b""
        if self._open == "thinking":
            # Clients pass thinking back with its signature (replay.py).
            block = self.blocks[index]
            block["signature"] = seal(block["thinking"])
            out += sse("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": block["signature"]}})
        self._open = None
        return out + sse("content_block_stop", {"type": "content_block_stop", "index": index})

    def _append(self, kind: str, key: str, piece: str) -> bytes:
        """Add text to the open block of `kind`, opening it if needed."""
        out = b""
        if self._open != kind:
            out += self._close()
            block = {"type": kind, key: ""}
            if kind == "thinking":
                block["signature"] = ""
            self.blocks.append(block)
            self._open = kind
            if self.stream:
                out += sse("content_block_start", {
                    "type": "content_block_start", "index": len(self.blocks) - 1,
                    "content_block": dict(block)})
        self.blocks[-1][key] += piece
        delta_type = "thinking_delta" if kind == "thinking" else "text_delta"
        if self.stream:
            out += sse("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": delta_type, key: piece}})
        return out

    def _tool_use(self, call: dict) -> bytes:
        function = call.get("function", {})
        arguments = function.get("arguments") or "{}"
        try:
            args = json.loads(arguments)
        except (ValueError, RecursionError):
            # A call max_tokens cut off (responses.TruncatedCall): its input
            # as far as it parses, streamed as that JSON (the SDKs' partial
            # parsers drop a cut-off string: the stream would differ).
            args = partial_json(arguments)
            if isinstance(args, dict):
                arguments = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, dict):
            # Anthropic's input is an object: keep what the model wrote.
            args = {"arguments": args if args is not None else arguments}
            arguments = json.dumps(args, ensure_ascii=False)
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                 "name": function.get("name", ""), "input": args}
        out = self._close()
        self.blocks.append(block)
        if not self.stream:
            return b""
        index = len(self.blocks) - 1
        return (
            out
            + sse("content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": dict(block, input={})})
            + sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "input_json_delta",
                                                    "partial_json": arguments}})
            + sse("content_block_stop", {"type": "content_block_stop", "index": index})
        )

    def delta(self, text, tool_calls, reasoning):
        out = b""
        if reasoning:
            out += self._append("thinking", "thinking", reasoning)
        if text:
            out += self._append("text", "text", text)
        for call in tool_calls or ():
            out += self._tool_use(call)
        return out if self.stream else b""

    def _stop(self, completion: Completion):
        if completion.stop_sequence is not None:
            return "stop_sequence", completion.stop_sequence
        return STOP_REASONS.get(completion.finish_reason, "end_turn"), None

    def finish(self, completion):
        stop_reason, stop_sequence = self._stop(completion)
        usage = self._usage(completion.prompt_tokens, completion.cached_tokens,
                            completion.completion_tokens)
        return (
            self._close()
            + sse("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop_reason,
                                              "stop_sequence": stop_sequence},
                                    "usage": usage})
            + sse("message_stop", {"type": "message_stop"})
        )

    def body(self, completion):
        self._close()  # (its frames are the stream's; the block is signed)
        stop_reason, stop_sequence = self._stop(completion)
        usage = self._usage(completion.prompt_tokens, completion.cached_tokens,
                            completion.completion_tokens)
        return self._message(self.blocks, usage, stop_reason, stop_sequence)

    def stream_error(self, message, status):
        kind = "overloaded_error" if status == 503 else (
            "api_error" if status >= 500 else "invalid_request_error")
        return sse("error", {"type": "error", "error": {"type": kind, "message": message}})
