"""Tiny random-weight embedding and reranker model folders, built offline in seconds.

    from testkit.embedding_fixtures import build_embedding_fixture
    path = build_embedding_fixture("bert_embed", root)

    python -m testkit.embedding_fixtures KIND OUTDIR    # prints the folder

Each kind is shaped like a real model family, down to the files a loader or
sentence-transformers reads, so code that serves embeddings and reranking can
be tested without downloads:

  * `qwen3_embed`: a decoder embedder like Qwen/Qwen3-Embedding: the qwen3
    chat fixture's model (testkit/fixtures.py: hidden 64, float32, mlx_lm.load
    takes it; the same weights, byte for byte) whose tokenizer appends
    <|endoftext|> to every text (eos_token stays <|im_end|>), as
    Qwen3-Embedding's does, so last-token pooling reads the EOS position.
    sentence-transformers files: Transformer, last-token Pooling, Normalize,
    and the "query" prompt.
  * `bert_embed`: an encoder embedder like sentence-transformers/all-MiniLM-L6-v2
    (mlx_embeddings.utils.load takes it): BERT with a WordPiece tokenizer,
    mean pooling, Normalize.
  * `bert_cls`: the same weights and tokenizer as `bert_embed` but CLS pooling
    and no Normalize module (as some BAAI/bge folders): the same model giving
    other vectors shows that pooling and normalization come from the folder.
  * `xlmr_embed`: an encoder embedder like intfloat/multilingual-e5-base
    (mlx_embeddings.utils.load takes it): model type "xlm-roberta", a
    SentencePiece-style Unigram tokenizer (<s> $A </s>, <pad> id 1),
    positions numbered from pad_token_id + 1 (130 of them: a context of 128
    tokens, which only the position table sets here: the tokenizer's
    model_max_length is the unset sentinel, max_seq_length 512), mean
    pooling, Normalize.
  * `modernbert_embed`: an encoder embedder like nomic-ai/modernbert-embed-base:
    model type "modernbert" (ModernBertModel's weights, without the "model."
    prefix, as sentence-transformers saves them), a byte-level BPE tokenizer
    with [CLS] $A [SEP], mean pooling, Normalize. 3 layers, global attention
    every 2: layer 1 attends within a sliding window of 16 (8 either side),
    so an input over 9 tokens tells a wrong window or mask from a right one.
  * `qwen3_rerank`: a decoder reranker like Qwen/Qwen3-Reranker-0.6B: a qwen3
    causal LM whose tokenizer has "yes" and "no" as single tokens; the score
    is softmax over the last position's [no, yes] logits (RERANK_PREFIX and
    RERANK_SUFFIX wrap the prompt). No modules.json, as the real one.
  * cross-encoder rerankers, each its family's encoder (the tokenizer and
    shape of the embedder of its family, other weights) with transformers'
    sequence-classification head and one label, saved as transformers saves
    them (the trunk under `bert.` / `roberta.` / `model.`), no modules.json:
    - `bert_rerank` like cross-encoder/ms-marco-MiniLM-L6-v2: BERT, pairs
      with token type ids 0/1, the score the raw logit
      (`sbert_ce_default_activation_function`: Identity);
    - `xlmr_rerank` like BAAI/bge-reranker-v2-m3: XLM-RoBERTa, no pooler,
      the score a sigmoid (no activation named: CrossEncoder's default);
      its card says text-classification (its config says what it is);
    - `modernbert_rerank` like Alibaba-NLP/gte-reranker-modernbert-base:
      ModernBERT with mean pooling before its head, the score a sigmoid
      (`sentence_transformers.activation_fn`).

Why the weights are usable: the qwen3 kinds reuse the chat fixtures' tuning
(testkit.fixtures._make_usable: matrices x2, sharp q/k norms), so the last
position's hidden state depends on every earlier token; the special tokens'
lm_head rows are zeroed there, but "yes" and "no" are ordinary tokens, so
their rows stay random, non-zero and different. BERT's matrices are scaled
x2 for the same reason (MLX's default init is flat), its LayerNorms keep the
outputs well-scaled; XLM-RoBERTa's and ModernBERT's likewise. Building is
deterministic (fixed seeds, a fixed corpus, BERT's and XLM-RoBERTa's
vocabularies listed rather than trained) and idempotent (the marker
fixture.json holds a version).
"""

