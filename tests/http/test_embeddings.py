"""/v1/embeddings and /v1/rerank end to end: a server with a chat model and
tiny random embedders (a decoder, and BERT, XLM-RoBERTa and ModernBERT
encoders) and rerankers (a decoder, and a cross-encoder of each encoder
family) (testkit/embedding_fixtures.py) beside it, against
references computed here from the same weights without the server: each
input alone, unpadded, through a direct model call, pooled and scored by
numpy code written here from the model cards' definitions."""

import base64
import json
import math
import threading
import urllib.error
import urllib.request

import mlx.core as mx
import numpy as np
import pytest

from compat.launch import OURS, ServerProcess
from mlx_lm_plus import patches

CHAT_KIND = "qwen3"
EMBEDDERS = {"qembed": "qwen3_embed", "bembed": "bert_embed", "bcls": "bert_cls",
             "xembed": "xlmr_embed", "mbembed": "modernbert_embed"}
# What each fixture's folder says (1_Pooling/config.json, modules.json):
# the pooling and whether a Normalize module follows.
POOLING = {"qembed": ("last", True), "bembed": ("mean", True), "bcls": ("cls", False),
           "xembed": ("mean", True), "mbembed": ("mean", True)}
# Cross-encoder rerankers, and what their folders say: the score's activation.
CROSS_ENCODERS = {"brerank": "bert_rerank", "xrerank": "xlmr_rerank", "mbrerank": "modernbert_rerank"}
ACTIVATION = {"brerank": "identity", "xrerank": "sigmoid", "mbrerank": "sigmoid"}
# The modernbert_embed fixture's sliding window (local_attention): 8 either side.
MODERNBERT_WINDOW = 16
TEXTS = [
    "hello",
    "the cat sat on the mat and looked at the window for a while",
    "a",
    "Water boils at one hundred degrees, said the teacher to the class of forty",
    "green light",
    " ".join(["river"] * 40),
]
QUERY_PROMPT = ("Instruct: Given a web search query, retrieve relevant passages that answer "
                "the query\nQuery:")
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                 "on the Query and the Instruct provided. Note that the answer can only be "
                 "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def post(server, path, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def at_once(send, n):
    """send(0) .. send(n - 1), each on a thread of its own, all started before any ends."""
    threads = [threading.Thread(target=send, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def stats(server):
    with urllib.request.urlopen(server.url + "/v1/stats", timeout=30) as r:
        return json.loads(r.read())["engine"]["embeddings"]


@pytest.fixture(scope="module")
def paths(fixture_path):
    out = {name: str(fixture_path(kind)) for name, kind in EMBEDDERS.items()}
    out["rerank"] = str(fixture_path("qwen3_rerank"))
    out.update({name: str(fixture_path(kind)) for name, kind in CROSS_ENCODERS.items()})
    out["chat"] = str(fixture_path(CHAT_KIND))
    return out


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    root = tmp_path_factory.mktemp("embeddings")
    config = root / "models.json"
    config.write_text(json.dumps({"models": [{"name": n, "path": p} for n, p in paths.items()]}))
    with ServerProcess(OURS, ["--models-config", str(config)], log=root / "server.log") as s:
        yield s


class Reference:
    """Each input alone through the model, as the model card defines the
    output (no server code but patches/, as the engine applies them:
    mlx-embeddings' ModernBERT runs the exact GELU then, which
    tests/test_embedding_fixtures.py checks against transformers'
    definition in numpy)."""

    def __init__(self, paths):
        self.paths = paths
        self.models = {}
        patches.apply_all()

    def _load(self, name):
        if name not in self.models:
            from transformers import AutoTokenizer

            if name in ("qembed", "rerank"):
                from mlx_lm import load
            else:
                from mlx_embeddings.utils import load
            model, _ = load(self.paths[name])
            self.models[name] = (model, AutoTokenizer.from_pretrained(self.paths[name]))
        return self.models[name]

    def ids(self, name, text):
        return self._load(name)[1](text)["input_ids"]

    def embed(self, name, text=None, ids=None, dimensions=None):
        model, tokenizer = self._load(name)
        ids = ids if ids is not None else tokenizer(text)["input_ids"]
        tokens = mx.array([ids])
        if name == "qembed":
            hidden = model.model(tokens)  # the trunk's last hidden states
        elif name == "mbembed":  # (its Model's output is pooled: the trunk's)
            hidden = model.model(tokens, attention_mask=mx.ones(tokens.shape))[
                "last_hidden_state"]
        else:
            hidden = model(tokens).last_hidden_state  # no mask: nothing padded
        hidden = np.array(hidden.astype(mx.float32))[0].astype(np.float64)
        pooling, normalize = POOLING[name]
        vector = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[pooling]
        if dimensions is not None:
            vector = vector[:dimensions]
        if normalize:
            vector = vector / np.linalg.norm(vector)
        return vector

    def _cross(self, name):
        """A cross-encoder's trunk (mlx-embeddings' model of its family,
        given the checkpoint's weights by name here), its tokenizer, its
        weights and config."""
        if name not in self.models:
            from mlx_embeddings.models import bert, modernbert, xlm_roberta
            from transformers import AutoTokenizer

            folder = self.paths[name]
            config = json.load(open(f"{folder}/config.json"))
            weights = mx.load(f"{folder}/model.safetensors")
            if name == "brerank":
                trunk, prefix = bert.Model(bert.ModelArgs.from_dict(config)), "bert."
            elif name == "xrerank":
                trunk = xlm_roberta.Model(xlm_roberta.ModelArgs.from_dict(
                    {**config, "add_pooling_layer": False}))
                prefix = "roberta."
            else:
                trunk = modernbert.ModernBertModel(modernbert.ModelArgs.from_dict(config))
                prefix = "model."
            trunk.load_weights([(k[len(prefix):], v) for k, v in weights.items()
                                if k.startswith(prefix) and "position_ids" not in k])
            trunk.eval()  # (no dropout)
            self.models[name] = (trunk, AutoTokenizer.from_pretrained(folder), weights)
        return self.models[name]

    def cross_score(self, name, query, document, token_types=True, pooling="mean"):
        """The pair alone through the trunk, then transformers' head of its
        family (BertForSequenceClassification's pooler and classifier,
        XLMRobertaClassificationHead, ModernBERT's prediction head after
        pooling) in numpy float64, and the folder's activation."""
        trunk, tokenizer, weights = self._cross(name)
        pair = tokenizer(query, document)
        ids = mx.array([pair["input_ids"]])
        if name == "brerank":
            types = mx.array([pair["token_type_ids"]]) if token_types else None
            hidden = trunk(ids, token_type_ids=types).last_hidden_state
        elif name == "xrerank":
            hidden = trunk(ids).last_hidden_state
        else:
            hidden = trunk(ids, attention_mask=mx.ones(ids.shape))["last_hidden_state"]
        h = np.array(hidden.astype(mx.float32))[0].astype(np.float64)
        w = {k: np.array(v).astype(np.float64) for k, v in weights.items() if "position" not in k}

        def linear(name, x):
            return w[f"{name}.weight"] @ x + w.get(f"{name}.bias", 0.0)

        if name == "brerank":
            logit = linear("classifier", np.tanh(linear("bert.pooler.dense", h[0])))
        elif name == "xrerank":
            logit = linear("classifier.out_proj", np.tanh(linear("classifier.dense", h[0])))
        else:
            x = linear("head.dense", h.mean(axis=0) if pooling == "mean" else h[0])
            x = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))  # exact GELU
            x = (x - x.mean()) / np.sqrt(x.var() + 1e-5) * w["head.norm.weight"]
            logit = linear("classifier", x)
        logit = float(logit[0])
        return logit if ACTIVATION[name] == "identity" else 1 / (1 + math.exp(-logit))

    def score(self, query, document, instruction=INSTRUCTION):
        model, tokenizer = self._load("rerank")
        text = (f"{RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n"
                f"<Document>: {document}{RERANK_SUFFIX}")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        logits = np.array(model(mx.array([ids])).astype(mx.float32))[0, -1].astype(np.float64)
        yes, no = (tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no"))
        pair = np.exp(logits[[no, yes]] - logits[[no, yes]].max())
        return pair[1] / pair.sum()


@pytest.fixture(scope="module")
def reference(paths):
    return Reference(paths)


def vectors(answer):
    return [np.array(d["embedding"]) for d in sorted(answer["data"], key=lambda d: d["index"])]


@pytest.mark.parametrize("name", sorted(EMBEDDERS))
def test_vectors_equal_each_input_alone_through_the_model(server, reference, name):
    """Six inputs of 1 to 40 words in one request (one padded batch), then
    each in a request of its own: every vector is the reference's to 1e-5,
    so neither padding nor batch neighbours change an input's vector."""
    before = stats(server)
    status, together = post(server, "/v1/embeddings", {"model": name, "input": TEXTS})
    assert status == 200, together
    after = stats(server)
    assert after["inputs"] - before["inputs"] == len(TEXTS)
    assert after["batches"] - before["batches"] < len(TEXTS)  # (batched, not one by one)
    expected = [reference.embed(name, t) for t in TEXTS]
    assert together["model"] == name and together["object"] == "list"
    assert together["usage"]["prompt_tokens"] == sum(len(reference.ids(name, t)) for t in TEXTS)
    for got, want in zip(vectors(together), expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)
    for text, want in zip(TEXTS[:3], expected):
        status, alone = post(server, "/v1/embeddings", {"model": name, "input": text})
        assert status == 200
        np.testing.assert_allclose(vectors(alone)[0], want, atol=1e-5)
    # The vectors differ from one another (a flat model would pass the above).
    assert min(np.abs(a - b).max() for i, a in enumerate(expected)
               for b in expected[i + 1:]) > 1e-3
    if name == "mbembed":  # (inputs within the sliding window, and past it)
        lengths = [len(reference.ids(name, t)) for t in TEXTS]
        assert min(lengths) <= MODERNBERT_WINDOW // 2 < 2 * MODERNBERT_WINDOW < max(lengths)


@pytest.mark.parametrize("name, context", [("xembed", 128), ("mbembed", 256)])
def test_inputs_as_long_as_the_context(server, reference, name, context):
    """An input of the model's whole context (XLM-RoBERTa's: its 130
    positions less pad_token_id + 1; ModernBERT's: many sliding windows)
    in one pass with short ones is the reference's vector; one token more
    is a 400."""
    longest = " ".join(["river"] * (context - 2))  # (a token a word, and two special tokens)
    assert len(reference.ids(name, longest)) == context
    inputs = ["a", longest, TEXTS[1]]
    status, answer = post(server, "/v1/embeddings", {"model": name, "input": inputs})
    assert status == 200, answer
    for got, text in zip(vectors(answer), inputs):
        np.testing.assert_allclose(got, reference.embed(name, text), atol=1e-5)
    status, answer = post(server, "/v1/embeddings",
                          {"model": name, "input": ["a", longest + " river"]})
    assert status == 400 and f"index 1 has {context + 1} tokens" in json.dumps(answer), answer
    assert f"context of {context} tokens" in json.dumps(answer)


def test_concurrent_requests_share_forward_passes(server, reference):
    """Eight requests sent together are answered right, in fewer forward
    passes than requests: their inputs share batches."""
    before = stats(server)
    answers = [None] * 8
    barrier = threading.Barrier(8)

    def send(i):
        barrier.wait()
        answers[i] = post(server, "/v1/embeddings",
                          {"model": "bembed", "input": TEXTS[i % 6:i % 6 + 2]})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (status, answer) in enumerate(answers):
        assert status == 200, answer
        for got, text in zip(vectors(answer), TEXTS[i % 6:i % 6 + 2]):
            np.testing.assert_allclose(got, reference.embed("bembed", text), atol=1e-5)
    after = stats(server)
    assert after["batches"] - before["batches"] < 8


def test_dimensions_base64_token_ids_and_prompts(server, reference):
    # Matryoshka: the first 16 dimensions, normalized again where the model normalizes.
    for name in ("qembed", "bcls"):
        status, answer = post(server, "/v1/embeddings",
                              {"model": name, "input": TEXTS[1], "dimensions": 16})
        assert status == 200
        np.testing.assert_allclose(vectors(answer)[0],
                                   reference.embed(name, TEXTS[1], dimensions=16), atol=1e-5)
    # base64: little-endian float32, what OpenAI's SDKs decode.
    status, answer = post(server, "/v1/embeddings",
                          {"model": "qembed", "input": TEXTS[:2], "encoding_format": "base64"})
    assert status == 200
    for item, text in zip(answer["data"], TEXTS[:2]):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, reference.embed("qembed", text), atol=1e-5)
    # Token ids, one list and a list of lists: as the same text's tokens.
    ids = [reference.ids("bembed", t) for t in TEXTS[:2]]
    status, one = post(server, "/v1/embeddings", {"model": "bembed", "input": ids[0]})
    status2, many = post(server, "/v1/embeddings", {"model": "bembed", "input": ids})
    assert status == status2 == 200
    np.testing.assert_allclose(vectors(one)[0], reference.embed("bembed", TEXTS[0]), atol=1e-5)
    for got, text in zip(vectors(many), TEXTS[:2]):
        np.testing.assert_allclose(got, reference.embed("bembed", text), atol=1e-5)
    # The model's query prompt (config_sentence_transformers.json), by name.
    status, answer = post(server, "/v1/embeddings",
                          {"model": "qembed", "input": "cats", "prompt_name": "query"})
    assert status == 200
    np.testing.assert_allclose(vectors(answer)[0],
                               reference.embed("qembed", QUERY_PROMPT + "cats"), atol=1e-5)


