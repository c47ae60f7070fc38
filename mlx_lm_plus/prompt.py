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
    _decode_image,
    _make_vision,
    convert_chat,
    process_message_content,
)

from .vision import VisionSupport


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
        tokens = tokenizer.encode(convert_chat(messages, request.role_mapping))
        return PromptPlan(tokens, [tokens], ["prompt"])

    urls = process_message_content(messages, keep_images=processor is not None)
    kwargs = dict(tools=request.tools, tokenize=True, **chat_template_args)
    vision = None
    if urls and isinstance(processor, VisionSupport):
        # A vision-language model served through mlx-vlm (vision.py).
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **{**kwargs, "tokenize": False}
        )
        tokens, vision = processor.prepare(text, urls, getattr(request, "images", None))
        boundaries = image_checkpoint_positions(tokenizer, messages, tokens, vision, kwargs)
        return _plan(tokens, boundaries, _initial_state(tokenizer, tokens), vision)
    if urls:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **{**kwargs, "tokenize": False}
        )
        text, pixel_values = processor(
            text, images=[_decode_image(u) for u in urls]
        )
        tokens = tokenizer.encode(text, add_special_tokens=False)
        vision = _make_vision(
            tokens,
            urls=urls,
            pixel_values=pixel_values,
            token_id=tokenizer.convert_tokens_to_ids(processor.image_token),
        )
    else:
        tokens = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **kwargs
        )

    initial_state = _initial_state(tokenizer, tokens)

    # Image prompts are served sequentially and cached whole (for now).
    if vision is not None:
        return PromptPlan(tokens, [tokens], ["prompt"], initial_state, vision)

    boundaries = checkpoint_positions(tokenizer, messages, tokens, kwargs)
    return _plan(tokens, boundaries, initial_state, None)


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


# Two sentinels with different first characters: whatever the real content
# starts with, one of them differs from it at once, so the shorter common
# prefix ends exactly where the content starts (or earlier, where the
# tokenizer merges the content with the text before it).
SENTINELS = ("\u2063a", "\u2063b")


def common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _boundary(tokenizer, tokens, variants, kwargs, add_generation_prompt) -> int:
    """Shortest common prefix of `tokens` and each variant's rendering (-1 on error)."""
    best = len(tokens)
    for variant in variants:
        try:
            other = tokenizer.apply_chat_template(
                variant, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception:
            return -1
        best = min(best, common_prefix(tokens, other))
    return best


def _with_content(messages, index, content):
    out = [dict(m) for m in messages]
    out[index]["content"] = content
    return out


def checkpoint_positions(tokenizer, messages, tokens, kwargs) -> List[tuple]:
    """Token positions worth a cache entry, found by sentinel substitution.

    Each position is where two renderings of the conversation stop agreeing
    when one message's content is replaced by a sentinel, so it is exact
    whatever the template does around it (and works for templates that reject
    a truncated message list):
      * "system": the start of the first non-system message's content, the
        prefix every conversation with these system messages shares;
      * "checkpoint": the start of the last user message's content (edits and
        regenerations of that message share it);
      * "checkpoint": the end of this conversation as the next turn renders it
        (the next turn appends an assistant reply and a user message; a
        thinking template re-renders the reply without its reasoning).
    Returns sorted (position, kind) pairs with 0 < position < len(tokens).
    """
    n = len(tokens)
    found = {}

    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is not None and first > 0:
        p = _boundary(tokenizer, tokens,
                      [_with_content(messages, first, s) for s in SENTINELS],
                      kwargs, True)
        if 0 < p < n:
            found[p] = "system"

    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is not None:
        p = _boundary(tokenizer, tokens,
                      [_with_content(messages, last_user, s) for s in SENTINELS],
                      kwargs, True)
        if 0 < p < n:
            found.setdefault(p, "checkpoint")

    if messages[-1]["role"] in ("user", "tool"):
        nexts = [
            [*messages, {"role": "assistant", "content": s}, {"role": "user", "content": s}]
            for s in SENTINELS
        ]
        p = _boundary(tokenizer, tokens, nexts, kwargs, True)
        if 0 < p < n:
            found.setdefault(p, "checkpoint")
    return sorted(found.items())


def image_checkpoint_positions(tokenizer, messages, tokens, vision, kwargs) -> List[tuple]:
    """Checkpoints of a prompt with images: the end of each image (the same
    picture with another question, or an edit after it, resumes there
    without the vision tower), and the message boundaries of
    `checkpoint_positions`.

    The template writes each image as one placeholder token, which the
    processor expands into the image's tokens: the sentinel renderings are
    compared with the prompt as the template tokenizes it, and a position
    after an image moves by that image's extra tokens. If the two
    tokenizations disagree on the text, only the image ends are kept.
    """
    n = len(tokens)
    found = {img.end: "checkpoint" for img in vision.images if img.end < n}
    collapsed, shifts, removed = list(tokens), [], 0
    for img in vision.images:
        del collapsed[img.start + 1 - removed : img.end - removed]
        shifts.append((img.start - removed, img.end - img.start - 1))
        removed += img.end - img.start - 1
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    if list(rendered) == collapsed:
        for p, kind in checkpoint_positions(tokenizer, messages, collapsed, kwargs):
            p += sum(extra for placeholder, extra in shifts if placeholder < p)
            p = vision.safe_prefix(p)
            if 0 < p < n:
                found.setdefault(p, kind)
    return sorted(found.items())


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