import json
import string
import sys
from pathlib import Path

from testkit.fixtures import (
    SPECIAL_TOKENS, WORDS, _built, _config, _corpus, _make_usable, build_tokenizer,
)

EMBEDDING_KINDS = ("qwen3_embed", "bert_embed", "bert_cls", "xlmr_embed", "modernbert_embed",
                   "qwen3_rerank", "bert_rerank", "xlmr_rerank", "modernbert_rerank")
CROSS_ENCODER_KINDS = ("bert_rerank", "xlmr_rerank", "modernbert_rerank")
EMBEDDING_VERSION = 1

# Qwen3-Embedding's prompts (its config_sentence_transformers.json).
QWEN3_EMBED_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
    "document": "",
}
# Qwen3-Reranker's prompt: RERANK_PREFIX + RERANK_TEMPLATE.format(...) + RERANK_SUFFIX;
# the score is P(yes) from the softmax over the last position's [no, yes] logits.
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_TEMPLATE = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_MAX_LENGTH = 128
# XLM-RoBERTa's special tokens, in its ids' order (<mask> comes last, after
# the pieces); its positions: XLMR_CONTEXT tokens, numbered from pad + 1.
XLMR_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
XLMR_CONTEXT = 128
# What tokenizers saved without a limit write as model_max_length.
UNSET_MAX_LENGTH = 1000000000000000019884624838656
# ModernBERT's special tokens (after the BPE vocabulary, as its 50280-50284)
# and its sliding window: `local_attention` is the whole window, half of it
# on either side (transformers: |i - j| <= local_attention // 2).
MODERNBERT_SPECIAL_TOKENS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
MODERNBERT_WINDOW = 16
MODERNBERT_MAX_LENGTH = 256

# sentence-transformers' module list: the model, then pooling, then (optionally)
# L2 normalization, each module's settings in its folder.
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                 "weightedmean_tokens", "lasttoken")


def _write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1))


def _readme(path: Path, **front_matter) -> None:
    """A model card: YAML front matter (what the hub and servers read), one line."""
    lines = ["---"]
    for key, value in front_matter.items():
        if isinstance(value, list):
            lines += [f"{key}:"] + [f"- {v}" for v in value]
        else:
            lines.append(f"{key}: {value}")
    lines += ["---", "", "A tiny random-weight test fixture (testkit/embedding_fixtures.py).", ""]
    path.write_text("\n".join(lines))


def _sentence_transformers(out: Path, hidden: int, pooling: str, normalize: bool,
                           prompts=None) -> None:
    """modules.json (Normalize last if asked), 1_Pooling/config.json (one mode on)
    and config_sentence_transformers.json."""
    assert pooling in POOLING_MODES, pooling
    modules = [TRANSFORMER, POOLING] + ([NORMALIZE] if normalize else [])
    # Normalize has no settings: no 2_Normalize folder (hub repos have none).
    _write_json(out / "modules.json", modules)
    _write_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden,
        **{f"pooling_mode_{mode}": mode == pooling for mode in POOLING_MODES},
        "include_prompt": True})
    _write_json(out / "config_sentence_transformers.json", {
        "prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"})


# -- the qwen3 kinds: the chat fixture's model, a tokenizer tuned per kind --

