"""Prompt building: request -> PromptPlan (tokens, cache key, segments).

A pure function of the tokenizer, the processor and the request, so it can be
tested without a model. The segmentation follows mlx_lm.server 0.32.2
(`ResponseGenerator._tokenize`): a "system" segment that ends where the system
messages end, a "user" segment, and a short "assistant" tail holding the
thinking start of the generation prompt. The prompt cache stores an entry at
the end of each segment but the last.
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


@dataclass
class PromptPlan:
    tokens: List[int]
    # The prompt split at the positions worth caching, with one type per
    # segment ("system", "user", "assistant"). Concatenated they are `tokens`.
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
        return PromptPlan(tokens, [tokens], ["assistant"])

    messages = request.messages
    if not tokenizer.has_chat_template:
        tokens = tokenizer.encode(convert_chat(messages, request.role_mapping))
        return PromptPlan(tokens, [tokens], ["assistant"])

    urls = process_message_content(messages, keep_images=processor is not None)
    kwargs = dict(tools=request.tools, tokenize=True, **chat_template_args)
    vision = None
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

    # Only a prompt that ends in a user message gets segments; image prompts
    # are served sequentially and cached whole.
    if messages[-1]["role"] != "user" or vision is not None:
        return PromptPlan(tokens, [tokens], ["assistant"], initial_state, vision)

    segments, segment_types = [], []
    sys_end = _system_prompt_end(tokenizer, messages, tokens, kwargs)
    if 0 < sys_end < len(tokens):
        segments.append(tokens[:sys_end])
        segment_types.append("system")

    # A short tail that holds the thinking start of the generation prompt, so
    # the cached "user" entry is the one the next turn can extend.
    tail_start = len(tokens)
    if tokenizer.has_thinking:
        think_start = tokenizer.rfind_think_start(tokens, start=tail_start - 11)
        if think_start >= 0:
            tail_start = think_start

    if sys_end < tail_start:
        segments.append(tokens[sys_end:tail_start])
        segment_types.append("user")
    if tail_start < len(tokens):
        segments.append(tokens[tail_start:])
        segment_types.append("assistant")
    if not segments:
        segments, segment_types = [tokens], ["assistant"]
    return PromptPlan(tokens, segments, segment_types, initial_state, None)


def _initial_state(tokenizer, tokens: List[int]) -> str:
    state = "normal"
    if tokenizer.has_thinking:
        if tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens):
            state = "reasoning"
    return tokenizer.response_initial_state or state


def _system_prompt_end(tokenizer, messages, tokens, kwargs) -> int:
    """Where the leading system messages end in `tokens` (0 if none)."""
    num_system = 0
    for m in messages:
        if m["role"] != "system":
            break
        num_system += 1
    if num_system == 0:
        return 0
    sys_tokens = tokenizer.apply_chat_template(
        messages[:num_system] + [{"role": "user", "content": ""}],
        add_generation_prompt=False,
        **kwargs,
    )
    for i, (a, b) in enumerate(zip(sys_tokens, tokens)):
        if a != b:
            return i
    return 0
