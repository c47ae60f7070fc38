"""A Responses API request as the chat-completions body it is served as:
its input items as chat messages (a stored conversation first, for
previous_response_id), its tools, tool_choice, text format and reasoning
as their chat fields (responses.py's module docstring has the table)."""

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from mlx_lm_plus.logs import warn_once
from mlx_lm_plus.protocols.replay import open_sealed
from mlx_lm_plus.protocols.assembler import PARTIAL_JSON_CHARS, partial_json
from mlx_lm_plus.protocols.validation import (
    FOREIGN_ENFORCEMENT,
    RequestError,
    refuse_foreign_enforcement,
)
from mlx_lm_plus.protocols.base import chat_content
from mlx_lm_plus.protocols.tools import (
    RESPONSES_THINKING_BY_EFFORT,
    chat_tool,
    has_tool,
    named_tool,
    thinking_switch,
    tool_names,
)
from mlx_lm_plus.protocols.response_store import ResponseStore


# Sampling fields beyond the Responses API, passed along as chat completions
# take them (mlx_lm.server's extensions).
PASSTHROUGH = ("top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "logit_bias", "stop")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


def not_found(response_id: str) -> RequestError:
    return RequestError(f"Response with id '{response_id}' not found.", 404)


# -- request: items -> chat messages --


# Text parts, whichever side wrote them (clients replay output as input).
TEXT_PARTS = ("input_text", "output_text", "text")


def parses_as_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return False


def _text_parts(content, where: str):
    """A string or a list of text/image parts -> a string, or chat parts
    when there are images."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of content parts")
    parts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{at}.text: must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            if not isinstance(part.get("refusal"), str):
                raise RequestError(f"{at}.refusal: must be a string")
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if url is None and part.get("file_id") is not None:
                raise RequestError(f"{at}: images by file_id are not supported by this server; "
                            "send image_url (a data URL)")
            if not isinstance(url, str) or not url:
                raise RequestError(f"{at}.image_url: must be a string (a data URL)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "input_file":
            raise RequestError(f"{at}: input_file parts are not supported by this server")
        else:
            raise RequestError(f"{at}.type: unsupported content part type {kind!r}")
    return chat_content(parts)


class _Conversation:
    """Chat messages built from Responses items, in order.

    The assistant side of a turn (reasoning, then a message, then function
    calls) becomes one assistant message, as the turn's output would be
    stored: replaying a response's output items as input and continuing
    with previous_response_id give the same messages.
    """

    PHASES = {"reasoning": 0, "content": 1, "tool_calls": 2}

    def __init__(self, call_ids=()):
        self.messages: List[Dict[str, Any]] = []
        self.call_ids = set(call_ids)
        self._turn: Optional[dict] = None
        self._phase = -1
        # Characters of cut-off arguments read back (partial_json) in all:
        # one request's worth, however many items bring some.
        self._partial_budget = PARTIAL_JSON_CHARS

    def _assistant(self, phase: str) -> dict:
        p = self.PHASES[phase]
        if self._turn is None or p < self._phase or (p == self._phase and p != 2):
            self._turn = {"role": "assistant", "content": ""}
            self.messages.append(self._turn)
        self._phase = p
        return self._turn

    def _other(self, message: dict) -> None:
        self._turn, self._phase = None, -1
        self.messages.append(message)

    def add(self, items: list, where: str = "input") -> None:
        for i, item in enumerate(items):
            at = f"{where}[{i}]"
            if not isinstance(item, dict):
                raise RequestError(f"{at}: must be an object")
            kind = item.get("type")
            if kind is None and "role" in item:
                kind = "message"
            if kind == "message":
                self._message(item, at)
            elif kind == "function_call":
                self._function_call(item, at)
            elif kind == "function_call_output":
                self._function_call_output(item, at)
            elif kind == "reasoning":
                self._reasoning(item, at)
            elif kind == "item_reference":
                raise RequestError(f"{at}: item references are not supported by this server; "
                            "send the items themselves, or use previous_response_id")
            elif isinstance(kind, str):
                raise RequestError(f"{at}.type: input item type {kind!r} is not supported by "
                            "this server (message, function_call, function_call_output "
                            "and reasoning items are)")
            else:
                raise RequestError(f"{at}.type: missing (an item needs a type, or a role for a "
                            "message)")

    def _message(self, item: dict, at: str) -> None:
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise RequestError(f"{at}.role: must be one of 'user', 'system', 'developer', "
                        "'assistant'")
        content = _text_parts(item.get("content"), f"{at}.content")
        if role == "assistant":
            if not isinstance(content, str):
                raise RequestError(f"{at}.content: an assistant message takes text only")
            message = self._assistant("content")
            message["content"] = content
            return
        self._other({"role": "system" if role == "developer" else role, "content": content})

    def _function_call(self, item: dict, at: str) -> None:
        call_id, name = item.get("call_id"), item.get("name")
        arguments = item.get("arguments", "")
        if not isinstance(call_id, str) or not call_id:
            raise RequestError(f"{at}.call_id: must be a non-empty string")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{at}.name: must be a non-empty string")
        namespace = item.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise RequestError(f"{at}.namespace: must be a string")
        name = flat_name(namespace, name)  # as the model wrote it (see _tools)
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise RequestError(f"{at}.arguments: must be a string (JSON text)")
        if item.get("status") == "incomplete" and not parses_as_json(arguments):
            # A call max_tokens cut off: templates take arguments as JSON,
            # so as far as they parse (responses.partial_json), within the
            # request's budget (past it: none).
            read = partial_json(arguments) if len(arguments) <= self._partial_budget else None
            self._partial_budget = max(0, self._partial_budget - len(arguments))
            arguments = json.dumps(read or {}, ensure_ascii=False)
        if arguments.strip():
            try:
                json.loads(arguments)
            except (ValueError, RecursionError) as e:
                raise RequestError(f"{at}.arguments: not valid JSON ({e})") from None
        message = self._assistant("tool_calls")
        message.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments or "{}"}})
        self.call_ids.add(call_id)

    def _function_call_output(self, item: dict, at: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise RequestError(f"{at}.call_id: must be a non-empty string")
        if call_id not in self.call_ids:
            raise RequestError(f"{at}: no tool call found for function call output with call_id "
                        f"{call_id!r} (a function_call item with this call_id must come "
                        "before it, in input or in the previous response)")
        output = _text_parts(item.get("output"), f"{at}.output")
        self._other({"role": "tool", "tool_call_id": call_id, "content": output})

    def _reasoning(self, item: dict, at: str) -> None:
        content = item.get("content") or []
        if not isinstance(content, list):
            raise RequestError(f"{at}.content: must be a list of reasoning_text parts")
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise RequestError(f"{at}.content[{i}]: must be a reasoning_text part with text")
            texts.append(part["text"])
        summary = item.get("summary", [])
        if summary is not None and not isinstance(summary, list):
            raise RequestError(f"{at}.summary: must be a list")
        # Only the reasoning text itself goes back to the template: the
        # content, else what this server sealed in encrypted_content (a
        # value it did not seal, or the summary: another model's, left out).
        if not texts:
            opened = open_sealed(item.get("encrypted_content"))
            texts = [opened] if opened else []
        if texts:
            message = self._assistant("reasoning")
            message["reasoning_content"] = "".join(texts)


def to_messages(input_, call_ids=()) -> Tuple[List[dict], set]:
    """`input` as chat messages (and the call ids seen)."""
    conversation = _Conversation(call_ids)
    if isinstance(input_, str):
        conversation.messages.append({"role": "user", "content": input_})
    elif isinstance(input_, list):
        conversation.add(input_)
    elif input_ is not None:
        raise RequestError("input: must be a string or a list of input items")
    return conversation.messages, conversation.call_ids


def output_messages(output: List[dict]) -> List[dict]:
    """A response's output items as the chat messages they continue with."""
    conversation = _Conversation()
    conversation.add(output, "output")
    return conversation.messages or [{"role": "assistant", "content": ""}]


def _call_ids(messages) -> set:
    return {c.get("id") for m in messages for c in m.get("tool_calls") or ()}


# -- request: the other fields --


# Built-in tool types: run by OpenAI's servers (web_search, file_search, ...)
# or by a client that speaks their own item types (local_shell,
# computer_use). Neither is something a local model's chat template has a
# shape for, so they are left out of the prompt (Codex sends web_search by
# default). A tool_choice that names one is refused (_tool_choice).
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "image_generation", "computer_use",
                "computer_use_preview", "mcp", "local_shell")
