"""The workloads of `python -m benchmarks run`, each an async function of a
`Run` (one server, one model) returning its figures.

The conversations are those of benchmarks/cache_reuse.py (a ~600-token
system prompt, ~40-token user messages, replies sent back with a reasoning
block the template drops).
"""

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from benchmarks.cache_reuse import SYSTEM, _reply, _user
from benchmarks.harness import Client, get_json, median, percentile, reuse_ratio


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
        for _ in range(rounds):
            client = run.client()
            start = time.perf_counter()
            rows = await asyncio.gather(*(client.chat(run.http, burst_messages(i), stream=True)
                                          for i in range(size)))
            elapsed = time.perf_counter() - start
            tps.append(sum(r.output_tokens for r in rows) / elapsed)
            ttfts += [r.ttft for r in rows]
            mismatches += sum(r.text != references[i] for i, r in enumerate(rows))
        figures[f"{size} clients: output tok/s"] = median(tps)
        figures[f"{size} clients: ttft p50 (s)"] = percentile(ttfts, 0.5)
        figures[f"{size} clients: ttft p99 (s)"] = percentile(ttfts, 0.99)
    figures["replies differing from the request alone"] = mismatches
    return figures


def overhead_messages(i: int, salt: str = ""):
    """Short prompts, so decoding dominates (and no cache can help)."""
    return [{"role": "user", "content": f"Overhead probe {salt}{i}: tell a story."}]


OVERHEAD_TOKENS = 64


async def overhead(run: Run) -> Dict[str, Any]:
    """Output tok/s through the server over a bare BatchGenerator loop on the
    same prompts (in the benchmark's process): what HTTP and streaming cost."""
    figures = {}
    client = run.client(OVERHEAD_TOKENS)
    await client.chat(run.http, overhead_messages(0, "warm-up "), stream=True, record=False)
    for size in ((1, 4) if run.smoke else (1, 8)):
        start = time.perf_counter()
        rows = await asyncio.gather(*(client.chat(run.http, overhead_messages(i), stream=True)
                                      for i in range(size)))
        served = sum(r.output_tokens for r in rows) / (time.perf_counter() - start)
        bare = run.bare(size)
        figures[f"batch {size}: server tok/s"] = served
        figures[f"batch {size}: bare BatchGenerator tok/s"] = bare
        figures[f"batch {size}: server / bare"] = served / bare
    return figures


def picture(size=(224, 224)) -> str:
    """A data URL of a PNG with some structure (the same bytes every time)."""
    import base64
    import io

    from PIL import Image

    image = Image.new("RGB", size, (40, 90, 160))
    for x in range(size[0]):
        image.putpixel((x, (x * 7) % size[1]), (250, 200, 20))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def vision(run: Run) -> Dict[str, Any]:
    """One picture, then text follow-ups about it (streamed): how much of
    turn 1's time the later turns take, and how often the vision tower ran.
    Then the same picture with another first question (what a user does on
    editing that question): its time to first token over turn 1's."""
    client = run.client()

    def first_message(question):
        return {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": picture()}},
            {"type": "text", "text": question}]}

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
        "vision tower images": vision_stats.get("images_encoded"),
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


WORKLOADS = {
    "multiturn": multiturn,
    "divergent": divergent,
    "branch": branch,
    "interleaved": interleaved,
    "seeded": seeded,
    "burst": burst,
    "overhead": overhead,
    "memory": memory,
    "vision": vision,
}
# Workloads that need a model with vision (run only on such a model).
VISION_WORKLOADS = ("vision",)
