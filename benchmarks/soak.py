"""Soak test: the load benchmark for long, with hang-ups, bad inputs and a tiny cache.

The load benchmark (benchmarks/load.py) for a long while, with hang-ups, bad
inputs mixed in and a prompt cache small enough to evict all the time.

    python -m benchmarks.soak --minutes 30
    python -m benchmarks.soak --minutes 30 --kind hybrid --clients 16 --json soak.json
    python -m benchmarks.soak --minutes 30 --embedders    # embedding traffic too

The server runs as a subprocess with a small --prompt-cache-bytes. Before the
load, every prompt (single-turn chats sharing a system prompt, multi-turn
conversations built on their own earlier replies, text completions sharing a
prefix) is sent alone, greedy, and its reply kept as the reference. Then
`--clients` clients loop until the time is up, each request one of:

* a streamed chat/completion, hung up on after a random number of chunks
  with probability --disconnect-rate;
* a non-streamed one, abandoned after a random fraction of a second with
  probability --disconnect-rate;
* a bad input from the corpora in testkit/bad_input.py, every protocol's
  (chat completions, Messages, Responses), and bodies nesting arrays past
  the server's bound and at json's own limit, streamed or not (probability
  --bad-rate), which must be answered 4xx with the protocol's JSON error.

Where the server serves testkit/bad_input.py's embedder and reranker (by
their names there, "embed" and "rerank": --embedders serves them beside the
chat model), embeddings and rerank requests join the prompts (their
reference: their answer alone; under load, batched with others, they must
come back within 1e-4 of it) and the embedding corpora join the bad inputs.

Beside them, every --flood-every seconds, a schema flood: --flood-schemas
requests with large distinct response_format schemas at once, each of
which must get a 200, a 4xx or a 503 with Retry-After (the large lane full,
or past --planning-timeout), never anything else, never no answer.

Every --interval seconds the server process's resident memory (psutil, or
/proc/PID/status VmRSS), MLX's memory (/v1/stats), the prompt cache's bytes,
entries and evictions and the requests done are sampled. At the end a
per-interval table is printed and the verdict:

* RSS growth after warm-up < --max-rss-growth (5%): the warm-up is the first
  --warmup-intervals intervals (2; fewer when the run is too short to leave
  two intervals after it). RSS is read every second and each interval's
  median kept (a single reading swings by 10-20% with MLX's buffers and the
  allocator); growth is the last interval's median over the median of the
  first interval after the warm-up. The readings at the samples and the
  per-interval maxima are reported too;
* 0 mismatches: a completed greedy reply that differs from the reference;
* 0 unanswered: a request that got no response within --request-timeout, a
  connection the client did not drop that dropped, or a stream that ended
  without [DONE];
* 0 failed valid requests (a non-200 status or an error event), every bad
  input answered 4xx JSON, every flood request answered as above, the
  cache evicting (evictions > 0), and the server healthy after.

Exits 1 when the verdict fails.
"""

import argparse
import asyncio
import base64
import json
import random
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import aiohttp

from benchmarks.fuzz import error_message
from benchmarks.load import SYSTEM, TOPICS, clear_and_measure, load_prompts, stream_reply
from benchmarks.load import rss_bytes as proc_rss_bytes
from testkit.bad_input import RERANK_PATHS

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
KINDS = {"attention": "qwen3", "hybrid": "qwen3_5"}

try:  # not a dependency: /proc is read where it is missing
    import psutil
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None


def rss_bytes(pid: int) -> Optional[int]:
    """The process's resident set size, None where it is gone (or a zombie)."""
    try:
        if psutil is not None:
            return psutil.Process(pid).memory_info().rss or None
        return proc_rss_bytes(pid) or None
    except Exception:  # OSError, psutil.Error: no such process
        return None