# How a namespaced tool is named to the model: the namespace and the tool's
# name joined, within OpenAI's function name rule (so templates, tool parsers
# and the forced-call grammars take it as any name), as Codex's own flat
# tool names join them.
NAMESPACE_JOIN = "__"


def flat_name(namespace: Optional[str], name: str) -> str:
    return f"{namespace}{NAMESPACE_JOIN}{name}" if namespace else name


def _function_tool(tool: dict, at: str, namespace: Optional[str] = None) -> dict:
    """A Responses function tool as a chat tool (named flat_name)."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{at}.name: must be a non-empty string")
    description, parameters = tool.get("description"), tool.get("parameters")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{at}.description: must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"{at}.parameters: must be an object (a JSON schema)")
    # (strict: explicit only)
    return chat_tool(flat_name(namespace, name), description, parameters,
                     tool.get("strict") is True)


def _tools(tools) -> Tuple[list, Optional[list], Dict[str, Tuple[str, str]]]:
    """(the tools to echo, the chat tools, {flat name: (namespace, name)} of
    the tools in namespaces)."""
    if tools is None:
        return [], None, {}
    if not isinstance(tools, list):
        raise RequestError("tools: must be a list")
    chat, namespaced = [], {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}]: must be an object")
        kind = tool.get("type")
        if kind == "function":
            chat.append(_function_tool(tool, f"tools[{i}]"))
        elif kind == "namespace":
            # Codex's: {"type": "namespace", "name", "description", "tools":
            # [function tools]}; a call to one names both (function_call's
            # `namespace`).
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace:
                raise RequestError(f"tools[{i}].name: must be a non-empty string")
            if not isinstance(inner, list):
                raise RequestError(f"tools[{i}].tools: must be a list of function tools")
            for j, t in enumerate(inner):
                at = f"tools[{i}].tools[{j}]"
                if not isinstance(t, dict) or t.get("type") != "function":
                    raise RequestError(f"{at}: must be a function tool")
                chat.append(_function_tool(t, at, namespace))
                namespaced[chat[-1]["function"]["name"]] = (namespace, t["name"])
        elif kind in HOSTED_TOOLS:
            warn_once(("hosted tool", kind),
                      f"A request lists the built-in tool {kind!r}, which this server can't "
                      "offer the model: left out of the prompt")
        else:
            raise RequestError(f"tools[{i}]: Tool type {kind!r} is not supported by this server "
                               "(function and namespace tools are; hosted tools are left out)")
    names = tool_names(chat)
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise RequestError(f"tools: two tools are named {twice!r}")
    echo = [dict(t) for t in tools]
    return echo, chat or None, namespaced


def _tool_choice(choice, tools) -> Any:
    """The tool_choice to echo, validated."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise RequestError("tool_choice: must be 'auto', 'none', 'required' or an object")
        if choice == "required" and not tools:
            raise RequestError("tool_choice: 'required' needs function tools")
        return choice
    if not isinstance(choice, dict):
        raise RequestError("tool_choice: must be 'auto', 'none', 'required' or an object")
    kind = choice.get("type")
    if kind == "function":
        name, namespace = choice.get("name"), choice.get("namespace")
        if not isinstance(name, str):
            raise RequestError("tool_choice.name: must be a string")
        if namespace is not None and not isinstance(namespace, str):
            raise RequestError("tool_choice.namespace: must be a string")
        if not has_tool(tools, flat_name(namespace, name)):
            raise RequestError(f"tool_choice.name: no function tool named {name!r} in tools")
        return {"type": "function", "name": name,
                **({"namespace": namespace} if namespace is not None else {})}
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode"), choice.get("tools")
        if mode not in ("auto", "required"):
            raise RequestError("tool_choice.mode: must be 'auto' or 'required'")
        if not isinstance(allowed, list) or not all(
                isinstance(t, dict) and isinstance(t.get("name"), str)
                and isinstance(t.get("namespace", ""), str) for t in allowed):
            raise RequestError("tool_choice.tools: must be a list of {'type': 'function', "
                               "'name': ...}")
        names = {flat_name(t.get("namespace"), t["name"]) for t in allowed}
        every = set(tool_names(tools))
        if mode == "required" and not names:
            raise RequestError("tool_choice: allowed_tools 'required' needs function tools")
        if not names <= every:
            raise RequestError(f"tool_choice.tools: no function tool named "
                               f"{sorted(names - every)[0]!r} in tools")
        # Enforced as far as chat completions' tool_choice can say it: all
        # the tools (auto / required), or one of them (required).
        if names != every and not (mode == "required" and len(names) == 1):
            raise RequestError("tool_choice: allowed_tools restricting the calls to some of "
                               "the tools is not supported by this server (allow them all, "
                               "or require one by name)")
        return choice
    raise RequestError(f"tool_choice: type {kind!r} is not supported by this server "
                "(only function tools are)")


