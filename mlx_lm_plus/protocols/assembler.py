"""OpenAI-shaped responses, as mlx_lm.server 0.32.2 writes them.

`ResponseBuilder` makes the JSON objects (`generate_response` and
`completion_usage_response` of upstream's APIHandler). `CompletionAssembler`
turns the engine's per-token `Response`s into text, reasoning and tool calls
with upstream's TextStateMachine, and says when a streaming chunk is due.
Both are plain objects with no I/O, so the shapes are testable alone.
"""

import collections
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mlx_lm.generate import TextStateMachine


@dataclass
class ResponseBuilder:
    request_id: str
    object_type: str  # "chat.completion", "chat.completion.chunk", "text_completion"
    model: str
    created: int
    system_fingerprint: str
    stream: bool

    def response(
        self,
        text: str,
        finish_reason: Optional[str],
        prompt_token_count: Optional[int] = None,
        completion_token_count: Optional[int] = None,
        prompt_cache_count: Optional[int] = None,
        token_logprobs: Optional[List[float]] = None,
        top_tokens: Optional[List[tuple]] = None,
        tokens: Optional[List[int]] = None,
        tool_calls: Optional[List[dict]] = None,
        reasoning_text: Optional[str] = None,
    ) -> Dict[str, Any]:
        response = {
            "id": self.request_id,
            "system_fingerprint": self.system_fingerprint,
            "object": self.object_type,
            "model": self.model,
            "created": self.created,
            "choices": [{"index": 0, "finish_reason": finish_reason}],
        }
        choice = response["choices"][0]
        if top_tokens:
            # Upstream makes the entry of i[0], an arbitrary member of the
            # top-k (argpartition order). Ours is the sampled token's own entry
            # when it is in the top-k (always, when greedy), and the top-k come
            # sorted by probability.
            choice["logprobs"] = {
                "content": [
                    dict(_entry_of(i, t), top_logprobs=i) if i else {}
                    for i, t in zip(top_tokens, tokens or [None] * len(top_tokens))
                ]
            }
        elif token_logprobs:
            choice["logprobs"] = {
                "content": [dict(id=i, logprob=g) for i, g in zip(tokens, token_logprobs)]
            }

        if not self.stream:
            response["usage"] = self._usage(
                prompt_token_count, completion_token_count, prompt_cache_count
            )

        if self.object_type.startswith("chat.completion"):
            key = "delta" if self.stream else "message"
            choice[key] = {"role": "assistant"}
            if not self.stream:
                # The schema requires "content" to be present.
                choice[key]["content"] = text if text else None
            elif text:
                choice[key]["content"] = text
            if reasoning_text:
                choice[key]["reasoning"] = reasoning_text
            if tool_calls:
                choice[key]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        return response

    def text_chunk(self, text: str) -> bytes:
        """The SSE event of a streamed chunk carrying only `text` (not empty),
        the same bytes as `data: json.dumps(self.response(text, None))`: made
        from a template rendered once, because it is sent once per token."""
        template = self.__dict__.get("_text_template")
        if template is None:
            marker = "\u0000text\u0000"
            rendered = f"data: {json.dumps(self.response(marker, None))}\n\n"
            head, tail = rendered.split(json.dumps(marker))
            template = self._text_template = (head.encode(), tail.encode())
        return template[0] + json.dumps(text).encode() + template[1]

    def usage_response(self, prompt_tokens, completion_tokens, cached_tokens):
        """The extra chunk sent when stream_options.include_usage is true."""
        return {
            "id": self.request_id,
            "system_fingerprint": self.system_fingerprint,
            "object": "chat.completion",
            "model": self.model,
            "created": self.created,
            "choices": [],
            "usage": self._usage(prompt_tokens, completion_tokens, cached_tokens),
        }

    @staticmethod
    def _usage(prompt_tokens, completion_tokens, cached_tokens):
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if cached_tokens is not None and cached_tokens >= 0:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage


def _entry_of(top: tuple, token) -> dict:
    return next((t for t in top if t["id"] == token), top[0])


# partial_json reads at most this much text, and tries closing it at its
# last few places only: a client's text (a Responses function_call item
# replayed incomplete) or a model's long call must cost linear time.
PARTIAL_JSON_CHARS = 256 << 10
PARTIAL_JSON_TRIES = 8


