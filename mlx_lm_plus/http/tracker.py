"""What the metrics record of one completion request (`_Tracker`), and the
message a cache miss departs in (`_with_message`)."""

import time

from mlx_lm_plus.http.metrics import RequestRecord


class _Tracker:
    """Stamps and counts of one completion request, for the metrics.

    Set at arrival, when the engine accepts it, at its first token and at the
    end: nothing per token but one comparison.
    """

    def __init__(self, endpoint: str):
        self.record = RequestRecord(
            id="", endpoint=endpoint, model="", status=0, started=time.time()
        )
        self.start = time.perf_counter()
        self.accepted_at = self.first = None
        self.ctx = self.assembler = None
        self.cancelled = False
        self.error = None
        self.exchange = None  # the protocol's Exchange
        self.body_bytes = 0  # the request body's size (which lanes it takes)
        self.arriving = False  # counted in Server.arriving
        self.messages = None  # the request's chat messages (None: a text prompt)
        self.miss_text = False  # --cache-miss-text

    def accepted(self, ctx, assembler):
        self.accepted_at = time.perf_counter()
        self.ctx, self.assembler = ctx, assembler

    def finish(self, response) -> RequestRecord:
        end = time.perf_counter()
        r = self.record
        r.ended = time.time()
        r.total_seconds = end - self.start
        if self.ctx is not None:
            r.prompt_tokens = len(self.ctx.prompt)
            r.cached_tokens = self.ctx.prompt_cache_count or 0
            r.images = getattr(self.ctx, "images", 0)
            r.speculation = getattr(self.ctx, "speculation", None)
            r.cache_miss = _with_message(getattr(self.ctx, "cache_miss", None), self.messages,
                                         self.miss_text)
        if self.assembler is not None:
            r.generated_tokens = len(self.assembler.tokens)
        if self.first is not None:
            r.ttft = self.first - self.start
            r.prefill_seconds = self.first - self.accepted_at
            r.decode_seconds = end - self.first
        if self.cancelled:
            r.status, r.finish_reason = 499, "cancelled"  # nginx's "client closed request"
        else:
            r.status = response.status if response is not None else 500
            if self.error is not None:
                r.finish_reason, r.error = "error", self.error
            elif r.status == 200 and self.assembler is not None:
                r.finish_reason = self.assembler.finish_reason
            elif r.status != 200:
                r.finish_reason = "error"
        return r


# Characters of a conversation searched for a cache miss's message, at
# most (the search runs on the event loop, at a request's end).
MISS_SEARCH_CHARS = 1 << 20
# What a departure in a message of each role most often is.
MISS_HINTS = {
    "system": "the system prompt changed since it was cached (a date, a session id?)",
    "assistant": "a reply came back other than as the model wrote it (re-rendered, "
                 "its reasoning dropped, or edited)",
    "user": "an earlier user message changed",
    "tool": "an earlier tool result changed",
}


# A cache miss's text (Engine._explain_miss): kept with --cache-miss-text only.
MISS_TEXT = ("before", "prompt", "stored")


def _with_message(miss, messages, keep_text: bool = False):
    """A cache miss (Engine._explain_miss) with the message whose text holds
    the prompt's side of the departure: its index in the conversation as
    chat messages (a system message first) and role, searched from the last
    message back, within MISS_SEARCH_CHARS (None where the departure lies in
    the template's own text, such as role markers or tool definitions, or
    farther than the search goes). Its text (MISS_TEXT: the request's and a
    stored prompt's, maybe another client's) only if `keep_text`."""
    if not miss:
        return miss
    miss = dict(miss)
    if miss.get("prompt") and messages:
        miss["message"] = None
        # The excerpt's start, shorter and shorter: it may run on into the
        # template's text (the end of a message, the next role's marker).
        text = miss["prompt"].strip()
        for n in (24, 12, 6):
            if len(text) >= min(n, 4) and _find_message(miss, messages, text[:n]):
                break
    if not keep_text:
        for key in MISS_TEXT:
            miss.pop(key, None)
    return miss


def _find_message(miss, messages, needle) -> bool:
    budget = MISS_SEARCH_CHARS
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i] if isinstance(messages[i], dict) else {}
        content = message.get("content")
        texts = [content] if isinstance(content, str) else [
            p.get("text") for p in content or () if isinstance(p, dict)
            and isinstance(p.get("text"), str)] if isinstance(content, list) else []
        texts += [message.get("reasoning_content") or "", message.get("reasoning") or ""]
        for text in texts:
            if not isinstance(text, str):
                continue
            budget -= len(text)
            if budget < 0:
                return False
            if needle in text:
                miss["message"] = {"index": i, "role": message.get("role")}
                hint = MISS_HINTS.get(message.get("role"))
                if hint:
                    miss["hint"] = hint
                return True
    return False
