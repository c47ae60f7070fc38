"""Embedding and reranking models: which task a model folder serves, and
the model called on a batch of token lists.

A folder says what it is; nothing here guesses from a model's name:
  * sentence-transformers' `modules.json` with a Pooling module: an
    embedder. Its pooling comes from that module's `config.json`, L2
    normalization from a Normalize module after it, and its prompts
    (Qwen3-Embedding's query instruction) from
    `config_sentence_transformers.json`;
  * `pipeline_tag: text-ranking` in the front matter of its README.md (the
    model card), on a causal LM: a reranker that scores "yes" against "no"
    after its prompt (Qwen3-Reranker);
  * an encoder whose config.json names a sequence-classification
    architecture (BertForSequenceClassification...): a cross-encoder
    reranker (cross_encoders.py; one label is served);
  * anything else generates (chat and text completions).
A --models-config entry's `task` overrides what the folder says.

Decoders load through mlx-lm when it knows their model type (Qwen3, Llama,
Gemma...), encoders through mlx-embeddings (BERT, XLM-RoBERTa, ModernBERT).
A batch is right-padded. A decoder needs no mask for that: causal attention
never looks at a later position, so what follows an input can't change its
hidden states. An encoder gets an attention mask, which mlx-embeddings turns
into -10000 on the padded keys (exp of that is 0 in float32); ModernBERT's
into boolean masks, with its sliding window in its local layers
(patches/modernbert_padding.py: upstream's fail in bfloat16 and float16).
"""

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from mlx_lm_plus.models.cross_encoders import (
    ARCHITECTURES, CrossEncoderError, CrossEncoderHead, cross_encoder_family,
    is_cross_encoder_folder, load_cross_encoder,
)

TASKS = ("generate", "embed", "rerank")
# mlx-embeddings' encoder families served: every position's last hidden
# state (which pooling needs) is its Model's `last_hidden_state`, or for
# ModernBERT, whose Model pools inside by its config, its trunk's
# (`model.model`).
ENCODER_TYPES = ("bert", "xlm-roberta", "xlm_roberta", "modernbert")
# ModernBERT's layers: global attention every N, the others local (in a
# sliding window); transformers 5 writes them out as `layer_types`.
MODERNBERT_LAYER_TYPES = ("full_attention", "sliding_attention")
# sentence-transformers' pooling modes (1_Pooling/config.json) served here.
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# Qwen3-Reranker's prompt, from its model card: the pair goes between the
# prefix and the suffix, and the score is P("yes") against P("no") at the
# last position.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements "
                 "based on the Query and the Instruct provided. Note that the answer can "
                 "only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class EmbedderError(ValueError):
    """A model folder that can't be served for its task (said at load)."""