def _qwen3_model(out: Path, vocab: int) -> None:
    """config.json and model.safetensors of testkit.fixtures' "qwen3" (same
    config, seed and tuning), for a tokenizer of `vocab` tokens in `out`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer

    # Real Qwen3-Embedding / -Reranker configs name the causal LM class.
    config = dict(_config("qwen3", vocab), architectures=["Qwen3ForCausalLM"])
    _write_json(out / "config.json", config)
    model_class, args_class = _get_classes(config)
    mx.random.seed(1234)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    special_ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    weights = _make_usable(dict(tree_flatten(model.parameters())), special_ids, "qwen3")
    mx.save_safetensors(str(out / "model.safetensors"), weights)


def _append_eos(out: Path) -> int:
    """Make the tokenizer end every text with <|endoftext|> when special tokens
    are added (Qwen3-Embedding's post-processor); returns that token's id."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eos)])
    tok.save(str(out / "tokenizer.json"))
    return eos


def _add_words(out: Path, words) -> dict:
    """Make each of `words` one ordinary BPE token (as "yes" and "no" are in
    Qwen's vocabulary; the tiny corpus never has them): a vocabulary entry and
    merges ranked after all the trained ones, so every other text tokenizes as
    before. Returns the words' ids."""
    from tokenizers import Tokenizer

    path = out / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    data = json.loads(path.read_text())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    next_id = tok.get_vocab_size()
    for word in words:
        # Join the pieces the trained merges leave ("y", "es"), left to right.
        pieces = tok.encode(word, add_special_tokens=False).tokens
        merged = pieces[0]
        for piece in pieces[1:]:
            merges.append([merged, piece])
            merged += piece
            if merged not in vocab:
                vocab[merged] = next_id
                next_id += 1
    path.write_text(json.dumps(data, ensure_ascii=False))
    return {word: vocab[word] for word in words}


def _build_qwen3_embed(out: Path) -> dict:
    vocab = build_tokenizer(out)
    eos = _append_eos(out)
    _qwen3_model(out, vocab)
    _sentence_transformers(out, 64, "lasttoken", normalize=True, prompts=QWEN3_EMBED_PROMPTS)
    _readme(out / "README.md", license="apache-2.0", library_name="sentence-transformers",
            pipeline_tag="feature-extraction",
            tags=["transformers", "sentence-transformers", "sentence-similarity",
                  "feature-extraction"])
    return {"hidden_size": 64, "eos_token_id": eos}


def _build_qwen3_rerank(out: Path) -> dict:
    from tokenizers import Tokenizer

    build_tokenizer(out)
    ids = _add_words(out, ["yes", "no"])
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    _qwen3_model(out, vocab)  # 2 more rows than "qwen3": other random draws
    _readme(out / "README.md", license="apache-2.0", library_name="transformers",
            pipeline_tag="text-ranking")
    return {"hidden_size": 64, "yes_token_id": ids["yes"], "no_token_id": ids["no"]}


# -- the BERT kinds: mlx_embeddings' bert, a WordPiece tokenizer --

def _bert_tokenizer(out: Path) -> dict:
    """A lowercasing WordPiece tokenizer (as BERT's uncased one) over the
    fixtures' corpus: [CLS] $A [SEP], pairs [CLS] $A [SEP] $B [SEP] with type
    ids 0/1. Returns the special tokens' ids and the vocabulary size.

    The vocabulary is listed, not trained: tokenizers' WordPieceTrainer gives
    the "##" pieces ids in hash order and breaks ties by id, so each run
    learns another vocabulary (seen: 6 runs, 6 vocabularies), and the fixed
    weights would meet other token ids. Listed: the special tokens, every
    character of the (normalized) corpus and a-z 0-9, each letter or digit as a "##"
    continuation, and the corpus' words whole: known words are one token,
    others split into characters, numbers into digits (as BERT's)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(lowercase=True)
    corpus_chars = set(normalizer.normalize_str("".join(_corpus()))) - set(" \n")
    chars = sorted(corpus_chars | set(string.ascii_lowercase + string.digits))
    tokens = (BERT_SPECIAL_TOKENS + chars + ["##" + c for c in chars if c.isalnum()]
              + [w for w in WORDS if len(w) > 1])
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(BERT_SPECIAL_TOKENS)  # matched whole in text, skipped in decode
    ids = {t: tok.token_to_id(t) for t in BERT_SPECIAL_TOKENS}
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tok.save(str(out / "tokenizer.json"))
    # BertTokenizer, as all-MiniLM-L6-v2 names it: AutoTokenizer loads it from
    # tokenizer.json, and its outputs include token_type_ids (cross-encoder pairs).
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "BertTokenizer", "do_lower_case": True,
        "model_max_length": BERT_MAX_LENGTH, "pad_token": "[PAD]", "unk_token": "[UNK]",
        "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"})
    # The vocabulary by id, as BERT folders ship it (vocab.txt).
    vocab = tok.get_vocab()
    (out / "vocab.txt").write_text("".join(t + "\n" for t in sorted(vocab, key=vocab.get)))
    return {"cls_token_id": ids["[CLS]"], "sep_token_id": ids["[SEP]"],
            "pad_token_id": ids["[PAD]"], "vocab_size": tok.get_vocab_size()}


def _bert_config(vocab: int) -> dict:
    """The BERT fixtures' config.json (an encoder's: BertModel)."""
    return {
        "model_type": "bert", "architectures": ["BertModel"], "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "hidden_act": "gelu", "max_position_embeddings": BERT_MAX_LENGTH, "type_vocab_size": 2,
        "vocab_size": vocab, "layer_norm_eps": 1e-12, "pad_token_id": 0,
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "initializer_range": 0.02, "position_embedding_type": "absolute",
        "torch_dtype": "float32"}


def _bert_model(out: Path, vocab: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert

    config = _bert_config(vocab)
    _write_json(out / "config.json", config)
    mx.random.seed(4321)
    model = bert.Model(bert.ModelArgs.from_dict(config))
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        if w.ndim == 2 and "embeddings" not in name:
            # MLX's default Linear init is flat: sharper attention, so each
            # token's state depends on the others (as in the qwen3 fixtures).
            w = w * 2.0
        weights[name] = w.astype(mx.float32)
    mx.save_safetensors(str(out / "model.safetensors"), weights)


def _build_bert(out: Path, pooling: str, normalize: bool) -> dict:
    ids = _bert_tokenizer(out)
    _bert_model(out, ids.pop("vocab_size"))
    _sentence_transformers(out, 64, pooling, normalize=normalize)
    _write_json(out / "sentence_bert_config.json",
                {"max_seq_length": BERT_MAX_LENGTH, "do_lower_case": False})
    _readme(out / "README.md", license="apache-2.0", library_name="sentence-transformers",
            pipeline_tag="sentence-similarity",
            tags=["sentence-transformers", "feature-extraction", "sentence-similarity"])
    return {"hidden_size": 64, **ids}


def _scaled(params) -> dict:
    """A model's parameters as float32, matrices (not embeddings) x2: MLX's
    default Linear init is flat (see _bert_model)."""
    from mlx.utils import tree_flatten
    import mlx.core as mx

    return {name: (w * 2.0 if w.ndim == 2 and "embeddings" not in name else w).astype(mx.float32)
            for name, w in tree_flatten(params)}


def _encoder_files(out: Path, max_seq_length: int) -> None:
    """sentence-transformers' files of a mean-pooled, normalized encoder."""
    _sentence_transformers(out, 64, "mean_tokens", normalize=True)
    _write_json(out / "sentence_bert_config.json",
                {"max_seq_length": max_seq_length, "do_lower_case": False})
    _readme(out / "README.md", license="mit", library_name="sentence-transformers",
            pipeline_tag="sentence-similarity",
            tags=["sentence-transformers", "feature-extraction", "sentence-similarity"])


