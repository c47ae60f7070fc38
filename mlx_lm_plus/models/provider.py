"""Models: the served set, and the models loaded from it.

Loading is mlx_lm.server's own: each loaded model is an upstream
ModelProvider holding just that model (`LoadedModel`: lazy load, adapters,
draft models, sharded loading under mx.distributed, processor for images),
plus mlx-vlm for vision-language folders. What this module adds:

  * the served set (served.py: every --model, --models-dir's folders,
    --models-config's entries); anything else only with
    --allow-model-loading, as upstream;
  * several models loaded at once (`ModelProvider.loaded`). Which to load or
    unload, and when, is the engine's decision (it knows what runs where);
    this module says what fits: --max-loaded-models and the machine's memory;
  * with no --model, the embedded SmolLM2 demo model.
"""

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.server as upstream
from mlx_lm.server import ModelProvider as UpstreamModelProvider

from mlx_lm_plus import native
from mlx_lm_plus.models.cpu import converts, weights_for_cpu
from mlx_lm_plus.models.cpu_decode import runs_native_kernels
from mlx_lm_plus.models.embedders import folder_task, load_embedder, local_folder
from mlx_lm_plus.models.served import ServedModel, resolved_path, served_set
from mlx_lm_plus.models.folders import (
    _mlx_lm_has, context_length, served_image_path, weights_bytes_on_disk,
)
from mlx_lm_plus.models.vision import VisionSupport, configured_max_pixels, load_vision_model
from mlx_lm_plus.models.vlm_generation import MlxVlmGeneration, load_mlx_vlm_model

def memory_budget() -> int:
    """Bytes the loaded models' weights, with the prompt cache's budget, may
    take: Metal's recommended working set, else 90% of the machine's RAM."""
    total = 0
    try:
        total = int(mx.device_info().get("max_recommended_working_set_size", 0))
    except Exception:
        pass
    if not total:
        total = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.9)
    return total


def _arrays(obj, seen):
    """Every mx.array a model holds, parameters or not (`_freqs` and the like)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _arrays(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _arrays(v, seen)
    # A module's attributes; and those of the plain helper objects mlx-lm and
    # mlx-vlm keep in one (mlx-vlm's Pixtral rotary embedding is no Module,
    # and its inv_freq would be left to the thread that loaded it).
    if isinstance(obj, nn.Module) or type(obj).__module__.startswith(("mlx_lm.", "mlx_vlm.")):
        for v in getattr(obj, "__dict__", {}).values():
            yield from _arrays(v, seen)


def group_max(values: List[int]) -> List[int]:
    """Each value's largest over the ranks of the mx.distributed group: how
    the ranks agree on a decision each could make apart, from its own share
    of the model (a collective: every rank calls it at the same point)."""
    return mx.distributed.all_max(mx.array(values, dtype=mx.int64)).tolist()


def _sharding(model) -> str:
    """How mx.distributed split `model` on this rank, for the load's log."""
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        return f"pipelined, layers {inner.start_idx}-{inner.end_idx - 1} here"
    return "tensor-parallel"


def _vision_tower(lm) -> bool:
    return getattr(lm.processor, "vlm", None) is not None


def serves_images(lm) -> bool:
    """Whether a loaded model takes image parts (through mlx-vlm, batched by
    vision.py or one at a time by vlm_generation.py)."""
    return isinstance(lm.processor, (VisionSupport, MlxVlmGeneration))


def own_vision(lm) -> bool:
    """Whether a loaded model is one of mlx-lm's own vision models (a
    processor, not mlx-vlm's): their image requests are planned at
    admission and served one at a time, as upstream does. (A model without
    a processor refuses images when they are planned.)"""
    return lm.processor is not None and not serves_images(lm)


def vision_of(lm) -> Optional[VisionSupport]:
    """A model's vision support (mlx-vlm models), or None."""
    return lm.processor if isinstance(lm.processor, VisionSupport) else None


