"""The workloads of `python -m benchmarks run`, each an async function of a
`Run` (one server, one model) returning its figures.

The conversations are those of benchmarks/cache_reuse.py (a ~600-token
system prompt, ~40-token user messages, replies sent back with a reasoning
block the template drops).
"""

import asyncio
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from benchmarks.cache_reuse import SYSTEM, _reply, _user
from benchmarks.harness import (
    Client,
    delta_text,
    get_json,
    median,
    percentile,
    reuse_ratio,
    stream_events,
    window_rate,
)


@dataclass
class Run:
    url: str
    tokenizer: Any
    http: Any  # aiohttp.ClientSession
    max_tokens: int
    smoke: bool  # fewer turns and requests: a quick check that everything runs
    bare: Optional[Callable[[int], float]] = None  # overhead: bare BatchGenerator tok/s

    def client(self, max_tokens=None) -> Client:
        return Client(self.url, self.tokenizer, max_tokens or self.max_tokens)


async def _conversation(run, client, c, turns, extra=None, system=SYSTEM, stream=False):
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": _user(c, t)})
        row = await client.chat(run.http, messages, extra, stream=stream)
        messages.append({"role": "assistant", "content": _reply(row.text)})
    return messages


async def multiturn(run: Run, extra=None) -> Dict[str, Any]:
    client = run.client()
    turns = 3 if run.smoke else 8
    start = time.perf_counter()
    await _conversation(run, client, 0, turns, extra)
    total = time.perf_counter() - start
    # A second conversation (same system prompt), streamed: time to first token.
    streamed = run.client()
    await _conversation(run, streamed, 1, turns, extra, stream=True)
    return {
        "ttft per turn, streamed (s)": [round(r.ttft, 4) for r in streamed.rows],
        "ttft turns 2.. mean (s)": _mean([r.ttft for r in streamed.rows[1:]]),
        "recomputed/novel": reuse_ratio(client.rows),
        "latency per turn (s)": [round(r.total, 4) for r in client.rows],
        "latency turns 2.. mean (s)": _mean([r.total for r in client.rows[1:]]),
        "total (s)": total,
    }


async def seeded(run: Run) -> Dict[str, Any]:
    return await multiturn(run, {"seed": 7})