def bad_inputs(embeddings: bool = False) -> List[tuple]:
    """(path, raw body) of the bad-input corpora, less the cases that name a
    host other than loopback (the soak sends traffic to 127.0.0.1 only),
    and the bodies nesting too deep on every protocol; `embeddings`: the
    embedding and rerank corpora too."""
    from benchmarks.fuzz import DEEP_PATHS, MAX_JSON_DEPTH, Raw
    from testkit.bad_input import (
        CASES, EMBEDDINGS_CASES, MESSAGES_CASES, RERANK_CASES, RESPONSES_CASES,
    )

    deep = [(DEEP_PATHS[protocol], Raw("deep_echo", n, protocol, stream).data())
            for protocol in DEEP_PATHS for stream in ("", "stream")
            for n in (MAX_JSON_DEPTH + 1, 966, 990)]
    cases = []
    embedding = [*EMBEDDINGS_CASES, *RERANK_CASES] if embeddings else []
    for path, body in [*CASES, *MESSAGES_CASES, *RESPONSES_CASES, *deep, *embedding]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        if b"http://" in raw or b"https://" in raw:
            if b"127.0.0.1" not in raw:
                continue
        cases.append((path, raw))
    return cases


# -- the prompts and their references --

class Item:
    """One request the clients send, with the reply it got alone."""

    def __init__(self, name: str, path: str, body: dict):
        self.name, self.path, self.body = name, path, body
        self.reference: Optional[str] = None


def chat_body(messages, max_tokens):
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}


async def alone(session, url, path, body) -> str:
    async with session.post(url + path, json=body) as r:
        text = await r.text()
        assert r.status == 200, f"reference {path}: {r.status} {text[:300]}"
        choice = json.loads(text)["choices"][0]
        if path == TEXT:
            return choice["text"]
        return choice["message"].get("content") or ""