# -- XLM-RoBERTa: mlx_embeddings' xlm_roberta, a Unigram tokenizer --

def _xlmr_tokenizer(out: Path) -> dict:
    """A SentencePiece-style Unigram tokenizer (XLM-RoBERTa's kind: Metaspace
    "▁", <s> $A </s>, pairs <s> $A </s> </s> $B </s>), not lowercasing.
    Listed, not trained (as BERT's, for the same reason): the corpus' words
    whole with "▁" before them (lower case and capitalized), and every
    character alone and, for letters and digits, after "▁"; scores make a
    known word one piece. Other characters are <unk>."""
    from tokenizers import (
        Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
    )

    normalizer = normalizers.Sequence([normalizers.NFKC(),
                                       normalizers.Replace(Regex(" {2,}"), " ")])
    chars = sorted((set(normalizer.normalize_str("".join(_corpus()))) - set(" \n"))
                   | set(string.ascii_letters + string.digits))
    words = sorted({w for w in WORDS} | {w.capitalize() for w in WORDS})
    pieces = ([("\u2581" + w, -5.0 - 0.01 * i) for i, w in enumerate(words)]
              + [("\u2581", -9.0)] + [(c, -10.0) for c in chars]
              + [("\u2581" + c, -9.5) for c in chars if c.isalnum()])
    vocab = [(t, 0.0) for t in XLMR_SPECIAL_TOKENS] + pieces + [("<mask>", 0.0)]
    ids = {t: i for i, (t, _) in enumerate(vocab) if t in XLMR_SPECIAL_TOKENS + ["<mask>"]}
    tok = Tokenizer(models.Unigram(vocab, unk_id=ids["<unk>"], byte_fallback=False))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.add_special_tokens(XLMR_SPECIAL_TOKENS + ["<mask>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])])
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "XLMRobertaTokenizer", "model_max_length": UNSET_MAX_LENGTH,
        "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>"})
    return {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"],
            "pad_token_id": ids["<pad>"], "vocab_size": tok.get_vocab_size()}