def local_folder(path) -> Optional[Path]:
    """A model's folder on this machine: the path itself, or a Hugging Face
    repo already in the local cache (never downloaded here)."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception:
        return None


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pipeline_tag(folder: Path) -> Optional[str]:
    """The model card's `pipeline_tag` (README.md's YAML front matter)."""
    try:
        text = (folder / "README.md").read_text(errors="replace")[:20000]
    except OSError:
        return None
    if not text.startswith("---"):
        return None
    front = text[3:].split("\n---", 1)[0]
    found = re.search(r"^pipeline_tag:\s*['\"]?([\w-]+)", front, re.MULTILINE)
    return found.group(1) if found else None


def _modules(folder: Path) -> list:
    modules = _json(folder / "modules.json")
    return modules if isinstance(modules, list) else []


def folder_task(path) -> str:
    """What a model folder serves (module docstring): "embed", "rerank" or
    "generate". A folder not on this machine generates (upstream's way)."""
    folder = local_folder(path)
    if folder is None:
        return "generate"
    if any(isinstance(m, dict) and m.get("type") == ST_POOLING for m in _modules(folder)):
        return "embed"
    if _pipeline_tag(folder) == "text-ranking" or is_cross_encoder_folder(folder):
        return "rerank"
    return "generate"


@dataclass(frozen=True)
class Pooling:
    """sentence-transformers' Pooling module and whether a Normalize module
    follows it."""

    mode: str = "lasttoken"  # a value of POOLING_MODES
    normalize: bool = True
    # False: mean and max pooling leave out the prompt's tokens (INSTRUCTOR).
    include_prompt: bool = True

    def __call__(self, hidden: mx.array, lengths: mx.array, starts: mx.array) -> mx.array:
        """[B, L, H] hidden states of right-padded inputs -> [B, H] float32.
        `lengths`: each input's tokens; `starts`: the first position pooled
        (after a prompt left out; 0 otherwise)."""
        hidden = hidden.astype(mx.float32)
        rows = mx.arange(hidden.shape[0])
        if self.mode == "cls":
            pooled = hidden[:, 0]
        elif self.mode == "lasttoken":
            pooled = hidden[rows, lengths - 1]
        else:
            positions = mx.arange(hidden.shape[1])[None]
            valid = (positions < lengths[:, None]) & (positions >= starts[:, None])
            if self.mode == "max":
                pooled = mx.where(valid[..., None], hidden, -mx.inf).max(axis=1)
            else:
                count = mx.maximum(valid.sum(axis=1, keepdims=True), 1).astype(mx.float32)
                total = (hidden * valid[..., None]).sum(axis=1)
                pooled = total / (count if self.mode == "mean" else mx.sqrt(count))
        if self.normalize:
            # (sentence-transformers' Normalize: F.normalize, eps 1e-12)
            norm = mx.linalg.norm(pooled, axis=-1, keepdims=True)
            pooled = pooled / mx.maximum(norm, 1e-12)
        return pooled


def read_pooling(folder: Path) -> Tuple[Pooling, Dict[str, str], Optional[str]]:
    """An embedder folder's Pooling, its prompts (name -> text) and the
    prompt used when a request names none. EmbedderError for what can't be
    served as its card says (a Dense layer after pooling, weighted mean)."""
    modules = _modules(folder)
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    other = [t for t in types if t not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE)]
    if other:
        raise EmbedderError(f"{folder}: modules.json has {other}: only Transformer, Pooling "
                            "and Normalize modules are served")
    pooling_module = next(m for m in modules if isinstance(m, dict) and m.get("type") == ST_POOLING)
    config = _json(folder / pooling_module.get("path", "") / "config.json") or {}
    modes = [mode for key, mode in POOLING_MODES.items() if config.get(key)]
    if config.get("pooling_mode_weightedmean_tokens") or len(modes) != 1:
        raise EmbedderError(f"{folder}: its Pooling config asks for "
                            f"{modes or 'no mode'}; one of {sorted(POOLING_MODES.values())} "
                            "is served")
    after = types[types.index(ST_POOLING) + 1:]
    pooling = Pooling(mode=modes[0], normalize=ST_NORMALIZE in after,
                      include_prompt=bool(config.get("include_prompt", True)))
    st = _json(folder / "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") if isinstance(st.get("prompts"), dict) else {}
    prompts = {k: v for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str)}
    default = st.get("default_prompt_name")
    return pooling, prompts, default if default in prompts else None


def _hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer under mlx-lm's or mlx-embeddings' wrapper."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


@dataclass
class Embedder:
    """A loaded embedding or reranking model: `hidden(tokens, lengths)`
    runs it on a right-padded batch; `pool` and `score` turn that into what
    the endpoints answer."""

    task: str  # "embed" or "rerank"
    model: object  # mlx-lm's Model (decoder) or mlx-embeddings' (encoder)
    tokenizer: object  # the Hugging Face tokenizer
    decoder: bool
    context_length: int
    width: int  # the vectors' size (hidden size)
    pooling: Pooling = field(default_factory=Pooling)
    prompts: Dict[str, str] = field(default_factory=dict)
    default_prompt: Optional[str] = None
    yes_no: Optional[Tuple[int, int]] = None  # a reranker's "yes" and "no" token ids
    cross_encoder: Optional[CrossEncoderHead] = None  # a cross-encoder reranker's head
    # The most characters one token stands for (WordPiece's [UNK] a whole
    # word, up to 100): a text over (context + 1) times this can't fit.
    longest_token: int = 100
    model_type: str = ""  # the config's

    @property
    def token_types(self) -> bool:
        """Whether a rerank pair carries token type ids (a BERT cross-encoder)."""
        return self.cross_encoder is not None and self.cross_encoder.token_types

    def hidden(self, tokens: mx.array, lengths: mx.array, cache=None,
               token_types: Optional[mx.array] = None) -> mx.array:
        """[B, L] token ids -> [B, L, H] last hidden states. `cache`: a
        decoder's prompt cache, for an input run in chunks; `token_types`:
        [B, L] type ids of BERT pairs."""
        if self.decoder:
            return self.model.model(tokens, cache=cache)
        mask = (mx.arange(tokens.shape[1])[None] < lengths[:, None]).astype(mx.float32)
        if self.model_type == "modernbert":  # (its Model's output is pooled)
            return self.model.model(tokens, attention_mask=mask)["last_hidden_state"]
        return self.model(tokens, attention_mask=mask, token_type_ids=token_types
                          ).last_hidden_state

    def scores(self, hidden: mx.array, lengths: mx.array) -> mx.array:
        """[B, L, H] hidden states of right-padded rerank inputs -> [B]
        float32 relevance scores: a cross-encoder's head, or a decoder's
        yes/no at each prompt's last position: P("yes") / (P("yes") + P("no"))."""
        if self.cross_encoder is not None:
            return self.cross_encoder(self.model, hidden, lengths)
        last_hidden = hidden[mx.arange(hidden.shape[0]), lengths - 1]
        model = self.model
        if hasattr(model, "lm_head"):
            logits = model.lm_head(last_hidden)
        else:  # tied embeddings (mlx-lm's own models do this)
            logits = model.model.embed_tokens.as_linear(last_hidden)
        yes, no = self.yes_no
        logits = logits.astype(mx.float32)
        return mx.sigmoid(logits[:, yes] - logits[:, no])


