"""Load test: concurrent streaming clients for a while, some hanging up at random.

    python -m benchmarks.load --model-kind qwen3 --clients 32 --duration 60

Every request that is not hung up on must come back complete and equal to
the reply the same prompt got alone (greedy decoding), with no 5xx. Before
and after, the prompt cache is cleared (DELETE /v1/cache) and MLX's memory
is read from /v1/stats: after the load it must be back near where it began.
Prints a table and, with --json, writes the figures to a file.
"""

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import aiohttp

from benchmarks.harness import print_figures

SYSTEM = (
    "You are a careful assistant for a shipping company. Answer in short, "
    "plain sentences and mention the port names you are given. " * 4
)
TOPICS = ["rivers", "boats", "weather", "harbours", "cargo", "tides", "lighthouses", "maps"]


def load_prompts(n: int = 8) -> List[List[dict]]:
    """n chat prompts sharing a system prompt, with user messages of different lengths."""
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Tell me about {topic}. " + f"Consider port number {i}. " * (1 + 3 * i)
        prompts.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}])
    return prompts


async def reply_alone(session, url, messages, max_tokens) -> str:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["message"]["content"]


async def clear_and_measure(session, url) -> Dict[str, int]:
    """Clear the prompt cache, wait for MLX's buffer cache to follow, read memory."""
    async with session.delete(url + "/v1/cache") as r:
        assert r.status == 200, await r.text()
    for _ in range(100):
        async with session.get(url + "/v1/stats") as r:
            stats = await r.json()
        if stats["memory"]["mlx_cache_bytes"] == 0 and stats["engine"]["active_requests"] == 0:
            break
        await asyncio.sleep(0.05)
    return stats["memory"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Streamed:
    """What one streamed request brought back."""

    status: int = 0
    text: str = ""  # the content deltas joined
    reasoning: str = ""  # the reasoning deltas joined
    chunks: int = 0  # deltas with content
    ttft: Optional[float] = None  # seconds to the first content delta
    error: Any = None  # the body of a non-200 answer, or an error event
    hung_up: bool = False  # the client stopped reading after hang_up_after chunks
    done: bool = False  # "data: [DONE]" arrived


async def stream_reply(session, url, body, hang_up_after=None, path="/v1/chat/completions",
                       on_chunk=None) -> Streamed:
    """POST a streamed request and read its events (chat deltas or text
    completions), hanging up after `hang_up_after` content chunks if given.
    Client errors (aiohttp.ClientError, asyncio.TimeoutError) propagate."""
    out = Streamed()
    started = time.monotonic()
    parts, reasoning = [], []
    async with session.post(url + path, json=body) as r:
        out.status = r.status
        if r.status != 200:
            out.error = f"{r.status}: {await r.text()}"
            return out
        async for line in r.content:
            line = line.decode().strip()
            if line == "data: [DONE]":
                out.done = True
                continue
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                break
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") if "delta" in choice else choice.get("text")
                if delta.get("reasoning"):
                    reasoning.append(delta["reasoning"])
                if piece:
                    if out.ttft is None:
                        out.ttft = time.monotonic() - started
                    parts.append(piece)
                    out.chunks += 1
                    if on_chunk is not None:
                        on_chunk()
            if hang_up_after is not None and out.chunks >= hang_up_after:
                out.hung_up = True
                break
    out.text, out.reasoning = "".join(parts), "".join(reasoning)
    return out


async def one_client(session, url, prompts, references, deadline, disconnect_rate,
                     max_tokens, rng, tally):
    def count_token():
        tally["tokens"] += 1

    while time.monotonic() < deadline:
        i = rng.randrange(len(prompts))
        hang_up_after = rng.randrange(1, max_tokens) if rng.random() < disconnect_rate else None
        body = {"messages": prompts[i], "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True}
        tally["started"] += 1
        try:
            reply = await stream_reply(session, url, body, hang_up_after, on_chunk=count_token)
            tally["status"][reply.status] = tally["status"].get(reply.status, 0) + 1
            if reply.status != 200:
                tally["errors"].append(reply.error)
                continue
            if reply.error is not None:
                tally["errors"].append(reply.error)
            if reply.hung_up:
                tally["disconnected"] += 1
                continue
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tally["errors"].append(f"client error: {e!r}")
            continue
        if reply.ttft is not None:
            tally["ttft"].append(reply.ttft)
        tally["completed"] += 1
        if reply.text != references[i]:
            tally["mismatches"] += 1


async def run_load(url: str, *, clients: int = 32, duration: float = 60.0,
                   disconnect_rate: float = 0.25, max_tokens: int = 48, seed: int = 0,
                   pid: int = None) -> dict:
    prompts = load_prompts()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        references = [await reply_alone(session, url, p, max_tokens) for p in prompts]
        before = await clear_and_measure(session, url)
        rss_before = rss_bytes(pid) if pid else None

        tally = {"started": 0, "completed": 0, "disconnected": 0, "mismatches": 0,
                 "tokens": 0, "status": {}, "errors": [], "ttft": []}
        rng = random.Random(seed)
        deadline = time.monotonic() + duration
        began = time.monotonic()
        await asyncio.gather(*(
            one_client(session, url, prompts, references, deadline, disconnect_rate,
                       max_tokens, random.Random(rng.random()), tally)
            for _ in range(clients)
        ))
        elapsed = time.monotonic() - began

        async with session.get(url + "/health") as r:
            healthy = r.status == 200
        during = (await (await session.get(url + "/v1/stats")).json())["memory"]
        after = await clear_and_measure(session, url)
        rss_after = rss_bytes(pid) if pid else None

    ttft = sorted(tally["ttft"])
    return {
        "clients": clients,
        "duration_s": round(elapsed, 1),
        "requests": tally["started"],
        "completed": tally["completed"],
        "disconnected": tally["disconnected"],
        "mismatches": tally["mismatches"],
        "status_counts": tally["status"],
        "server_errors_5xx": sum(n for s, n in tally["status"].items() if s >= 500),
        "errors": tally["errors"][:10],
        "error_count": len(tally["errors"]),
        "output_tokens_per_s": round(tally["tokens"] / elapsed, 1),
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 3) if ttft else None,
        "healthy_after": healthy,
        "mlx_active_bytes_before": before["mlx_active_bytes"],
        "mlx_active_bytes_peak_during": during["mlx_peak_bytes"],
        "mlx_active_bytes_after_clear": after["mlx_active_bytes"],
        "rss_bytes_before": rss_before,
        "rss_bytes_after_clear": rss_after,
    }


def disconnect_latencies_ms(log_text: str) -> List[float]:
    """The engine's "... ms after the disconnect" figures from a server log."""
    return [float(m) for m in re.findall(r"([0-9.]+) ms after the disconnect", log_text)]


def main(argv=None):
    from benchmarks.harness import add_model_args, fixture_or_model
    from compat.launch import OURS, ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, "qwen3")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--disconnect-rate", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="mlx_lm_plus-load-"))
    model = fixture_or_model(args, work)
    log = work / "server.log"
    with ServerProcess(OURS, ["--model", model], log=log) as server:
        result = asyncio.run(run_load(
            server.url, clients=args.clients, duration=args.duration,
            disconnect_rate=args.disconnect_rate, max_tokens=args.max_tokens,
            pid=server.proc.pid))
        waits = disconnect_latencies_ms(server.log_tail(10**8))
    if waits:
        result["disconnect_to_removal_ms_median"] = round(statistics.median(waits), 1)
        result["disconnect_to_removal_ms_max"] = round(max(waits), 1)
    result["model"] = model
    print_figures(result, args.json)
    return result


if __name__ == "__main__":
    main()