def _chat_tool_choice(choice) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return named_tool(flat_name(choice.get("namespace"), choice["name"]))
    if isinstance(choice, dict):  # allowed_tools (see _tool_choice): all, or one by name
        names = [flat_name(t.get("namespace"), t["name"]) for t in choice["tools"]]
        if choice["mode"] == "required" and len(names) == 1:
            return named_tool(names[0])
        return choice["mode"]
    return choice


def _text_config(text) -> Tuple[dict, Optional[dict]]:
    """(text to echo, the chat response_format or None)."""
    if text is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(text, dict):
        raise RequestError("text: must be an object")
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise RequestError("text.verbosity: must be 'low', 'medium' or 'high'")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise RequestError("text.format: must be an object")
    kind = fmt.get("type")
    if kind == "text":
        response_format = None
    elif kind == "json_object":
        response_format = {"type": "json_object"}
    elif kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise RequestError("text.format.name: must be a non-empty string")
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format.schema: must be an object (a JSON schema)")
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        response_format = {"type": "json_schema", "json_schema": schema}
    else:
        raise RequestError("text.format.type: must be 'text', 'json_schema' or 'json_object'")
    echo = {"format": fmt}
    if verbosity is not None:
        echo["verbosity"] = verbosity
    return echo, response_format


