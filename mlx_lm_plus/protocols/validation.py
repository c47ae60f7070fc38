"""Request body -> (CompletionRequest, GenerationArguments), or a ValueError.

Field names, defaults and error messages are those of mlx_lm.server 0.32.2
(`APIHandler.do_POST` and `validate_model_parameters`). Where upstream accepts
a value that later kills its generation thread, we reject it here with a
message in the same style (see `_validate_extra`).
"""

import binascii
import io
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from mlx_lm.server import (
    CompletionRequest,
    GenerationArguments,
    LogitsProcessorArguments,
    ModelDescription,
    SamplingArguments,
)

from mlx_lm_plus.codec import b64decode
from mlx_lm_plus.errors import RequestError
from mlx_lm_plus.planning.vocab import check_vocab
from mlx_lm_plus.upstream import image_parts, image_url
from mlx_lm_plus.planning.reasoning import EFFORT_BUDGETS


@dataclass
class Request(CompletionRequest):
    """Upstream's CompletionRequest, plus its images decoded and fingerprinted
    before it reaches the engine (images.DecodedImage, in the order of the
    messages' image parts; None: not decoded yet)."""

    images: Optional[List[Any]] = None
    # Plan the prompt and answer its size only (/v1/messages/count_tokens).
    count_only: bool = False
    # Structured output, as asked (checked here, compiled by the API into
    # `constraint`, a grammars.Grammar the engine enforces).
    response_format: Optional[Dict[str, Any]] = None
    tool_choice: Any = None
    constraint: Any = None
    # How long its model stays loaded once idle (Ollama's keep_alive, in
    # seconds; negative: for good; None: the model's TTL).
    keep_alive: Optional[float] = None
    # Tokens the model may think before its think block is closed for it
    # (reasoning.py; None: unbounded).
    thinking_budget: Optional[int] = None


@dataclass
class ParsedRequest:
    request: Request
    args: GenerationArguments
    stream: bool
    stream_options: Optional[Dict[str, Any]]
    requested_model: str
    # What a wire protocol other than chat completions keeps from its own
    # request for its answer (wire.py).
    extra: Any = None
    # Bytes of conversation the request brings beyond its body (a Responses
    # continuation's stored one): what picks its planning lane, with the
    # body's size.
    carried_bytes: int = 0


def _validate(params, name, expected_type, min_val=None, max_val=None,
              optional=False, whitelist=None):
    """Upstream's APIHandler._validate, on a dict of parameters."""
    value = params[name]
    if optional and value is None:
        return
    types = expected_type if isinstance(expected_type, tuple) else (expected_type,)
    # Stricter than upstream: JSON true/false are not numbers (bool is an int
    # subclass; `top_logprobs: true` used to fail the whole batch), and NaN or
    # Infinity are not values.
    wrong = not isinstance(value, expected_type) or (
        isinstance(value, bool) and bool not in types
    ) or (isinstance(value, float) and not math.isfinite(value))
    if wrong:
        try:
            allowed = tuple(et.__name__ for et in expected_type)
        except TypeError:
            allowed = expected_type.__name__
        raise RequestError(f"{name} must be of type {allowed}")
    if whitelist is not None and value in whitelist:
        return
    if min_val is not None and value < min_val:
        raise RequestError(f"{name} must be at least {min_val}")
    if max_val is not None and value > max_val:
        raise RequestError(f"{name} must be at most {max_val}")