def partial_json(text: str) -> Any:
    """The value a cut-off JSON text had so far: an open string closed, an
    unfinished member or item dropped, open arrays and objects closed
    (None: not even that parses, or the text is over PARTIAL_JSON_CHARS)."""
    if len(text) > PARTIAL_JSON_CHARS:
        return None
    stack, in_string, escaped = [], False, False
    cuts = collections.deque(maxlen=PARTIAL_JSON_TRIES)  # (where, closers there)
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
            cuts.append((i + 1, len(stack)))
        elif c in "}]" and stack:
            stack.pop()
            cuts.append((i + 1, len(stack)))
        elif c == ",":
            cuts.append((i, len(stack)))
    closers = "".join(reversed(stack))

    def candidates():
        if in_string and not escaped:
            yield text + '"' + closers
        yield text + closers
        for i, depth in reversed(cuts):
            # (Any cut's open containers are those still open at the end,
            # or closed later: the first `depth` of them are the same.)
            yield text[:i] + "".join(reversed(stack[:depth])) if depth <= len(stack) else None
        yield text[:1] + closers[-1:] if text[:1] in ("{", "[") else None

    for candidate in candidates():
        if candidate is None:
            continue
        try:
            return json.loads(candidate)
        except (ValueError, RecursionError):
            continue
    return None


@dataclass
class TruncatedCall:
    """A tool call max_tokens cut off: its name, and its arguments as far as
    the model wrote them (JSON text that may not parse; "" if it stopped
    before them)."""

    name: str
    arguments: str

    @classmethod
    def of(cls, tool_text: str, names=()) -> Optional["TruncatedCall"]:
        """From the text of a <tool_call> in the JSON format ({"name": ...,
        "arguments": ...}) that was cut off; `names`: those the call may
        have (the tools', or the one tool_choice forced). A name cut off
        too is the one of them it begins. None: not that format, or no one
        name to give it."""
        head = re.match(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)', tool_text)
        if head is None or not head.group(1):
            if len(names) == 1 and is_call_opening(tool_text):
                return cls(names[0], "")  # (cut in the call's opening)
            return None
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            return None
        if not head.group(2):
            matches = [n for n in names if n.startswith(name)]
            if len(matches) != 1:
                return None  # (no tool, or several: no call to name)
            name = matches[0]
        at = re.search(r'"arguments"\s*:\s*', tool_text[head.end():])
        arguments = tool_text[head.end() + at.end():].rstrip() if at is not None else ""
        return cls(name, arguments)


def is_call_opening(tool_text: str) -> bool:
    """Whether `tool_text` is no more than the start of a JSON call's
    opening ({"name": "), whatever its spaces."""
    return '{"name":"'.startswith(re.sub(r"\s", "", tool_text))


class ToolCalls:
    """Chat tool_calls from the texts of <tool_call> blocks, as upstream's
    ToolCallFormatter writes them (its own, not reused: upstream drops a
    call that max_tokens cut off, with the tokens the model wrote for it;
    here a TruncatedCall is kept with its arguments as far as they go, as
    OpenAI returns one)."""

    def __init__(self, tool_parser, tools, streaming: bool = False):
        self._parser = tool_parser
        self._tools = tools
        self._streaming = streaming
        self._index = 0

    def __call__(self, tool_texts) -> List[dict]:
        out = []
        for text in tool_texts or ():
            if isinstance(text, TruncatedCall):
                out.append(self._call(text.name, text.arguments, None))
                continue
            try:
                parsed = self._parser(text, self._tools)
            except (ValueError, RecursionError) as e:
                logging.warning(f"Failed to parse tool call ({type(e).__name__}: {e})")
                continue
            for call in parsed if isinstance(parsed, list) else [parsed]:
                # (Whatever JSON the model wrote: a call needs a name, and
                # its arguments may be left out, as for a tool that takes none.)
                if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                    logging.warning(f"A tool call without a name: {str(call)[:200]}")
                    continue
                out.append(self._call(call["name"], json.dumps(
                    call.get("arguments", {}), ensure_ascii=False), call.get("id")))
        return out

    def _call(self, name: str, arguments: str, call_id) -> dict:
        call = {"function": {"name": name, "arguments": arguments}, "type": "function",
                "id": call_id or str(uuid.uuid4())}
        if self._streaming:
            call["index"] = self._index
            self._index += 1
        return call


