"""/v1/embeddings (OpenAI's shape) and /v1/rerank (the shape llama-server
and vLLM take from Jina's and Cohere's clients): bodies checked into
planning/embedding.py's requests, and the engine's numbers into answers.

No I/O here. Errors are RequestError (400) with OpenAI's kind of message,
naming the field and, for a list, the index.
"""

import base64
import json
import uuid
from typing import Any, Dict, Optional

import numpy as np

from mlx_lm_plus.planning.embedding import MAX_INPUTS, EmbeddingsRequest, RerankRequest
from mlx_lm_plus.protocols.validation import RequestError

EMBEDDINGS_PATHS = ("/v1/embeddings",)
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
ENCODING_FORMATS = ("float", "base64")


def _model(body: dict) -> str:
    model = body.get("model", "default_model")
    if model is None:
        return "default_model"
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, not {type(model).__name__}")
    return model


def _int(body: dict, key: str, low: int) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{key} must be an integer of at least {low}")
    return value


def _valid_text(text: str, where: str) -> str:
    """`text`, unless it holds a lone surrogate (JSON's \\ud800 escapes):
    no tokenizer takes one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{where} must be valid Unicode text: {e.reason} at "
                           f"character {e.start}") from e
    return text


def _ids(value, where: str) -> tuple:
    if not value:
        raise RequestError(f"{where} is an empty list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise RequestError(f"{where} must hold token ids (integers of at least 0)")
    return tuple(value)


def parse_embeddings(body: Any) -> EmbeddingsRequest:
    """An /v1/embeddings body: `input` a string, a list of strings, a list
    of token ids or a list of lists of them; `encoding_format`, `dimensions`,
    `user` (accepted, unused) and `prompt_name` (one of the model's
    sentence-transformers prompts, such as Qwen3-Embedding's "query")."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object")
    if "input" not in body:
        raise RequestError("Missing required field: input")
    given = body["input"]
    if isinstance(given, str):
        given = [given]
    if not isinstance(given, list) or not given:
        raise RequestError("input must be a non-empty string, a non-empty list of strings, "
                           "a list of token ids or a list of lists of token ids")
    if len(given) > MAX_INPUTS and not all(isinstance(t, int) for t in given):
        raise RequestError(f"input has {len(given)} items: at most {MAX_INPUTS} a request")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in given):
        inputs = (_ids(given, "input"),)
    else:
        items = []
        for i, item in enumerate(given):
            if isinstance(item, str):
                if not item:
                    raise RequestError(f"input[{i}] is an empty string")
                items.append(_valid_text(item, f"input[{i}]"))
            elif isinstance(item, list):
                items.append(_ids(item, f"input[{i}]"))
            else:
                raise RequestError(f"input[{i}] must be a string or a list of token ids, "
                                   f"not {type(item).__name__}")
        inputs = tuple(items)
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODING_FORMATS:
        raise RequestError(f"encoding_format must be one of {list(ENCODING_FORMATS)}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("user must be a string")
    prompt_name = body.get("prompt_name")
    if prompt_name is not None and not isinstance(prompt_name, str):
        raise RequestError("prompt_name must be a string")
    return EmbeddingsRequest(model=_model(body), inputs=inputs, encoding_format=encoding,
                             dimensions=_int(body, "dimensions", 1), prompt_name=prompt_name)


def parse_rerank(body: Any) -> RerankRequest:
    """A rerank body: `query`, `documents` (strings, or objects with a
    `text` string), `top_n`, `return_documents` (default true, as Jina's)
    and `instruction` (the reranker's task, Qwen3-Reranker's <Instruct>)."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object")
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise RequestError("query must be a non-empty string")
    _valid_text(query, "query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise RequestError("documents must be a non-empty list of strings or of objects "
                           "with a `text` string")
    if len(documents) > MAX_INPUTS:
        raise RequestError(f"documents has {len(documents)} items: at most {MAX_INPUTS} "
                           "a request")
    texts = []
    for i, doc in enumerate(documents):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise RequestError(f"documents[{i}] must be a string or an object with a "
                               "`text` string")
        texts.append(_valid_text(text, f"documents[{i}]"))
    return_documents = body.get("return_documents")
    return_documents = True if return_documents is None else return_documents
    if not isinstance(return_documents, bool):
        raise RequestError("return_documents must be a boolean")
    instruction = body.get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise RequestError("instruction must be a string")
    if instruction is not None:
        _valid_text(instruction, "instruction")
    return RerankRequest(model=_model(body), query=query, documents=tuple(texts),
                         top_n=_int(body, "top_n", 1), return_documents=return_documents,
                         instruction=instruction)


def embeddings_body(request: EmbeddingsRequest, model: str, vectors: np.ndarray,
                    normalized: bool, prompt_tokens: int) -> Dict[str, Any]:
    """OpenAI's answer: each vector truncated to `dimensions` (Matryoshka)
    and, where the model's vectors are L2-normalized, normalized again;
    as floats or as base64 of little-endian float32 (what OpenAI's SDKs
    decode)."""
    if request.dimensions is not None:
        vectors = vectors[:, :request.dimensions]
        if normalized:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    if request.encoding_format == "base64":
        values = [base64.b64encode(v.tobytes()).decode() for v in vectors]
    else:
        values = list(vectors)  # (rows: `encode` writes them one at a time)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v}
                 for i, v in enumerate(values)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def encode(body: Dict[str, Any]) -> bytes:
    """An answer as JSON, its vectors a row at a time: json.dumps of 2,048
    rows of 4,096 floats holds the GIL for seconds in one C call, and the
    event loop with it; a call a row lets it in between. (NaN from a broken
    model raises: JSON has no such number.)"""
    rest = json.dumps({k: v for k, v in body.items() if k != "data"}, allow_nan=False)
    items = [json.dumps({**d, "embedding": d["embedding"].tolist()} if isinstance(
        d["embedding"], np.ndarray) else d, allow_nan=False) for d in body["data"]]
    return ('{"data": [' + ", ".join(items) + "], " + rest[1:]).encode()


def rerank_body(request: RerankRequest, model: str, scores: np.ndarray,
                prompt_tokens: int) -> Dict[str, Any]:
    """The documents by relevance, best first (the first `top_n`), each with
    its index in the request and, with `return_documents`, its text."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    if request.top_n is not None:
        order = order[:request.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": float(scores[i])}
        if request.return_documents:
            result["document"] = {"text": request.documents[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "object": "list",
        "model": model,
        "results": results,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
