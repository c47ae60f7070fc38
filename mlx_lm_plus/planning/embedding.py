"""/v1/embeddings and /v1/rerank requests, as the wire protocols hand them
over, and their plan: each input as token ids for the model that serves it.

Planned off the generation thread (a planning lane) once the model is
loaded; a request for a model not loaded yet is planned at admission, by the
same function. The generation thread only runs the model on the plan.
"""

from dataclasses import dataclass
from typing import Optional, Tuple, Union

from mlx_lm_plus.errors import PromptError
from mlx_lm_plus.models.embedders import RERANK_INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX

# A request's inputs and their tokens (OpenAI's limits for /v1/embeddings:
# 2,048 inputs, 300,000 tokens a request).
MAX_INPUTS = 2048
MAX_REQUEST_TOKENS = 300_000
# Texts tokenized in one call: the limits are checked after each, so a
# refused request costs its first slices, not all its text.
SLICE = 64


@dataclass(frozen=True)
class EmbeddingsRequest:
    """POST /v1/embeddings, checked (protocols/embeddings.py)."""

    model: str
    inputs: Tuple[Union[str, Tuple[int, ...]], ...]  # texts, or token ids as given
    encoding_format: str = "float"  # or "base64"
    dimensions: Optional[int] = None
    prompt_name: Optional[str] = None  # one of the model's prompts (sentence-transformers)


@dataclass(frozen=True)
class RerankRequest:
    """POST /v1/rerank (and /rerank, /v2/rerank), checked."""

    model: str
    query: str
    documents: Tuple[str, ...]
    top_n: Optional[int] = None
    return_documents: bool = False
    instruction: Optional[str] = None


EMBEDDING_REQUESTS = (EmbeddingsRequest, RerankRequest)


@dataclass(frozen=True)
class PlanFirst:
    """What the engine answers an embedding request that reached it
    unplanned (its model was not loaded when the HTTP side looked): the
    model, loaded now. The HTTP side plans the request with it in a lane and
    sends it again; the plan stays good if the model is unloaded and
    loaded again meanwhile (its key and tokenizer are the same)."""

    lm: object  # a provider.LoadedModel


@dataclass(frozen=True)
class EmbeddingArgs:
    """What the engine's scheduler reads of a request's arguments: the
    model it names (mlx-lm's ModelDescription)."""

    model: object


@dataclass(frozen=True)
class EmbeddingPlan:
    """What the generation thread runs for one request: its inputs' token
    ids, the position each input's pooling starts at (after a prompt left
    out of it; 0 otherwise), and for which model and task. `segments`: for
    a BERT cross-encoder's pairs, where each document starts (its token type
    ids are 1 from there; 0 before); empty otherwise."""

    model_key: object
    task: str  # "embed" or "rerank"
    inputs: Tuple[Tuple[int, ...], ...]
    starts: Tuple[int, ...]
    segments: Tuple[int, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(i) for i in self.inputs)


def plan_embedding_request(lm, request) -> EmbeddingPlan:
    """A request's plan for loaded model `lm` (a provider.LoadedModel).
    PromptError when the model doesn't serve the request's endpoint: a chat
    request for an embedder, an embedding request for a chat model."""
    embedder = lm.embedder
    name = getattr(request, "model", None)
    if not isinstance(name, str):  # (a chat Request names its model in its args)
        name = lm.key[0]
    if not isinstance(request, EMBEDDING_REQUESTS):
        raise PromptError(f"Model {name!r} is " + (
            "a reranking model: it serves /v1/rerank" if embedder.task == "rerank" else
            "an embedding model: it serves /v1/embeddings") + ", not chat or text completions")
    if embedder is None:
        raise PromptError(f"Model {name!r} does not serve embeddings or reranking: it is "
                          "a generation model (chat and text completions)")
    if isinstance(request, RerankRequest):
        return plan_rerank(embedder, lm.key, request)
    vocab = lm.vocab_size
    for i, given in enumerate(request.inputs):
        if vocab is not None and not isinstance(given, str) and max(given) >= vocab:
            raise PromptError(f"input[{i}] has token id {max(given)}, outside the model's "
                              f"vocabulary of {vocab}")
    return plan_embeddings(embedder, lm.key, request)