def _reasoning(reasoning) -> Tuple[dict, Optional[bool]]:
    """(reasoning to echo, the thinking switch or None for the template's
    default)."""
    if reasoning is None:
        return {"effort": None, "summary": None}, None
    if not isinstance(reasoning, dict):
        raise RequestError("reasoning: must be an object")
    effort = reasoning.get("effort")
    thinking = thinking_switch(effort, RESPONSES_THINKING_BY_EFFORT, "reasoning.effort:")
    summary = reasoning.get("summary")
    if summary is not None and (not isinstance(summary, str)
                                or summary not in ("auto", "concise", "detailed")):
        raise RequestError("reasoning.summary: must be 'auto', 'concise' or 'detailed'")
    echo = {"effort": effort, "summary": summary}
    return echo, thinking


def _check(body: dict, name: str, types, what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in (
            types if isinstance(types, tuple) else (types,))):
        raise RequestError(f"{name}: must be {what}")
    return value


@dataclass
class ResponsesRequest:
    """What the answer needs of the request (ParsedRequest.extra)."""

    echo: Dict[str, Any]
    # The conversation before this response, without the instructions: what
    # a continuation starts from.
    history: List[Dict[str, Any]]
    store: bool
    tools: List[dict] = field(default_factory=list)
    carried_bytes: int = 0  # the stored conversation continued (its size)
    # The chat names of tools in namespaces: {flat name: (namespace, name)}.
    namespaced: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    # include: ["reasoning.encrypted_content"]: reasoning items carry it.
    sealed_reasoning: bool = False


