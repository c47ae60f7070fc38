"""Silence on a stream during a long prefill: the largest gap between bytes.

    python -m benchmarks.stream_gaps                    # the demo model
    python -m benchmarks.stream_gaps --model PATH --words 3000
    python -m benchmarks.stream_gaps --model-kind qwen3  # a tiny fixture

Starts our server (the demo model when neither --model nor --model-kind is
given), and on each protocol (chat completions, Anthropic Messages,
Responses) streams one request whose prompt is --words words no earlier
request shared (so all of it is prefilled), with max_tokens 2. It records
when each piece of the response body arrived, from the request sent to the
stream's end, and reports the largest gap between two arrivals (the
request's send counts as the first), the time to the first text, and the
keepalive frames seen (comments, Anthropic pings, repeated
response.in_progress events). Clients give up on a silent stream (Claude
Code resent a request after minutes of silence): the goal is a largest gap
of at most 15 s however long the prefill.
"""

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional

import aiohttp

from benchmarks.harness import fixture_or_model
from compat.launch import OURS, ServerProcess

PROTOCOLS = {
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
WORDS = ("river stone cloud lamp orbit cedar violet harbor signal prism meadow copper "
         "lantern falcon quartz ember willow basalt comet tundra").split()


# A frame with the answer's first text, in each protocol.
TEXT_MARKERS = (b'"delta": {"content"', b'"delta": {"role": "assistant", "content"',
                b"text_delta", b"output_text.delta")


def prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body(protocol: str, text: str) -> Dict[str, Any]:
    if protocol == "responses":
        return {"model": "m", "input": text, "max_output_tokens": 2, "stream": True}
    chat = {"max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": text}]}
    # (chat completions: no model means the default one; the agent APIs
    # take any name as the default model.)
    return chat if protocol == "chat" else {"model": "m", **chat}


async def measure(url: str, protocol: str, text: str) -> Dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sent = time.perf_counter()
        arrivals, raw, first_text = [sent], b"", None
        async with session.post(url + PROTOCOLS[protocol], json=body(protocol, text)) as r:
            assert r.status == 200, await r.text()
            async for piece in r.content.iter_any():
                arrivals.append(time.perf_counter())
                raw += piece
                if first_text is None and any(k in piece for k in TEXT_MARKERS):
                    first_text = arrivals[-1] - sent
    blocks = [b for b in raw.decode().split("\n\n") if b]
    comments = sum(b.startswith(":") for b in blocks)
    pings = sum(b.startswith("event: ping") for b in blocks)
    in_progress = sum(b.startswith("event: response.in_progress") for b in blocks)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"protocol": protocol, "seconds": round(arrivals[-1] - sent, 1),
            "largest_gap": round(max(gaps), 2), "first_text": first_text and round(first_text, 1),
            "comments": comments, "pings": pings,
            "in_progress_events": in_progress}


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: the demo model)")
    parser.add_argument("--model-kind", help="a tiny fixture instead (testkit/fixtures.py)")
    parser.add_argument("--words", type=int, default=1500)
    parser.add_argument("--protocols", default="chat,messages,responses")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-gaps-"))
    model: Optional[str] = args.model
    if model is None and args.model_kind:
        model = fixture_or_model(args, work)
    server_args = ["--model", model] if model else []
    rows = []
    with ServerProcess(OURS, server_args, log=work / "server.log") as server:
        for seed, protocol in enumerate(args.protocols.split(",")):
            rows.append(asyncio.run(measure(server.url, protocol, prompt(args.words, seed))))
            print(json.dumps(rows[-1]), flush=True)
    out = {"model": model or "demo", "words": args.words, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