def plan_embeddings(embedder, key, request: EmbeddingsRequest) -> EmbeddingPlan:
    """Tokenize an /v1/embeddings request for `embedder` (PromptError: the
    client's 400, naming the input)."""
    if embedder.task != "embed":
        raise PromptError(f"Model {request.model!r} is a reranker: it serves /v1/rerank, "
                          "not /v1/embeddings")
    if request.dimensions is not None and request.dimensions > embedder.width:
        raise PromptError(f"dimensions={request.dimensions} is more than the model's "
                          f"{embedder.width}")
    name = request.prompt_name or embedder.default_prompt
    if name is not None and name not in embedder.prompts:
        raise PromptError(f"prompt_name {name!r} is not one of the model's prompts "
                          f"({sorted(embedder.prompts) or 'it has none'})")
    prompt = embedder.prompts.get(name, "") if name is not None else ""
    tokenizer = embedder.tokenizer
    # (sentence-transformers' include_prompt=False: the special tokens put
    # before a text and the prompt's own tokens are left out of pooling)
    skip = 0
    if prompt and not embedder.pooling.include_prompt:
        skip = _put_before(tokenizer) + len(tokenizer(prompt, add_special_tokens=False)[
            "input_ids"])
    texts = [prompt + x if isinstance(x, str) else x for x in request.inputs]
    inputs = _tokenized(embedder, texts, True, "input")
    starts = [min(skip, len(ids) - 1) if isinstance(x, str) else 0
              for ids, x in zip(inputs, request.inputs)]
    return EmbeddingPlan(key, "embed", tuple(inputs), tuple(starts))


def plan_rerank(embedder, key, request: RerankRequest) -> EmbeddingPlan:
    """A /v1/rerank request as one input per document: for a decoder
    reranker, a prompt in Qwen3-Reranker's template (RERANK_PREFIX, the
    instruction, query and document, RERANK_SUFFIX); for a cross-encoder,
    the pair (query, document) as its tokenizer joins them."""
    if embedder.task != "rerank":
        raise PromptError(f"Model {request.model!r} is not a reranker: /v1/rerank needs "
                          "a reranking model (GET /v1/models says which models rerank)")
    cross = embedder.cross_encoder is not None
    if cross and request.instruction is not None:
        raise PromptError(f"Model {request.model!r} is a cross-encoder, which takes no "
                          "instruction (a decoder reranker such as Qwen3-Reranker does)")
    instruction = request.instruction or RERANK_INSTRUCTION
    shared = (request.query if cross else
              f"{RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {request.query}\n")
    # Every input repeats the query: a long one times 2,048 documents is
    # gigabytes of tokens from a small body. Its tokens, counted once (less
    # a token or two that may merge across its end), bound the request's
    # before any input is tokenized; its characters too, whitespace
    # included (BERT's tokenizer drops it: a megabyte of spaces is no
    # tokens, but work for each pair it is in).
    if len(request.query) > (embedder.context_length + 1) * embedder.longest_token:
        raise PromptError(f"The query has {len(request.query)} characters: more than the "
                          f"model's context of {embedder.context_length} tokens")
    at_least = max(0, len(embedder.tokenizer(shared, add_special_tokens=False)["input_ids"]) - 2)
    if at_least > embedder.context_length:
        raise PromptError(f"The query {'has' if cross else 'and instruction have'} about "
                          f"{at_least} tokens, more than the model's context of "
                          f"{embedder.context_length} tokens")
    if at_least * len(request.documents) > MAX_REQUEST_TOKENS:
        raise PromptError(f"The request's {len(request.documents)} documents have at least "
                          f"{at_least * len(request.documents)} tokens in all (the query in "
                          f"each), more than {MAX_REQUEST_TOKENS} a request")
    if cross:
        segments = []
        inputs = _tokenized(embedder, list(request.documents), True, "document",
                            query=request.query, segments=segments)
        return EmbeddingPlan(key, "rerank", tuple(inputs), (0,) * len(inputs),
                             tuple(segments) if embedder.token_types else ())
    texts = [f"{shared}<Document>: {doc}{RERANK_SUFFIX}" for doc in request.documents]
    inputs = _tokenized(embedder, texts, False, "document")
    return EmbeddingPlan(key, "rerank", tuple(inputs), (0,) * len(inputs))


