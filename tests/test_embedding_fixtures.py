"""The embedding and reranker fixtures load with their families' loaders, carry
the files sentence-transformers reads, and are sensitive enough for tests:
a pooled vector or a rerank score changes when the input does. ModernBERT's
is also run here in numpy from transformers' definition of the model (its
sliding window, RoPE and GELU), and XLM-RoBERTa's positions are checked
against its numbering from pad_token_id + 1."""

import json
import math
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from huggingface_hub import metadata_load
from transformers import AutoTokenizer

from mlx_lm_plus import patches
from testkit.embedding_fixtures import (
    EMBEDDING_KINDS, NORMALIZE, POOLING, POOLING_MODES, QWEN3_EMBED_PROMPTS, RERANK_INSTRUCTION,
    RERANK_PREFIX, RERANK_SUFFIX, RERANK_TEMPLATE, TRANSFORMER, build_embedding_fixture,
)
from testkit.fixtures import SPECIAL_TOKENS

# 8 tokens each (the qwen3 BPE, the BERT WordPiece), before special tokens.
QWEN_TEXT = "Describe the river and the old city"
BERT_TEXT = "the cat and the dog by the river"
# Longer than ModernBERT's sliding window (16: 8 either side) several times.
LONG_TEXT = "the cat sat on the mat and looked at the old river for a while, " * 3


@pytest.fixture(scope="module")
def built(fixture_dir):
    """kind -> (folder, its marker's contents)."""
    def build(kind):
        path = build_embedding_fixture(kind, fixture_dir)
        return path, json.loads((path / "fixture.json").read_text())

    return build


def read(path):
    return json.loads(path.read_text())


def check_pooling(path, mode, hidden):
    pooling = read(path / "1_Pooling" / "config.json")
    assert pooling["word_embedding_dimension"] == hidden
    assert {m for m in POOLING_MODES if pooling[f"pooling_mode_{m}"]} == {mode}


def variants(ids, replacement):
    """Each token dropped, then each replaced by `replacement` (or its neighbour)."""
    for i, token in enumerate(ids):
        yield ids[:i] + ids[i + 1:]
        other = replacement if token != replacement else replacement + 1
        yield ids[:i] + [other] + ids[i + 1:]


def max_change(a, b):
    return mx.abs(a - b).max().item()


def test_qwen3_embed(built):
    from mlx_lm import load

    path, marker = built("qwen3_embed")
    assert read(path / "modules.json") == [TRANSFORMER, POOLING, NORMALIZE]
    check_pooling(path, "lasttoken", read(path / "config.json")["hidden_size"])
    st = read(path / "config_sentence_transformers.json")
    assert st["prompts"] == QWEN3_EMBED_PROMPTS and st["similarity_fn_name"] == "cosine"
    card = metadata_load(path / "README.md")
    assert card["pipeline_tag"] == "feature-extraction"
    assert card["library_name"] == "sentence-transformers"

    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert marker["eos_token_id"] == eos
    ids = tok(QWEN_TEXT)["input_ids"]
    assert ids[-1] == eos and eos not in ids[:-1]
    assert eos not in tok("x", add_special_tokens=False)["input_ids"]

    model, _ = load(str(path))
    text_ids = ids[:-1]
    assert len(text_ids) == 8

    def pooled(text_ids):  # last token (the EOS), L2-normalized
        h = model.model(mx.array([text_ids + [eos]]))[0, -1]
        return h / mx.linalg.norm(h)

    base = pooled(text_ids)
    assert base.shape == (marker["hidden_size"],)
    for changed in variants(text_ids, tok.convert_tokens_to_ids("Ġriver")):
        assert max_change(pooled(changed), base) > 1e-3, changed


@pytest.fixture(scope="module")
def bert(built):
    from mlx_embeddings.utils import load

    path, marker = built("bert_embed")
    model, tok = load(str(path))
    return path, marker, model, tok