class LoadedModel(UpstreamModelProvider):
    """One loaded model: an upstream ModelProvider that holds only it, with
    how long it stays (the engine's residency fields)."""

    def __init__(self, cli_args, key, pinned=False, ttl=None, sequential_vision=False,
                 room_for_weights=None, task="generate"):
        super().__init__(cli_args)
        # "generate", or "embed"/"rerank" with the model in `embedder`
        # (embedders.Embedder) for /v1/embeddings and /v1/rerank.
        self.task = task
        self.embedder = None
        self.sequential_vision = sequential_vision
        # Bytes its weights may take (cpu.weights_for_cpu; None: no bound).
        self.room_for_weights = room_for_weights
        self.weights_float32 = False
        self.native_kernels = False  # (cpu_decode.py)
        self._load(*key)
        # Loaded on the loader thread and used on the generation thread: an
        # array left unevaluated here belongs to this thread's stream, and
        # MLX can't evaluate it on another ("There is no Stream(cpu, 0) in
        # current thread"). The vision tower (mlx-vlm's model) too.
        roots = [self.model, self.draft_model, getattr(self.processor, "vlm", None)]
        arrays = list(_arrays([r for r in roots if r is not None], set()))
        mx.eval(arrays)
        self.key = key
        self.pinned = pinned
        self.ttl = ttl  # this model's idle TTL, None: --model-ttl
        self.keep_alive: Optional[float] = None  # the last request's keep_alive
        self.last_used = time.monotonic()
        self.loaded_at = time.time()
        self.load_seconds = 0.0
        self.nbytes = sum(a.nbytes for a in arrays)  # (each array once: `seen`)
        self.vocab_size = self._vocab_size()
        self.context_length = context_length(self.config)

    def _vocab_size(self) -> Optional[int]:
        """How many token ids top_k and logit_bias may use: the width of the
        logits (the model's vocabulary; the tokenizer's when the model does
        not say), and of the draft model's, whose logits the same processors
        see. An id past it is written out of bounds."""
        def width(model, tokenizer=None):
            n = getattr(getattr(model, "args", None), "vocab_size", None)
            if not isinstance(n, int) and tokenizer is not None and hasattr(tokenizer, "vocab"):
                n = len(tokenizer.vocab)
            return n if isinstance(n, int) else None

        sizes = [width(self.model, self.tokenizer)]
        if self.draft_model is not None:
            sizes.append(width(self.draft_model))
        sizes = [n for n in sizes if n is not None]
        return min(sizes) if sizes else None

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        """Vision-language models through mlx-vlm (`image_path`: batched by
        vision.py, or sequential through mlx-vlm's own generation);
        everything else as upstream's ModelProvider._load (0.32.2) does, but
        for its first step: dropping the model it held and a gc.collect(),
        which holds the GIL for ~50 ms (a stall of every model generating
        meanwhile on the generation thread) and has nothing to free here."""
        if self.task != "generate":
            return self._load_embedder(model_path)
        path = served_image_path((model_path, adapter_path, draft_model_path),
                                 self.sequential_vision, self.is_distributed)
        if path is None:
            return self._load_text(model_path, adapter_path, draft_model_path)
        if path == "batched":
            model, tokenizer, processor = load_vision_model(
                model_path, self.tensor_group, self.pipeline_group)
        else:
            model, tokenizer, processor = load_mlx_vlm_model(model_path)
        if self.cli_args.chat_template:
            tokenizer.chat_template = self.cli_args.chat_template
        self.model_key = (model_path, None, draft_model_path)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = processor.config
        # (A text draft of the language model's tokenizer: it reads an image
        # row's placeholder tokens as the text they are; only batched.)
        self.draft_model = (self._load_draft(draft_model_path, tokenizer, 0)
                            if draft_model_path is not None else None)
        self.is_batchable = path == "batched"
        if path == "batched":
            logging.info(f"Loaded {model_path} as a vision-language model (mlx-vlm): "
                         "image requests batch with text requests")
            if self.is_distributed:
                self._log_part(model_path, model.lm, ", the vision tower whole")
        else:
            logging.info(
                f"Loaded {model_path} as a vision-language model ({processor.model_type}) "
                "served through mlx-vlm's own generation: one request at a time, without "
                "the prompt cache (batched vision: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, "
                "Gemma 3, Idefics3, SmolVLM)")

    def _load_draft(self, draft_model_path, tokenizer, grown: int):
        """The draft model, its weights for the CPU within the room left
        (`grown`: bytes the served model's weights grew by)."""
        room = getattr(self, "room_for_weights", None)
        draft_model, draft_tokenizer = upstream.load(draft_model_path)
        weights_for_cpu(draft_model, self.cli_args.keep_quantized,
                        None if room is None else room - grown)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            logging.warning("Draft model tokenizer does not match model tokenizer. "
                            "Speculative decoding may not work as expected.")
        return draft_model

    def _weights_for_cpu(self, model, model_path) -> Optional[int]:
        """cpu.weights_for_cpu, said in the log: float32 weights for the
        CPU's BLAS where they fit. Returns the bytes they grew by (None:
        kept as they were)."""
        grown = weights_for_cpu(model, self.cli_args.keep_quantized,
                                getattr(self, "room_for_weights", None))
        self.weights_float32 = grown is not None
        self.native_kernels = runs_native_kernels(model)
        if grown is not None:
            decode = (", decode steps, RoPE and attention's softmax on our kernels "
                      "(mlx_lm_plus.native)" if self.native_kernels else "")
            logging.info(f"{model_path}: weights as float32 for the CPU's BLAS{decode} "
                         f"({grown / 1e6:+.0f} MB; --keep-quantized keeps them as they were)")
        return grown

    def _load_embedder(self, model_path):
        """An embedding or reranking model (embedders.py): not batched with
        generation, served by the engine's embedding runner."""
        if self.is_distributed:
            raise ValueError("Embedding and reranking models are not served under "
                             "mx.distributed")
        embedder, config = load_embedder(model_path, self.task, _mlx_lm_has)
        self._weights_for_cpu(embedder.model, model_path)
        self.embedder = embedder
        self.model_key = (model_path, None, None)
        self.model = embedder.model
        self.tokenizer = embedder.tokenizer
        self.processor = None
        self.config = config
        self.draft_model = None
        self.is_batchable = False
        scoring = (embedder.pooling.mode if self.task == "embed" else
                   "cross-encoder" if embedder.cross_encoder else "yes/no")
        logging.info(f"Loaded {model_path} as {'an embedding' if self.task == 'embed' else 'a reranking'} "
                     f"model ({'mlx-lm' if embedder.decoder else 'mlx-embeddings'}; "
                     f"{scoring} scoring, context {embedder.context_length})")

    def _log_part(self, model_path, model, extra: str = ""):
        """Which part of mlx-lm's `model` this rank of mx.distributed holds."""
        group = self.pipeline_group or self.tensor_group
        logging.info(f"Loaded {model_path} on rank {group.rank()} of {group.size()}: "
                     f"{_sharding(model)}{extra}")

    def _load_text(self, model_path, adapter_path, draft_model_path):
        if self.is_distributed and (adapter_path is not None
                                    or draft_model_path is not None):
            raise ValueError("Loading with adapters or draft models not supported in "
                             "distributed mode")
        if self.is_distributed:
            model, tokenizer, config = upstream.sharded_load(
                model_path, pipeline_group=self.pipeline_group,
                tensor_group=self.tensor_group, return_config=True,
                tokenizer_config=self._tokenizer_config,
                trust_remote_code=self.cli_args.trust_remote_code)
            self._log_part(model_path, model)
        else:
            model, tokenizer, config = upstream.load(
                model_path, adapter_path=adapter_path, tokenizer_config=self._tokenizer_config,
                return_config=True, trust_remote_code=self.cli_args.trust_remote_code)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        # (Not under mx.distributed: mlx-lm's sharded layers are not the
        # quantized layers dequantize_model knows.)
        grown = None if self.is_distributed else self._weights_for_cpu(model, model_path)
        draft_model = None
        if draft_model_path is not None:
            draft_model = self._load_draft(draft_model_path, tokenizer, grown or 0)
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.processor = upstream.load_processor(model, config)
        if config.get("vision_config") and self.processor is None:
            # (Say which path it takes: images are not served for it yet.)
            logging.warning(
                f"{model_path} is a vision-language model ({config.get('model_type')}) "
                "that is served as text only, batched: its image parts get a 400. "
                'With "vision": "sequential" in --models-config its images are served '
                "through mlx-vlm, one request at a time (README: Vision-language models)")
        self.draft_model = draft_model
        # (With a draft: batched where the draft can propose inside the
        # batch, engine/facts.py; else upstream's sequential path.)
        self.is_batchable = all(
            hasattr(c, "merge") for c in upstream.make_prompt_cache(model))
        if self.is_distributed:  # (batched on every rank, or on none)
            self.is_batchable = not group_max([not self.is_batchable])[0]

    def idle_limit(self, default_ttl: Optional[float]) -> Optional[float]:
        """Idle seconds after which this model may be unloaded (None: never).
        A request's keep_alive (Ollama's: negative is forever, 0 at once)
        overrides the TTL; pinned models stay whatever it says."""
        if self.pinned:
            return None
        if self.keep_alive is not None:
            return None if self.keep_alive < 0 else self.keep_alive
        ttl = self.ttl if self.ttl is not None else default_ttl
        return ttl if ttl else None