async def build_items(session, url, max_tokens: int, conversations: int = 3,
                      turns: int = 3) -> List[Item]:
    """Prompts sharing prefixes, each sent alone (greedy) for its reference.
    Conversation turn k+1 carries turn k's reference reply, as a client
    continuing that conversation would."""
    items = []
    for i, messages in enumerate(load_prompts()):
        item = Item(f"single-{i}", CHAT, chat_body(messages, max_tokens))
        item.reference = await alone(session, url, CHAT, item.body)
        items.append(item)
    for c in range(conversations):
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            topic = TOPICS[(c + t) % len(TOPICS)]
            messages = messages + [{"role": "user", "content":
                                    f"Turn {t} of talk {c}: now {topic}. " + "Be brief. " * (2 + c)}]
            item = Item(f"talk-{c}-turn-{t}", CHAT, chat_body(messages, max_tokens))
            item.reference = await alone(session, url, CHAT, item.body)
            items.append(item)
            messages = messages + [{"role": "assistant", "content": item.reference}]
    for i in range(3):
        prompt = SYSTEM + f"Log entry {i}: " + "the harbour was calm. " * (1 + 4 * i)
        item = Item(f"text-{i}", TEXT, {"prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0.0})
        item.reference = await alone(session, url, TEXT, item.body)
        items.append(item)
    return items


async def serves_embedders(session, url) -> bool:
    """Whether the server serves testkit/bad_input.py's embedder and
    reranker, by those names (GET /v1/models says each model's task)."""
    from testkit.bad_input import EMBED_MODEL, RERANK_MODEL

    async with session.get(url + "/v1/models") as r:
        tasks = {m["id"]: m.get("task") for m in (await r.json())["data"]}
    return tasks.get(EMBED_MODEL) == "embed" and tasks.get(RERANK_MODEL) == "rerank"


async def embedding_items(session, url) -> List[Item]:
    """Embeddings and rerank requests (several inputs, several documents:
    batched under load), each sent alone for its reference numbers."""
    from testkit.bad_input import EMBED_MODEL, EMBEDDINGS, RERANK, RERANK_MODEL

    bodies = [
        (EMBEDDINGS, {"model": EMBED_MODEL, "input": [f"Tell me about {t}." for t in TOPICS]}),
        (EMBEDDINGS, {"model": EMBED_MODEL, "input": SYSTEM[:120], "dimensions": 16,
                      "encoding_format": "base64"}),
        (RERANK, {"model": RERANK_MODEL, "query": "Where do the boats go?", "top_n": 4,
                  "documents": [f"A note about {t} and the port." for t in TOPICS]}),
        (RERANK, {"model": RERANK_MODEL, "query": "cargo", "return_documents": False,
                  "instruction": "Find the shipping notes",
                  "documents": [{"text": "the harbour was calm. " * (1 + i)} for i in range(5)]}),
    ]
    items = []
    for i, (path, body) in enumerate(bodies):
        item = Item(f"{'embed' if path == EMBEDDINGS else 'rerank'}-{i}", path, body)
        async with session.post(url + path, json=body) as r:
            text = await r.text()
            assert r.status == 200, f"reference {path}: {r.status} {text[:300]}"
        item.reference = embedding_numbers(path, text)
        items.append(item)
    return items


def embedding_numbers(path: str, raw: str) -> List[tuple]:
    """An embeddings answer's vectors, or a rerank answer's (index, score)
    pairs, best first (with each document's text, where returned)."""
    answer = json.loads(raw)
    if "results" in answer:
        return [(r["index"], r["relevance_score"], (r.get("document") or {}).get("text"))
                for r in answer["results"]]
    vectors = []
    for item in answer["data"]:
        v = item["embedding"]
        if isinstance(v, str):
            data = base64.b64decode(v)
            v = struct.unpack(f"<{len(data) // 4}f", data)
        vectors.append(tuple(v))
    return vectors


def close(path: str, got: List[tuple], want: List[tuple], atol: float = 1e-4) -> bool:
    """Equal but for numbers within `atol` (a batch's padding and
    neighbours move the last bits). A rerank's order may differ only where
    two scores are that close (at top_n's edge too)."""
    if len(got) != len(want):
        return False
    if path in RERANK_PATHS:
        ours = {i: (s, t) for i, s, t in got}
        floor = min((s for _, s, _ in got), default=0.0)
        return all(abs(ours[i][0] - s) <= atol and ours[i][1] == t if i in ours
                   else abs(s - floor) <= atol for i, s, t in want)
    return all(len(a) == len(b) and all(abs(x - y) <= atol for x, y in zip(a, b))
               for a, b in zip(got, want))


# -- the clients --

def new_tally() -> Dict[str, Any]:
    return {"started": 0, "completed": 0, "embeddings": 0, "disconnected": 0, "mismatches": 0,
            "unanswered": 0, "failed": 0, "bad_sent": 0, "bad_4xx": 0, "bad_other": 0,
            "flood_sent": 0, "flood_200": 0, "flood_4xx": 0, "flood_503": 0, "flood_other": 0,
            "tokens": 0, "examples": {"mismatch": [], "unanswered": [], "failed": [],
                                      "bad_other": [], "flood_other": []}}


def note(tally, kind, text, keep=5):
    if len(tally["examples"][kind]) < keep:
        tally["examples"][kind].append(text[:400])


async def send_bad(session, url, case, timeout, tally):
    path, raw = case
    tally["bad_sent"] += 1
    try:
        async with session.post(url + path, data=raw, timeout=timeout,
                                headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            try:
                error = error_message(path, json.loads(text))
            except (ValueError, AttributeError):
                error = None
            if 400 <= r.status < 500 and error:
                tally["bad_4xx"] += 1
            else:
                tally["bad_other"] += 1
                note(tally, "bad_other", f"{path} {raw[:120]!r} -> {r.status} {text[:200]}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        tally["bad_other"] += 1
        tally["unanswered"] += 1
        note(tally, "unanswered", f"bad input {path} {raw[:120]!r}: {e!r}")
        note(tally, "bad_other", f"{path} {raw[:120]!r} -> no answer: {e!r}")


async def send_valid(session, url, item, stream, hang_up, timeout, tally):
    """One valid request. `hang_up`: streamed, stop reading after that many
    chunks; non-streamed, give up after that many seconds (the client's own
    disconnect, not counted as unanswered)."""
    if item.path not in (CHAT, TEXT):
        return await send_embedding(session, url, item, hang_up, timeout, tally)
    body = dict(item.body)
    tally["started"] += 1
    what = f"{item.name} {'stream' if stream else 'plain'}"

    def count():
        tally["tokens"] += 1

    try:
        if stream:
            body["stream"] = True
            reply = await asyncio.wait_for(
                stream_reply(session, url, body, hang_up, path=item.path, on_chunk=count), timeout)
            if reply.status != 200 or reply.error is not None:
                tally["failed"] += 1
                note(tally, "failed", f"{what}: {reply.status} {reply.error}")
                return
            if reply.hung_up:
                tally["disconnected"] += 1
                return
            if not reply.done:
                tally["unanswered"] += 1
                note(tally, "unanswered", f"{what}: stream ended without [DONE] "
                     f"after {reply.chunks} chunks")
                return
            text = reply.text
        else:
            answer = await post_or_hang_up(session, url + item.path, body, hang_up, timeout)
            if answer is None:
                tally["disconnected"] += 1
                return
            status, raw = answer
            if status != 200:
                tally["failed"] += 1
                note(tally, "failed", f"{what}: {status} {raw[:300]}")
                return
            choice = json.loads(raw)["choices"][0]
            text = choice["text"] if item.path == TEXT else (choice["message"].get("content") or "")
            tally["tokens"] += json.loads(raw)["usage"]["completion_tokens"]
    except asyncio.TimeoutError:
        tally["unanswered"] += 1
        note(tally, "unanswered", f"{what}: no complete answer within {timeout:.0f} s")
        return
    except aiohttp.ClientError as e:
        tally["unanswered"] += 1
        note(tally, "unanswered", f"{what}: connection dropped: {e!r}")
        await asyncio.sleep(0.1)  # no busy loop against a server that is gone
        return
    except (ValueError, KeyError, IndexError, TypeError) as e:  # a malformed answer
        tally["failed"] += 1
        note(tally, "failed", f"{what}: malformed answer: {e!r}")
        return
    tally["completed"] += 1
    if text != item.reference:
        tally["mismatches"] += 1
        note(tally, "mismatch", f"{what}: got {text!r} expected {item.reference!r}")


async def post_or_hang_up(session, url, body, hang_up, timeout):
    """POST `body` (not streamed): None when `hang_up` seconds pass first
    (the client hangs up), else (status, text) within `timeout`
    (asyncio.TimeoutError past it)."""
    async def plain():
        async with session.post(url, json=body) as r:
            return r.status, await r.text()

    task = asyncio.ensure_future(plain())
    if hang_up is not None:
        done, _ = await asyncio.wait({task}, timeout=hang_up)
        if not done:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, aiohttp.ClientError):
                pass
            return None
    return await asyncio.wait_for(task, timeout)


async def send_embedding(session, url, item, hang_up, timeout, tally):
    """An embeddings or rerank request (never streamed): abandoned after
    `hang_up` seconds if one is given, else its numbers close to its
    reference."""
    tally["started"] += 1
    try:
        answer = await post_or_hang_up(session, url + item.path, item.body, hang_up, timeout)
        if answer is None:
            tally["disconnected"] += 1
            return
        status, raw = answer
        if status != 200:
            tally["failed"] += 1
            note(tally, "failed", f"{item.name}: {status} {raw[:300]}")
            return
        got = embedding_numbers(item.path, raw)
    except asyncio.TimeoutError:
        tally["unanswered"] += 1
        note(tally, "unanswered", f"{item.name}: no answer within {timeout:.0f} s")
        return
    except aiohttp.ClientError as e:
        tally["unanswered"] += 1
        note(tally, "unanswered", f"{item.name}: connection dropped: {e!r}")
        await asyncio.sleep(0.1)
        return
    except (ValueError, KeyError, IndexError, TypeError, struct.error) as e:
        tally["failed"] += 1
        note(tally, "failed", f"{item.name}: malformed answer: {e!r}")
        return
    tally["completed"] += 1
    tally["embeddings"] += 1
    if not close(item.path, got, item.reference):
        tally["mismatches"] += 1
        note(tally, "mismatch", f"{item.name}: got {str(got)[:150]} expected "
             f"{str(item.reference)[:150]}")


async def send_flood_request(session, url, body, timeout, tally):
    tally["flood_sent"] += 1
    try:
        async with session.post(url + CHAT, json=body, timeout=timeout) as r:
            text = await r.text()
            if r.status == 200:
                tally["flood_200"] += 1
            elif 400 <= r.status < 500:
                tally["flood_4xx"] += 1
            elif r.status == 503 and r.headers.get("Retry-After"):
                tally["flood_503"] += 1
            else:
                tally["flood_other"] += 1
                note(tally, "flood_other", f"{r.status} {text[:200]}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        tally["flood_other"] += 1
        tally["unanswered"] += 1
        note(tally, "unanswered", f"schema flood request: {e!r}")


async def flood_client(session, url, deadline, tally, *, every, schemas, timeout):
    """A schema flood every `every` seconds (benchmarks.fuzz.heavy_schema_body)."""
    from benchmarks.fuzz import heavy_schema_body

    round_ = 0
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        round_ += 1
        salt = f"{time.monotonic_ns():x}"
        await asyncio.gather(*(
            send_flood_request(session, url, heavy_schema_body(f"{salt}_{round_}_{i}"),
                               timeout, tally) for i in range(schemas)))


async def soak_client(session, url, items, bad, deadline, rng, tally, *, disconnect_rate,
                      bad_rate, stream_rate, max_tokens, timeout):
    while time.monotonic() < deadline:
        if bad and rng.random() < bad_rate:
            await send_bad(session, url, rng.choice(bad), timeout, tally)
            continue
        item = rng.choice(items)
        stream = rng.random() < stream_rate
        hang_up = None
        if rng.random() < disconnect_rate:
            hang_up = rng.randrange(1, max_tokens) if stream else rng.uniform(0.02, 0.6)
        await send_valid(session, url, item, stream, hang_up, timeout, tally)


# -- sampling --

async def sample(session, url, pid, t0, tally, window) -> Dict[str, Any]:
    """One row: now, and RSS's median and max over the interval (`window`,
    read every second by watch_rss, emptied here)."""
    try:
        async with session.get(url + "/v1/stats?limit=0") as r:
            stats = await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        stats = {"engine": {"healthy": False}}  # the row shows "?" where it has no figure
    cache, memory = stats.get("cache", {}), stats.get("memory", {})
    rss = rss_bytes(pid)
    seen = window[:] or ([rss] if rss else [])
    window.clear()
    return {
        "t_s": round(time.monotonic() - t0, 1),
        "rss_bytes": rss,
        "rss_median_bytes": int(statistics.median(seen)) if seen else None,
        "rss_max_bytes": max(seen) if seen else None,
        "mlx_active_bytes": memory.get("mlx_active_bytes"),
        "mlx_cache_bytes": memory.get("mlx_cache_bytes"),
        "mlx_peak_bytes": memory.get("mlx_peak_bytes"),
        "cache_bytes": cache.get("bytes"),
        "cache_budget_bytes": cache.get("budget_bytes"),
        "cache_entries": cache.get("entries"),
        "cache_evictions": cache.get("evictions"),
        "cache_hits": sum((cache.get("hits") or {}).values()) if cache else None,
        "cache_tokens_saved": cache.get("prompt_tokens_saved"),
        "server_requests": (stats.get("totals") or {}).get("requests"),
        "healthy": stats["engine"]["healthy"],
        "active": stats["engine"].get("active_requests"),
        **{k: tally[k] for k in ("started", "completed", "disconnected", "mismatches",
                                 "unanswered", "failed", "bad_sent", "bad_4xx", "bad_other",
                                 "tokens")},
    }


async def watch_rss(pid, window, period=1.0):
    while True:
        rss = rss_bytes(pid)
        if rss:
            window.append(rss)
        await asyncio.sleep(period)


async def sampler(session, url, pid, t0, tally, interval, deadline, samples, window):
    next_at = t0 + interval
    while next_at < deadline - 1.0:  # the last sample is taken after the load
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        samples.append(await sample(session, url, pid, t0, tally, window))
        next_at += interval


def growth(samples, key, first) -> Dict[str, Optional[float]]:
    """Growth of `key` from samples[first] to the last sample, and the
    largest from samples[first] on (samples start at t=0)."""
    base = samples[first][key]
    if not base or any(s[key] is None for s in samples[first:]):
        return {"base": base, "end": samples[-1][key], "growth": None, "max_growth": None}
    after = [s[key] for s in samples[first:]]
    return {"base": base, "end": after[-1], "growth": (after[-1] - base) / base,
            "max_growth": (max(after) - base) / base}


async def run_soak(url: str, pid: int, *, minutes: float = 30.0, interval: float = 60.0,
                   clients: int = 16, disconnect_rate: float = 0.25, bad_rate: float = 0.1,
                   stream_rate: float = 0.6, max_tokens: int = 48, request_timeout: float = 120.0,
                   warmup_intervals: int = 2, max_rss_growth: float = 0.05, seed: int = 0,
                   flood_every: float = 20.0, flood_schemas: int = 12,
                   progress=None) -> Dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        items = await build_items(session, url, max_tokens)
        embedders = await serves_embedders(session, url)
        if embedders:
            items += await embedding_items(session, url)
        bad = bad_inputs(embeddings=embedders)
        tally = new_tally()
        rng = random.Random(seed)
        duration = minutes * 60.0
        t0 = time.monotonic()
        deadline = t0 + duration
        window: List[int] = []
        samples = [await sample(session, url, pid, t0, tally, window)]
        watcher = asyncio.ensure_future(watch_rss(pid, window))

        async def report():
            shown = 0
            while True:
                await asyncio.sleep(1.0)
                if progress and len(samples) > shown:
                    progress(samples[shown:])
                    shown = len(samples)

        reporter = asyncio.ensure_future(report())
        await asyncio.gather(
            sampler(session, url, pid, t0, tally, interval, deadline, samples, window),
            *([flood_client(session, url, deadline, tally, every=flood_every,
                            schemas=flood_schemas, timeout=request_timeout)]
              if flood_every > 0 else []),
            *(soak_client(session, url, items, bad, deadline, random.Random(rng.random()), tally,
                          disconnect_rate=disconnect_rate, bad_rate=bad_rate,
                          stream_rate=stream_rate, max_tokens=max_tokens,
                          timeout=request_timeout)
              for _ in range(clients)))
        samples.append(await sample(session, url, pid, t0, tally, window))
        reporter.cancel()
        watcher.cancel()
        if progress:
            progress(samples[-1:])
        elapsed = time.monotonic() - t0

        try:
            async with session.get(url + "/health") as r:
                healthy = r.status == 200
        except aiohttp.ClientError:
            healthy = False
        after_clear = await clear_and_measure(session, url) if healthy else {}
        rss_after_clear = rss_bytes(pid)

    # Leave two intervals after the warm-up where the run is long enough:
    # the first is the baseline, the last the end.
    warmup = max(0, min(warmup_intervals, len(samples) - 3))
    rss = growth(samples, "rss_median_bytes", warmup + 1)
    rss_instant = growth(samples, "rss_bytes", warmup)
    rss_peak = growth(samples, "rss_max_bytes", warmup + 1)
    mlx = growth(samples, "mlx_active_bytes", warmup)
    evictions = [s["cache_evictions"] for s in samples if s["cache_evictions"] is not None]
    checks = {
        f"rss_growth_after_warmup<{max_rss_growth:.0%}": (rss["growth"] is not None
                                                          and rss["growth"] < max_rss_growth),
        "mismatches==0": tally["mismatches"] == 0,
        "unanswered==0": tally["unanswered"] == 0,
        "failed_valid==0": tally["failed"] == 0,
        "bad_inputs_all_4xx": tally["bad_other"] == 0 and tally["bad_sent"] > 0,
        "flood_answered": tally["flood_other"] == 0 and (
            flood_every <= 0 or tally["flood_sent"] > 0),
        "evictions>0": len(evictions) > 1 and evictions[-1] > evictions[0],
        "healthy_after": healthy,
    }
    return {
        "minutes": round(elapsed / 60, 2),
        "interval_s": interval,
        "clients": clients,
        "items": len(items),
        "bad_cases": len(bad),
        "warmup_intervals": warmup,
        "warmup_end_s": samples[warmup]["t_s"],
        "rss_source": "psutil" if psutil is not None else "/proc/PID/status VmRSS",
        "samples": samples,
        "rss": rss,  # the verdict's: per-interval medians, first after warm-up -> last
        "rss_instant": rss_instant,  # the readings at the samples, end of warm-up -> last
        "rss_peak": rss_peak,  # per-interval maxima, first after warm-up -> last
        "mlx_active": mlx,
        "mlx_active_after_clear": after_clear.get("mlx_active_bytes"),
        "mlx_active_at_start": samples[0]["mlx_active_bytes"],
        "rss_after_clear": rss_after_clear,
        "requests": tally["started"] + tally["bad_sent"],
        "completed": tally["completed"],
        "embeddings": tally["embeddings"],  # (of completed: embeddings and rerank)
        "embedders": embedders,
        "disconnected": tally["disconnected"],
        "mismatches": tally["mismatches"],
        "unanswered": tally["unanswered"],
        "failed": tally["failed"],
        "bad_sent": tally["bad_sent"],
        "bad_4xx": tally["bad_4xx"],
        "bad_other": tally["bad_other"],
        **{k: tally[k] for k in ("flood_sent", "flood_200", "flood_4xx", "flood_503",
                                 "flood_other")},
        "evictions": evictions[-1] - evictions[0] if evictions else None,
        "output_tokens_per_s": round(tally["tokens"] / elapsed, 1),
        "healthy_after": healthy,
        "examples": tally["examples"],
        "checks": checks,
        "passed": all(checks.values()),
    }


# -- the report --

MiB = 1 << 20
COLUMNS = [  # header, width, row -> text
    ("t min", 6, lambda s, b: f"{s['t_s'] / 60:.1f}"),
    ("RSS MiB", 8, lambda s, b: f"{s['rss_bytes'] / MiB:.1f}"),
    ("median", 6, lambda s, b: f"{s['rss_median_bytes'] / MiB:.1f}"),
    ("max", 6, lambda s, b: f"{s['rss_max_bytes'] / MiB:.1f}"),
    ("med %", 6, lambda s, b: f"{100 * (s['rss_median_bytes'] - b) / b:+.1f}" if b else "-"),
    ("MLX act", 8, lambda s, b: f"{s['mlx_active_bytes'] / MiB:.2f}"),
    ("MLX buf", 8, lambda s, b: f"{s['mlx_cache_bytes'] / MiB:.2f}"),
    ("MLX peak", 8, lambda s, b: f"{s['mlx_peak_bytes'] / MiB:.2f}"),
    ("cache KiB", 9, lambda s, b: f"{s['cache_bytes'] / 1024:.0f}"),
    ("entries", 7, lambda s, b: str(s["cache_entries"])),
    ("evicted", 7, lambda s, b: str(s["cache_evictions"])),
    ("hits", 6, lambda s, b: str(s["cache_hits"])),
    ("srv reqs", 8, lambda s, b: str(s["server_requests"])),
    ("done", 6, lambda s, b: str(s["completed"])),
    ("hung up", 7, lambda s, b: str(s["disconnected"])),
    ("bad 4xx", 7, lambda s, b: f"{s['bad_4xx']}/{s['bad_sent']}"),
    ("unans", 5, lambda s, b: str(s["unanswered"])),
    ("mism", 4, lambda s, b: str(s["mismatches"])),
    ("fail", 4, lambda s, b: str(s["failed"])),
]


def header() -> str:
    return "  ".join(f"{h:>{w}}" for h, w, _ in COLUMNS)


def cell(f, s, base) -> str:
    try:
        text = f(s, base)
    except TypeError:  # a figure the server did not give
        return "?"
    return "?" if text == "None" else text


def row(s, base) -> str:
    return "  ".join(f"{cell(f, s, base):>{w}}" for _, w, f in COLUMNS)


def mib(x):
    return "n/a" if x is None else f"{x / MiB:.2f} MiB"


def pct(x):
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def report(result) -> str:
    samples, rss = result["samples"], result["rss"]
    lines = ["", "Per-interval samples (counts cumulative; MiB; RSS at the sample, and its median "
             "and max over the interval ending there, read every second; med %: against the "
             "median over the first interval after the warm-up):", header()]
    w = result["warmup_intervals"]
    for i, s in enumerate(samples):
        lines.append(row(s, rss["base"]))
        if i == w and i + 1 < len(samples):
            lines.append(f"{'-- end of warm-up --':^{len(lines[2])}}")
    lines += [
        "",
        f"warm-up: the first {w} interval(s), to t={result['warmup_end_s']:.0f} s; "
        f"RSS from {result['rss_source']}",
        f"RSS growth after warm-up (interval medians, first interval after the warm-up "
        f"{mib(rss['base'])} -> last {mib(rss['end'])}): {pct(rss['growth'])} "
        f"(largest {pct(rss['max_growth'])}); interval maxima {pct(result['rss_peak']['growth'])}; "
        f"single readings, end of warm-up -> end {pct(result['rss_instant']['growth'])}; "
        f"after DELETE /v1/cache {mib(result['rss_after_clear'])}",
        f"MLX active (single readings: it holds the batch in flight)  end of warm-up "
        f"{mib(result['mlx_active']['base'])} -> end {mib(result['mlx_active']['end'])} "
        f"({pct(result['mlx_active']['growth'])}); at start {mib(result['mlx_active_at_start'])}, "
        f"after DELETE /v1/cache {mib(result['mlx_active_after_clear'])}",
        f"requests {result['requests']} ({result['items']} prompts, {result['bad_cases']} bad cases): "
        f"completed {result['completed']} ({result['embeddings']} embeddings and rerank), "
        f"hung up by the client {result['disconnected']}, "
        f"failed {result['failed']}, {result['output_tokens_per_s']} output tok/s",
        f"cache evictions during the soak: {result['evictions']}",
        f"mismatches: {result['mismatches']}",
        f"unanswered: {result['unanswered']}",
        f"bad inputs: {result['bad_sent']} sent, {result['bad_4xx']} answered 4xx JSON, "
        f"{result['bad_other']} other",
    ]
    for kind, examples in result["examples"].items():
        for e in examples:
            lines.append(f"  {kind}: {e}")
    failed = [k for k, ok in result["checks"].items() if not ok]
    lines.append("VERDICT: " + ("PASS" if result["passed"] else "FAIL")
                 + " (" + ", ".join(f"{k} {'ok' if ok else 'FAILED'}"
                                    for k, ok in result["checks"].items()) + ")"
                 + (f" -- failed: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    from benchmarks.harness import fixture_or_model
    from compat.launch import OURS, ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--model", help="a model folder (default: a tiny fixture model)")
    parser.add_argument("--kind", "--model-kind", dest="model_kind", default="qwen3",
                        help="fixture kind (testkit/fixtures.py), or attention / hybrid "
                             "(qwen3 / qwen3_5), when no --model")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-cache-bytes", type=int, default=1 << 20,
                        help="the server's cache budget: small, so it evicts all the time "
                             "(default 1 MiB: a few entries of the tiny fixtures)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--warmup-intervals", type=int, default=2)
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--disconnect-rate", type=float, default=0.25)
    parser.add_argument("--bad-rate", type=float, default=0.1)
    parser.add_argument("--stream-rate", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flood-every", type=float, default=20.0,
                        help="seconds between two schema floods (0: none)")
    parser.add_argument("--flood-schemas", type=int, default=12)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra server argument (repeatable), e.g. --server-arg=--decode-concurrency=8")
    parser.add_argument("--embedders", action="store_true",
                        help="serve testkit/bad_input.py's embedder and reranker beside the "
                             "model (--models-config), and send them requests and bad inputs")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    args.model_kind = KINDS.get(args.model_kind, args.model_kind)

    work = Path(tempfile.mkdtemp(prefix="mlx_lm_plus-soak-"))
    model = fixture_or_model(args, work)
    log = work / "server.log"
    served = ["--model", model]
    if args.embedders:
        import os

        from benchmarks.fuzz import fixture_builder
        from testkit.bad_input import models_config_file

        build = fixture_builder(Path(os.environ.get("MLX_LM_PLUS_FIXTURES") or work))
        served = ["--models-config", str(models_config_file(build, work, chat=model))]
    server_args = [*served, "--prompt-cache-bytes", str(args.prompt_cache_bytes),
                   *args.server_arg]
    print(f"soak: {args.minutes} min, {args.clients} clients, model {model}, "
          f"--prompt-cache-bytes {args.prompt_cache_bytes}, server log {log}", flush=True)

    def progress(new):
        for s in new:
            if s["t_s"] == 0:
                print(header(), flush=True)
            print(row(s, 0), flush=True)

    with ServerProcess(OURS, server_args, log=log, env={"HF_HUB_OFFLINE": "1"}) as server:
        result = asyncio.run(run_soak(
            server.url, server.proc.pid, minutes=args.minutes, interval=args.interval,
            clients=args.clients, disconnect_rate=args.disconnect_rate, bad_rate=args.bad_rate,
            stream_rate=args.stream_rate, max_tokens=args.max_tokens,
            request_timeout=args.request_timeout, warmup_intervals=args.warmup_intervals,
            max_rss_growth=args.max_rss_growth, flood_every=args.flood_every,
            flood_schemas=args.flood_schemas, seed=args.seed, progress=progress))
        exited = server.proc.poll()
    log_text = log.read_text(errors="replace")
    result["server_log"] = str(log)
    result["server_log_tracebacks"] = log_text.count("Traceback")
    result["server_exited_during_soak"] = exited
    result["model"] = model
    result["prompt_cache_bytes"] = args.prompt_cache_bytes
    print(report(result))
    print(f"server log: {log} ({result['server_log_tracebacks']} tracebacks)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
