"""Warm restart: a conversation resumed from the disk tier (--prompt-cache-dir)
after the server restarts, against a memory hit and a cold prompt.

    python -m benchmarks.warm_restart                 # the demo model (~7 min on 2 CPU cores)
    python -m benchmarks.warm_restart --quick         # a tiny fixture, seconds
    python -m benchmarks.warm_restart --model PATH --tokens 8000 --json out.json

1. Server A (--prompt-cache-dir D) holds a conversation whose prompt grows
   to about --tokens tokens: a long system prompt, then --turns turns.
2. A is stopped with SIGTERM (its memory entries are written to D) and
   server B starts on the same D.
3. The next turn on B, streamed: its time to first token ("restarted: disk
   hit") and the share of its prompt the server reports cached.
4. The same turn again on B: a memory hit. B stops, starts again, and gets
   the same turn once more: a disk hit with as little left to compute.
5. Server C (--prompt-cache-bytes 0: no cache) gets the same turn: cold.

Greedy throughout; the three answers are compared. On a 2-core CPU the demo
model prefills about 8 tokens/s, so the two full prefills (A's first turn,
C's cold turn) take most of the time.
"""

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import Client, session
from compat.launch import OURS, ServerProcess

SYSTEM_HEAD = ("You are the operations assistant of a small sea harbour. Follow the "
               "harbour rules below when you answer; quote a rule by its number.\n")
RULES = [
    "Ships longer than {n}0 metres wait for a pilot at the outer buoy.",
    "Berth {n} is kept free for the ferry between six and nine in the morning.",
    "Fuel is delivered to berth {n} only with the fire crew present.",
    "Fishing boats unload at the north quay before {n} o'clock.",
    "A vessel that drags its anchor reports to the tower on channel {n}.",
    "Cranes on the east quay stop when the wind passes {n}0 knots.",
    "Cargo manifests for berth {n} reach the office a day before arrival.",
    "Pleasure craft keep {n} metres clear of the tug station.",
]
QUESTIONS = [
    "A 140 metre tanker arrives at dawn with fuel for the town. Which rules apply?",
    "The wind is rising and two fishing boats are late. What should the tower do?",
    "The ferry is delayed by an hour and a cargo ship wants its berth. Who decides?",
    "Summarise what the night shift must check before handing over.",
]


def system_prompt(tokenizer, tokens: int) -> str:
    """A system prompt of rules, as long as makes a first prompt of about
    `tokens` tokens less a turn's worth."""
    lines = [SYSTEM_HEAD]
    target = max(64, tokens - 120)
    while True:
        messages = [{"role": "system", "content": "".join(lines)},
                    {"role": "user", "content": QUESTIONS[0]}]
        if len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)) >= target:
            return "".join(lines)
        n = len(lines)
        lines.append(f"Rule {n}. " + RULES[n % len(RULES)].format(n=n % 9 + 1) + "\n")


async def one_turn(url, tokenizer, messages, max_tokens):
    client = Client(url, tokenizer, max_tokens)
    async with session() as http:
        return await client.chat(http, messages, stream=True)


def turn(server, tokenizer, messages, max_tokens):
    return asyncio.run(one_turn(server.url, tokenizer, messages, max_tokens))


def started(args, log):
    return ServerProcess(OURS, args, log=log, startup_timeout=600).start()