@dataclass
class CompletionAssembler:
    """Accumulates a completion from the engine's per-token Responses.

    Mirrors the loop of upstream's `APIHandler.handle_completion`: text is
    split by the TextStateMachine into normal, reasoning and tool text; a tool
    call is complete when the state leaves "tool".
    """

    ctx: Any  # mlx_lm.server.GenerationContext
    tools: Optional[List[Any]]
    stream: bool
    logprobs: bool
    top_logprobs: int

    finish_reason: str = "stop"
    text: str = ""
    reasoning_text: str = ""
    tool_text: str = ""
    tool_calls: List[str] = field(default_factory=list)
    made_tool_call: bool = False
    tokens: List[int] = field(default_factory=list)
    token_logprobs: List[float] = field(default_factory=list)
    top_tokens: List[tuple] = field(default_factory=list)
    # The function tool_choice forces, if one is (a call cut off in its
    # name is that one's).
    forced_tool: Optional[str] = None

    def __post_init__(self):
        self._sm = self.ctx.text_sm.make_state(self.ctx.initial_state)
        self._prev_state = self.ctx.initial_state
        self._current_state = self.ctx.initial_state
        self.format_tool_calls = ToolCalls(self.ctx.tool_parser, self.tools, self.stream)

    def add(self, gen) -> bool:
        """Consume one Response. Returns whether a streaming chunk is due."""
        if gen.finish_reason == "stop":
            self._sm, current = TextStateMachine.discard(self._sm)
            segments = [(current, "")]
        elif gen.finish_reason == "length":
            self._sm, segments = TextStateMachine.split(self._sm, gen.text)
            self._sm, flushed, current = TextStateMachine.flush(self._sm)
            segments.append((current, flushed))
        else:
            self._sm, segments = TextStateMachine.split(self._sm, gen.text)

        for state, clean_text in segments:
            if state == "reasoning":
                self.reasoning_text += clean_text
            elif state == "tool":
                self.tool_text += clean_text
            elif state == "normal":
                if self._prev_state == "tool":
                    self.tool_calls.append(self.tool_text)
                    self.tool_text = ""
                    self.made_tool_call = True
                self.text += clean_text
            self._prev_state = state
            self._current_state = state

        self.tokens.append(gen.token)
        if self.logprobs:
            self.token_logprobs.append(gen.logprob)
        if self.top_logprobs > 0:
            self.top_tokens.append(gen.top_tokens)
        if gen.finish_reason is not None:
            self.finish_reason = gen.finish_reason

        return (
            self.stream
            and self._current_state != "tool"
            and bool(self.text or self.tool_calls or self.reasoning_text)
        )

    def take_delta(self):
        """(text, tool_calls, reasoning) accumulated since the last chunk."""
        delta = (self.text, self.format_tool_calls(self.tool_calls), self.reasoning_text)
        self.text, self.tool_calls, self.reasoning_text = "", [], ""
        return delta

    def finish(self):
        """Close a pending tool call and settle the finish reason. A call
        max_tokens cut off is kept as a TruncatedCall (or, in a format
        that can't be read so, as text): what the model wrote is never
        dropped."""
        if self._prev_state == "tool" and self.tool_text:
            raw, self.tool_text = self.tool_text, ""
            call = raw
            if self.finish_reason == "length" and not self._parses(raw):
                call = TruncatedCall.of(raw, self._tool_names())
            if call is None:
                # (Not the JSON call format, or no one name to give it:
                # the call's opening alone is no call, and no text.)
                if not is_call_opening(raw):
                    self.text += raw
            else:
                self.tool_calls.append(call)
                self.made_tool_call = True
        if self.finish_reason == "stop" and self.made_tool_call:
            self.finish_reason = "tool_calls"

    def _parses(self, tool_text: str) -> bool:
        try:
            self.ctx.tool_parser(tool_text, self.tools)
            return True
        except (ValueError, RecursionError):
            return False

    def _tool_names(self) -> List[str]:
        """The names a call may have: the forced tool's, else the tools'."""
        if self.forced_tool is not None:
            return [self.forced_tool]
        names = []
        for tool in self.tools or ():
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names.append(function["name"])
        return names