def _pairs(tokenizer, query: str, texts) -> dict:
    """(query, text) pairs as the tokenizer joins them: input_ids and
    token_type_ids. A fast tokenizer takes the query once (a pair's
    encoding is its two parts' joined by the post-processor's template,
    as `tokenizer(query, text)` does); another, every pair whole."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # (A tokenizer.json that pads or truncates: its own settings would
    # apply here, where `tokenizer(...)` sets its call's.)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return tokenizer([query] * len(texts), texts, return_token_type_ids=True)
    first = backend.encode(query, add_special_tokens=False)
    joined = [backend.post_process(first, second, add_special_tokens=True)
              for second in backend.encode_batch(texts, add_special_tokens=False)]
    return {"input_ids": [e.ids for e in joined], "token_type_ids": [e.type_ids for e in joined]}


def _second_part(types) -> int:
    """Where a pair's second part starts, from its token type ids."""
    return next((k for k, t in enumerate(types) if t), len(types))


def _put_before(tokenizer) -> int:
    """How many special tokens the tokenizer puts before a text ([CLS] for
    BERT, none for Qwen3-Embedding, which appends its EOS)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    return next((k for k in range(len(full)) if full[k:k + len(plain)] == plain), 0)


def _tokenized(embedder, texts, special_tokens: bool, what: str, query: Optional[str] = None,
               segments: Optional[list] = None) -> list:
    """Each of `texts` (a string, or token ids as given) as token ids,
    within the model's context and MAX_REQUEST_TOKENS in all (PromptError
    naming the first that isn't). The work is bounded by the limits, not by
    the body: a text too long to fit is refused from its length (no token
    covers more than `embedder.longest_token` characters), and tokenizing
    stops at the slice that passes the total. `query`: each text is the
    second of a pair (query, text), a cross-encoder's input; `segments`, if
    a list, gets where each pair's second part starts (its type ids)."""
    context = embedder.context_length
    out, total = [], 0
    for at in range(0, len(texts), SLICE):
        part = texts[at:at + SLICE]
        for i, text in enumerate(part, start=at):
            # (Whitespace left out: BERT's tokenizer drops it, sentencepiece
            # collapses its runs.)
            if isinstance(text, str) and len(text) > (context + 1) * embedder.longest_token \
                    and len("".join(text.split())) > (context + 1) * embedder.longest_token:
                raise PromptError(f"The {what} at index {i} has {len(text)} characters: more "
                                  f"than the model's context of {context} tokens")
        strings = [t for t in part if isinstance(t, str)]
        if query is None:
            encoded = embedder.tokenizer(strings, add_special_tokens=special_tokens) \
                if strings else {"input_ids": []}
        else:
            encoded = _pairs(embedder.tokenizer, query, strings)
        if segments is not None:
            segments += [_second_part(types) for types in encoded["token_type_ids"]]
        encoded = iter(encoded["input_ids"])
        for i, text in enumerate(part, start=at):
            ids = tuple(next(encoded)) if isinstance(text, str) else text
            if not ids:
                raise PromptError(f"The {what} at index {i} has no tokens")
            if len(ids) > context:
                raise PromptError(f"The {what} at index {i} has {len(ids)} tokens, more than "
                                  f"the model's context of {context} tokens")
            total += len(ids)
            out.append(ids)
        if total > MAX_REQUEST_TOKENS:
            raise PromptError(f"The request's {len(texts)} {what}s have more than "
                              f"{MAX_REQUEST_TOKENS} tokens in all (a request's most); "
                              f"the first {len(out)} have {total}")
    return out