def measure(model, tokens, turns, max_tokens, work: Path):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    folder = work / "prompt-cache"
    cached_args = ["--model", model, "--prompt-cache-dir", str(folder),
                   "--shutdown-timeout", "60", "--max-tokens", str(max_tokens)]
    messages = [{"role": "system", "content": system_prompt(tokenizer, tokens)}]
    out = {"model": model}

    # 1. The conversation on server A.
    server = started(cached_args, work / "a.log")
    try:
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            row = turn(server, tokenizer, messages, max_tokens)
            print(f"  A turn {t + 1}: {row.prompt} prompt tokens, {row.cached} cached, "
                  f"{row.total:.1f} s", flush=True)
            messages.append({"role": "assistant", "content": row.text or "Noted."})
    finally:
        # 2. A graceful stop: the memory entries go to disk.
        tic = time.perf_counter()
        server.stop(timeout=120)
        out["stop A s (memory to disk)"] = round(time.perf_counter() - tic, 2)
    messages.append({"role": "user", "content": QUESTIONS[turns % len(QUESTIONS)]})

    # 3. and 4. Server B, same folder: the next turn, then the same turn again.
    tic = time.perf_counter()
    server = started(cached_args, work / "b.log")
    try:
        disk = None
        while disk is None:  # the tier opens once the model has loaded
            time.sleep(0.1)
            disk = server.get("/v1/cache/stats")[1]["disk"]
        out["start B s (model loaded, index read)"] = round(time.perf_counter() - tic, 2)
        out["disk entries at start"], out["disk MB at start"] = disk["entries"], round(
            disk["bytes"] / 1e6, 1)
        warm = turn(server, tokenizer, messages, max_tokens)
        memory = turn(server, tokenizer, messages, max_tokens)
        stats = server.get("/v1/cache/stats")[1]
    finally:
        server.stop(timeout=120)

    # The same turn once more after another restart: a disk hit that leaves
    # as little to compute as the memory hit did (the restarted turn also
    # prefills its new tokens).
    server = started(cached_args, work / "b2.log")
    try:
        disk_same = turn(server, tokenizer, messages, max_tokens)
    finally:
        server.stop(timeout=120)

    # 5. Server C, no prompt cache: the same turn, cold.
    server = started(["--model", model, "--prompt-cache-bytes", "0",
                         "--max-tokens", str(max_tokens)], work / "c.log")
    try:
        cold = turn(server, tokenizer, messages, max_tokens)
    finally:
        server.stop(timeout=120)

    out.update({
        "prompt tokens": warm.prompt,
        "cached tokens (restarted)": warm.cached,
        "cached share (restarted)": round(warm.cached / warm.prompt, 4),
        "TTFT restarted, disk hit s": round(warm.ttft, 3),
        "TTFT memory hit (same turn again) s": round(memory.ttft, 3),
        "TTFT cold s": round(cold.ttft, 3),
        "cold / restarted TTFT": round(cold.ttft / warm.ttft, 1),
        "restarted / memory TTFT": round(warm.ttft / memory.ttft, 2),
        "computed tokens: restarted, memory, cold": [
            warm.prompt - warm.cached, memory.prompt - memory.cached, cold.prompt - cold.cached],
        "TTFT disk hit, same turn (2nd restart) s": round(disk_same.ttft, 3),
        "computed tokens: disk hit, same turn": disk_same.prompt - disk_same.cached,
        "hits by tier": stats["hits_by_tier"],
        "disk bytes per token": stats["disk"]["bytes_per_token"],
        "memory bytes per token": stats["memory"]["bytes_per_token"],
        "same output as cold (restarted, memory, 2nd restart)": [
            r.text == cold.text for r in (warm, memory, disk_same)],
    })
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder (default: the demo model, or with "
                   "--quick the tiny qwen3 fixture)")
    p.add_argument("--quick", action="store_true", help="the qwen3 fixture, 1,000 tokens")
    p.add_argument("--tokens", type=int, default=2000,
                   help="prompt tokens of the restarted turn, about (default: 2000)")
    p.add_argument("--turns", type=int, default=2, help="turns before the restart")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    model = args.model
    if args.quick:
        args.tokens = min(args.tokens, 1000)
        if model is None:
            from tests.fixtures import build_fixture

            model = str(build_fixture("qwen3", work / "fixtures"))
    if model is None:
        from mlx_lm_plus.demo import demo_model_path

        model = str(demo_model_path())
    tic = time.perf_counter()
    try:
        out = measure(model, args.tokens, args.turns, args.max_tokens, work)
    finally:
        shutil.rmtree(work / "prompt-cache", ignore_errors=True)
    out["seconds"] = round(time.perf_counter() - tic, 1)
    for k, v in out.items():
        print(f"{k:<52} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