def to_chat_body(body: Any, store: ResponseStore,
                 count_only: bool = False) -> Tuple[Dict[str, Any], ResponsesRequest]:
    """A Responses request as a chat-completions body (raises RequestError)."""
    if not isinstance(body, dict):
        raise RequestError("Request body must be a JSON object")
    model = _check(body, "model", str, "a string", "default_model")
    instructions = _check(body, "instructions", str, "a string")
    stored = _check(body, "store", bool, "a boolean", True)
    previous_id = _check(body, "previous_response_id", str, "a string")
    refuse_foreign_enforcement(body, ("response_format", *FOREIGN_ENFORCEMENT),
                               "text.format ({'type': 'json_schema', 'name': ..., "
                               "'schema': {...}})")
    if body.get("conversation") is not None:
        raise RequestError("conversation: conversations are not supported by this server; "
                    "use previous_response_id")
    if body.get("prompt") is not None:
        raise RequestError("prompt: prompt templates are not supported by this server")
    if body.get("background"):
        raise RequestError("background: background responses are not supported by this server")
    metadata = _check(body, "metadata", dict, "an object of strings", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise RequestError("metadata: must be an object of strings")
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        _check(body, name, str, "a string")
    include = _check(body, "include", list, "a list of strings", [])
    if not all(isinstance(x, str) for x in include):
        raise RequestError("include: must be a list of strings")
    truncation = _check(body, "truncation", str, "'auto' or 'disabled'", "disabled")
    if truncation not in ("auto", "disabled"):
        raise RequestError("truncation: must be 'auto' or 'disabled'")
    service_tier = _check(body, "service_tier", str, "a string", "auto")
    top_logprobs = _check(body, "top_logprobs", int, "an integer from 0 to 20")
    if top_logprobs is not None and not 0 <= top_logprobs <= 20:
        raise RequestError("top_logprobs: must be an integer from 0 to 20")
    max_tool_calls = _check(body, "max_tool_calls", int, "a positive integer")
    parallel = _check(body, "parallel_tool_calls", bool, "a boolean", True)
    _check(body, "stream_options", dict, "an object")
    max_output = _check(body, "max_output_tokens", int, "a positive integer")
    if max_output is not None and max_output < 1:
        raise RequestError("max_output_tokens: must be a positive integer")

    echo_tools, tools, namespaced = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    text, response_format = _text_config(body.get("text"))
    reasoning, thinking = _reasoning(body.get("reasoning"))

    history: List[dict] = []
    carried = 0
    if previous_id is not None:
        previous = store.get(previous_id)
        if previous is None:
            raise not_found(previous_id)
        history, carried = previous.messages(), previous.size
    if "input" not in body and previous_id is None:
        raise RequestError("input: required (a string or a list of input items)")
    new, _ = to_messages(body.get("input"), _call_ids(history))
    history += new
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    if not messages:
        raise RequestError("input: must not be empty")

    chat: Dict[str, Any] = {
        "model": model,
        # The engine normalizes messages in place: its own copy.
        "messages": copy.deepcopy(messages),
    }
    if not count_only:
        chat["stream"] = body.get("stream", False)
        if max_output is not None:
            chat["max_tokens"] = max_output
    if tools and choice != "none":
        chat["tools"] = tools
        chat["tool_choice"] = _chat_tool_choice(choice)
        chat["parallel_tool_calls"] = parallel
    if response_format is not None:
        chat["response_format"] = response_format
    for name in ("temperature", "top_p", *PASSTHROUGH):
        if body.get(name) is not None:
            chat[name] = body[name]
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs: must be an object")
    if thinking is not None:
        kwargs = {**(kwargs or {}), "enable_thinking": thinking}
    if reasoning["effort"] is not None:  # its budget (reasoning.py)
        chat["reasoning_effort"] = reasoning["effort"]
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs

    echo = {
        "model": model,
        "instructions": instructions,
        "tools": echo_tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "max_output_tokens": max_output,
        "max_tool_calls": max_tool_calls,
        "previous_response_id": previous_id,
        "store": stored,
        "text": text,
        "reasoning": reasoning,
        "metadata": metadata,
        "truncation": truncation,
        "service_tier": service_tier if service_tier in SERVICE_TIERS else "auto",
        "top_logprobs": top_logprobs,
        "user": body.get("user"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "safety_identifier": body.get("safety_identifier"),
        "background": False,
    }
    return chat, ResponsesRequest(echo, history, stored, echo_tools, carried, namespaced,
                                  "reasoning.encrypted_content" in include)