def _read_params(body: Dict[str, Any], cli) -> Dict[str, Any]:
    max_tokens = body.get("max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = body.get("max_tokens", cli.max_tokens)
    return dict(
        stream=body.get("stream", False),
        stream_options=body.get("stream_options", None),
        requested_model=body.get("model", "default_model"),
        requested_draft_model=body.get("draft_model", "default_model"),
        num_draft_tokens=body.get("num_draft_tokens", cli.num_draft_tokens),
        adapter=body.get("adapters", None),
        max_tokens=max_tokens,
        temperature=body.get("temperature", cli.temp),
        top_p=body.get("top_p", cli.top_p),
        top_k=body.get("top_k", cli.top_k),
        min_p=body.get("min_p", cli.min_p),
        repetition_penalty=body.get("repetition_penalty", 0.0),
        repetition_context_size=body.get("repetition_context_size", 20),
        presence_penalty=body.get("presence_penalty", 0.0),
        presence_context_size=body.get("presence_context_size", 20),
        frequency_penalty=body.get("frequency_penalty", 0.0),
        frequency_context_size=body.get("frequency_context_size", 20),
        xtc_probability=body.get("xtc_probability", 0.0),
        xtc_threshold=body.get("xtc_threshold", 0.1),
        logit_bias=body.get("logit_bias", None),
        logprobs=body.get("logprobs", False),
        top_logprobs=body.get("top_logprobs", -1),
        seed=body.get("seed", None),
        chat_template_kwargs=body.get("chat_template_kwargs"),
    )


# Items a wire protocol's request may carry per message allowed (Responses
# input items, Anthropic content blocks): they are translated into chat
# messages on the event loop, and several make one message (a turn's tool
# calls), so --max-messages alone would not bound that work.
ITEMS_PER_MESSAGE = 4


def count_items(value, keys, limit: int) -> int:
    """List elements in `value`, however nested, walking into dicts by
    `keys` only (messages, their content blocks, a block's content), as
    translation walks them; it stops once past `limit` (a 128 MiB body may
    hold 67 million). Without recursion: any depth JSON allows."""
    count, stack = 0, [value]
    while stack and count <= limit:
        value = stack.pop()
        if isinstance(value, list):
            count += len(value)
            if count <= limit:
                stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.get(k) for k in keys)
    return count


def check_item_count(values, keys, cli, what: str) -> None:
    """At most ITEMS_PER_MESSAGE x --max-messages items in `values` (each
    counted by count_items), or a 400."""
    most = cli.max_messages
    if most is None:
        return
    limit, n = ITEMS_PER_MESSAGE * most, 0
    for value in values:
        n += count_items(value, keys, limit - n)
    if n > limit:
        raise RequestError(f"Too many {what}: more than {limit} ({ITEMS_PER_MESSAGE} x "
                           "--max-messages)")


# The penalties' look-back slices the tokens with it: MLX takes 32-bit
# indices (past them the batch step fails, and every request in it).
MAX_CONTEXT_SIZE = 2**31 - 1


def _validate_upstream(p: Dict[str, Any]) -> None:
    """validate_model_parameters of mlx_lm.server 0.32.2, in its order."""
    _validate(p, "stream", bool)
    _validate(p, "max_tokens", int, min_val=1)
    _validate(p, "temperature", (float, int), min_val=0)
    _validate(p, "top_p", (float, int), min_val=0, max_val=1)
    _validate(p, "top_k", int, min_val=0)
    _validate(p, "min_p", (float, int), min_val=0, max_val=1)
    _validate(p, "num_draft_tokens", int, min_val=0)
    _validate(p, "repetition_penalty", (float, int), min_val=0)
    _validate(p, "repetition_context_size", int, min_val=0, max_val=MAX_CONTEXT_SIZE)
    _validate(p, "presence_penalty", (float, int))
    _validate(p, "presence_context_size", int, min_val=0, max_val=MAX_CONTEXT_SIZE)
    _validate(p, "frequency_penalty", (float, int))
    _validate(p, "frequency_context_size", int, min_val=0, max_val=MAX_CONTEXT_SIZE)
    _validate(p, "logprobs", bool)
    _validate(p, "top_logprobs", int, min_val=0, max_val=11, whitelist=[-1])
    _validate(p, "xtc_probability", float, min_val=0, max_val=1)
    _validate(p, "xtc_threshold", float, min_val=0, max_val=1)
    _validate(p, "requested_model", str)
    _validate(p, "adapter", str, optional=True)
    _validate(p, "seed", int, optional=True, min_val=0, max_val=2**64 - 1)
    _validate(p, "logit_bias", dict, optional=True)
    if p["logit_bias"] is not None:
        try:
            p["logit_bias"] = {int(k): float(v) for k, v in p["logit_bias"].items()}
        except (ValueError, TypeError) as e:
            raise RequestError("logit_bias must be a dict of int to float") from e
        if not all(math.isfinite(v) and abs(v) <= 1e4 for v in p["logit_bias"].values()):
            raise RequestError("logit_bias values must be numbers within [-10000, 10000]")


