"""Embedding and rerank plans (planning/embedding.py): the work a request
costs is bounded by the limits, not by its body."""

import contextlib

import pytest

from mlx_lm_plus.errors import PromptError
from mlx_lm_plus.models.embedders import load_embedder
from mlx_lm_plus.models.folders import _mlx_lm_has
from mlx_lm_plus.planning.embedding import (
    MAX_REQUEST_TOKENS, EmbeddingsRequest, RerankRequest, plan_embeddings, plan_rerank,
)


class Counting:
    """A tokenizer that counts the texts it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, 0

    def __call__(self, texts, **kw):
        self.texts += len(texts) if isinstance(texts, list) else 1
        return self.tokenizer(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def embedders(fixture_path):
    return {kind: load_embedder(str(fixture_path(kind)), task, _mlx_lm_has)[0]
            for kind, task in (("qwen3_embed", "embed"), ("bert_embed", "embed"),
                               ("qwen3_rerank", "rerank"), ("bert_rerank", "rerank"),
                               ("xlmr_rerank", "rerank"))}


@contextlib.contextmanager
def counting(embedder):
    """The embedder's tokenizer counted while in the block, then put back."""
    tokenizer = embedder.tokenizer = Counting(embedder.tokenizer)
    try:
        yield tokenizer
    finally:
        embedder.tokenizer = tokenizer.tokenizer


def test_a_text_too_long_to_fit_is_refused_from_its_length(embedders):
    bert = embedders["bert_embed"]
    with counting(bert) as tokenizer:
        text = "cat " * (bert.longest_token * 200)
        with pytest.raises(PromptError, match="index 1 has .* characters"):
            plan_embeddings(bert, "k", EmbeddingsRequest("m", ("ok", text)))
        assert tokenizer.texts == 0  # (nothing tokenized)


def test_tokenizing_stops_at_the_slice_that_passes_the_total(embedders):
    qwen = embedders["qwen3_embed"]
    with counting(qwen) as tokenizer:
        text = "the cat sat on the mat " * 40  # (~200 tokens)
        per = len(tokenizer.tokenizer(text)["input_ids"])
        with pytest.raises(PromptError, match=f"more than {MAX_REQUEST_TOKENS} tokens"):
            plan_embeddings(qwen, "k", EmbeddingsRequest("m", (text,) * 2048))
        assert tokenizer.texts < MAX_REQUEST_TOKENS // per + 64 + 1 < 2048


def test_a_rerank_query_is_counted_once(embedders):
    rerank = embedders["qwen3_rerank"]
    with counting(rerank) as tokenizer:
        with pytest.raises(PromptError, match="the query in each"):
            plan_rerank(rerank, "k", RerankRequest("m", "word " * 2000, ("d",) * 2048))
        assert tokenizer.texts == 1  # (the query, once)


def test_token_ids_and_texts_keep_their_order_and_prompt_starts(embedders):
    bert = embedders["bert_embed"]
    ids = tuple(bert.tokenizer("a cat")["input_ids"])
    plan = plan_embeddings(bert, "k", EmbeddingsRequest("m", ("a dog", ids, "a cat")))
    assert plan.inputs[1] == ids == plan.inputs[2]
    assert plan.starts == (0, 0, 0) and plan.prompt_tokens == sum(map(len, plan.inputs))


def test_a_cross_encoder_s_inputs_are_its_tokenizer_s_pairs(embedders):
    docs = ("cats eat mice", "the sky is blue over the river", "a")
    for kind in ("bert_rerank", "xlmr_rerank"):
        model = embedders[kind]
        plan = plan_rerank(model, "k", RerankRequest("m", "what do cats eat", docs))
        want = [model.tokenizer("what do cats eat", d) for d in docs]
        assert plan.inputs == tuple(tuple(w["input_ids"]) for w in want)
        if kind == "bert_rerank":  # (the document's type ids start after the query's [SEP])
            assert plan.segments == tuple(w["token_type_ids"].index(1) for w in want)
            assert len(set(plan.segments)) == 1 and 0 < plan.segments[0] < len(plan.inputs[2])
        else:  # XLM-RoBERTa has one token type
            assert plan.segments == ()
        with pytest.raises(PromptError, match="takes no instruction"):
            plan_rerank(model, "k", RerankRequest("m", "q", ("d",), instruction="x"))
        with pytest.raises(PromptError, match="document at index 1 has"):
            plan_rerank(model, "k", RerankRequest("m", "q", ("d", "word " * 200)))
        with counting(model) as tokenizer:  # (a query past the context: no pair tokenized)
            with pytest.raises(PromptError, match="The query has about"):
                plan_rerank(model, "k", RerankRequest("m", "cat " * 200, ("d",) * 2048))
            assert tokenizer.texts == 1


def test_a_cross_encoder_s_query_is_bounded_and_tokenized_once(embedders):
    """A query of whitespace (BERT's tokenizer drops it: no tokens, but work
    for each pair it is in) is refused from its length; a query is
    tokenized once, and the pairs are those the tokenizer makes whole."""
    bert = embedders["bert_rerank"]
    spaces = "cats" + " " * ((bert.context_length + 1) * bert.longest_token)
    with pytest.raises(PromptError, match="The query has .* characters"):
        plan_rerank(bert, "k", RerankRequest("m", spaces, ("d",) * 2048))
    from mlx_lm_plus.planning import embedding

    docs = ["cats   eat mice", "a", "the sky is blue"]
    for kind in ("bert_rerank", "xlmr_rerank"):
        tokenizer = embedders[kind].tokenizer
        fast = embedding._pairs(tokenizer, "what  do cats eat", docs)
        whole = tokenizer(["what  do cats eat"] * 3, docs, return_token_type_ids=True)
        assert fast["input_ids"] == whole["input_ids"]
        assert fast["token_type_ids"] == whole["token_type_ids"]
