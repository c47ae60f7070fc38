"""Several models in one server (--model A --model B), against upstream.

    python -m benchmarks.models [--models A B] [--rounds 3]

Figures (medians over --rounds):
  * time to first token of a request whose model must be loaded first (it
    was unloaded with keep_alive 0), and of the same request once loaded;
  * a frontend switching models: requests alternate A, B, A, B. Upstream
    unloads one model to load the other at every switch; ours keeps both;
  * decode throughput of A and B streaming at once against each alone
    (one generation thread steps both batches in turn);
  * what a load costs the model already running: the largest gap between
    A's tokens while B loads and runs its first steps (its prefill, which
    takes turns with A's decode), against A alone.
Default models: two tiny fixtures (qwen3 and llama). On them a load takes
milliseconds; a real model's load is seconds, which is what the switch and
the stall figures then show.
"""

import argparse
import asyncio
import tempfile
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from benchmarks.harness import Client, median, print_figures, session
from compat.launch import OURS, UPSTREAM, ServerProcess
from testkit.fixtures import build_fixture

PROMPT = "Write a long story about a village by the sea, with boats and a storm."


def messages(i):
    return [{"role": "user", "content": f"{PROMPT} Chapter {i}."}]


async def ttft(client, http, model, i, **extra):
    row = await client.chat(http, messages(i), extra={"model": model, **extra}, stream=True)
    return row.ttft


async def decode_rate(client, http, model, i):
    """Tokens after the first per second of one streamed request, and its
    largest gap between two tokens."""
    row = await client.chat(http, messages(i), extra={"model": model}, stream=True)
    gaps = [b - a for a, b in zip(row.arrivals, row.arrivals[1:])]
    rate = (len(row.arrivals) - 1) / (row.arrivals[-1] - row.arrivals[0])
    return rate, max(gaps)


async def ours_figures(url, tokenizer, a, b, rounds, max_tokens):
    client = Client(url, tokenizer, max_tokens)
    short = Client(url, tokenizer, 4)
    figures = {}
    async with session() as http:
        await short.chat(http, messages(0), extra={"model": b}, stream=True)  # warm up
        cold, warm = [], []
        for r in range(rounds):
            # B unloaded once its request is done (keep_alive 0), then asked for.
            await short.chat(http, messages(1), extra={"model": b, "keep_alive": 0})
            await asyncio.sleep(0.6)
            cold.append(await ttft(short, http, b, 100 + r))
            warm.append(await ttft(short, http, b, 200 + r))
        figures["ttft needing a load (s)"] = round(median(cold), 4)
        figures["ttft loaded (s)"] = round(median(warm), 4)

        alone_a, alone_b, both_a, both_b, base_gap, load_gap = [], [], [], [], [], []
        for r in range(rounds):
            alone_a.append((await decode_rate(client, http, a, 300 + r))[0])
            alone_b.append((await decode_rate(client, http, b, 400 + r))[0])
            (ra, _), (rb, _) = await asyncio.gather(decode_rate(client, http, a, 500 + r),
                                                    decode_rate(client, http, b, 600 + r))
            both_a.append(ra)
            both_b.append(rb)
            base_gap.append((await decode_rate(client, http, a, 700 + r))[1])
            # B unloaded, then loaded while A streams.
            await short.chat(http, messages(1), extra={"model": b, "keep_alive": 0})
            await asyncio.sleep(0.6)
            streaming = asyncio.ensure_future(decode_rate(client, http, a, 800 + r))
            await asyncio.sleep(0.05)
            await short.chat(http, messages(900 + r), extra={"model": b})
            load_gap.append((await streaming)[1])
        figures["decode tok/s A alone"] = round(median(alone_a), 1)
        figures["decode tok/s B alone"] = round(median(alone_b), 1)
        figures["decode tok/s A+B at once (sum)"] = round(median(
            [x + y for x, y in zip(both_a, both_b)]), 1)
        figures["A's largest token gap (s): alone"] = round(median(base_gap), 4)
        figures["A's largest token gap (s): while B loads and starts"] = round(median(load_gap), 4)
    return figures


async def switching(url, tokenizer, a, b, rounds):
    """Median TTFT of requests alternating between models A and B."""
    client = Client(url, tokenizer, 4)
    times = []
    async with session() as http:
        for i in range(2 * rounds + 2):
            t = await ttft(client, http, (a, b)[i % 2], 1000 + i)
            if i >= 2:  # (both seen once)
                times.append(t)
    return median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs=2, help="two model folders (default: fixtures)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp())
    a, b = args.models or [str(build_fixture(k, work)) for k in ("qwen3", "llama")]
    tokenizer = load_tokenizer(Path(a))
    figures = {}
    with ServerProcess(OURS, ["--model", a, "--model", b], log=work / "ours.log") as s:
        figures.update(asyncio.run(ours_figures(s.url, tokenizer, a, b, args.rounds,
                                                args.max_tokens)))
        ours_switch = asyncio.run(switching(s.url, tokenizer, a, b, args.rounds))
    with ServerProcess(UPSTREAM, ["--model", a], log=work / "upstream.log") as s:
        theirs_switch = asyncio.run(switching(s.url, tokenizer, a, b, args.rounds))
    figures["switching A/B ttft (s): upstream"] = round(theirs_switch, 4)
    figures["switching A/B ttft (s): ours"] = round(ours_switch, 4)
    figures["switching A/B ttft: ours/upstream"] = round(ours_switch / theirs_switch, 3)
    print_figures(figures, args.json)


if __name__ == "__main__":
    main()
