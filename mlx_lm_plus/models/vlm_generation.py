"""Vision-language families vision.py does not batch, served through
mlx-vlm's own generation: those mlx-lm can't load (Idefics2, PaliGemma,
Molmo, ...), and those a --models-config entry asks it of with "vision":
"sequential" (Mistral 3, Pixtral, LLaVA, which mlx-lm serves as text).

mlx-vlm expands the prompt (its prepare_inputs) and generates (its
generate_step: vision tower, positions, caches of its own) exactly as its
stream_generate does; the engine runs each request alone on the generation
thread and does the rest as for any request (stop sequences, detokenizing,
logprobs, structured output). Every request starts from an empty cache:
mlx-vlm's own prompt reuse (PromptCacheState) matches a prefix by token ids,
where two pictures of one size look alike, and its cache classes are not
what our prompt store keeps and counts.
"""

import importlib.util
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import GenerationResponse

from mlx_lm_plus.models.images import DecodedImage, decode_images
from mlx_lm_plus.models.vision import read_json, load_vlm


@dataclass
class MlxVlmPrompt:
    """A prompt with images as mlx-vlm's processor expanded it."""

    inputs: dict  # the processor's arrays: input_ids, pixel_values, ...
    cache_key: List[int] = field(default_factory=list)  # (nothing is stored)
    starts: List[int] = field(default_factory=list)  # one entry per image


class MlxVlmGeneration:
    """What the engine needs of a model served through mlx-vlm's own
    generation: its prompts with images (`prepare`) and its tokens
    (`generate`)."""

    def __init__(self, vlm, processor, config: dict):
        self.vlm = vlm
        self.config = config  # (config.json's)
        self.processor = processor
        self.model_type = config.get("model_type")
        self.calls = 0  # images through the vision tower (tests and metrics)
        self.hits = 0  # (never: nothing is reused)

    def prepare(self, prompt_text: str, urls: List[str],
                decoded: Optional[List[DecodedImage]] = None
                ) -> Tuple[List[int], MlxVlmPrompt]:
        """Token ids of a rendered prompt with its images expanded by
        mlx-vlm (as its stream_generate does), and the arrays that go with
        them."""
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        if decoded is None or len(decoded) != len(urls):
            decoded = decode_images(urls)
        inputs = prepare_inputs(
            self.processor, images=[d.image for d in decoded], prompts=prompt_text,
            image_token_index=getattr(self.vlm.config, "image_token_index", None),
            add_special_tokens=should_add_special_tokens(self.model_type, self.processor))
        tokens = mx.array(inputs["input_ids"])[0].tolist()
        # (Evaluated on the thread that plans, as vision.py's.)
        mx.eval([v for v in inputs.values() if isinstance(v, mx.array)])
        # An empty key: nothing of this path is stored, and its image tokens
        # are the same ids for any picture of a size, so no lookup may match.
        return tokens, MlxVlmPrompt(dict(inputs), [], [0] * len(decoded))

    def make_cache(self) -> List[Any]:
        """An empty cache of mlx-vlm's classes for one request (the engine
        counts its bytes against the prompt store's budget)."""
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.vlm.language_model)

    def generate(self, tokens: List[int], prompt: Optional[MlxVlmPrompt], cache: List[Any],
                 sampler, logits_processors, max_tokens: int, prefill_step_size: int,
                 progress, **quantization) -> Iterator[Tuple[int, mx.array]]:
        """mlx-vlm's generate_step into the empty `cache`: (token, logprobs)
        pairs, `max_tokens` of them at most. `progress(done, total)` is
        called after each prefill chunk (it may raise to stop there): hung
        on mlx-vlm's checkpoint callback, at every chunk's end.
        `quantization`: --kv-bits and its settings, as mlx-vlm takes them."""
        from mlx_vlm.generate.ar import generate_step

        total = len(tokens)
        ends = list(range(prefill_step_size, total, prefill_step_size))

        if prompt is None:  # text only
            input_ids, pixel_values, mask, extra = mx.array(tokens)[None], None, None, {}
        else:
            extra = dict(prompt.inputs)
            input_ids = extra.pop("input_ids")
            pixel_values = extra.pop("pixel_values", None)
            mask = extra.pop("attention_mask", None)
            self.calls += len(prompt.starts)
        return generate_step(input_ids, self.vlm, pixel_values, mask, sampler=sampler,
                             logits_processors=logits_processors, max_tokens=max_tokens,
                             prompt_cache=cache, prefill_step_size=prefill_step_size,
                             prompt_cache_checkpoint_lengths=ends,
                             prompt_cache_checkpoint=(lambda done, _: progress(done, total))
                             if ends else None, **quantization, **extra)


def responses(tokenizer, pairs: Iterator[Tuple[Any, mx.array]], prompt_tokens: int,
              max_tokens: int) -> Iterator[GenerationResponse]:
    """mlx-lm's stream_generate (0.32.2) on another token generator: text
    through the tokenizer's streaming detokenizer, the end at an EOS token
    or `max_tokens`, the last response carrying the finish reason."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tic = time.perf_counter()
    prompt_tps, n, token, logprobs = 0.0, -1, None, None
    for n, (token, logprobs) in enumerate(pairs):
        token = int(token)
        if n == 0:
            prompt_tps = prompt_tokens / (time.perf_counter() - tic)
            tic = time.perf_counter()
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
        if n + 1 == max_tokens:
            break
        yield _response(detokenizer.last_segment, token, logprobs, prompt_tokens, prompt_tps,
                        n, tic, None)
    if n < 0:
        logging.warning("mlx-vlm's generation ended before its first token")
        return
    detokenizer.finalize()
    yield _response(detokenizer.last_segment, token, logprobs, prompt_tokens, prompt_tps, n,
                    tic, "stop" if token in tokenizer.eos_token_ids else "length")


def _response(text, token, logprobs, prompt_tokens, prompt_tps, n, tic, finish_reason):
    return GenerationResponse(
        text=text, token=token, logprobs=logprobs, from_draft=False,
        prompt_tokens=prompt_tokens, prompt_tps=prompt_tps, generation_tokens=n + 1,
        generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
        peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish_reason)


def is_mlx_vlm_model(model_path) -> bool:
    """A local folder with a vision config whose family mlx-vlm has (found
    without importing mlx-vlm: the API asks before any model is loaded)."""
    cfg = read_json(Path(model_path) / "config.json")
    spec = importlib.util.find_spec("mlx_vlm")
    if not ("vision_config" in cfg and spec and spec.origin
            and isinstance(cfg.get("model_type"), str)):
        return False
    models = Path(spec.origin).parent / "models"
    family = cfg["model_type"].replace("-", "_")
    if not (models / family / "__init__.py").is_file():
        from mlx_vlm.utils import MODEL_REMAPPING  # (llava_qwen2, cohere2_vision, ...)

        family = MODEL_REMAPPING.get(cfg["model_type"], family).replace("-", "_")
    return (models / family / "__init__.py").is_file()


def load_mlx_vlm_model(model_path: str):
    """(mlx-vlm's model, mlx-lm tokenizer, MlxVlmGeneration) for a local folder."""
    vlm, processor, config, tokenizer = load_vlm(model_path)
    return vlm, tokenizer, MlxVlmGeneration(vlm, processor, config)
