"""Model loading: mlx_lm.server's ModelProvider, with the demo default.

Upstream's ModelProvider (lazy load, adapters, draft models, sharded loading
under mx.distributed, processor for images) is reused as it is. Ours adds:
  * with no --model, the embedded SmolLM2 demo model (converted on first use);
  * the names a client learns from /v1/models (the resolved --model path) and
    the --model string itself map to the default model instead of loading it
    a second time under another key.
"""

import gc
import logging
from pathlib import Path

import mlx.core as mx
from mlx_lm.server import ModelProvider as UpstreamModelProvider

from .vision import configured_max_pixels, is_vision_model, load_vision_model


class _Default:
    model = "default_model"
    adapter = None
    draft = "default_model"


def resolve_default_model(cli_args) -> None:
    """Fill in --model with the demo model when none was given."""
    if cli_args.model is None:
        from .demo import demo_model_path

        cli_args.model = str(demo_model_path())
        logging.info(f"No --model given: serving the demo model at {cli_args.model}")


class ModelProvider(UpstreamModelProvider):
    def __init__(self, cli_args):
        super().__init__(cli_args)
        model = cli_args.model
        # Known before the model is loaded (on the generation thread), so the
        # API can prepare images for it from the first request on.
        self.default_is_vision = model is not None and is_vision_model(model)
        # Read from the folder, so images are scaled alike (and fingerprinted
        # alike) whether or not the model had finished loading.
        self.default_image_max_pixels = (
            configured_max_pixels(model) if self.default_is_vision else None)
        if model is not None:
            aliases = {model}
            if Path(model).exists():
                aliases.add(str(Path(model).resolve()))
            for alias in aliases:
                self._model_map.setdefault(alias, model)
                self._adapter_map.setdefault(alias, cli_args.adapter_path)

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        """Vision-language models (vision.VISION_MODEL_TYPES) through mlx-vlm;
        everything else as upstream."""
        if not (is_vision_model(model_path) and adapter_path is None
                and draft_model_path is None and not self.is_distributed):
            return super()._load(model_path, adapter_path, draft_model_path)
        self.reset()
        gc.collect()
        mx.clear_cache()
        model, tokenizer, vision = load_vision_model(model_path)
        if self.cli_args.chat_template:
            tokenizer.chat_template = self.cli_args.chat_template
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = vision
        self.draft_model = None
        self.is_batchable = True
        logging.info(f"Loaded {model_path} as a vision-language model (mlx-vlm)")

    def is_served(self, desc) -> bool:
        """Whether a request's model/adapters/draft_model may be used.

        The configured model (under any of its names) always; anything else
        only with --allow-model-loading. Upstream loads whatever is named, and
        a name that fails to load leaves it with no model at all.
        """
        if self.cli_args.allow_model_loading:
            return True
        default = self.key_for(_Default)
        return self.key_for(desc) == default

    def key_for(self, desc):
        """The (model, adapter, draft) key `load` would use for a request."""
        adapter = self._adapter_map.get(desc.model, desc.adapter)
        model = self._model_map.get(desc.model, desc.model)
        draft = self._draft_model_map.get(desc.draft, desc.draft)
        return (model, adapter, draft)
