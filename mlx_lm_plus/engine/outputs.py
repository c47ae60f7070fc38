"""What a request's channel gets from either runner: a Response per token
(its logprobs as OpenAI reports them) and, after the last, the end."""

from typing import List

import mlx.core as mx
from mlx_lm.server import Response

from mlx_lm_plus.errors import InternalError
from mlx_lm_plus.upstream import format_top_logprobs as _upstream_top_logprobs

# OpenAI's logprob for "very unlikely": what a token a constraint masked out
# (-inf, which JSON can't carry) is reported as.
UNLIKELY = -9999.0


def logprob(value: float) -> float:
    return value if value > UNLIKELY else UNLIKELY


def top_logprobs(logprobs, top_n, tokenizer):
    """Upstream's top-k entries, sorted by probability (most likely first)."""
    if top_n <= 0:  # (every token of most requests)
        return ()
    top = _upstream_top_logprobs(logprobs, top_n, tokenizer)
    for entry in top:
        entry["logprob"] = logprob(entry["logprob"])
    return tuple(sorted(top, key=lambda t: -t["logprob"]))



def token_response(text: str, token: int, logprobs, finish_reason, args, tokenizer) -> Response:
    """The Response of one generated token (`logprobs`: the step's, over the
    vocabulary; `args`: the request's GenerationArguments)."""
    return Response(
        text,
        token,
        logprob(logprobs[token].item()) if args.logprobs else 0.0,
        finish_reason,
        top_logprobs(logprobs, args.top_logprobs, tokenizer),
    )


def final_events(constraint) -> list:
    """What follows a request's last token (once its cache is stored, so
    that a follow-up sent the moment it ends finds it): a structured-output
    failure as an InternalError, then None, the end."""
    if constraint is not None and constraint.error is not None:
        return [InternalError(f"Structured output failed: {constraint.error}"), None]
    return [None]


def with_prompt(processors, head: List[int], repeated_tail: bool):
    """One logits processor running `processors` in turn on the whole
    context, `head` + what the generation loop passes:
      * mlx-lm's generate_step passes the prompt it was given (the part
        the cache did not cover) and the tokens since: head is the cached
        part (`repeated_tail` False);
      * mlx-vlm's passes the prompt's tail it fed last, the same at every
        step, and the tokens since: head is the whole prompt, and that
        tail (the first call's tokens) is left out (`repeated_tail`).
    Penalties (repetition, presence, frequency) then count the same tokens
    cached or cold, as on the batched path (all_tokens)."""
    tail = first = None

    def process(tokens, logits):
        nonlocal tail, first
        if first is None:
            tail = tokens.size if repeated_tail else 0
            first = mx.array(head, tokens.dtype)
        context = mx.concatenate([first, tokens[tail:]])
        for processor in processors:
            logits = processor(context, logits)
        return logits
    return process