def _context_length(config: dict, tokenizer, decoder: bool, folder: Path) -> int:
    """The longest input the model takes: its positions (XLM-RoBERTa's
    are numbered from the padding id + 1), capped by the tokenizer's
    model_max_length and sentence-transformers' max_seq_length (what the
    model was trained on: all-MiniLM's 256 of its 512 positions) where they
    are set."""
    n = config.get("max_position_embeddings") or config.get("n_positions") or 2048
    if not decoder and config.get("model_type", "").replace("_", "-") == "xlm-roberta":
        n -= int(config.get("pad_token_id", 1)) + 1
    limits = [getattr(tokenizer, "model_max_length", None),
              (_json(folder / "sentence_bert_config.json") or {}).get("max_seq_length")]
    for limit in limits:
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < 10**7:
            n = min(n, limit)
    return int(n)


def _modernbert_config(config: dict, path) -> dict:
    """What mlx-embeddings' ModernBERT must be told of `config`, which it
    reads in the older keys only (global_attn_every_n_layers,
    global_rope_theta, local_rope_theta; it defaults the missing ones):
    transformers 5 writes `layer_types` and `rope_parameters` instead. The
    keys to pass it (load's model_config); EmbedderError for what its model
    can't run: an activation other than GELU (patches/modernbert_gelu.py),
    scaled RoPE, local layers not every N."""
    path = f"{path}: ModernBERT"
    if config.get("hidden_activation", "gelu") != "gelu":
        raise EmbedderError(f"{path} with hidden_activation "
                            f"{config['hidden_activation']!r} is not served (GELU is)")
    given = {}
    layers = config.get("layer_types")
    if layers is not None:
        count = int(config.get("num_hidden_layers", len(layers)))
        periods = [n for n in range(1, count + 1) if list(layers) == [
            MODERNBERT_LAYER_TYPES[bool(i % n)] for i in range(count)]]
        if not periods:
            raise EmbedderError(f"{path}'s layer_types {layers} are not global attention "
                                "every N layers, which mlx-embeddings' model runs")
        given["global_attn_every_n_layers"] = periods[0]
    if config.get("rope_scaling"):
        raise EmbedderError(f"{path} with rope_scaling is not served")
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        if set(rope) - set(MODERNBERT_LAYER_TYPES):
            # (transformers 5 refuses a ModernBERT config without them)
            raise EmbedderError(f"{path}'s rope_parameters are not per layer type "
                                f"{MODERNBERT_LAYER_TYPES}")
        for layer_type, key in zip(MODERNBERT_LAYER_TYPES, ("global_rope_theta",
                                                            "local_rope_theta")):
            params = rope.get(layer_type) or {}
            # (`type`: the older key, which transformers still reads)
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default":
                raise EmbedderError(f"{path} with {layer_type} RoPE of type {kind!r} "
                                    "is not served")
            if "rope_theta" in params:
                given[key] = float(params["rope_theta"])
    return given


def _single_token(tokenizer, text: str, folder) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise EmbedderError(f"{folder}: a reranker's tokenizer must have {text!r} as one "
                            f"token (it has {ids})")
    return ids[0]