async def divergent(run: Run) -> Dict[str, Any]:
    client = run.client()
    n = 3 if run.smoke else 6
    for i in range(n):
        await client.chat(run.http, [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": _user(i, 0, " (a different question)")}])
    later = client.rows[1:]
    return {
        "cached share of requests 2..": round(sum(r.cached for r in later)
                                              / sum(r.prompt for r in later), 4),
        "latency 2.. mean / latency 1": _mean([r.total for r in later]) / client.rows[0].total,
        "recomputed/novel": reuse_ratio(client.rows),
    }


async def branch(run: Run) -> Dict[str, Any]:
    client = run.client()
    turns = 5 if run.smoke else 8
    messages = (await _conversation(run, client, 0, turns))[:-1]
    built = len(client.rows)
    for v in range(2 if run.smoke else 4):  # edit / regenerate the last user message
        await client.chat(run.http, messages[:-1] + [
            {"role": "user", "content": _user(0, turns - 1, f" variant {v}")}])
    fifth = 1 + 2 * 4
    for v in range(1 if run.smoke else 2):  # edit the 5th user message
        await client.chat(run.http, messages[:fifth] + [
            {"role": "user", "content": _user(0, 4, f" edit {v}")}])
    branches = client.rows[built:]
    return {
        "recomputed/novel": reuse_ratio(client.rows),
        "recomputed/novel, branches only": reuse_ratio(branches),
        "latency of branches mean (s)": _mean([r.total for r in branches]),
    }


async def interleaved(run: Run, skip_first=True) -> Dict[str, Any]:
    client = run.client()
    n, turns = (3, 2) if run.smoke else (6, 4)
    convs = {c: [{"role": "system", "content": f"Profile {c}. " + SYSTEM}] for c in range(n)}
    for t in range(turns):
        for c in range(n):
            convs[c].append({"role": "user", "content": _user(c, t)})
            row = await client.chat(run.http, convs[c])
            convs[c].append({"role": "assistant", "content": _reply(row.text)})
    later = client.rows[n:] if skip_first else client.rows
    stats = await get_json(run.http, run.url, "/v1/cache/stats")
    return {
        "recomputed/novel, turns 2..": reuse_ratio(later),
        "latency turns 2.. mean (s)": _mean([r.total for r in later]),
        "cache bytes": stats["bytes"] if stats else None,
    }


async def memory(run: Run) -> Dict[str, Any]:
    """Interleaved conversations under a fixed --prompt-cache-bytes (set by
    the runner): how well each server reuses with little memory."""
    figures = await interleaved(run)
    stats = await get_json(run.http, run.url, "/v1/cache/stats")
    if stats:
        figures["cache bytes per cached token"] = (
            stats["bytes"] / stats["cached_tokens"] if stats["cached_tokens"] else None)
        figures["entries held"] = stats["entries"]
        figures["budget bytes"] = stats["budget_bytes"]
    return figures


async def thread_counters(run: Run) -> Optional[Dict[str, float]]:
    """Our server's generation-thread counters (/v1/stats), None elsewhere."""
    stats = await get_json(run.http, run.url, "/v1/stats")
    engine = (stats or {}).get("engine") or {}
    if "thread_seconds" not in engine:
        return None
    return {**engine["thread_seconds"], "requests": engine["admitted_requests"],
            "tokens": engine["generated_tokens"]}


def thread_figures(before, after, prefix: str) -> Dict[str, Any]:
    """Where the generation thread's time went between two readings: outside
    model steps per generated token, and admitting per request (ms)."""
    if before is None or after is None:
        return {f"{prefix}gen. thread outside model, per token (ms)": None,
                f"{prefix}gen. thread admission, per request (ms)": None}
    d = {k: after[k] - before[k] for k in after}
    return {
        f"{prefix}gen. thread outside model, per token (ms)":
            1000 * d["outside_model"] / d["tokens"] if d["tokens"] else None,
        f"{prefix}gen. thread admission, per request (ms)":
            1000 * d["admission"] / d["requests"] if d["requests"] else None,
    }


def burst_messages(i: int):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": _user(i, 0, " and more" * (i % 5) * 4)}]


async def burst(run: Run) -> Dict[str, Any]:
    """8 then 16 concurrent streaming requests sharing the system prompt, two
    rounds; every reply checked against the same request sent alone."""
    sizes = (4,) if run.smoke else (8, 16)
    rounds = 1 if run.smoke else 2
    alone = run.client()
    references = {}
    for i in range(max(sizes)):
        references[i] = (await alone.chat(run.http, burst_messages(i), stream=True)).text
    figures, mismatches = {}, 0
    for size in sizes:
        tps, ttfts = [], []
        before = await thread_counters(run)
        for _ in range(rounds):
            client = run.client()
            start = time.perf_counter()
            rows = await asyncio.gather(*(client.chat(run.http, burst_messages(i), stream=True)
                                          for i in range(size)))
            elapsed = time.perf_counter() - start
            client.rows  # settled (token counts) once the timed part is over
            tps.append(sum(r.output_tokens for r in rows) / elapsed)
            ttfts += [r.ttft for r in rows]
            mismatches += sum(r.text != references[i] for i, r in enumerate(rows))
        figures[f"{size} clients: output tok/s"] = median(tps)
        figures[f"{size} clients: ttft p50 (s)"] = percentile(ttfts, 0.5)
        figures[f"{size} clients: ttft p99 (s)"] = percentile(ttfts, 0.99)
        figures.update(thread_figures(before, await thread_counters(run), f"{size} clients: "))
    figures["replies differing from the request alone"] = mismatches
    return figures


async def short_burst(run: Run) -> Dict[str, Any]:
    """Requests that arrive together and share nothing: 8 concurrent short
    prompts, each its own (no cache can help), three times, and a lone
    request of the same kind before each burst. TTFT of each: a burst
    should be one prefill wave, and a lone request not wait for company."""
    client = run.client()
    await client.chat(run.http, overhead_messages(0, "warm-up "), stream=True, record=False)
    lone, together = [], []
    rounds = 1 if run.smoke else 3
    for r in range(rounds):
        row = await client.chat(run.http, overhead_messages(r, f"lone {os.getpid()} "),
                                stream=True)
        lone.append(row.ttft)
        rows = await asyncio.gather(*(
            client.chat(run.http, overhead_messages(i, f"burst {r} {os.getpid()} "),
                        stream=True) for i in range(8)))
        together += [row.ttft for row in rows]
    return {
        "batch 1: ttft p50 (s)": median(lone),
        "batch 8: ttft p50 (s)": median(together),
        "batch 8: ttft max (s)": max(together),
    }


def overhead_messages(i: int, salt: str = ""):
    """Short prompts, so decoding dominates (and no cache can help)."""
    return [{"role": "user", "content": f"Overhead probe {salt}{i}: tell a story."}]


OVERHEAD_TOKENS = 128


def decode_rate(rows) -> Optional[float]:
    """Decode tok/s of concurrent streams while all of them decode
    (harness.window_rate; admission and prefill are in end-to-end)."""
    return window_rate([r.arrivals for r in rows], [r.output_tokens for r in rows])


async def overhead(run: Run) -> Dict[str, Any]:
    """Output tok/s through the server over a bare BatchGenerator loop on the
    same prompts (in the benchmark's process): what HTTP and streaming cost.
    Decode: from each stream's first token to its last; end to end: from the
    requests sent to the last token (admission and prefill included)."""
    figures = {}
    client = run.client(OVERHEAD_TOKENS)
    await client.chat(run.http, overhead_messages(0, "warm-up "), stream=True, record=False)
    for size in ((1, 4) if run.smoke else (1, 8)):
        before = await thread_counters(run)
        start = time.perf_counter()
        rows = await asyncio.gather(*(client.chat(run.http, overhead_messages(i), stream=True)
                                      for i in range(size)))
        elapsed = time.perf_counter() - start
        client.rows  # settled (token counts) once the timed part is over
        served = sum(r.output_tokens for r in rows) / elapsed
        figures.update(thread_figures(before, await thread_counters(run), f"batch {size}: "))
        bare, bare_decode = run.bare(size)
        decode = decode_rate(rows)
        figures[f"batch {size}: decode tok/s"] = decode
        figures[f"batch {size}: bare decode tok/s"] = bare_decode
        figures[f"batch {size}: decode / bare"] = (
            decode / bare_decode if decode and bare_decode else None)
        figures[f"batch {size}: end-to-end tok/s"] = served
        figures[f"batch {size}: bare end-to-end tok/s"] = bare
        figures[f"batch {size}: end-to-end / bare"] = served / bare
    return figures


# The admission workload: a long prompt admitted while a stream runs.
ADMISSION_STEP = 256  # --prefill-step-size of both servers (set by the runner)
_SUBJECTS = ("The harbour master", "A tired botanist", "Our night courier", "The old ferry",
             "A careful auditor", "The village choir", "Every glacier", "The lighthouse keeper",
             "A wandering cartographer", "The copper kettle", "Some quiet engineers",
             "The northern orchard")
_VERBS = ("counted", "repainted", "forgot", "measured", "carried", "described", "ignored",
          "rebuilt", "sorted", "borrowed", "weighed", "followed")
_OBJECTS = ("the salt ledgers", "seven brass lanterns", "a map of the marshes",
            "the winter timetable", "four crates of pears", "the broken telescope",
            "a letter from the mayor", "the eastern tide tables", "two hundred bricks",
            "the harvest songs", "a coil of tarred rope", "the signal flags")


def long_messages(tokenizer, target: int, salt: str):
    """A chat prompt of about `target` tokens (chat template included) of
    varied sentences, seeded by `salt` and opening with it (so that prompts of
    different salts share no prefix a cache could reuse). Returns the
    messages and their token count."""
    rng = random.Random(salt)

    def sentence():
        return (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                f"{rng.randint(2, 999)} times near mile {rng.randint(1, 99)}.")

    def build(parts):
        return [{"role": "user", "content": f"Log {salt}. " + " ".join(parts)
                 + " Summarise the log."}]

    def count(parts):
        return len(tokenizer.apply_chat_template(build(parts), add_generation_prompt=True))

    parts = [sentence() for _ in range(20)]
    n = count(parts)
    while n < target:  # grow by an estimate, then recount (a few passes)
        per = max(1.0, (n - count([])) / len(parts))
        parts += [sentence() for _ in range(max(1, int((target - n) / per * 0.9)))]
        n = count(parts)
    return build(parts), n


async def _admission_stream(run, body, times, first_event=None, usage=None):
    """Stream one chat completion, appending the arrival time of every event
    that carries text to `times` (and setting `first_event` at the first);
    comments (keepalives) are ignored. Returns the text."""
    parts = []
    async with run.http.post(run.url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for event in stream_events(r):
            if event.get("usage") and usage is not None:
                usage.update(event["usage"])
            for choice in event.get("choices", []):
                piece = delta_text(choice)
                if piece:
                    times.append(time.perf_counter())
                    parts.append(piece)
                    if first_event is not None:
                        first_event.set()
    return "".join(parts)


def _chat_body(messages, max_tokens):
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


async def admission(run: Run) -> Dict[str, Any]:
    """How long a running stream stalls while a long prompt is admitted
    (both servers with --prefill-step-size 256, set by the runner).

    Stream A (greedy, long) runs; ~0.5 s into it, request B (a ~8,000-token
    prompt no cache holds, 8 tokens) is sent. Figures: A's median gap between
    tokens before B; A's largest gap between B's send and B's first token
    (the stall), and its ratio to the median; B's time to first token; and
    one prefill chunk's time estimated as B's TTFT over its chunks."""
    target, a_tokens = (2000, 1000) if run.smoke else (8000, 3000)
    salt = f"{os.getpid()}-{time.time_ns()}"
    warm_long, _ = long_messages(run.tokenizer, target, f"warm-up {salt}")
    b_messages, b_prompt = long_messages(run.tokenizer, target, f"admit {salt}")
    a_messages = [{"role": "user", "content": f"Stream {salt}: tell a very long story."}]
    # A writes one word over and over (logit_bias): every token is a text
    # event, so a gap between events is a gap between tokens (a random
    # model's tokens are often partial characters, which send nothing).
    word = run.tokenizer.encode(" the", add_special_tokens=False)[-1]
    a_body = {**_chat_body(a_messages, a_tokens), "logit_bias": {str(word): 100}}

    # Warm-up: a short stream, then a long prompt (its shapes compiled too).
    await _admission_stream(run, _chat_body(overhead_messages(0, "warm-up "), 16), [])
    await _admission_stream(run, _chat_body(warm_long, 4), [])

    a_times, b_times, b_usage = [], [], {}
    started = asyncio.Event()
    a_task = asyncio.create_task(
        _admission_stream(run, a_body, a_times, started))
    try:
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.sleep(0.5)
        if a_task.done():
            a_task.result()  # raises the stream's error
            raise RuntimeError(f"stream A ended before B was sent ({len(a_times)} tokens)")
        b_sent = time.perf_counter()
        await _admission_stream(run, _chat_body(b_messages, 8), b_times, usage=b_usage)
        if not b_times:
            raise RuntimeError("request B streamed no text")
        b_first = b_times[0]
        a_outlasted = not a_task.done()
    finally:
        a_task.cancel()  # A has served its purpose: the connection is closed
        try:
            await a_task
        except (asyncio.CancelledError, Exception):
            pass

    before = [t for t in a_times if t <= b_sent]
    gaps_before = [b - a for a, b in zip(before, before[1:])]
    # Gaps of A overlapping [b_sent, b_first] (the one straddling b_sent included).
    during = [b - a for a, b in zip(a_times, a_times[1:]) if b > b_sent and a < b_first]
    if not a_outlasted and a_times and a_times[-1] < b_first:
        during.append(b_first - a_times[-1])  # A ended first: its stall lasted until then
    median_gap = median(gaps_before)
    stall = max(during) if during else b_first - b_sent
    ttft = b_first - b_sent
    prompt = b_usage.get("prompt_tokens") or b_prompt
    chunks = math.ceil(prompt / ADMISSION_STEP)
    return {
        "B prompt tokens": prompt,
        "A median gap before B (s)": median_gap,
        "A largest gap during B's admission (s)": stall,
        "stall / A median gap": stall / median_gap if median_gap else None,
        # ~1: every gap is one chunk (and a step); 2: a token skipped a chunk.
        "stall / A median gap during B's admission": stall / median(during) if during else None,
        "A tokens during B's admission": sum(1 for t in a_times if b_sent < t < b_first),
        "B ttft (s)": ttft,
        "prefill chunk time, est. (s)": ttft / chunks,
        "A outlasted B's admission": int(a_outlasted),
    }


def picture(size=(224, 224), colour=(40, 90, 160)) -> str:
    """A data URL of a PNG with some structure (the same bytes every time)."""
    import base64
    import io

    from PIL import Image

    image = Image.new("RGB", size, colour)
    for x in range(size[0]):
        image.putpixel((x, (x * 7) % size[1]), (250, 200, 20))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def vision(run: Run) -> Dict[str, Any]:
    """One picture, then text follow-ups about it (streamed): how much of
    turn 1's time the later turns take, and how often the vision tower ran.
    Then the same picture with another first question (what a user does on
    editing that question): its time to first token over turn 1's. A
    request about another picture first, unrecorded: turn 1 is a running
    server's, not its first request's (which pays one-time warm-up)."""
    client = run.client()

    def first_message(question, url=None):
        return {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url or picture()}},
            {"type": "text", "text": question}]}

    await client.chat(run.http, [first_message("Warm up.", picture(colour=(200, 60, 60)))],
                      record=False, stream=True)
    before = ((await get_json(run.http, run.url, "/v1/stats") or {}).get("engine", {})
              .get("vision") or {}).get("images_encoded", 0)

    messages = [first_message("Describe this picture in detail.")]
    turns = 2 if run.smoke else 4
    for t in range(turns):
        row = await client.chat(run.http, messages, stream=True)
        messages += [{"role": "assistant", "content": row.text},
                     {"role": "user", "content": _user(0, t)}]
    edited = await client.chat(
        run.http, [first_message("What stands out in this picture?")], stream=True)
    stats = await get_json(run.http, run.url, "/v1/stats")
    vision_stats = (stats or {}).get("engine", {}).get("vision") or {}
    rows = client.rows[:turns]
    return {
        "ttft turn 1 (s)": rows[0].ttft,
        "ttft turn 2 / turn 1": rows[1].ttft / rows[0].ttft,
        "ttft turns 2.. mean / turn 1": _mean([r.ttft for r in rows[1:]]) / rows[0].ttft,
        "cached share of turns 2..": sum(r.cached for r in rows[1:]) / sum(r.prompt for r in rows[1:]),
        "ttft same picture, new question / turn 1": edited.ttft / rows[0].ttft,
        "cached share, same picture new question": edited.cached / edited.prompt,
        "vision tower images": (vision_stats["images_encoded"] - before
                                if "images_encoded" in vision_stats else None),
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


SPEED_PROMPT_TOKENS = 512
SPEED_DECODE_TOKENS = 48


async def speed(run: Run) -> Dict[str, Any]:
    """One request at a time, nothing cached: prefill tok/s (prompt tokens
    over the time to the first token) of a ~512-token prompt, and decode
    tok/s (from the first streamed token to the last) of 48 tokens. What a
    CPU's BLAS and weight format decide (mlx_lm_plus/models/cpu.py)."""
    client = run.client(8 if run.smoke else SPEED_DECODE_TOKENS)
    await client.chat(run.http, overhead_messages(0, "warm-up "), stream=True, record=False)
    prefill, decode = [], []
    for r in range(1 if run.smoke else 2):
        messages, _ = long_messages(run.tokenizer, SPEED_PROMPT_TOKENS, f"speed {os.getpid()} {r}")
        row = await client.chat(run.http, messages, stream=True)
        prefill.append(row.prompt / row.ttft)
        decode.append(window_rate([row.arrivals], [row.output_tokens]))
    return {"prompt tokens": row.prompt, "prefill tok/s": median(prefill),
            "decode tok/s": median([d for d in decode if d] or [0.0])}


WORKLOADS = {
    "multiturn": multiturn,
    "divergent": divergent,
    "branch": branch,
    "interleaved": interleaved,
    "seeded": seeded,
    "burst": burst,
    "short_burst": short_burst,
    "overhead": overhead,
    "memory": memory,
    "vision": vision,
    "admission": admission,
    "speed": speed,
}
# Workloads that need a model with vision (run only on such a model).
VISION_WORKLOADS = ("vision",)