def test_bert_embed(bert):
    path, marker, model, tok = bert
    config = read(path / "config.json")
    assert config["model_type"] == "bert" and config["architectures"] == ["BertModel"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["max_position_embeddings"],
            config["type_vocab_size"]) == (64, 2, 128, 2)
    assert read(path / "modules.json") == [TRANSFORMER, POOLING, NORMALIZE]
    check_pooling(path, "mean_tokens", 64)
    assert metadata_load(path / "README.md")["pipeline_tag"] == "sentence-similarity"

    cls, sep, pad = (tok.convert_tokens_to_ids(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    assert (marker["cls_token_id"], marker["sep_token_id"], marker["pad_token_id"]) == (cls, sep, pad)
    assert tok.model_max_length == 128 and tok.pad_token_id == pad
    ids = tok(BERT_TEXT)["input_ids"]
    assert ids[0] == cls and ids[-1] == sep and len(ids) == 10
    pair = tok("a cat", "a dog")
    assert pair["input_ids"].count(sep) == 2 and pair["token_type_ids"] == [0] * 4 + [1] * 3

    def embed(ids):  # mlx_embeddings' text_embeds: mean pooled, L2-normalized
        return model(mx.array([ids])).text_embeds[0]

    base = embed(ids)
    assert base.shape == (64,)
    inner = ids[1:-1]
    for changed in variants(inner, tok.convert_tokens_to_ids("boat")):
        assert max_change(embed([cls] + changed + [sep]), base) > 1e-3, changed

    # Padding is masked out: a padded row embeds as it does alone.
    batch = tok([BERT_TEXT, "a dog"], padding=True, return_tensors="np")
    out = model(mx.array(batch["input_ids"]), attention_mask=mx.array(batch["attention_mask"]))
    assert max_change(out.text_embeds[1], embed(tok("a dog")["input_ids"])) < 1e-5


def test_bert_cls(built, bert):
    from mlx_embeddings.utils import load

    embed_path, _, embed_model, _ = bert
    path, marker = built("bert_cls")
    # No Normalize module, CLS pooling: the same weights as bert_embed, other vectors.
    assert read(path / "modules.json") == [TRANSFORMER, POOLING]
    check_pooling(path, "cls_token", 64)
    assert (path / "model.safetensors").read_bytes() == (embed_path / "model.safetensors").read_bytes()
    model, tok = load(str(path))
    ids = tok(BERT_TEXT)["input_ids"]
    assert ids[0] == marker["cls_token_id"]

    def cls_vector(ids):
        return model(mx.array([ids])).last_hidden_state[0, 0]

    base = cls_vector(ids)
    assert abs(mx.linalg.norm(base).item() - 1.0) > 0.1  # not normalized by the model
    assert max_change(base / mx.linalg.norm(base),
                      embed_model(mx.array([ids])).text_embeds[0]) > 1e-2
    inner = ids[1:-1]
    for changed in variants(inner, tok.convert_tokens_to_ids("boat")):
        assert max_change(cls_vector([ids[0]] + changed + [ids[-1]]), base) > 1e-3, changed


def mean_vector(hidden):
    """[1, L, H] -> the mean over positions, L2-normalized (numpy)."""
    vector = np.array(hidden.astype(mx.float32))[0].mean(axis=0)
    return vector / np.linalg.norm(vector)


def test_xlmr_embed(built):
    from mlx_embeddings.utils import load

    path, marker = built("xlmr_embed")
    config = read(path / "config.json")
    pad = config["pad_token_id"]
    assert config["model_type"] == "xlm-roberta" and config["architectures"] == ["XLMRobertaModel"]
    # Positions numbered from pad + 1: 130 of them are a context of 128.
    assert config["max_position_embeddings"] == marker["context_length"] + pad + 1 == 130
    assert read(path / "modules.json") == [TRANSFORMER, POOLING, NORMALIZE]
    check_pooling(path, "mean_tokens", 64)
    assert read(path / "sentence_bert_config.json")["max_seq_length"] == 512  # (no cap)

    model, wrapper = load(str(path))
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.model_max_length > 10**20  # (unset: the positions set the context)
    bos, eos = tok.convert_tokens_to_ids("<s>"), tok.convert_tokens_to_ids("</s>")
    assert (bos, pad, eos, tok.convert_tokens_to_ids("<unk>")) == (0, 1, 2, 3)
    assert tok.pad_token_id == pad and marker["pad_token_id"] == pad
    ids = tok(BERT_TEXT)["input_ids"]
    assert ids[0] == bos and ids[-1] == eos and len(ids) == 10
    assert tok.convert_ids_to_tokens(ids[1:3]) == ["\u2581the", "\u2581cat"]
    assert tok("a cat", "a dog")["input_ids"].count(eos) == 3  # <s> A </s> </s> B </s>
    assert wrapper._tokenizer("The Cat")["input_ids"] != wrapper._tokenizer("the cat")["input_ids"]

    # The embeddings' positions: pad + 1, pad + 2, ... (XLM-RoBERTa's, not BERT's 0, 1, ...).
    weights = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}

    def embedded(positions):
        x = (weights["embeddings.word_embeddings.weight"][ids]
             + weights["embeddings.position_embeddings.weight"][positions]
             + weights["embeddings.token_type_embeddings.weight"][0])
        x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
        return x * weights["embeddings.LayerNorm.weight"] + weights["embeddings.LayerNorm.bias"]

    got = np.array(model.embeddings(mx.array([ids])))[0]
    np.testing.assert_allclose(got, embedded(pad + 1 + np.arange(len(ids))), atol=1e-5)
    assert np.abs(got - embedded(np.arange(len(ids)))).max() > 1e-2

    def embed(ids):
        return mean_vector(model(mx.array([ids])).last_hidden_state)

    base = embed(ids)
    for changed in variants(ids[1:-1], tok.convert_tokens_to_ids("\u2581boat")):
        assert np.abs(embed([bos] + changed + [eos]) - base).max() > 1e-3, changed
    # Padding is masked out (and numbered as the text's tokens are not).
    batch = tok([BERT_TEXT, "a dog"], padding=True, return_tensors="np")
    out = model(mx.array(batch["input_ids"]), attention_mask=mx.array(batch["attention_mask"]))
    short = tok("a dog")["input_ids"]
    np.testing.assert_allclose(np.array(out.last_hidden_state)[1, :len(short)],
                               np.array(model(mx.array([short])).last_hidden_state)[0],
                               atol=1e-5)


def _layer_norm(x, weight, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * weight


def _rope(x, theta):
    """transformers' rotate-half RoPE over positions 0..L-1: x [L, heads, d]."""
    d = x.shape[-1]
    angles = np.arange(x.shape[0])[:, None] * theta ** (-np.arange(0, d, 2) / d)[None]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None]
    rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


_erf = np.vectorize(math.erf)


def numpy_modernbert(weights, config, ids, window=None):
    """ModernBERT's last hidden states for one unpadded input, in float64
    numpy, as transformers defines the model: pre-norm layers (no norm
    before the first attention), global attention every N layers and a
    sliding window (|i - j| <= local_attention // 2) in the others, each with
    its RoPE theta, a GLU MLP with the exact GELU, a final norm. `window`:
    another local_attention, to show that the window matters."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    eps, heads = config["norm_eps"], config["num_attention_heads"]
    half = (window or config["local_attention"]) // 2
    x = _layer_norm(w["embeddings.tok_embeddings.weight"][ids], w["embeddings.norm.weight"], eps)
    n, hidden = x.shape
    d = hidden // heads
    far = np.abs(np.arange(n)[:, None] - np.arange(n)[None]) > half
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        h = x if i == 0 else _layer_norm(x, w[p + "attn_norm.weight"], eps)
        q, k, v = (h @ w[p + "attn.Wqkv.weight"].T).reshape(n, 3, heads, d).transpose(1, 0, 2, 3)
        local = i % config["global_attn_every_n_layers"] != 0
        theta = config["local_rope_theta" if local else "global_rope_theta"]
        scores = np.einsum("qhd,khd->hqk", _rope(q, theta), _rope(k, theta)) / math.sqrt(d)
        if local:
            scores = np.where(far[None], -np.inf, scores)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(n, hidden) @ w[p + "attn.Wo.weight"].T
        a, gate = np.split(_layer_norm(x, w[p + "mlp_norm.weight"], eps) @ w[p + "mlp.Wi.weight"].T,
                           2, axis=-1)
        x = x + (0.5 * a * (1 + _erf(a / math.sqrt(2))) * gate) @ w[p + "mlp.Wo.weight"].T
    return _layer_norm(x, w["final_norm.weight"], eps)


def test_modernbert_embed(built):
    from mlx_embeddings.utils import load

    path, marker = built("modernbert_embed")
    config = read(path / "config.json")
    assert config["model_type"] == "modernbert" and config["architectures"] == ["ModernBertModel"]
    assert (config["num_hidden_layers"], config["global_attn_every_n_layers"],
            config["local_attention"], config["hidden_activation"]) == (3, 2, 16, "gelu")
    assert read(path / "modules.json") == [TRANSFORMER, POOLING, NORMALIZE]
    check_pooling(path, "mean_tokens", 64)
    # ModernBertModel's weight names, as sentence-transformers saves them.
    weights = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    assert "layers.1.attn.Wqkv.weight" in weights
    assert not any(k.startswith("model.") for k in weights)
    assert "layers.0.attn_norm.weight" not in weights  # (no norm before the first attention)

    tok = AutoTokenizer.from_pretrained(path)
    cls, sep, pad = (tok.convert_tokens_to_ids(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    assert [marker[f"{t}_token_id"] for t in ("cls", "sep", "pad")] == [cls, sep, pad]
    assert tok.model_max_length == 256 and tok.pad_token_id == pad
    ids = tok(LONG_TEXT)["input_ids"]
    assert ids[0] == cls and ids[-1] == sep and len(ids) > 3 * 16
    assert tok("a cat", "a dog")["input_ids"].count(sep) == 2

    patches.apply_all()  # (the server's: the exact GELU, modernbert_gelu)
    model, _ = load(str(path))

    def hidden(ids):
        return model.model(mx.array([ids]), attention_mask=mx.ones((1, len(ids))))[
            "last_hidden_state"]

    # mlx-embeddings' model (and the folder's config and weights) is
    # transformers' ModernBERT; the window is one a wrong window differs from.
    want = numpy_modernbert(weights, config, ids)
    np.testing.assert_allclose(np.array(hidden(ids))[0], want, atol=1e-5)
    for window in (14, 18, 10**6):
        assert np.abs(numpy_modernbert(weights, config, ids, window) - want).max() > 1e-3

    def embed(ids):
        return mean_vector(hidden(ids))

    inner = ids[1:13]
    base = embed([cls] + inner + [sep])
    assert base.shape == (64,)
    for changed in variants(inner, tok.convert_tokens_to_ids("Ġboat")):
        assert np.abs(embed([cls] + changed + [sep]) - base).max() > 1e-3, changed
    # Padding is masked out: a padded row is as it is alone.
    batch = tok([LONG_TEXT, "a dog"], padding=True, return_tensors="np")
    out = model.model(mx.array(batch["input_ids"]),
                      attention_mask=mx.array(batch["attention_mask"]))
    short = tok("a dog")["input_ids"]
    np.testing.assert_allclose(np.array(out["last_hidden_state"])[1, :len(short)],
                               np.array(hidden(short))[0], atol=1e-5)


def test_qwen3_rerank(built):
    from mlx_lm import load

    path, marker = built("qwen3_rerank")
    assert not (path / "modules.json").exists()
    card = metadata_load(path / "README.md")
    assert card["pipeline_tag"] == "text-ranking" and card["library_name"] == "transformers"

    tok = AutoTokenizer.from_pretrained(path)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    assert (marker["yes_token_id"], marker["no_token_id"]) == (yes, no)
    assert tok.encode("yes", add_special_tokens=False) == [yes]
    assert tok.encode("no", add_special_tokens=False) == [no]
    for special in SPECIAL_TOKENS:
        assert tok.encode(special, add_special_tokens=False) == [tok.convert_tokens_to_ids(special)]

    model, _ = load(str(path))
    head = model.lm_head.weight
    assert mx.abs(head[yes]).sum().item() > 0 and mx.abs(head[no]).sum().item() > 0
    assert max_change(head[yes], head[no]) > 0

    def score(query, doc):
        text = RERANK_PREFIX + RERANK_TEMPLATE.format(
            instruction=RERANK_INSTRUCTION, query=query, doc=doc) + RERANK_SUFFIX
        logits = model(mx.array([tok.encode(text, add_special_tokens=False)]))[0, -1]
        return mx.softmax(mx.stack([logits[no], logits[yes]]))[1].item()

    pairs = [("what is the capital of france", "paris is the capital of france"),
             ("what is the capital of france", "the dog is by the river"),
             ("tell me about a cat", "a cat and a dog"),
             ("count to ten", "one two three four"),
             ("where is tokyo", "tokyo is in japan")]
    scores = [score(q, d) for q, d in pairs]
    assert all(0 < s < 1 for s in scores)
    for i in range(len(scores)):
        for j in range(i):
            assert abs(scores[i] - scores[j]) > 1e-4, scores


def test_deterministic_idempotent_and_cli(built, tmp_path):
    for kind in EMBEDDING_KINDS:
        path, _ = built(kind)
        stamp = (path / "model.safetensors").stat().st_mtime_ns
        assert build_embedding_fixture(kind, path.parent) == path  # reused, not rebuilt
        assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    # Another build, by the command line, is the same byte for byte.
    for kind in ("qwen3_embed", "bert_embed", "xlmr_embed", "modernbert_embed", "qwen3_rerank",
                 "bert_rerank", "xlmr_rerank", "modernbert_rerank"):
        printed = subprocess.run(
            [sys.executable, "-m", "testkit.embedding_fixtures", kind, str(tmp_path)],
            check=True, capture_output=True, text=True).stdout.strip()
        assert printed == str(tmp_path / kind)
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (tmp_path / kind / name).read_bytes() == (built(kind)[0] / name).read_bytes()
    with pytest.raises(ValueError):
        build_embedding_fixture("nope", tmp_path)
