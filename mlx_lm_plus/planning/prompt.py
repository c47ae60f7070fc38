"""Prompt building: request -> PromptPlan (tokens, cache key, segments).

A pure function of the tokenizer, the processor and the request, so it can be
tested without a model. A chat prompt is split into segments at the
message boundaries a later request can reuse (`checkpoint_positions`); the
engine stores a cache entry at the end of each segment but the last, for
each request at its own positions.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from mlx_lm.server import (
    CompletionRequest,
    Vision,
    convert_chat,
    process_message_content,
)

from mlx_lm_plus.models.vision import VisionSupport
from mlx_lm_plus.models.vlm_generation import MlxVlmGeneration
from mlx_lm_plus.planning.checkpoints import (
    checkpoint_positions, image_checkpoint_positions, rendered_with_positions,
)
from mlx_lm_plus.upstream import decode_image, image_parts, image_url, make_vision


# A prompt's text is bounded before it is rendered and tokenized: a fast
# tokenizer holds ~150 bytes a character while it works (a 5 MB prompt took
# 800 MB and 4.5 s on the fixture's tokenizer; a 100 MB body had the server
# killed for memory), for a prompt no model could take anyway. What is
# counted is everything the template may render, some of which it drops
# (past turns' reasoning): the bound is generous, no tokenizer writes more
# than a few characters a token of real text. Where the model's config
# does not say its context, it is taken as UNKNOWN_CONTEXT tokens.
MAX_CHARS_PER_TOKEN = 32
UNKNOWN_CONTEXT = 1 << 20
# Without a chat template, upstream's plain format (convert_chat) writes
# each message's role prefix and stop: with its own mapping, at most this.
DEFAULT_ROLE_CHARS = 160


def _chars(value, skip_images: bool, as_repr: bool = False) -> int:
    """Characters of the strings in `value`, dict keys included, image
    parts aside when `skip_images` (a walk: nesting depth is the client's).
    `as_repr`: at most what repr(value) writes (a character of a string
    as up to 10, `\\U000e0001`, and the punctuation)."""
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            n += 10 * len(v) + 2 if as_repr else len(v)
        elif isinstance(v, dict):
            if not (skip_images and v.get("type") in ("image_url", "image", "input_image")):
                n += 4 * len(v) + 2 if as_repr else 0
                stack += v.keys()
                stack += v.values()
        elif isinstance(v, (list, tuple)):
            n += 2 * len(v) + 2 if as_repr else 0
            stack += v
        elif as_repr:
            n += len(repr(v))
    return n


def prompt_chars(request: CompletionRequest, template_args: Dict[str, Any],
                 has_chat_template: bool) -> int:
    """Characters of the text a request's prompt is rendered from: its
    prompt; or its messages' and tools' strings and the template's
    arguments' (`template_args`), image parts aside where a template
    places them (the plain format writes them out, data URL and all), and
    without a template each message's role prefix and stop."""
    if request.request_type != "chat":
        return len(request.prompt)
    n = (_chars(request.messages, has_chat_template) + _chars(request.tools, False)
         + _chars(template_args, False))
    if not has_chat_template:
        # (upstream's plain format writes a list of parts as its repr)
        n += sum(_chars(m.get("content"), False, as_repr=True) for m in request.messages
                 if isinstance(m, dict) and isinstance(m.get("content"), list))
        mapping = request.role_mapping
        per_message = (2 * max((len(v) for v in mapping.values() if isinstance(v, str)),
                               default=0) if mapping else DEFAULT_ROLE_CHARS)
        n += per_message * (len(request.messages) + 1)
    return n


def check_prompt_size(n: int, context_length: Optional[int]) -> None:
    """ValueError when a prompt of `n` characters (prompt_chars) is more
    than MAX_CHARS_PER_TOKEN for each token of the model's context."""
    context = context_length or UNKNOWN_CONTEXT
    most = MAX_CHARS_PER_TOKEN * context
    if n > most:
        raise ValueError(
            f"The prompt is {n} characters long, more than a model with a context of "
            f"{context} tokens can take (this server takes at most {most} characters, "
            f"{MAX_CHARS_PER_TOKEN} a token)")


@dataclass
class PromptPlan:
    tokens: List[int]
    # The prompt split at the positions worth caching, with one type per
    # segment ("system", "checkpoint", and "prompt" for the last one).
    # Concatenated they are `tokens`.
    segments: List[List[int]]
    segment_types: List[str]
    # Initial state of the TextStateMachine: "normal" or "reasoning" when the
    # generation prompt already opened a thinking block.
    initial_state: str = "normal"
    vision: Optional[Vision] = None

    @property
    def cache_key(self) -> List[int]:
        """The key of this prompt in the prompt cache (images get their ids)."""
        return list(self.vision.cache_key if self.vision else self.tokens)


def template_kwargs(cli_template_args: Dict[str, Any], request_kwargs) -> Dict:
    """`--chat-template-args` overridden by the request's chat_template_kwargs."""
    kwargs = dict(cli_template_args or {})
    if request_kwargs:
        kwargs.update(request_kwargs)
    return kwargs


def build_prompt(
    tokenizer,
    processor,
    request: CompletionRequest,
    chat_template_args: Dict[str, Any],
) -> PromptPlan:
    """Tokenize a request and split it into cacheable segments.

    Raises ValueError (bad content parts, template errors surface as their own
    exception types) for the caller to answer with a 4xx.
    """
    if request.request_type != "chat":
        tokens = tokenizer.encode(request.prompt)
        return PromptPlan(tokens, [tokens], ["prompt"])

    messages = request.messages
    if not tokenizer.has_chat_template:
        if processor is not None and any(image_parts(messages)):
            # (convert_chat would write the parts' repr, data URL and all)
            raise ValueError("This model has no chat template to place images with")
        tokens = tokenizer.encode(convert_chat(messages, request.role_mapping))
        return PromptPlan(tokens, [tokens], ["prompt"])

    urls = process_message_content(messages, keep_images=processor is not None)
    through_mlx_vlm = bool(urls) and isinstance(processor, (VisionSupport, MlxVlmGeneration))
    if through_mlx_vlm:
        _as_image_parts(messages)
    kwargs = dict(tools=request.tools, tokenize=True, **chat_template_args)
    vision = None
    if urls:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **{**kwargs, "tokenize": False}
        )
    if through_mlx_vlm:
        # A vision-language model through mlx-vlm: batched (vision.py), with
        # checkpoints; or its own generation (one segment: nothing is stored).
        tokens, vision = processor.prepare(text, urls, getattr(request, "images", None))
        if isinstance(processor, VisionSupport):
            boundaries = image_checkpoint_positions(tokenizer, messages, tokens, vision, kwargs)
            return _plan(tokens, boundaries, _initial_state(tokenizer, tokens), vision)
    elif urls:
        text, pixel_values = processor(
            text, images=[decode_image(u) for u in urls]
        )
        tokens = tokenizer.encode(text, add_special_tokens=False)
        vision = make_vision(
            tokens,
            urls=urls,
            pixel_values=pixel_values,
            token_id=tokenizer.convert_tokens_to_ids(processor.image_token),
        )
    else:
        # One tokenization serves both the prompt and its boundaries.
        found = rendered_with_positions(tokenizer, messages, kwargs)
        if found is not None:
            tokens, boundaries = found
            return _plan(tokens, boundaries, _initial_state(tokenizer, tokens), None)
        tokens = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **kwargs
        )

    initial_state = _initial_state(tokenizer, tokens)

    # Image prompts on mlx-lm's own vision models and through mlx-vlm's
    # own generation: one segment.
    if vision is not None:
        return PromptPlan(tokens, [tokens], ["prompt"], initial_state, vision)

    boundaries = checkpoint_positions(tokenizer, messages, tokens, kwargs)
    return _plan(tokens, boundaries, initial_state, None)


