"""Warm restart: a conversation resumed from the disk tier (--prompt-cache-dir)
after the server restarts, against a memory hit and a cold prompt.

    python -m benchmarks.warm_restart                 # the demo model (~7 min on 2 CPU cores)
    python -m benchmarks.warm_restart --quick         # a tiny fixture, seconds
    python -m benchmarks.warm_restart --model PATH --tokens 8000 --json out.json
    python -m benchmarks.warm_restart --load          # DiskTier.load alone, seconds

1. Server A (--prompt-cache-dir D) holds a conversation whose prompt grows
   to about --tokens tokens: a long system prompt, then --turns turns.
2. A is stopped with SIGTERM (its memory entries are written to D) and
   server B starts on the same D.
3. The next turn on B, streamed: its time to first token ("restarted: disk
   hit") and the share of its prompt the server reports cached.
4. The same turn again on B: a memory hit. B stops, starts again, and gets
   the same turn once more: a disk hit with as little left to compute, as
   the restarted server's first request; then once more after another
   restart, after a short unrelated request (as the memory hit came after
   one), and the same turn once more there (a memory hit): what a disk hit
   costs beside a memory hit. Each --restarts times (alternated; medians,
   every figure listed).
5. Server C (--prompt-cache-bytes 0: no cache) gets the same turn: cold.

Every turn on a restarted server waits until the server has loaded the model
and opened its disk tier (/health answers before that): otherwise the first
turn's time to first token counts the rest of the model's loading.

Greedy throughout; the three answers are compared. On a 2-core CPU the demo
model prefills about 8 tokens/s, so the two full prefills (A's first turn,
C's cold turn) take most of the time.

--load times DiskTier.load alone on an entry of the demo model's shape (30
layers, keys and values of 3 heads x 64 dims, float32: 46 KB a token) and
--tokens tokens of random values: in this process (the entry read again and
again, --runs times) and as the first read of a fresh process (what a
restarted server does), --runs processes.
"""

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import Client, print_figures, session
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


def tier_open(server, timeout=600):
    """The disk tier's stats once the server has loaded the model and opened
    the tier (/health answers before: the generation thread loads the model)."""
    deadline = time.time() + timeout
    while True:
        disk = server.get("/v1/cache/stats")[1]["disk"]
        if disk is not None:
            return disk
        if time.time() > deadline:
            raise TimeoutError("the disk tier did not open")
        time.sleep(0.05)


def measure(model, tokens, turns, max_tokens, work: Path, restarts: int = 3):
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
        disk = tier_open(server)
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
    # prefills its new tokens). First as the server's first request, then,
    # after one more restart, after a short unrelated one: the memory hit
    # was not its server's first request either. Each a few times: one
    # request's time to first token on a shared machine is noisy.
    firsts, afters, memories = [], [], [memory]
    for i in range(restarts):
        server = started(cached_args, work / "b2.log")
        try:
            tier_open(server)
            firsts.append(turn(server, tokenizer, messages, max_tokens))
        finally:
            server.stop(timeout=120)
        server = started(cached_args, work / "b3.log")
        try:
            tier_open(server)
            turn(server, tokenizer, [{"role": "user", "content": "Say hello."}], 2)
            afters.append(turn(server, tokenizer, messages, max_tokens))
            memories.append(turn(server, tokenizer, messages, max_tokens))
        finally:
            server.stop(timeout=120)
    disk_same, disk_warm = firsts[0], afters[0]
    first_ttft = statistics.median(r.ttft for r in firsts)
    after_ttft = statistics.median(r.ttft for r in afters)
    memory_ttft = statistics.median(r.ttft for r in memories)

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
        "TTFT disk hit, same turn (2nd restart) s": round(first_ttft, 3),
        "TTFT disk hit, same turn, after a short request (3rd restart) s": round(
            after_ttft, 3),
        "TTFT memory hit, same turn, median of B and the 3rd restarts s": round(
            memory_ttft, 3),
        "disk / memory TTFT, same turn (2nd restart, 3rd restart)": [
            round(first_ttft / memory_ttft, 2), round(after_ttft / memory_ttft, 2)],
        "TTFTs s (2nd restarts; 3rd restarts; memory hits)": [
            [round(r.ttft, 3) for r in rows] for rows in (firsts, afters, memories)],
        "computed tokens: disk hit, same turn": disk_same.prompt - disk_same.cached,
        "computed tokens: disk hit, same turn, 3rd restart": disk_warm.prompt - disk_warm.cached,
        "hits by tier": stats["hits_by_tier"],
        "disk bytes per token": stats["disk"]["bytes_per_token"],
        "memory bytes per token": stats["memory"]["bytes_per_token"],
        "same output as cold (restarted, memory, 2nd restart)": [
            r.text == cold.text for r in (warm, memory, disk_same)],
        "same output as cold, 3rd restart": disk_warm.text == cold.text,
        "same output as cold, every restart": all(
            r.text == cold.text for r in firsts + afters + memories),
    })
    return out