def _xlmr_config(vocab: int, ids: dict) -> dict:
    """The XLM-RoBERTa fixtures' config.json (XLMRobertaModel); `ids`, the
    tokenizer's special tokens'."""
    pad = ids["pad_token_id"]
    return {
        "model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"], "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "hidden_act": "gelu", "max_position_embeddings": XLMR_CONTEXT + pad + 1,
        "type_vocab_size": 1, "vocab_size": vocab, "layer_norm_eps": 1e-5,
        "pad_token_id": pad, "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"], "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02,
        "position_embedding_type": "absolute", "torch_dtype": "float32"}


def _build_xlmr(out: Path) -> dict:
    import mlx.core as mx
    from mlx_embeddings.models import xlm_roberta

    ids = _xlmr_tokenizer(out)
    config = _xlmr_config(ids.pop("vocab_size"), ids)
    _write_json(out / "config.json", config)
    mx.random.seed(5678)
    model = xlm_roberta.Model(xlm_roberta.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), _scaled(model.parameters()))
    _encoder_files(out, 512)  # (more than the positions allow, as e5's 512 of 514)
    return {"hidden_size": 64, "context_length": XLMR_CONTEXT, **ids}


# -- ModernBERT: mlx_embeddings' modernbert, a byte-level BPE tokenizer --

def _modernbert_tokenizer(out: Path) -> dict:
    """The fixtures' byte-level BPE (testkit.fixtures.build_tokenizer) with
    ModernBERT's special tokens added after it and its template: [CLS] $A
    [SEP], pairs [CLS] $A [SEP] $B [SEP]."""
    from tokenizers import Tokenizer, processors

    build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(MODERNBERT_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in MODERNBERT_SPECIAL_TOKENS}
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MODERNBERT_MAX_LENGTH,
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]", "model_input_names": ["input_ids", "attention_mask"]})
    return {"cls_token_id": ids["[CLS]"], "sep_token_id": ids["[SEP]"],
            "pad_token_id": ids["[PAD]"], "vocab_size": tok.get_vocab_size()}


