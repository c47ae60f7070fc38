"""Structured output's grammars: response_format and forced or strict tool
calls compiled into llguidance grammars, and what a request asks for,
compiled ahead for the tokenizer of the model that serves it.

    grammar = compile_response_format(body["response_format"])   # None: free text
    grammar = tool_call_grammar(tools, name, tokenizer=tokenizer)  # tool_choice
    prepared = prepare(constraint, tokenizer)    # in a constraint lane

Its own room: compiling is the slow, one-off part of structured output,
done ahead on the HTTP side's constraint lanes before a request is planned
(the engine compiles again only for another tokenizer), and raises
ConstraintError (a ValueError: answer 400). Enforcing a grammar while the
model writes, step by step, is constraints.py's.

Why llguidance: it computes a token mask for a grammar in tens to hundreds of
microseconds on the CPU, drops the GIL while doing so, compiles JSON schemas and
Lark grammars with %json{...} sub-schemas, and refuses schema keywords it does
not implement instead of silently ignoring them.
"""

import functools
import json
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from llguidance import LLMatcher, LLTokenizer

# Compact JSON with the separators json.dumps writes (and the Qwen chat
# template's tojson): ", " and ": ". No free whitespace: llguidance's default
# allows any run of whitespace between tokens, and a model (a random one
# certainly, a real one sometimes) can then pad forever instead of finishing.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# OpenAI's rule for function and response_format names. Names go into the
# grammar as literals, so this also keeps them free of anything to escape.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class ConstraintError(ValueError):
    """A response_format / tools body the constraint engine cannot honour."""


class ConstraintUnavailable(ConstraintError):
    """What the model (its tokenizer, its tool format) or the tool list's
    shape can't support, rather than a schema that is wrong: strict tools
    the model calls at its choice are then served unconstrained."""


@dataclass(frozen=True)
class Grammar:
    """A compiled, validated llguidance grammar (tokenizer-independent)."""

    text: str  # what LLMatcher takes
    kind: str  # "json_object", "json_schema" or "tool_call"
    schema: Optional[Dict[str, Any]] = field(default=None, compare=False, hash=False)


# -- compiling -----------------------------------------------------------------