def test_rerank_scores_sorted_with_documents(server, reference):
    docs = ["a cat is a small animal", "the sky is blue", "dogs bark at night",
            "cats chase mice in the house"]
    query = "what do cats eat"
    expected = [reference.score(query, d) for d in docs]
    order = sorted(range(len(docs)), key=lambda i: -expected[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        status, answer = post(server, path, {"model": "rerank", "query": query,
                                             "documents": docs})
        assert status == 200, answer
        assert [r["index"] for r in answer["results"]] == order
        for r in answer["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
            assert r["document"] == {"text": docs[r["index"]]}
    # Jina's document objects, top_n, no documents back; an instruction.
    status, answer = post(server, "/v1/rerank", {
        "model": "rerank", "query": query, "documents": [{"text": d} for d in docs],
        "top_n": 2, "return_documents": False, "instruction": "Find animals"})
    assert status == 200
    assert len(answer["results"]) == 2 and "document" not in answer["results"][0]
    mine = [reference.score(query, d, "Find animals") for d in docs]
    best = max(range(len(docs)), key=lambda i: mine[i])
    assert answer["results"][0]["index"] == best
    assert answer["results"][0]["relevance_score"] == pytest.approx(mine[best], abs=1e-5)
    assert len({round(s, 6) for s in expected}) == len(docs)  # (the scores tell them apart)


@pytest.mark.parametrize("name", sorted(CROSS_ENCODERS))
def test_cross_encoder_scores_equal_each_pair_alone_through_the_model(server, reference, name):
    # Documents of 1 to ~40 words in one request: one padded pass.
    docs = ["cats eat mice and fish", "the sky is blue", "a",
            "dogs bark at night when the moon is high over the river and the town",
            " ".join(["river"] * 40)]
    query = "what do cats eat"
    expected = [reference.cross_score(name, query, d) for d in docs]
    status, answer = post(server, "/v1/rerank", {"model": name, "query": query,
                                                 "documents": docs})
    assert status == 200, answer
    assert [r["index"] for r in answer["results"]] == sorted(
        range(len(docs)), key=lambda i: -expected[i])
    for r in answer["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
        assert r["document"] == {"text": docs[r["index"]]}
    # Each document alone, and concurrent requests of other lengths, give
    # the same scores (nothing depends on what a pair is padded with).
    answers = [None] * len(docs)

    def alone(i):
        answers[i] = post(server, "/v1/rerank", {"model": name, "query": query,
                                                 "documents": [docs[i]]})

    at_once(alone, len(docs))
    for i, (status, answer) in enumerate(answers):
        assert status == 200, answer
        assert answer["results"][0]["relevance_score"] == pytest.approx(expected[i], abs=1e-5)
    # What the reference would catch: the scores tell the documents apart,
    # BERT's token types and ModernBERT's pooling move them, and ms-marco's
    # raw logits leave [0, 1].
    assert len({round(s, 4) for s in expected}) == len(docs)
    if name == "brerank":
        assert abs(reference.cross_score(name, query, docs[0], token_types=False)
                   - expected[0]) > 1e-3
        assert any(not 0 <= s <= 1 for s in expected)
    if name == "mbrerank":
        assert abs(reference.cross_score(name, query, docs[3], pooling="cls")
                   - expected[3]) > 1e-3


BAD = [
    ("/v1/embeddings", {"model": "bembed"}, "input"),
    ("/v1/embeddings", {"model": "bembed", "input": ""}, "empty"),
    ("/v1/embeddings", {"model": "bembed", "input": ["ok", ""]}, "input[1]"),
    ("/v1/embeddings", {"model": "bembed", "input": [["x"]]}, "token ids"),
    ("/v1/embeddings", {"model": "bembed", "input": [1.5]}, "input[0]"),
    ("/v1/embeddings", {"model": "bembed", "input": []}, "input"),
    ("/v1/embeddings", {"model": "bembed", "input": ["x"] * 2049}, "at most 2048"),
    ("/v1/embeddings", {"model": "bembed", "input": [[10**9]]}, "vocabulary"),
    ("/v1/embeddings", {"model": "bembed", "input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"model": "bembed", "input": "x", "dimensions": 10**6}, "dimensions"),
    ("/v1/embeddings", {"model": "bembed", "input": "x", "encoding_format": "int8"},
     "encoding_format"),
    ("/v1/embeddings", {"model": "bembed", "input": ["ok", "word " * 300]},
     "index 1 has"),
    ("/v1/embeddings", {"model": "qembed", "input": "x", "prompt_name": "nope"}, "prompt_name"),
    ("/v1/embeddings", {"model": ["bembed"], "input": "x"}, "model"),
    ("/v1/embeddings", {"model": "chat", "input": "x"}, "generation model"),
    ("/v1/embeddings", {"model": "rerank", "input": "x"}, "reranking model"),
    ("/v1/rerank", {"model": "bembed", "query": "q", "documents": ["d"]}, "embedding model"),
    ("/v1/rerank", {"model": "rerank", "query": "", "documents": ["d"]}, "query"),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": [3]}, "documents[0]"),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"model": "brerank", "query": "q", "documents": ["d"], "instruction": "x"},
     "takes no instruction"),
    ("/v1/rerank", {"model": "xrerank", "query": "q", "documents": ["d", "word " * 200]},
     "index 1 has"),
    ("/v1/embeddings", {"model": "mbrerank", "input": "x"}, "reranking model"),
    ("/v1/chat/completions", {"model": "qembed", "messages": [{"role": "user",
                                                                "content": "hi"}]},
     "embedding model"),
]


@pytest.mark.parametrize("path,body,says", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_are_400s_that_say_why(server, path, body, says):
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert says in json.dumps(answer), answer


def test_bad_bodies_leave_the_server_serving(server, reference):
    for raw in (b"[1, 2]", b"not json", b'{"input": "x", "model": "bembed"' + b"]" * 3):
        status, _ = post(server, "/v1/embeddings", None, raw=raw)
        assert status == 400
    status, answer = post(server, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404
    # Both kinds of model still answer, the chat model too.
    status, answer = post(server, "/v1/embeddings", {"model": "bembed", "input": TEXTS[0]})
    assert status == 200
    np.testing.assert_allclose(vectors(answer)[0], reference.embed("bembed", TEXTS[0]),
                               atol=1e-5)
    status, answer = post(server, "/v1/chat/completions", {
        "model": "chat", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


def test_models_list_says_what_each_model_serves(server):
    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
        listed = {m["id"]: m["task"] for m in json.loads(r.read())["data"]}
    assert listed == {"qembed": "embed", "bembed": "embed", "bcls": "embed", "xembed": "embed",
                      "mbembed": "embed", "rerank": "rerank", "brerank": "rerank",
                      "xrerank": "rerank", "mbrerank": "rerank", "chat": "generate"}


def test_requests_for_models_that_evict_one_another_are_all_answered(paths, reference,
                                                                    tmp_path):
    """With room for one model, concurrent requests for three embedders
    load and unload them in turn: a request handed back to be planned once
    its model is loaded is planned with that model, and answered right."""
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"name": n, "path": paths[n]}
                                             for n in ("qembed", "bembed", "bcls")]}))
    with ServerProcess(OURS, ["--models-config", str(config), "--max-loaded-models", "1"],
                       log=tmp_path / "server.log") as s:
        names = ["qembed", "bembed", "bcls"] * 6
        answers = [None] * len(names)

        def send(k):
            answers[k] = post(s, "/v1/embeddings", {"model": names[k], "input": TEXTS[k % 6]})

        at_once(send, len(names))
    for k, (status, answer) in enumerate(answers):
        assert status == 200, answer
        np.testing.assert_allclose(vectors(answer)[0], reference.embed(names[k], TEXTS[k % 6]),
                                   atol=1e-5)


def test_openai_sdk_and_langchain(server, reference):
    from langchain_openai import OpenAIEmbeddings
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    got = client.embeddings.create(model="qembed", input=TEXTS[:3])  # (base64 by default)
    for item, text in zip(got.data, TEXTS[:3]):
        np.testing.assert_allclose(item.embedding, reference.embed("qembed", text), atol=1e-5)
    got = client.embeddings.create(model="bembed", input=TEXTS[1], encoding_format="float",
                                   dimensions=8)
    np.testing.assert_allclose(got.data[0].embedding,
                               reference.embed("bembed", TEXTS[1], dimensions=8), atol=1e-5)
    assert got.usage.prompt_tokens == len(reference.ids("bembed", TEXTS[1]))
    # LangChain's OpenAIEmbeddings (its tiktoken length check is for OpenAI's
    # own models, and would download an encoding).
    lc = OpenAIEmbeddings(model="bembed", base_url=server.url + "/v1", api_key="none",
                          check_embedding_ctx_length=False)
    docs = lc.embed_documents(TEXTS[:4])
    for got, text in zip(docs, TEXTS[:4]):
        np.testing.assert_allclose(got, reference.embed("bembed", text), atol=1e-5)
    np.testing.assert_allclose(lc.embed_query(TEXTS[4]), reference.embed("bembed", TEXTS[4]),
                               atol=1e-5)