def _modernbert_config(vocab: int, ids: dict) -> dict:
    """The ModernBERT fixtures' config.json (ModernBertModel); `ids`, the
    tokenizer's special tokens'."""
    return {
        "model_type": "modernbert", "architectures": ["ModernBertModel"], "hidden_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 96,
        "hidden_activation": "gelu", "max_position_embeddings": MODERNBERT_MAX_LENGTH,
        "vocab_size": vocab, "norm_eps": 1e-5, "norm_bias": False,
        "global_attn_every_n_layers": 2, "local_attention": MODERNBERT_WINDOW,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0,
        "attention_bias": False, "attention_dropout": 0.0, "embedding_dropout": 0.0,
        "mlp_bias": False, "mlp_dropout": 0.0, "classifier_pooling": "mean",
        "tie_word_embeddings": True, "torch_dtype": "float32",
        "bos_token_id": ids["cls_token_id"], "eos_token_id": ids["sep_token_id"],
        **ids}


def _build_modernbert(out: Path) -> dict:
    import mlx.core as mx
    from mlx_embeddings.models import modernbert

    ids = _modernbert_tokenizer(out)
    config = _modernbert_config(ids.pop("vocab_size"), ids)
    _write_json(out / "config.json", config)
    mx.random.seed(8765)
    model = modernbert.ModernBertModel(modernbert.ModelArgs.from_dict(config))
    # (ModernBertModel's names, as a sentence-transformers folder has them:
    # mlx-embeddings' Model puts them under "model.")
    mx.save_safetensors(str(out / "model.safetensors"), _scaled(model.parameters()))
    _encoder_files(out, MODERNBERT_MAX_LENGTH)
    return {"hidden_size": 64, "local_attention": MODERNBERT_WINDOW, **ids}


# -- cross-encoders: an encoder and transformers' classification head --

SIGMOID = "torch.nn.modules.activation.Sigmoid"
ONE_LABEL = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
IDENTITY = "torch.nn.modules.linear.Identity"


def _head_weights(hidden: int, seed: int, names) -> dict:
    """Random float32 head weights: each of `names` -> its shape. The
    last layer's are small, so that the scores stay off a sigmoid's flat
    ends (where pairs and errors would not tell apart)."""
    import mlx.core as mx

    mx.random.seed(seed)
    scale = {2: 2.0 / hidden ** 0.5, 1: 0.1}
    return {name: (mx.random.normal(shape) * (0.05 if shape[0] == 1 else scale[len(shape)])
                   ).astype(mx.float32)
            for name, shape in names.items()}


def _cross_encoder_files(out: Path, pipeline_tag: str = "text-ranking") -> None:
    # (A CrossEncoder folder: no modules.json; the card may name the task,
    # or only a classification, as bge-reranker's.)
    _readme(out / "README.md", license="apache-2.0", library_name="sentence-transformers",
            pipeline_tag=pipeline_tag, tags=["sentence-transformers", "cross-encoder"])


def _build_bert_rerank(out: Path) -> dict:
    import mlx.core as mx
    from mlx_embeddings.models import bert

    ids = _bert_tokenizer(out)
    config = {**_bert_config(ids.pop("vocab_size")),
              "architectures": ["BertForSequenceClassification"], **ONE_LABEL,
              "sbert_ce_default_activation_function": IDENTITY}
    _write_json(out / "config.json", config)
    mx.random.seed(2468)
    trunk = _scaled(bert.Model(bert.ModelArgs.from_dict(config)).parameters())
    weights = {"bert." + k: v for k, v in trunk.items()}
    # (older transformers saved this buffer; mlx-embeddings drops it)
    weights["bert.embeddings.position_ids"] = mx.arange(BERT_MAX_LENGTH)[None]
    weights.update(_head_weights(64, 2469, {"classifier.weight": (1, 64), "classifier.bias": (1,)}))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    _cross_encoder_files(out)
    return {"hidden_size": 64, "activation": "identity", **ids}


