"""Structured output: grammars for response_format and forced tool calls, and a
per-request logits processor that enforces them, built on llguidance.

    grammar = compile_response_format(body["response_format"])   # None: free text
    grammar = tool_call_grammar(tools, name, tokenizer=tokenizer)  # tool_choice
    proc = ConstraintProcessor(grammar, tokenizer, after_think=...)
    generator.insert(..., logits_processors=[[*others, proc]])     # ours last
    ...
    if proc.error: the request failed in the grammar (it was ended by EOS)

Everything here is standalone: compiling raises ConstraintError (a ValueError:
answer 400), while the processor never raises into the batch once generation
has started (see ConstraintProcessor).

Why llguidance: it computes a token mask for a grammar in tens to hundreds of
microseconds on the CPU, drops the GIL while doing so, compiles JSON schemas and
Lark grammars with %json{...} sub-schemas, and refuses schema keywords it does
not implement instead of silently ignoring them.
"""

import functools
import json
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np
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


# -- the logits processor ------------------------------------------------------

# States of a ConstraintProcessor.
_MAYBE_THINK = "maybe_think"  # grammar or the think-start token
_THINKING = "thinking"  # pass-through until the think-end token
_ACTIVE = "active"  # the grammar applies
_DONE = "done"  # grammar complete or failed: EOS only
_FREE = "free"  # strict tools: pass-through until the model opens a call

# What a request's row needs at one step.
_PASS = "pass"  # its logits unchanged (thinking)
_EOS = "eos"  # only the EOS ids (grammar complete, or failed)
_MASK = "mask"  # the matcher's mask (plus any extra ids)