MAX_NAME_CHARS = 4096  # (PATH_MAX on Linux)


def _validate_extra(p: Dict[str, Any], vocab_size: Optional[int]) -> None:
    """Checks upstream lacks, for values that crash its generation thread."""
    # Stricter than upstream: values its samplers can't take. Beyond these the
    # sampler raises (xtc_threshold > 0.5; integers past 2**63: std::bad_cast)
    # or turns the logits into NaN (huge penalties), failing or corrupting
    # the whole batch.
    _validate(p, "xtc_threshold", float, min_val=0, max_val=0.5)
    _validate(p, "temperature", (float, int), min_val=0, max_val=1000)
    for name in ("presence_penalty", "frequency_penalty"):
        _validate(p, name, (float, int), min_val=-100, max_val=100)
    _validate(p, "repetition_penalty", (float, int), min_val=0, max_val=100)
    if 0 < p["repetition_penalty"] < 0.01:
        raise RequestError("repetition_penalty must be 0 (off) or at least 0.01")
    if not isinstance(p["requested_draft_model"], str):
        # Upstream never checks it; the model lookup then raises on whatever
        # thread it runs (a hang with --allow-model-loading).
        raise RequestError("draft_model must be of type str")
    # A name is a path or a repository id: longer is no model, only bytes
    # kept in the request history, logged and echoed in errors.
    for field, value in (("model", p["requested_model"]),
                         ("draft_model", p["requested_draft_model"]), ("adapters", p["adapter"])):
        if isinstance(value, str) and len(value) > MAX_NAME_CHARS:
            raise RequestError(f"{field} must be at most {MAX_NAME_CHARS} characters")
    options = p["stream_options"]
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError("stream_options must be of type dict")
        if not isinstance(options.get("include_usage", False), bool):
            raise RequestError("stream_options.include_usage must be of type bool")
    if vocab_size is not None:
        check_vocab(p["top_k"], p["logit_bias"], vocab_size)


def _validate_limits(p: Dict[str, Any], body: Dict[str, Any], cli) -> None:
    """The server's configured limits (--max-tokens-ceiling, --max-messages)."""
    ceiling = cli.max_tokens_ceiling
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if ceiling is not None and asked is None:
        # The server's default (--max-tokens) is held to the ceiling too.
        p["max_tokens"] = min(p["max_tokens"], ceiling)
    if ceiling is not None and p["max_tokens"] > ceiling:
        raise RequestError(
            f"max_tokens must be at most {ceiling} on this server (--max-tokens-ceiling)"
        )
    most = cli.max_messages
    messages = body.get("messages")
    if most is not None and isinstance(messages, list) and len(messages) > most:
        raise RequestError(
            f"Too many messages: {len(messages)} (this server takes at most {most}, "
            "--max-messages)"
        )


