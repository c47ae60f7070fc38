"""Cross-encoder rerankers: an encoder that reads a query and a document
together and scores the pair with a classification head, as
sentence-transformers' CrossEncoder runs them (cross-encoder/ms-marco-MiniLM,
BAAI/bge-reranker-base and -v2-m3, Alibaba-NLP/gte-reranker-modernbert-base).

    family = cross_encoder_family(config)        # None: not a cross-encoder
    model, tokenizer, head = load_cross_encoder(folder, config, family, given)
    scores = head(model, hidden, lengths)        # [B] float32

A folder is one when its config.json's `architectures` names one of
ARCHITECTURES (served with one label; another count is refused at load). The encoder is mlx-embeddings' model of its
family, loaded with the folder's weights. Its head is written here because
mlx-embeddings 0.1.0 has none for BERT or XLM-RoBERTa (its models load the
trunk only, and a checkpoint's `classifier.*` fails its strict load), and
ModernBERT's runs the tanh GELU where the config names the exact one. Each
head is transformers' (`*ForSequenceClassification`):

  BERT          classifier(tanh(pooler.dense(h[CLS])))
  XLM-RoBERTa   classifier.out_proj(tanh(classifier.dense(h[<s>])))
  ModernBERT    classifier(norm(gelu(head.dense(pool(h)))))   pool: CLS or mean,
                                                              per classifier_pooling

The score is the one logit through the activation the folder names
(sentence-transformers' `activation_fn`, or the older
`sbert_ce_default_activation_function`), else a sigmoid, which is
CrossEncoder's default for one label; vLLM scores these models the same
way. BERT pairs carry token type ids (0 for the query, 1 for the
document), which the plan gives as where the document starts.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

# transformers' architecture -> the family (config model_type) it is served for.
ARCHITECTURES = {
    "BertForSequenceClassification": "bert",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
    "ModernBertForSequenceClassification": "modernbert",
}
# The prefix of the trunk's weights in transformers' checkpoints, which
# mlx-embeddings' models hold at their top (ModernBERT's keep theirs).
_TRUNK_PREFIX = {"bert": "bert.", "xlm-roberta": "roberta."}
# Activations named in the folder's config (torch.nn's classes, by their
# full or short path) -> what the score goes through.
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


class CrossEncoderError(ValueError):
    """A classification model that can't be served as a reranker."""


def cross_encoder_family(config: dict) -> Optional[str]:
    """The family of a cross-encoder's config (module doc), or None."""
    archs = config.get("architectures") or []
    families = {ARCHITECTURES[a] for a in archs if a in ARCHITECTURES}
    if len(families) != 1:
        return None
    family = families.pop()
    model_type = str(config.get("model_type", "")).replace("_", "-")
    return family if model_type == family else None


def _labels(config: dict) -> int:
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    return int(config.get("num_labels", 2))  # (transformers' default)


def _activation(config: dict, path) -> str:
    """What the logit goes through (module doc)."""
    st = config.get("sentence_transformers")
    named = st.get("activation_fn") if isinstance(st, dict) else None
    named = named or config.get("sbert_ce_default_activation_function")
    if named is None:
        return "sigmoid"
    module, _, name = str(named).rpartition(".")
    if module not in ("torch.nn", "torch.nn.modules.activation", "torch.nn.modules.linear") \
            or name not in _ACTIVATIONS:
        raise CrossEncoderError(f"{path}: a cross-encoder whose activation is {named!r} is "
                                f"not served (torch.nn's {sorted(_ACTIVATIONS)} are)")
    return _ACTIVATIONS[name]


class _RobertaHead(nn.Module):
    """XLMRobertaClassificationHead's weights (dense, out_proj)."""

    def __init__(self, hidden: int, labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)


@dataclass(frozen=True)
class CrossEncoderHead:
    """A cross-encoder's head, as transformers defines it (module doc):
    `head(model, hidden, lengths)` -> [B] float32 scores of right-padded
    pairs, from the encoder's last hidden states [B, L, H]."""

    family: str
    activation: str = "sigmoid"  # or "identity", "tanh"
    pooling: str = "cls"  # ModernBERT's classifier_pooling: "cls" or "mean"
    token_types: bool = False  # whether pairs carry type ids (BERT's two)

    def __call__(self, model, hidden: mx.array, lengths: mx.array) -> mx.array:
        if self.family == "bert":
            logits = model.classifier(mx.tanh(model.pooler.dense(hidden[:, 0])))
        elif self.family == "xlm-roberta":
            head = model.classifier
            logits = head.out_proj(mx.tanh(head.dense(hidden[:, 0])))
        else:  # modernbert
            if self.pooling == "mean":
                # (embedders.py imports this module: its Pooling, named here)
                from mlx_lm_plus.models.embedders import Pooling

                pooled = Pooling("mean", normalize=False)(hidden, lengths, mx.zeros_like(lengths))
            else:
                pooled = hidden[:, 0]
            x = model.head.norm(nn.gelu(model.head.dense(pooled)))  # (exact GELU)
            logits = model.classifier(x)
        logits = logits[:, 0].astype(mx.float32)
        if self.activation == "sigmoid":
            return mx.sigmoid(logits)
        return mx.tanh(logits) if self.activation == "tanh" else logits


