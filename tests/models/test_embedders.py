"""Which task a model folder serves, and sentence-transformers' pooling as
its config says (models/embedders.py), against numpy written here."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_plus.models.embedders import (
    EmbedderError, Pooling, folder_task, load_embedder, read_pooling,
)
from mlx_lm_plus.models.folders import _mlx_lm_has
from mlx_lm_plus.models.served import read_models_config


def test_the_folder_says_what_it_serves(fixture_path):
    assert folder_task(fixture_path("qwen3_embed")) == "embed"
    assert folder_task(fixture_path("bert_embed")) == "embed"
    assert folder_task(fixture_path("xlmr_embed")) == "embed"
    assert folder_task(fixture_path("modernbert_embed")) == "embed"
    assert folder_task(fixture_path("qwen3_rerank")) == "rerank"
    for kind in ("bert_rerank", "xlmr_rerank", "modernbert_rerank"):  # (their configs)
        assert folder_task(fixture_path(kind)) == "rerank"
    assert folder_task(fixture_path("qwen3")) == "generate"
    assert folder_task("no/such-repo") == "generate"


def test_pooling_follows_the_config(fixture_path):
    pooling, prompts, default = read_pooling(fixture_path("qwen3_embed"))
    assert pooling == Pooling("lasttoken", normalize=True, include_prompt=True)
    assert prompts["query"].startswith("Instruct:") and default is None
    assert read_pooling(fixture_path("bert_embed"))[0] == Pooling("mean", True)
    assert read_pooling(fixture_path("bert_cls"))[0] == Pooling("cls", False)
    assert read_pooling(fixture_path("xlmr_embed"))[0] == Pooling("mean", True)
    assert read_pooling(fixture_path("modernbert_embed"))[0] == Pooling("mean", True)


@pytest.mark.parametrize("mode", ["cls", "mean", "max", "lasttoken", "mean_sqrt_len"])
@pytest.mark.parametrize("normalize", [True, False])
def test_each_pooling_mode_against_numpy(mode, normalize):
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 7, 5)).astype(np.float32)
    lengths, starts = np.array([7, 3, 5]), np.array([0, 1, 2])
    got = np.array(Pooling(mode, normalize, include_prompt=False)(
        mx.array(hidden), mx.array(lengths), mx.array(starts)))
    for row in range(3):
        kept = hidden[row, starts[row]:lengths[row]]
        want = {"cls": hidden[row, 0], "lasttoken": hidden[row, lengths[row] - 1],
                "mean": kept.mean(axis=0), "max": kept.max(axis=0),
                "mean_sqrt_len": kept.sum(axis=0) / np.sqrt(len(kept))}[mode]
        if normalize:
            want = want / np.linalg.norm(want)
        np.testing.assert_allclose(got[row], want, atol=1e-6)


def test_what_cant_be_served_is_said_at_load(fixture_path, tmp_path):
    dense = tmp_path / "dense"
    shutil.copytree(fixture_path("bert_embed"), dense)
    modules = json.loads((dense / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(EmbedderError, match="Dense"):
        load_embedder(str(dense), "embed", _mlx_lm_has)
    with pytest.raises(EmbedderError, match="cross-encoder"):
        load_embedder(str(fixture_path("bert_embed")), "rerank", _mlx_lm_has)
    with pytest.raises(EmbedderError, match="local folder"):
        load_embedder("no/such-repo", "embed", _mlx_lm_has)


def test_models_config_task(tmp_path, fixture_path):
    config = tmp_path / "m.json"
    config.write_text(json.dumps({"models": [
        {"path": str(fixture_path("qwen3")), "name": "as-embedder", "task": "embed"}]}))
    assert read_models_config(config)[0].task == "embed"
    for bad in ({"task": "classify"}, {"task": "embed", "draft_model": "x"}):
        config.write_text(json.dumps({"models": [{"path": "p", **bad}]}))
        with pytest.raises(ValueError, match="task|embedding"):
            read_models_config(config)


def test_one_folder_serves_one_task(tmp_path, fixture_path, capsys):
    from mlx_lm_plus.config import parse_args

    config = tmp_path / "m.json"
    chat = str(fixture_path("qwen3"))
    config.write_text(json.dumps({"models": [
        {"path": chat, "name": "chat"}, {"path": chat, "name": "as-embedder", "task": "embed"}]}))
    with pytest.raises(SystemExit):  # (at startup, with the reason)
        parse_args(["--models-config", str(config)])
    assert "ask for different tasks" in capsys.readouterr().err


def _with_config(fixture_path, tmp_path, kind, **changes):
    """A copy of fixture `kind` whose config.json has `changes` (None: removed)."""
    folder = tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(fixture_path(kind), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_cross_encoders_score_as_their_config_says(fixture_path, tmp_path):
    heads = {kind: load_embedder(str(fixture_path(kind)), "rerank", _mlx_lm_has)[0].cross_encoder
             for kind in ("bert_rerank", "xlmr_rerank", "modernbert_rerank")}
    # ms-marco's Identity; bge's nothing (CrossEncoder's sigmoid for one
    # label); sentence-transformers 4's activation_fn; ModernBERT's pooling.
    assert (heads["bert_rerank"].activation, heads["bert_rerank"].token_types) == ("identity", True)
    assert (heads["xlmr_rerank"].activation, heads["xlmr_rerank"].token_types) == ("sigmoid", False)
    assert (heads["modernbert_rerank"].activation, heads["modernbert_rerank"].pooling) == (
        "sigmoid", "mean")
    # transformers' default pooling for ModernBERT is CLS.
    path = _with_config(fixture_path, tmp_path, "modernbert_rerank", classifier_pooling=None)
    assert load_embedder(path, "rerank", _mlx_lm_has)[0].cross_encoder.pooling == "cls"
    path = _with_config(fixture_path, tmp_path, "bert_rerank",
                        sbert_ce_default_activation_function=None)
    assert load_embedder(path, "rerank", _mlx_lm_has)[0].cross_encoder.activation == "sigmoid"
    # The same model under each activation: sigmoid and tanh of its logits.
    hidden = mx.random.normal((3, 7, 64), key=mx.random.key(0))
    lengths = mx.array([7, 3, 5])
    scores = {}
    for activation in ("Identity", "Sigmoid", "Tanh"):
        name = {"Identity": "linear.Identity"}.get(activation, f"activation.{activation}")
        path = _with_config(fixture_path, tmp_path, "bert_rerank",
                            sbert_ce_default_activation_function=f"torch.nn.modules.{name}")
        embedder = load_embedder(path, "rerank", _mlx_lm_has)[0]
        scores[activation] = np.array(embedder.scores(hidden, lengths))
    np.testing.assert_allclose(scores["Sigmoid"], 1 / (1 + np.exp(-scores["Identity"])), atol=1e-6)
    np.testing.assert_allclose(scores["Tanh"], np.tanh(scores["Identity"]), atol=1e-6)


@pytest.mark.parametrize("kind, changes, says", [
    ("bert_rerank", {"id2label": {"0": "a", "1": "b"}}, "2 labels"),
    ("bert_rerank", {"sbert_ce_default_activation_function": "torch.nn.Softmax"}, "activation"),
    ("xlmr_rerank", {"problem_type": "multi_label_classification"}, "problem_type"),
    ("modernbert_rerank", {"classifier_pooling": "max"}, "classifier_pooling"),
    ("modernbert_rerank", {"classifier_activation": "silu"}, "classifier_activation"),
    ("modernbert_rerank", {"classifier_bias": True}, "classifier_bias"),
    ("modernbert_rerank", {"problem_type": "multi_label_classification"}, "problem_type"),
    ("bert_rerank", {"hidden_act": "relu"}, "hidden_act"),
    ("xlmr_rerank", {"hidden_act": "gelu_new"}, "hidden_act"),
    ("bert_rerank", {"auto_map": {"AutoModel": "x.Y"}}, "auto_map"),
])
def test_cross_encoders_it_would_run_wrongly_are_refused(fixture_path, tmp_path, kind,
                                                         changes, says):
    with pytest.raises(EmbedderError, match=says):
        load_embedder(_with_config(fixture_path, tmp_path, kind, **changes), "rerank",
                      _mlx_lm_has)


def test_a_cross_encoder_is_known_by_its_config(fixture_path, tmp_path):
    """Without a card (or with bge-reranker's text-classification one, as
    xlmr_rerank's), its architecture says what it serves."""
    folder = tmp_path / "no_card"
    shutil.copytree(fixture_path("bert_rerank"), folder)
    (folder / "README.md").unlink()
    assert folder_task(folder) == "rerank"
    assert "text-classification" in (fixture_path("xlmr_rerank") / "README.md").read_text()
    assert folder_task(fixture_path("xlmr_rerank")) == "rerank"


def test_cross_encoder_folders_as_transformers_reads_them(fixture_path, tmp_path):
    """A pooler's weights in an XLM-RoBERTa checkpoint are ignored (its
    head never reads them); activations by their short torch.nn path; BERT
    pairs without type ids where the tokenizer gives the model none."""
    hidden = mx.random.normal((2, 5, 64), key=mx.random.key(1))
    lengths = mx.array([5, 3])
    original = load_embedder(str(fixture_path("xlmr_rerank")), "rerank", _mlx_lm_has)[0]
    pooled = tmp_path / "pooled"
    shutil.copytree(fixture_path("xlmr_rerank"), pooled)
    weights = mx.load(str(pooled / "model.safetensors"))
    weights.update({"roberta.pooler.dense.weight": mx.ones((64, 64)),
                    "roberta.pooler.dense.bias": mx.ones((64,))})
    mx.save_safetensors(str(pooled / "model.safetensors"), weights)
    again = load_embedder(str(pooled), "rerank", _mlx_lm_has)[0]
    np.testing.assert_array_equal(np.array(again.scores(hidden, lengths)),
                                  np.array(original.scores(hidden, lengths)))
    short = _with_config(fixture_path, tmp_path, "bert_rerank",
                         sbert_ce_default_activation_function="torch.nn.Sigmoid")
    assert load_embedder(short, "rerank", _mlx_lm_has)[0].cross_encoder.activation == "sigmoid"
    untyped = tmp_path / "untyped"
    shutil.copytree(fixture_path("bert_rerank"), untyped)
    tokenizer_config = json.loads((untyped / "tokenizer_config.json").read_text())
    tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"]
    (untyped / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert not load_embedder(str(untyped), "rerank", _mlx_lm_has)[0].token_types
    assert load_embedder(str(fixture_path("bert_rerank")), "rerank", _mlx_lm_has)[0].token_types


def test_a_cross_encoder_reranks_and_an_embedder_embeds(fixture_path):
    with pytest.raises(EmbedderError, match="serves /v1/rerank, not embeddings"):
        load_embedder(str(fixture_path("bert_rerank")), "embed", _mlx_lm_has)
    with pytest.raises(EmbedderError, match="classification head"):
        load_embedder(str(fixture_path("bert_embed")), "rerank", _mlx_lm_has)


def test_rerankers_and_decoders_it_would_run_wrongly_are_refused(fixture_path, tmp_path):
    with pytest.raises(EmbedderError, match="model type qwen3"):
        load_embedder(str(fixture_path("llama")), "rerank", _mlx_lm_has)
    own_code = tmp_path / "own_code"
    shutil.copytree(fixture_path("qwen3_embed"), own_code)
    config = json.loads((own_code / "config.json").read_text())
    (own_code / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    with pytest.raises(EmbedderError, match="bidirectional"):
        load_embedder(str(own_code), "embed", _mlx_lm_has)


def test_encoder_families_load_with_their_context(fixture_path):
    """XLM-RoBERTa's context is its positions less pad_token_id + 1 (its
    tokenizer sets none); ModernBERT's its max_position_embeddings. Both
    give every position's hidden state, ModernBERT's from its trunk (its
    Model pools by its own config), and refuse to rerank."""
    xlmr, _ = load_embedder(str(fixture_path("xlmr_embed")), "embed", _mlx_lm_has)
    assert (xlmr.context_length, xlmr.width, xlmr.decoder) == (128, 64, False)
    modernbert, config = load_embedder(str(fixture_path("modernbert_embed")), "embed",
                                       _mlx_lm_has)
    assert (modernbert.context_length, modernbert.width) == (256, 64)
    assert modernbert.model_type == config["model_type"] == "modernbert"
    tokens = mx.array([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 10]])
    for embedder in (xlmr, modernbert):
        assert embedder.hidden(tokens, mx.array([4, 6])).shape == (2, 6, 64)
    for kind in ("xlmr_embed", "modernbert_embed"):
        with pytest.raises(EmbedderError, match="cross-encoder"):
            load_embedder(str(fixture_path(kind)), "rerank", _mlx_lm_has)


def _modernbert_copy(fixture_path, tmp_path, **changes):
    """The modernbert_embed folder with its config changed (None: a key removed)."""
    folder = tmp_path / "modernbert"
    shutil.copytree(fixture_path("modernbert_embed"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _vector(embedder, ids):
    hidden = embedder.hidden(mx.array([ids]), mx.array([len(ids)]))
    return np.array(embedder.pooling(hidden, mx.array([len(ids)]), mx.array([0])))[0]


def test_modernbert_configs_in_transformers_5s_keys(fixture_path, tmp_path):
    """transformers 5 writes ModernBERT's layers and RoPE as `layer_types`
    and `rope_parameters`, which mlx-embeddings doesn't read (it would take
    its defaults: global attention every 3 layers, thetas 160000 and
    10000): they are passed to it, the same model gives the same vectors.
    What its model can't run is refused at load."""
    ids = list(range(5, 45))  # (longer than the window: 16)
    original, _ = load_embedder(str(fixture_path("modernbert_embed")), "embed", _mlx_lm_has)
    want = _vector(original, ids)
    new_keys = _modernbert_copy(
        fixture_path, tmp_path, global_attn_every_n_layers=None, global_rope_theta=None,
        local_rope_theta=None,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    embedder, _ = load_embedder(str(new_keys), "embed", _mlx_lm_has)
    np.testing.assert_allclose(_vector(embedder, ids), want, atol=1e-6)
    assert [layer.attn.local_attention for layer in embedder.model.model.layers] == [
        (-1, -1), (8, 8), (-1, -1)]
    # (mlx-embeddings' defaults would be other vectors)
    shutil.rmtree(new_keys)
    defaults = _modernbert_copy(fixture_path, tmp_path, global_attn_every_n_layers=None)
    assert np.abs(_vector(load_embedder(str(defaults), "embed", _mlx_lm_has)[0], ids)
                  - want).max() > 1e-3
    # Thetas other than mlx-embeddings' defaults reach the model from either
    # spelling (the defaults above would hide a theta not passed on).
    shutil.rmtree(defaults)
    thetas = _modernbert_copy(fixture_path, tmp_path, global_rope_theta=2000.0,
                              local_rope_theta=300.0)
    other = _vector(load_embedder(str(thetas), "embed", _mlx_lm_has)[0], ids)
    assert np.abs(other - want).max() > 1e-4
    shutil.rmtree(thetas)
    new_thetas = _modernbert_copy(
        fixture_path, tmp_path, global_attn_every_n_layers=None, global_rope_theta=None,
        local_rope_theta=None,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 2000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}})
    np.testing.assert_allclose(
        _vector(load_embedder(str(new_thetas), "embed", _mlx_lm_has)[0], ids), other, atol=1e-6)
    for changes, says in [
        ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"][::-1]},
         "every N"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
         "linear"),
        # (transformers still reads the older key `type`)
        ({"rope_parameters": {"full_attention": {"type": "linear", "factor": 2.0}}},
         "linear"),
        # (one set for every layer: transformers 5 refuses it for ModernBERT)
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 2000.0}}, "per layer type")]:
        shutil.rmtree(tmp_path / "modernbert")
        with pytest.raises(EmbedderError, match=says):
            load_embedder(str(_modernbert_copy(fixture_path, tmp_path, **changes)), "embed",
                          _mlx_lm_has)