def load_embedder(path, task: str, mlx_lm_has) -> Tuple[Embedder, dict]:
    """Load the model at `path` for `task` ("embed" or "rerank"): through
    mlx-lm when `mlx_lm_has(path)`, else mlx-embeddings. Returns the
    Embedder and the model's config. EmbedderError for a folder that can't
    be served so (said before its weights are read)."""
    folder = local_folder(path)
    if folder is None:
        raise EmbedderError(f"{path}: an embedding or reranking model must be a local folder "
                            "or in the Hugging Face cache")
    config = _json(folder / "config.json") or {}
    decoder = bool(mlx_lm_has(path))
    pooling, prompts, default_prompt = Pooling(), {}, None
    if task == "embed" and (folder / "modules.json").is_file():
        pooling, prompts, default_prompt = read_pooling(folder)
    elif task == "embed":
        logging.warning(f"{path}: no modules.json: served as an embedder with last-token "
                        "pooling and L2 normalization, as --models-config's `task` says")
    if not decoder and str(config.get("model_type")) not in ENCODER_TYPES:
        raise EmbedderError(
            f"{path}: model type {config.get('model_type')!r} is not served for {task}: "
            f"decoders mlx-lm loads, and encoders of types {ENCODER_TYPES}")
    family = None if decoder else cross_encoder_family(config)
    if not decoder and task == "rerank" and family is None:
        raise EmbedderError(f"{path}: an encoder serves /v1/rerank as a cross-encoder, with a "
                            f"classification head ({', '.join(ARCHITECTURES)}); its config "
                            f"names {config.get('architectures')}")
    if family is not None and task != "rerank":
        raise EmbedderError(f"{path}: a cross-encoder ({config.get('architectures')}) serves "
                            "/v1/rerank, not embeddings")
    if not decoder and config.get("auto_map"):
        raise EmbedderError(f"{path}: its config asks for its own modelling code (auto_map), "
                            "which mlx-embeddings' model doesn't run")
    if not decoder and str(config.get("model_type")).replace("_", "-") in ("bert", "xlm-roberta") \
            and config.get("hidden_act", "gelu") != "gelu":
        # (mlx-embeddings' BERT and XLM-RoBERTa run the exact GELU whatever
        # the config says.)
        raise EmbedderError(f"{path}: hidden_act {config['hidden_act']!r} is not served "
                            "(GELU is)")
    if decoder and task == "rerank" and any(
            str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ()):
        raise EmbedderError(f"{path}: a decoder with a classification head "
                            f"({config.get('architectures')}) is not served; Qwen3-Reranker's "
                            "causal LM, scoring yes against no, is")
    if decoder and task == "rerank" and config.get("model_type") != "qwen3":
        # (Its prompt and yes/no scoring are Qwen3-Reranker's; another
        # family's may differ, or post-process its logits: Gemma's soft cap.)
        raise EmbedderError(f"{path}: rerankers of Qwen3-Reranker's kind (model type qwen3) "
                            f"are served, not {config.get('model_type')!r}")
    if decoder and (config.get("auto_map") or config.get("is_causal") is False
                    or config.get("use_bidirectional_attention")):
        # (gte-Qwen2-instruct and others attend both ways in their own
        # modelling code: mlx-lm's causal model would give other vectors.)
        raise EmbedderError(f"{path}: its config asks for its own modelling code or "
                            "bidirectional attention, which mlx-lm's model doesn't run")
    if decoder:
        from mlx_lm import load

        model, wrapper = load(str(folder))
        if not hasattr(model, "model"):
            raise EmbedderError(f"{path}: {config.get('model_type')} models have no trunk "
                                "(`model.model`) to take hidden states from")
    else:
        from mlx_embeddings.utils import load

        given = {}
        if config.get("model_type") == "modernbert":
            given = _modernbert_config(config, path)
        if family is not None:
            try:
                model, wrapper, head = load_cross_encoder(folder, config, family, given)
            except CrossEncoderError as e:
                raise EmbedderError(str(e)) from None
        else:
            model, wrapper = load(str(folder), model_config=given)
    tokenizer = _hf_tokenizer(wrapper)
    width = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    embedder = Embedder(task=task, model=model, tokenizer=tokenizer, decoder=decoder,
                        context_length=_context_length(config, tokenizer, decoder, folder),
                        width=int(width or 0), pooling=pooling, prompts=prompts,
                        default_prompt=default_prompt,
                        longest_token=max([100] + [len(t) for t in tokenizer.get_vocab()]),
                        model_type=str(config.get("model_type", "")))
    if family is not None:
        embedder.cross_encoder = head
    elif task == "rerank":
        embedder.yes_no = (_single_token(tokenizer, "yes", path),
                           _single_token(tokenizer, "no", path))
    return embedder, config
