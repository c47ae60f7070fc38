"""The embedding and reranker fixtures load with their families' loaders, carry
the files sentence-transformers reads, and are sensitive enough for tests:
a pooled vector or a rerank score changes when the input does."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from huggingface_hub import metadata_load
from transformers import AutoTokenizer

from testkit.embedding_fixtures import (
    EMBEDDING_KINDS, NORMALIZE, POOLING, POOLING_MODES, QWEN3_EMBED_PROMPTS, RERANK_INSTRUCTION,
    RERANK_PREFIX, RERANK_SUFFIX, RERANK_TEMPLATE, TRANSFORMER, build_embedding_fixture,
)
from testkit.fixtures import SPECIAL_TOKENS

# 8 tokens each (the qwen3 BPE, the BERT WordPiece), before special tokens.
QWEN_TEXT = "Describe the river and the old city"
BERT_TEXT = "the cat and the dog by the river"


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
    for kind in ("qwen3_embed", "bert_embed", "qwen3_rerank"):
        printed = subprocess.run(
            [sys.executable, "-m", "testkit.embedding_fixtures", kind, str(tmp_path)],
            check=True, capture_output=True, text=True).stdout.strip()
        assert printed == str(tmp_path / kind)
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (tmp_path / kind / name).read_bytes() == (built(kind)[0] / name).read_bytes()
    with pytest.raises(ValueError):
        build_embedding_fixture("nope", tmp_path)