class ConstraintProcessor:
    """A logits processor for one request: `processor(tokens, logits) ->
    logits` in mlx-lm's BatchGenerator (or generate_step / stream_generate),
    and `ConstraintProcessor.mask_batch(rows, shape)` for every
    constrained row of a batch at once (patches/batched_logits_processors).

    Each call sees the request's tokens so far (prompt, then generated) and
    its logits. The first call comes before any token was generated:
    everything seen then is prompt. Each later call consumes the tokens added
    since the previous one (one per step), then masks the logits with -inf
    outside what the grammar allows next. Once the grammar is complete only
    the EOS ids are allowed, so the request ends by EOS (finish_reason
    "stop"); max_tokens can still cut it ("length").

    after_think: for thinking models. The grammar starts after the think-end
    token (`</think>`) the model generates; until then logits pass unchanged.
    At the first call the prompt decides: if its last think marker is a
    think-start (the template opened the block), wait for </think>; if the
    prompt ends with a think-end (the template closed the block:
    enable_thinking=False), constrain at once; otherwise (no marker, or one
    from an earlier turn) the model may open a block itself: the first token
    may be the think-start (then wait for </think>) or start the grammar.
    So the engine can pass after_think=tokenizer.has_thinking always.

    Strict tools (a "strict_tools" grammar, see tool_call_grammar's
    after_open): the model writes freely (thinking included) until it emits
    the <tool_call> token; the call that follows is held to the grammar, and
    once it is closed the model is free again (for text, or another call).

    Errors: a grammar failure during generation (a token the matcher refuses,
    a llguidance limit) never raises into the batch: `self.error` gets the
    reason and only EOS is allowed from then on, so the request ends at the
    next step with finish_reason "stop". The engine must check `error` when the
    request finishes and fail that one request. Construction raises
    ConstraintError (before the request joins a batch).

    Cost: `mask_seconds` / `steps` is the CPU time per constrained step
    (consume + mask + the mask as a bool array; see stats()). The masks are
    computed while the step's forward pass runs: the step starts it
    (mx.async_eval) before handing the CPU to llguidance, which drops the GIL
    (in a batch on the CPU, on a worker thread: see patches/
    batched_logits_processors). In a batch, one call fills every row's mask
    (a LogitMask) and one `where` applies them all. What cannot be hidden:
    the mask needs
    the token sampled at the previous step, so the step waits for it (mlx-lm
    otherwise queues the next step before the previous one is done); that
    wait happens while thinking too.

    Not for speculative decoding (tokens that are rolled back are not
    un-consumed); one processor per request, never shared or reused.
    """

    ORDER = 1  # (batched after a thinking budget: patches/batched_logits_processors)

    def __init__(self, grammar: Grammar, tokenizer, *, after_think: bool = False,
                 prompt: Optional[Sequence[int]] = None, may_open_think: bool = True,
                 matcher: Optional[LLMatcher] = None):
        self.grammar = grammar
        self._prompt = prompt
        # False for raw text prompts: no template asks the model to think,
        # so a prompt without markers is constrained from its first token.
        self._may_open_think = may_open_think
        self.ll = ll_tokenizer(tokenizer)
        # (`matcher`: one built ahead for this grammar and tokenizer, unused.)
        self.matcher = matcher or LLMatcher(self.ll, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.eos_ids = sorted(tokenizer.eos_token_ids)
        self.error: Optional[str] = None
        self.after_think = after_think and tokenizer.has_thinking
        self._think_start = tuple(tokenizer.think_start_tokens or ()) if self.after_think else ()
        self._think_end = tuple(tokenizer.think_end_tokens or ()) if self.after_think else ()
        self.state = _THINKING if self.after_think else _ACTIVE
        # Strict tools: the token that opens a call, which starts the grammar.
        self._trigger = (grammar.schema or {}).get("trigger") if grammar.kind == "strict_tools" else None
        if self._trigger is not None:
            self.after_think, self.state = False, _FREE
        self.calls = 0  # strict tools: the calls the model opened
        self._seen: Optional[int] = None  # tokens seen at the previous call
        self._recent: List[int] = []  # generated tokens, while looking for </think>
        self._words = (self.ll.vocab_size + 31) // 32  # of a bitmask row
        self._extra_ids: List[int] = []  # also allowed this step (think-start)
        self.steps = 0
        self.mask_seconds = 0.0

    @property
    def started(self) -> bool:
        """Whether the grammar applied at all (False: the model was still
        thinking when the request ended, so its output is unconstrained)."""
        return self.state in (_ACTIVE, _DONE) or self.calls > 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """One row, `tokens` its (1-d) context, `logits` of shape (1, vocab)."""
        # Start this step's forward pass: the mask is computed while it runs.
        mx.async_eval(logits)
        new = tokens[self._seen :].tolist() if self._seen is not None else None
        tic = time.perf_counter()
        if new is None:
            need = self._first(lambda: np.array(tokens).tolist())
        else:
            need = self._advance(new)
        self._seen = tokens.size
        return LogitMask.applied(logits, _mask(logits.shape, [(0, self, need)], tic))

    @staticmethod
    def mask_batch(rows, shape) -> Optional["LogitMask"]:
        """The mask of all constrained rows of a batch step, on the CPU
        alone (numpy and llguidance: any thread may make it while the step's
        forward pass runs). `rows`: (row index, processor, the row's tokens
        in the KV cache as a list, the token fed at this step); `shape`: the
        logits' (batch, vocab). Other rows pass unchanged; None: all do."""
        tic = time.perf_counter()
        needs = []
        for e, p, history, newest in rows:
            if p._seen is None:
                need = p._first(lambda: history + [newest])
            else:
                need = p._advance(history[p._seen :] + [newest])
            p._seen = len(history) + 1
            needs.append((e, p, need))
        return _mask(shape, needs, tic)

    def _first(self, context) -> str:
        """The first call: the prompt sets the thinking state."""
        if self.after_think:
            # The whole prompt when known: the sequential path passes only
            # the tokens after the cached prefix to the processor.
            prompt = self._prompt if self._prompt is not None else context()
            self.state = self._thinking_state(list(prompt))
            if self.state == _MAYBE_THINK:
                self._extra_ids = [self._think_start[0]]
        return self._advance([])

    def _advance(self, new: List[int]) -> str:
        """Take the tokens generated since the previous call; what this
        step's row needs."""
        if self.state == _FREE:
            if self._trigger not in new:
                return _PASS
            new = new[new.index(self._trigger) + 1 :]
            self.state = _ACTIVE
            self.calls += 1
        if self.state == _THINKING:
            new = self._skip_thinking(new)
            if self.state == _THINKING:
                return _PASS
        elif self.state == _MAYBE_THINK and new:
            # Offered at the first step only: never inside the grammar.
            self._extra_ids = []
            if new[0] == self._think_start[0]:
                self.state = _THINKING
                new = self._skip_thinking(new[1:])
                if self.state == _THINKING:
                    return _PASS
            else:
                self.state = _ACTIVE
        matcher = self.matcher
        if self.state == _ACTIVE and new and not matcher.consume_tokens(new):
            return self._fail()
        if self.state == _DONE:
            return _EOS
        if self._trigger is not None and self.state == _ACTIVE and matcher.is_accepting():
            # The call is closed (nothing can follow it in its grammar).
            matcher.reset()
            self.state = _FREE
            return _PASS
        if matcher.is_stopped():
            if matcher.is_error():
                return self._fail()
            # Grammar complete: only EOS (whatever llguidance's own stop mask).
            self.state = _DONE
            return _EOS
        return _MASK

    def _thinking_state(self, prompt: List[int]) -> str:
        """Where the prompt leaves a thinking model (see the class doc)."""
        start = _rfind(prompt, self._think_start)
        end = _rfind(prompt, self._think_end)
        if start > end:
            return _THINKING
        tail = prompt[end + len(self._think_end) :] if end >= 0 else None
        if tail is not None and len(tail) <= 8 and not self.ll.decode_str(tail).strip():
            return _ACTIVE  # closed just now: "<think>\n\n</think>\n\n"
        # No marker, or one from an earlier turn (templates that keep recent
        # reasoning): the model may open a block itself, if its think-start
        # is one token (the mask can offer it); else constrain at once.
        if len(self._think_start) == 1 and self._may_open_think:
            return _MAYBE_THINK
        return _ACTIVE

    def _skip_thinking(self, new: List[int]) -> List[int]:
        """Pass tokens while thinking; returns those after the think-end."""
        self._recent.extend(new)
        at = _find(self._recent, self._think_end)
        if at < 0:
            del self._recent[: max(0, len(self._recent) - len(self._think_end))]
            return []
        self.state = _ACTIVE
        rest = self._recent[at + len(self._think_end) :]
        self._recent = []
        return rest

    def _fail(self) -> str:
        # Never raise inside the batch: remember why and end this request.
        if self.error is None:
            self.error = self.matcher.get_error() or "the output left the grammar"
        self.state = _DONE
        return _EOS

    def stats(self) -> Dict[str, float]:
        return {
            "steps": self.steps,
            "mask_seconds": self.mask_seconds,
            "mask_ms_per_step": 1e3 * self.mask_seconds / self.steps if self.steps else 0.0,
        }


@dataclass
class LogitMask:
    """What batched logits processors do to a step's logits: made on the
    CPU with numpy (on any thread), applied on the generation thread in one
    or two `where`s. Logits outside `keep` become -inf, then those in `fill`
    0 (a row limited to a few ids samples one of them whatever their logits,
    never from a row of -inf). Both (batch, vocab) bool arrays."""

    keep: np.ndarray
    fill: Optional[np.ndarray] = None

    def apply(self, logits: mx.array) -> mx.array:
        # (-inf and 0.0 are weak scalars: a bf16 batch stays bf16.)
        out = mx.where(mx.array(self.keep), logits, -mx.inf)
        if self.fill is not None:
            out = mx.where(mx.array(self.fill), 0.0, out)
        return out

    @staticmethod
    def applied(logits: mx.array, mask: Optional["LogitMask"]) -> mx.array:
        return logits if mask is None else mask.apply(logits)


def _mask(shape, needs, tic: float) -> Optional[LogitMask]:
    """The mask of the rows `needs` names ((row, processor, need)) in
    logits of `shape`: every _MASK row's bitmask filled by its matcher,
    then one bool array for the whole batch (rows not in `needs`, and _PASS
    rows, all allowed). `tic`: when the step's work for them began."""
    if all(need == _PASS for _, _, need in needs):
        return None
    eos = [(e, p) for e, p, need in needs if need == _EOS]
    masked = [(e, p) for e, p, need in needs if need == _MASK]
    batch, vocab = shape
    allowed = np.ones((batch, vocab), dtype=bool)
    if masked:
        words = masked[0][1]._words  # one tokenizer per batch
        bitmask = np.zeros((len(masked), words), dtype=np.int32)
        # One row after another: llguidance's thread pool (LLExecutor) was
        # slower here (0.63-0.68x vs 0.68-0.79x of unconstrained at batch 8
        # on the CPU fixture): a mask takes microseconds, a handoff more.
        for i, (_, p) in enumerate(masked):
            row = bitmask[i]
            p.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(bool)
        known = min(vocab, bits.shape[1])
        for i, (e, p) in enumerate(masked):
            if p.matcher.is_error():
                p._fail()
                eos.append((e, p))
                continue
            allowed[e, :known] = bits[i, :known]
            # Ids past the tokenizer's vocabulary (padded embeddings) never.
            allowed[e, known:] = False
            for t in p._extra_ids:
                if t < vocab:
                    allowed[e, t] = True
    # EOS only, at logit 0: whatever the model (or a logit_bias) gave the
    # EOS ids, the row samples one of them, never from an all -inf row. (A
    # row whose EOS ids all lie past the logits can't stop: max_tokens ends it.)
    at_eos = np.zeros((batch, vocab), dtype=bool) if eos else None
    for e, p in eos:
        at_eos[e, [t for t in p.eos_ids if t < vocab]] = True
        if at_eos[e].any():
            allowed[e] = False
    work = [p for _, p, need in needs if need != _PASS]
    for p in work:
        p.steps += 1
        p.mask_seconds += (time.perf_counter() - tic) / len(work)
    return LogitMask(allowed, at_eos)


def _find(seq: List[int], sub: Sequence[int]) -> int:
    n = len(sub)
    if n == 0:
        return -1
    for i in range(len(seq) - n + 1):
        if seq[i] == sub[0] and tuple(seq[i : i + n]) == tuple(sub):
            return i
    return -1


def _rfind(seq: List[int], sub: Sequence[int]) -> int:
    n = len(sub)
    if n == 0:
        return -1
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == sub[0] and tuple(seq[i : i + n]) == tuple(sub):
            return i
    return -1


# -- measuring -----------------------------------------------------------------


def mask_cost(grammar: Grammar, tokenizer, text: str, repeat: int = 3) -> Dict[str, float]:
    """Time llguidance's per-token work on a valid output `text` (e.g. a
    json.dumps of an instance of the schema): for each of its tokens, one mask
    computation plus one consume, as the processor does per step.
    Returns microseconds per token: median, p90, max, and the token count."""
    ll = ll_tokenizer(tokenizer)
    ids = ll.tokenize_str(text, parse_special=True)
    bitmask = np.zeros((1, (ll.vocab_size + 31) // 32), dtype=np.int32)
    times = []
    for _ in range(repeat):
        matcher = LLMatcher(ll, grammar.text, log_level=0)
        for t in ids:
            tic = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            ok = matcher.consume_token(t)
            times.append(time.perf_counter() - tic)
            if not ok:
                raise ConstraintError(f"text does not match the grammar: {matcher.get_error()}")
    us = np.array(times) * 1e6
    return {
        "tokens": len(ids),
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "max_us": float(us.max()),
    }


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


def processor_for(constraint, tokenizer, prompt=None,
                  chat: bool = True) -> Optional["ConstraintProcessor"]:
    """The logits processor of a request's constraint, for the request whose
    prompt is `prompt` (its token ids; `chat`: from a chat template, which may
    have the model open a thinking block). Raises ConstraintError."""
    try:
        grammar = grammar_for(constraint, tokenizer)
    except ConstraintUnavailable:
        source = constraint.source if isinstance(constraint, Prepared) else constraint
        if isinstance(source, StrictToolCalls):
            return None  # best effort, as the API decided for the loaded model
        raise
    if grammar is None:
        return None
    matcher = constraint.take_matcher(tokenizer) if isinstance(constraint, Prepared) else None
    return ConstraintProcessor(grammar, tokenizer, after_think=True, prompt=prompt,
                               may_open_think=chat, matcher=matcher)