def _with_head(base, family: str, hidden: int, labels: int):
    """mlx-embeddings' Model class `base` with the head's weights and the
    trunk's names as transformers saves them."""
    if family == "modernbert":
        return base  # (its Model has them for ModernBertForSequenceClassification)
    prefix = _TRUNK_PREFIX[family]

    class CrossEncoder(base):
        def __init__(self, args):
            super().__init__(args)
            self.classifier = (nn.Linear(hidden, labels) if family == "bert"
                               else _RobertaHead(hidden, labels))

        def sanitize(self, weights):
            weights = {k[len(prefix):] if k.startswith(prefix) else k: v
                       for k, v in weights.items()}
            if family == "xlm-roberta":  # (a pooler's weights, which its head never reads)
                weights = {k: v for k, v in weights.items() if not k.startswith("pooler.")}
            return super().sanitize(weights)

    return CrossEncoder


def load_cross_encoder(folder: Path, config: dict, family: str,
                       given: dict) -> Tuple[object, object, CrossEncoderHead]:
    """The model (mlx-embeddings' encoder with its head's weights), the
    Hugging Face tokenizer and the head of the cross-encoder in `folder`.
    `given`: settings passed to mlx-embeddings' model (embedders.py's
    ModernBERT translation). CrossEncoderError for what isn't served."""
    from mlx_embeddings import utils

    labels = _labels(config)
    if labels != 1:
        raise CrossEncoderError(f"{folder}: a classifier with {labels} labels is not a "
                                "reranker (a cross-encoder reranker has one)")
    if config.get("problem_type") not in (None, "regression", "single_label_classification"):
        raise CrossEncoderError(f"{folder}: problem_type {config['problem_type']!r} is not "
                                "served")
    activation = _activation(config, folder)
    pooling = "cls"
    if family == "modernbert":
        pooling = config.get("classifier_pooling", "cls")  # (transformers' default)
        if pooling not in ("cls", "mean"):
            raise CrossEncoderError(f"{folder}: classifier_pooling {pooling!r} is not served")
        if config.get("classifier_activation", "gelu") != "gelu":
            raise CrossEncoderError(f"{folder}: classifier_activation "
                                    f"{config['classifier_activation']!r} is not served (GELU is)")
        if config.get("classifier_bias"):  # (mlx-embeddings' head never has one)
            raise CrossEncoderError(f"{folder}: a ModernBERT head with classifier_bias is "
                                    "not served")
        if not config.get("id2label"):  # (mlx-embeddings counts its labels from it)
            given = {**given, "id2label": {"0": "LABEL_0"}}
    elif family == "xlm-roberta":
        given = {**given, "add_pooling_layer": False}  # (its classifier reads h[<s>])
    hidden = int(config["hidden_size"])
    # (mlx-embeddings' own choice of classes for the config, as its load()
    # makes it; load_model then takes ours, which add the head.)
    base, args, _, _ = utils._get_classes({**config, **given})

    def classes(config):
        return _with_head(base, family, hidden, labels), args, None, None  # (any config)

    model = utils.load_model(folder, False, given, get_model_classes=classes,
                             path_to_repo=str(folder))
    tokenizer = utils.load_tokenizer(folder)
    # (Type ids where the tokenizer hands them to the model, as
    # transformers and sentence-transformers run it; else all 0.)
    inputs = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "model_input_names", ())
    token_types = (family == "bert" and int(config.get("type_vocab_size", 2)) > 1
                   and "token_type_ids" in inputs)
    return model, tokenizer, CrossEncoderHead(family, activation, pooling, token_types)


def is_cross_encoder_folder(folder: Path) -> bool:
    """Whether config.json in `folder` is a cross-encoder's (module doc)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and cross_encoder_family(config) is not None