class ModelProvider:
    """The served set, the names requests use for it, and the loaded models.

    `loaded` is changed only by the generation thread (`add`, `unload`) and
    read from any thread (a dict's get and copy are atomic under the GIL).
    """

    def __init__(self, cli_args):
        self.cli_args = cli_args
        group = mx.distributed.init()
        self.is_distributed = group.size() > 1
        self.served: List[ServedModel] = served_set(cli_args)
        self._names: Dict[str, ServedModel] = {}
        for entry in self.served:
            for name in (entry.name, entry.path, *entry.aliases):
                self._names.setdefault(name, entry)
        self.default: Optional[ServedModel] = self.served[0] if self.served else None
        if self.default is not None:
            self._names["default_model"] = self.default
        self.loaded: Dict[Any, LoadedModel] = {}
        self.loads = 0  # models loaded since the start (/metrics)
        self.unloads = 0
        # Known before the model is loaded (on the generation thread), so the
        # API can prepare images for it from the first request on.
        self._vision_facts: Dict[Any, Tuple[bool, Optional[int]]] = {}
        self._disk_bytes: Dict[str, int] = {}  # model path -> weight files' bytes
        self._budget: Optional[int] = None  # memory_budget(), read once
        self._config_vocabs: Dict[str, Optional[int]] = {}  # path -> its config's
        self._tasks: Dict[str, str] = {}  # path -> folder_task
        for entry in self.served:  # (read once here: /v1/models lists them)
            self.task(entry.key)

    @property
    def default_key(self):
        return self.default.key if self.default is not None else None

    def key_for(self, desc):
        """The (model, adapter, draft) key a request's model/adapters/
        draft_model name. A served name brings its own adapter (the request's
        is ignored, as before); draft_model "default_model" means the served
        entry's draft, or --draft-model for other names (upstream's map)."""
        entry = self._names.get(desc.model)
        if entry is None and isinstance(desc.model, str):  # ("./x" for x, say)
            entry = self._names.get(resolved_path(desc.model))
        draft = desc.draft
        if draft == "default_model":
            draft = entry.draft if entry is not None else self.cli_args.draft_model
        elif draft in self._names:
            draft = self._names[draft].path
        if entry is not None:
            return (entry.path, entry.adapter, draft)
        return (desc.model, desc.adapter, draft)

    def is_served(self, desc) -> bool:
        """Whether a request's model/adapters/draft_model may be used: the
        served set under any of its names; anything else only with
        --allow-model-loading (upstream loads whatever is named)."""
        if self.cli_args.allow_model_loading:
            return True
        key = self.key_for(desc)
        return any(key == e.key for e in self.served)

    def defaults_for(self, name):
        """The CLI arguments a request naming `name` is parsed with: the
        server's, with that model's sampling defaults from --models-config."""
        entry = self._names.get(name) if isinstance(name, str) else None
        if entry is None or not entry.defaults:
            return self.cli_args
        return dataclasses.replace(self.cli_args, **entry.defaults)

    def get(self, key) -> Optional[LoadedModel]:
        return self.loaded.get(key)

    def load(self, key) -> LoadedModel:
        """Load `key` on the calling thread (not yet in `loaded`: `add` it).
        Several served entries may share it (presets of one folder): it is
        pinned if any is, and takes the first TTL given."""
        entries = [e for e in self.served if e.key == key]
        tic = time.perf_counter()
        # (Under mx.distributed one model at a time, as upstream: none pinned.)
        pinned = any(e.pinned for e in entries) and not self.is_distributed
        ttl = next((e.ttl for e in entries if e.ttl is not None), None)
        held = sum(m.nbytes for m in self.loaded.values())
        cache = self.cli_args.prompt_cache_bytes
        if cache is None:
            from mlx_lm_plus.cache.store import default_budget

            cache = default_budget()
        lm = LoadedModel(self.cli_args, key, pinned=pinned, ttl=ttl,
                         sequential_vision=self._sequential_vision(key),
                         room_for_weights=self.memory_budget() - held - cache,
                         task=self.task(key))
        lm.load_seconds = time.perf_counter() - tic
        logging.info(f"Loaded model {key[0]} in {lm.load_seconds:.1f} s "
                     f"({lm.nbytes / 1e9:.2f} GB)")
        return lm

    def add(self, lm: LoadedModel):
        self.loaded[lm.key] = lm
        if lm.draft_model is None and not _vision_tower(lm):
            self._disk_bytes[lm.key[0]] = lm.nbytes  # (what loading it again takes)
        self.loads += 1

    def forget_size(self, key):
        """A load of `key` failed or was given up: its estimate (0 for a repo
        not downloaded then) is looked up again next time."""
        self._disk_bytes.pop(key[0], None)

    def unload(self, key, why: str):
        lm = self.loaded.pop(key, None)
        if lm is not None:
            self.unloads += 1
            logging.info(f"Unloaded model {key[0]} ({why}; {lm.nbytes / 1e9:.2f} GB)")

    def reset(self):
        self.loaded.clear()

    def is_vision(self, key) -> bool:
        return self._vision_fact(key)[0]

    def image_max_pixels(self, key) -> Optional[int]:
        return self._vision_fact(key)[1]

    def task(self, key) -> str:
        """What model `key` serves: "generate", "embed" or "rerank" (its
        --models-config entry's `task`, else what its folder says; known
        before it is loaded, for the endpoints' 400s)."""
        if key[1] is not None or key[2] is not None:
            return "generate"  # (adapters and draft models are generation's)
        entry = next((e for e in self.served if e.key == key and e.task), None)
        if entry is not None:
            return entry.task
        task = self._tasks.get(key[0])
        if task is None:  # (asked from executor threads)
            if len(self._tasks) > 256:  # (paths a client named)
                self._tasks.clear()
            task = folder_task(key[0])
            if local_folder(key[0]) is not None:  # (a repo not downloaded yet: asked again)
                self._tasks[key[0]] = task
        return task

    def _sequential_vision(self, key) -> bool:
        return any(e.vision == "sequential" for e in self.served if e.key == key)

    def _vision_fact(self, key):
        """(whether `key` will serve images, its processor's pixel limit),
        known before it is loaded."""
        fact = self._vision_facts.get(key)
        if fact is None:  # (asked from executor threads: no second lookup)
            if len(self._vision_facts) > 256:  # (keys a client named)
                self._vision_facts.clear()
            path = served_image_path(key, self._sequential_vision(key), self.is_distributed)
            fact = (path is not None, configured_max_pixels(key[0]) if path == "batched" else None)
            self._vision_facts[key] = fact
        return fact

    def fits(self, key, extra_bytes: int = 0) -> bool:
        """Whether `key` may be loaded beside the models loaded now: fewer
        than --max-loaded-models, and its weights on disk, the loaded
        weights and `extra_bytes` (the prompt cache's budget) within the
        machine's memory. (Nothing loaded: always, as upstream. Under
        mx.distributed, one model at a time.)"""
        if not self.loaded:
            return True
        if self.is_distributed or len(self.loaded) >= max(1, self.cli_args.max_loaded_models):
            return False
        held = sum(lm.nbytes for lm in self.loaded.values())
        if key[0] not in self._disk_bytes:  # (asked at every step while it waits)
            if len(self._disk_bytes) > 256:
                self._disk_bytes.clear()
            # (0 for a repo not downloaded yet: its size is known once it
            # loaded, `add`.)
            self._disk_bytes[key[0]] = weights_bytes_on_disk(key[0]) * self._widening(key[0])
        return held + self._disk_bytes[key[0]] + extra_bytes <= self.memory_budget()

    def _widening(self, path) -> int:
        """How many times its size on disk a model's weights take once
        loaded: float32 on a CPU with a fast BLAS (cpu.weights_for_cpu)
        widens quantized and half-precision ones, and 4- and 8-bit ones
        stay beside them for decode where our kernels are built
        (cpu_decode.py). (Once loaded, the size measured replaces the
        estimate: `add`.)"""
        if not converts(self.cli_args.keep_quantized):
            return 1
        try:
            config = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError, TypeError):
            return 1
        bits = (config.get("quantization") or {}).get("bits") if isinstance(config, dict) else None
        if isinstance(bits, int) and bits > 0:
            kept = bits in (4, 8) and native.kernels() is not None
            return max(1, 32 // bits) + kept
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
        return 2 if dtype in ("bfloat16", "float16") else 1

    def vocab_size(self, key) -> Optional[int]:
        """The token ids a request for `key` may use (see
        LoadedModel._vocab_size): the loaded model's, else what the model's
        and its draft's config.json say (None: unknown; the engine checks
        once it is loaded)."""
        lm = self.loaded.get(key)
        if lm is not None:
            return lm.vocab_size
        sizes = [self._config_vocab(path) for path in (key[0], key[2]) if path is not None]
        if not sizes or None in sizes:
            return None
        return min(sizes)

    def _config_vocab(self, path) -> Optional[int]:
        if path not in self._config_vocabs:
            if len(self._config_vocabs) > 256:  # (names a client sent)
                self._config_vocabs.clear()
            n = None
            try:
                config = json.loads((Path(path) / "config.json").read_text())
                n = config.get("vocab_size") or (config.get("text_config") or {}).get(
                    "vocab_size")
            except (OSError, ValueError, AttributeError, TypeError):
                pass
            self._config_vocabs[path] = n if isinstance(n, int) and n > 0 else None
        return self._config_vocabs[path]

    def memory_budget(self) -> int:
        if self._budget is None:
            self._budget = memory_budget()
        return self._budget

    def name_for(self, desc) -> str:
        """The `model` label of a request's metrics: the id of the served
        entry it names, else "other" (a name a client made up must not
        become a label)."""
        key = self.key_for(desc)
        entry = self._names.get(desc.model)
        if entry is None or entry.key != key:
            entry = next((e for e in self.served if e.key == key), None)
        return entry.name if entry is not None else "other"