def _canonical(value) -> str:
    # Property order is kept (no sort_keys): llguidance generates properties in
    # schema order, so two schemas differing only in order are different grammars.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _check(grammar: str, what: str, ll_tokenizer: Optional[LLTokenizer] = None) -> None:
    """llguidance's own validation: unknown types, unimplemented keywords and
    formats, bad $refs, look-around in patterns, unknown special tokens..."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    if is_error:
        reason = messages[0] if messages else "invalid grammar"
        raise ConstraintError(f"{what} is not supported: {reason.strip()}")


# Schemas longer than this are compiled each time rather than kept: the
# caches hold at most 128 + 64 entries of this size.
CACHED_SCHEMA_CHARS = 64 * 1024


def _compile_schema(key: str, kind: str) -> Grammar:
    if len(key) > CACHED_SCHEMA_CHARS:
        return _compile_schema_now(key, kind)
    return _compile_schema_cached(key, kind)


def _compile_schema_now(key: str, kind: str) -> Grammar:
    # Keyed by the canonical JSON, so a client repeating a schema (the usual
    # case) costs one dict lookup. Failures are not cached (lru_cache does not
    # keep exceptions); they are cheap to find again.
    schema = json.loads(key)
    try:
        text = LLMatcher.grammar_from_json_schema(key, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise ConstraintError(f"invalid JSON schema: {e}") from None
    _check(text, "the JSON schema")
    return Grammar(text, kind, schema)


_compile_schema_cached = functools.lru_cache(maxsize=128)(_compile_schema_now)


def compile_response_format(response_format: Any) -> Optional[Grammar]:
    """OpenAI `response_format` -> Grammar, or None for unconstrained text.

    {"type": "text"}                        None
    {"type": "json_object"}                 any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
                                           "strict": bool}}
                                            a JSON value valid for the schema

    `strict` is accepted and does not change anything: the output is always
    constrained, and schema keywords llguidance does not implement are always
    errors (a schema's own "x-guidance": {"lenient": true} opts out of that).
    Raises ConstraintError for malformed bodies and unsupported schemas.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ConstraintError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile_schema(_canonical({"type": "object"}), "json_object")
    if kind != "json_schema":
        raise ConstraintError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ConstraintError("response_format.json_schema must be an object")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ConstraintError(
            "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -"
        )
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise ConstraintError("response_format.json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ConstraintError("response_format.json_schema.schema must be a JSON schema object")
    try:
        key = _canonical(schema)
    except (TypeError, ValueError) as e:  # NaN is fine in Python, not in JSON
        raise ConstraintError(f"invalid JSON schema: {e}") from None
    return _compile_schema(key, "json_schema")


# -- tokenizers ----------------------------------------------------------------

_ll_tokenizers: "weakref.WeakKeyDictionary[Any, LLTokenizer]" = weakref.WeakKeyDictionary()
_ll_lock = threading.Lock()


def ll_tokenizer(tokenizer) -> LLTokenizer:
    """llguidance's view of an mlx-lm TokenizerWrapper, built once per tokenizer
    (about a second for a 150k vocabulary: worth doing at model load)."""
    with _ll_lock:
        ll = _ll_tokenizers.get(tokenizer)
        if ll is None:
            import llguidance.hf

            try:
                # Every EOS id the engine stops on: llguidance allows exactly
                # these once the grammar is complete.
                ll = llguidance.hf.from_tokenizer(
                    tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
                )
            except (ValueError, AttributeError, TypeError) as e:  # not a Rust HF tokenizer
                raise ConstraintUnavailable(
                    f"structured output is not available for this tokenizer: {e}")
            _ll_tokenizers[tokenizer] = ll
        return ll


def _single_token(tokenizer, text: str) -> Optional[int]:
    """The id of `text` if the tokenizer has it as one special token."""
    ll = ll_tokenizer(tokenizer)
    ids = ll.tokenize_str(text, parse_special=True)
    if len(ids) == 1 and ll.is_special_token(ids[0]):
        return ids[0]
    return None


# -- tool calls ----------------------------------------------------------------


def _lark_literal(text: str) -> str:
    # Lark string literals take JSON's escapes.
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(
    tools: Sequence[Dict[str, Any]],
    name: Optional[str] = None,
    *,
    tokenizer,
    parallel: bool = False,
    after_open: bool = False,
) -> Grammar:
    """A grammar for a forced tool call in the Hermes/Qwen format:

        <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>

    ARGS is constrained by that tool's `parameters` schema (a tool without one
    takes `{}`). `name` forces one tool (tool_choice {"type": "function", ...});
    None allows any of `tools` (tool_choice "required"). With `parallel`, one or
    more calls separated by "\\n" (as the chat template writes several).
    <tool_call> and </tool_call> are matched as the special tokens when the
    tokenizer has them, so the model's usual single token is the one allowed.
    `after_open`: the call after its <tool_call> token (which must be one
    special token), for strict tools the model calls when it chooses to.
    Raises ConstraintError for malformed tools, an unknown `name`, a tokenizer
    whose tool parser is not the <tool_call> JSON one, or unsupported schemas.
    """
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not getattr(parser, "__module__", "").endswith("json_tools"):
        raise ConstraintUnavailable(
            "tool calls held to a schema need a model with the <tool_call> JSON tool format"
        )
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ConstraintError("tools must be a non-empty array")
    functions = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise ConstraintError("each tool must be {'type': 'function', 'function': {...}}")
        fname = fn.get("name")
        if not (isinstance(fname, str) and _NAME.fullmatch(fname)):
            raise ConstraintUnavailable(
                "a function name must be 1-64 characters of a-z, A-Z, 0-9, _ and -"
            )
        params = fn.get("parameters")
        if params is None:
            # OpenAI: omitting parameters defines a function with no arguments.
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ConstraintError(f"the parameters of {fname!r} must be a JSON schema object")
        if "type" not in params:
            # Arguments are an object whatever the schema leaves open (a
            # sibling "type" intersects with anyOf/$ref/...).
            params = {"type": "object", **params}
        functions[fname] = params
    if name is not None:
        if name not in functions:
            raise ConstraintError(f"tool_choice names {name!r}, which is not among the tools")
        functions = {name: functions[name]}
    start = tokenizer.tool_call_start or "<tool_call>"
    end = tokenizer.tool_call_end or "</tool_call>"
    start_id, end_id = _single_token(tokenizer, start), _single_token(tokenizer, end)
    if after_open and start_id is None:
        raise ConstraintUnavailable(
            f"strict tools need a model whose {start} is one special token")
    # The grammar depends on the tokenizer only through these ids: in the key.
    key = _canonical([functions, start, end, start_id, end_id, parallel and not after_open,
                      after_open])
    if len(key) > CACHED_SCHEMA_CHARS:
        return _compile_tools_now(key)
    return _compile_tools_cached(key)


def _compile_tools_now(key: str) -> Grammar:
    functions, start, end, start_id, end_id, parallel, after_open = json.loads(key)
    # A special token is written <[id]>: the model must emit that one token,
    # not the same characters spelled in pieces (the engine finds tool calls
    # by that token sequence, and the model was trained on the single token).
    open_ = f"<[{start_id}]>" if start_id is not None else _lark_literal(start)
    close = f"<[{end_id}]>" if end_id is not None else _lark_literal(end)
    if after_open:
        open_ = ""
    choices = " | ".join(f"fn_{i}" for i in range(len(functions)))
    lines = [
        "%llguidance {}",
        'start: call ("\\n" call)*' if parallel else "start: call",
        f'call: {open_} "\\n" ({choices}) "\\n" {close}',
    ]
    for i, (fname, params) in enumerate(functions.items()):
        head = '{"name": "%s", "arguments": ' % fname
        # Each %json is compiled as a schema of its own: x-guidance applies.
        own = params.get("x-guidance")
        own = own if isinstance(own, dict) else {}
        params = {**params, "x-guidance": {**JSON_OPTIONS, **own}}
        lines.append(f'fn_{i}: {_lark_literal(head)} args_{i} "}}"')
        lines.append(f"args_{i}: %json {_canonical(params)}")
    text = LLMatcher.grammar_from_lark("\n".join(lines))
    _check(text, "the tool parameters schema")
    if after_open:
        return Grammar(text, "strict_tools", {"functions": functions, "trigger": start_id})
    return Grammar(text, "tool_call", {"functions": functions})


_compile_tools_cached = functools.lru_cache(maxsize=64)(_compile_tools_now)


# -- what a request asks for -----------------------------------------------------


@dataclass(frozen=True)
class ForcedToolCall:
    """tool_choice "required" (name None) or naming a function: compiled by
    the engine with the tokenizer of the model that serves the request (the
    grammar holds its special-token ids)."""

    tools: Any
    name: Optional[str] = None


@dataclass(frozen=True)
class StrictToolCalls:
    """Tools with "strict": true and a tool_choice that leaves the call to
    the model: any call it opens is held to its tool's schema (a tool without
    strict: to a JSON object). Compiled by the engine, as ForcedToolCall."""

    tools: Any

    @staticmethod
    def wanted(tools) -> bool:
        return isinstance(tools, list) and any(
            isinstance(t, dict) and isinstance(t.get("function"), dict)
            and t["function"].get("strict") is True for t in tools)


def _loose(tool):
    """A tool as the strict-tools grammar sees it: non-strict ones take any
    JSON object as arguments."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or fn.get("strict") is True:
        return tool
    return {**tool, "function": {**fn, "parameters": {"type": "object"}}}


class Prepared:
    """A request's constraint compiled for the tokenizer of the model that
    is to serve it, with its matcher built: the slow part of structured
    output (a large schema takes a second or more), done before the request
    is planned, in the HTTP side's constraint lanes, where no other request
    waits for it. The engine takes the matcher once (processor_for); for
    another tokenizer it compiles `source` again. Pickled (to the other
    ranks under mx.distributed) as `source`."""

    def __init__(self, source, grammar: Grammar, tokenizer):
        self.source = source  # a Grammar, ForcedToolCall or StrictToolCalls
        self.grammar = grammar
        self._tokenizer = weakref.ref(tokenizer)
        self._matcher: Optional[LLMatcher] = LLMatcher(
            ll_tokenizer(tokenizer), grammar.text, log_level=0)

    def is_for(self, tokenizer) -> bool:
        return self._tokenizer() is tokenizer

    def take_matcher(self, tokenizer) -> Optional[LLMatcher]:
        """The matcher built ahead, once, if it is for `tokenizer`."""
        matcher = self._matcher if self.is_for(tokenizer) else None
        self._matcher = None if matcher is not None else self._matcher
        return matcher

    def __reduce_ex__(self, protocol):
        return self.source.__reduce_ex__(protocol)


def prepare(constraint, tokenizer) -> Optional[Prepared]:
    """`constraint` compiled for `tokenizer`, its matcher built (None: it
    constrains nothing). Raises ConstraintError."""
    grammar = grammar_for(constraint, tokenizer)
    return Prepared(constraint, grammar, tokenizer) if grammar is not None else None


def grammar_for(constraint, tokenizer) -> Optional[Grammar]:
    """The grammar of a request's constraint (a Grammar, a ForcedToolCall, a
    StrictToolCalls, a Prepared, or None). Raises ConstraintError."""
    if isinstance(constraint, Prepared):
        if constraint.is_for(tokenizer):
            return constraint.grammar
        constraint = constraint.source
    if isinstance(constraint, ForcedToolCall):
        return tool_call_grammar(constraint.tools, constraint.name, tokenizer=tokenizer)
    if isinstance(constraint, StrictToolCalls):
        return tool_call_grammar([_loose(t) for t in constraint.tools], tokenizer=tokenizer,
                                 after_open=True)
    return constraint