def _build_xlmr_rerank(out: Path) -> dict:
    import mlx.core as mx
    from mlx_embeddings.models import xlm_roberta

    ids = _xlmr_tokenizer(out)
    config = {**_xlmr_config(ids.pop("vocab_size"), ids),
              "architectures": ["XLMRobertaForSequenceClassification"], **ONE_LABEL}
    _write_json(out / "config.json", config)
    mx.random.seed(3579)
    args = xlm_roberta.ModelArgs.from_dict({**config, "add_pooling_layer": False})
    weights = {"roberta." + k: v for k, v in _scaled(xlm_roberta.Model(args).parameters()).items()}
    weights.update(_head_weights(64, 3580, {
        "classifier.dense.weight": (64, 64), "classifier.dense.bias": (64,),
        "classifier.out_proj.weight": (1, 64), "classifier.out_proj.bias": (1,)}))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    _cross_encoder_files(out, pipeline_tag="text-classification")
    return {"hidden_size": 64, "context_length": XLMR_CONTEXT, "activation": "sigmoid", **ids}


def _build_modernbert_rerank(out: Path) -> dict:
    import mlx.core as mx
    from mlx_embeddings.models import modernbert

    ids = _modernbert_tokenizer(out)
    config = {**_modernbert_config(ids.pop("vocab_size"), ids),
              "architectures": ["ModernBertForSequenceClassification"], **ONE_LABEL,
              "classifier_pooling": "mean", "classifier_activation": "gelu",
              "classifier_bias": False,
              "sentence_transformers": {"activation_fn": SIGMOID, "version": "4.1.0"}}
    _write_json(out / "config.json", config)
    mx.random.seed(4680)
    trunk = _scaled(modernbert.ModernBertModel(modernbert.ModelArgs.from_dict(config)).parameters())
    weights = {"model." + k: v for k, v in trunk.items()}
    weights.update(_head_weights(64, 4681, {"head.dense.weight": (64, 64),
                                            "head.norm.weight": (64,),
                                            "classifier.weight": (1, 64),
                                            "classifier.bias": (1,)}))
    weights["head.norm.weight"] = weights["head.norm.weight"] + 1.0
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    _cross_encoder_files(out)
    return {"hidden_size": 64, "local_attention": MODERNBERT_WINDOW, "activation": "sigmoid",
            **ids}


def build_embedding_fixture(kind: str, root) -> Path:
    """Build (or reuse) the embedding / reranker fixture `kind` under `root`;
    returns its folder. The marker fixture.json holds the version and the
    token ids of note (eos, yes/no, cls/sep/pad) and the hidden size."""
    if kind not in EMBEDDING_KINDS:
        raise ValueError(f"unknown embedding fixture kind {kind!r}; one of {EMBEDDING_KINDS}")
    out = Path(root) / kind
    marker = out / "fixture.json"
    if _built(marker, EMBEDDING_VERSION):
        return out
    out.mkdir(parents=True, exist_ok=True)
    if kind == "qwen3_embed":
        info = _build_qwen3_embed(out)
    elif kind == "qwen3_rerank":
        info = _build_qwen3_rerank(out)
    elif kind == "bert_embed":
        info = _build_bert(out, "mean_tokens", normalize=True)
    elif kind == "xlmr_embed":
        info = _build_xlmr(out)
    elif kind == "modernbert_embed":
        info = _build_modernbert(out)
    elif kind == "bert_rerank":
        info = _build_bert_rerank(out)
    elif kind == "xlmr_rerank":
        info = _build_xlmr_rerank(out)
    elif kind == "modernbert_rerank":
        info = _build_modernbert_rerank(out)
    else:  # bert_cls: the same weights and tokenizer (same seed), CLS, unnormalized
        info = _build_bert(out, "cls_token", normalize=False)
    marker.write_text(json.dumps({"version": EMBEDDING_VERSION, "kind": kind, **info}))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python -m testkit.embedding_fixtures KIND OUTDIR (KIND: {EMBEDDING_KINDS})")
    print(build_embedding_fixture(sys.argv[1], sys.argv[2]))