def _validate_images(body: Dict[str, Any], cli) -> None:
    """Image parts: data URLs only, within the configured count, bytes and pixels.

    Only the image header is read here (PIL opens lazily), so a
    decompression bomb is refused before anything is decoded. Upstream
    fetches http(s) URLs from the server, which lets any client make the
    server read arbitrary URLs; we refuse them, unless --allow-remote-images:
    then they count towards --max-images here, and are fetched only once the
    whole request has validated, then checked like data URLs
    (remote_images.py).
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    urls = [image_url(p) for p in image_parts(messages)]
    if not urls:
        return
    most = cli.max_images
    if most is not None and len(urls) > most:
        raise RequestError(f"Too many images: {len(urls)} (at most {most}, --max-images)")
    max_bytes = cli.max_image_bytes
    max_pixels = cli.max_image_pixels
    # All the request's images together: what decoding them holds at once.
    budget = cli.max_request_image_pixels
    total = 0
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            raise RequestError(f"Image {i}: the url must be a string")
        if url.startswith(("http://", "https://")):
            if cli.allow_remote_images:
                continue
            raise RequestError(
                f"Image {i}: remote image URLs are not fetched by this server; "
                "send the image as a data URL (data:image/png;base64,...), or start "
                "the server with --allow-remote-images"
            )
        if not url.startswith("data:") or "," not in url:
            raise RequestError(f"Image {i}: images must be data URLs (data:<mime>;base64,<data>)")
        payload = url.partition(",")[2]
        if max_bytes is not None and len(payload) * 3 // 4 > max_bytes:
            raise RequestError(
                f"Image {i} is larger than {max_bytes} bytes (--max-image-bytes)", 413
            )
        try:
            data = b64decode(payload, validate=False)
        except (binascii.Error, ValueError) as e:
            raise RequestError(f"Image {i}: invalid base64 data ({e})") from e
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise RequestError(f"Image {i} could not be decoded: {e}") from e
        except Image.DecompressionBombError as e:
            raise RequestError(f"Image {i} is too large: {e}") from e
        if max_pixels is not None and width * height > max_pixels:
            raise RequestError(
                f"Image {i} has {width}x{height} pixels, more than {max_pixels} "
                "(--max-image-pixels)"
            )
        total += width * height
        if budget is not None and total > budget:
            raise RequestError(
                f"The images of this request have more than {budget} pixels in all "
                "(--max-request-image-pixels)"
            )


# Stop strings are matched by state machines built for each new set (and a
# hundred sets kept): their cost grows with the text, so it is bounded (a
# 2 MB list took 10 s to build, stalling every stream, and kept 900 MB).
MAX_STOP_STRINGS = 256
MAX_STOP_CHARACTERS = 16384


def _stop_words(body):
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS or sum(map(len, stop)) > MAX_STOP_CHARACTERS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} strings of "
                           f"{MAX_STOP_CHARACTERS} characters in all")
    for s in stop:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: no token has it
            raise RequestError(f"stop must be valid Unicode text: {e}") from e
    return [s for s in stop if s]


# Fields other servers take to hold the output to a schema, a regex, a
# choice or a grammar (vLLM's guided_* and structured_outputs, llama.cpp's
# json_schema and grammar). Upstream ignores them, and the client believes
# it got what it asked for: they are refused, pointing to what this server
# enforces.
FOREIGN_ENFORCEMENT = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                       "guided_decoding_backend", "structured_outputs", "json_schema",
                       "grammar")


def refuse_foreign_enforcement(body: Dict[str, Any], names=FOREIGN_ENFORCEMENT,
                               instead: str = "response_format ({'type': 'json_schema', "
                               "'json_schema': {'name': ..., 'schema': {...}}})") -> None:
    """RequestError for the first of `names` the body sets (empty values
    ask for nothing)."""
    for name in names:
        if body.get(name) not in (None, "", [], {}):
            raise RequestError(f"{name} is not supported by this server: use {instead}, "
                               "tool_choice or strict tools, which are enforced")


def _structured_output(request: Request, body: Dict[str, Any]) -> None:
    """response_format (both endpoints) and tool_choice (chat), by shape;
    the schemas themselves are compiled by grammars.py."""
    refuse_foreign_enforcement(body)
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise RequestError("response_format must be an object")
        request.response_format = response_format
    choice = body.get("tool_choice")
    if choice is None or request.request_type != "chat":
        return
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise RequestError("tool_choice must be 'auto', 'none', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}")
    elif not (isinstance(choice, dict) and choice.get("type") == "function"
              and isinstance(choice.get("function"), dict)
              and isinstance(choice["function"].get("name"), str)):
        raise RequestError("tool_choice must be 'auto', 'none', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}")
    if choice not in ("auto", "none") and not request.tools:
        raise RequestError("tool_choice names a tool call, but the request has no tools")
    request.tool_choice = choice


def _completion_request(path: str, body: Dict[str, Any]) -> Request:
    if path == "/v1/completions":
        if "prompt" not in body:
            raise RequestError("Request did not contain a prompt")
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be of type str")
        if not prompt:
            raise RequestError("prompt must not be empty")
        return Request("text", prompt, [], None, None)

    if "messages" not in body:
        raise RequestError("Request did not contain messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError("Each message must be an object with a string role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError("Message content must be a string, a list or null")
        if isinstance(content, list) and not all(isinstance(c, dict) for c in content):
            raise RequestError("Message content parts must be objects")
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list")
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}] must be an object with a function that has a name")
    role_mapping = body.get("role_mapping")
    if role_mapping is not None and not (
        isinstance(role_mapping, dict) and all(isinstance(v, str) for v in role_mapping.values())
    ):
        raise RequestError("role_mapping must be an object of strings")
    return Request("chat", "", messages, tools, role_mapping)


def parse_request(
    path: str, body: Any, cli, vocab_size: Optional[int] = None
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise RequestError("Request should be a JSON dictionary")
    p = _read_params(body, cli)
    _validate_upstream(p)
    _validate_extra(p, vocab_size)
    _validate_limits(p, body, cli)
    if p["chat_template_kwargs"] is not None and not isinstance(
        p["chat_template_kwargs"], dict
    ):
        raise RequestError("chat_template_kwargs must be of type dict")
    stop_words = _stop_words(body)
    request = _completion_request(path, body)
    request.keep_alive = parse_keep_alive(body.get("keep_alive"))
    request.thinking_budget = _thinking_budget(body)
    if request.request_type == "chat":  # a text completion's messages are unused
        _validate_images(body, cli)
    _structured_output(request, body)
    args = GenerationArguments(
        model=ModelDescription(
            model=p["requested_model"],
            draft=p["requested_draft_model"],
            adapter=p["adapter"],
        ),
        sampling=SamplingArguments(
            temperature=p["temperature"],
            top_p=p["top_p"],
            top_k=p["top_k"],
            min_p=p["min_p"],
            xtc_probability=p["xtc_probability"],
            xtc_threshold=p["xtc_threshold"],
        ),
        logits=LogitsProcessorArguments(
            logit_bias=p["logit_bias"],
            repetition_penalty=p["repetition_penalty"],
            repetition_context_size=p["repetition_context_size"],
            presence_penalty=p["presence_penalty"],
            presence_context_size=p["presence_context_size"],
            frequency_penalty=p["frequency_penalty"],
            frequency_context_size=p["frequency_context_size"],
        ),
        stop_words=stop_words,
        max_tokens=p["max_tokens"],
        num_draft_tokens=p["num_draft_tokens"],
        logprobs=p["logprobs"],
        top_logprobs=p["top_logprobs"],
        seed=p["seed"],
        chat_template_kwargs=p["chat_template_kwargs"],
    )
    return ParsedRequest(
        request, args, p["stream"], p["stream_options"], p["requested_model"]
    )


def one_of(value, table: Dict[str, Any], what: str):
    """`table[value]` for a level a request names (an effort), else a 400
    that lists the levels. `what`: the field, as the message starts."""
    if not isinstance(value, str) or value not in table:
        raise RequestError(f"{what} must be one of {', '.join(table)}")
    return table[value]


def _thinking_budget(body: Dict[str, Any]) -> Optional[int]:
    """thinking_budget (tokens), else reasoning_effort (OpenAI's: a level)."""
    budget = body.get("thinking_budget")
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise RequestError("thinking_budget must be a non-negative integer")
        return budget
    effort = body.get("reasoning_effort")
    return None if effort is None else one_of(effort, EFFORT_BUDGETS, "reasoning_effort")


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def parse_keep_alive(value) -> Optional[float]:
    """Ollama's keep_alive: seconds as a number, or a Go duration string
    ("10m", "1h30m", "-1"); negative keeps the model loaded for good, 0
    unloads it once its requests are done."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
            if math.isfinite(seconds):
                return seconds
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION.findall(body)
            if parts and "".join(n + u for n, u in parts) == body:
                return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    raise RequestError("keep_alive must be a number of seconds or a duration such as "
                       "\"5m\" or \"1h30m\" (negative: keep loaded)")