LOAD_ONCE = """
import sys, time
from mlx_lm_plus.cache.disk import DiskTier
tier = DiskTier(sys.argv[1], 1 << 40, "load")
(handle,) = tier._entries.values()
tic = time.perf_counter()
assert tier.load(handle) is not None
print(time.perf_counter() - tic)
tier.close()
"""


def measure_load(tokens: int, runs: int, work: Path, layers: int = 30, heads: int = 3,
                 dims: int = 64):
    """DiskTier.load's seconds on one entry: warm (median, min of `runs` in
    this process) and the first load of `runs` fresh processes."""
    import subprocess

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlx_lm_plus.cache.disk import DiskTier

    cache = []
    for _ in range(layers):
        c = KVCache()
        c.keys = mx.random.normal((1, heads, tokens, dims))
        c.values = mx.random.normal((1, heads, tokens, dims))
        c.offset = tokens
        cache.append(c)
    mx.eval([c.state for c in cache])
    folder = str(work / "load")
    tier = DiskTier(folder, 1 << 40, "load")
    key = list(range(tokens))
    tier.put(key, cache, "prompt")
    assert tier.flush(600)
    handle = tier.find(key + [0])[1]
    del cache
    tier.load(handle)
    warm = []
    for _ in range(runs):
        tic = time.perf_counter()
        assert tier.load(handle) is not None
        warm.append(time.perf_counter() - tic)
    tier.close()
    first = [float(subprocess.check_output([sys.executable, "-c", LOAD_ONCE, folder]))
             for _ in range(runs)]
    return {
        "entry MB": round(handle.nbytes / 1e6, 1),
        "load ms, warm: median, min": [round(1000 * statistics.median(warm), 1),
                                       round(1000 * min(warm), 1)],
        "load ms, first in a fresh process: median, min": [
            round(1000 * statistics.median(first), 1), round(1000 * min(first), 1)],
        "runs": runs,
    }


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
    p.add_argument("--restarts", type=int, default=3,
                   help="times the same-turn disk hits are measured (default: 3)")
    p.add_argument("--load", action="store_true",
                   help="time DiskTier.load alone (no server; see above)")
    p.add_argument("--runs", type=int, default=15, help="--load's repetitions")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    if args.load:
        try:
            out = measure_load(args.tokens, args.runs, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print_figures(out, args.json)
        return out
    model = args.model
    if args.quick:
        args.tokens = min(args.tokens, 1000)
        if model is None:
            from testkit.fixtures import build_fixture

            model = str(build_fixture("qwen3", work / "fixtures"))
    if model is None:
        from mlx_lm_plus.models.demo import demo_model_path

        model = str(demo_model_path())
    tic = time.perf_counter()
    try:
        out = measure(model, args.tokens, args.turns, args.max_tokens, work, args.restarts)
    finally:
        shutil.rmtree(work / "prompt-cache", ignore_errors=True)
    out["seconds"] = round(time.perf_counter() - tic, 1)
    print_figures(out, args.json)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