def _as_image_parts(messages) -> None:
    """Every image part (image_url, input_image, image) of type "image", its
    other keys kept: the templates of Gemma 3, Idefics3, SmolVLM and others
    write a placeholder only for `type == 'image'` (Hugging Face's content
    format); Qwen's and Mistral's take it too."""
    for message in messages:
        if isinstance(message.get("content"), list):
            for part in message["content"]:
                if isinstance(part, dict) and image_url(part) is not None:
                    part["type"] = "image"


def _plan(tokens, boundaries, initial_state, vision) -> PromptPlan:
    """A plan whose segments end at the sorted (position, kind) boundaries."""
    segments, segment_types, start = [], [], 0
    for position, kind in boundaries:
        segments.append(tokens[start:position])
        segment_types.append(kind)
        start = position
    segments.append(tokens[start:])
    segment_types.append("prompt")
    return PromptPlan(tokens, segments, segment_types, initial_state, vision)


def split_at(plan: PromptPlan, position: int, kind: str = "checkpoint") -> None:
    """Add a segment boundary at `position` (no-op where one already is)."""
    start = 0
    for i, segment in enumerate(plan.segments):
        end = start + len(segment)
        if start < position < end:
            plan.segments[i : i + 1] = [segment[: position - start], segment[position - start :]]
            plan.segment_types.insert(i, kind)
            return
        start = end


def _initial_state(tokenizer, tokens: List[int]) -> str:
    state = "normal"
    if tokenizer.has_thinking:
        if tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens):
            state = "reasoning"
    return tokenizer.response_initial_state or state
