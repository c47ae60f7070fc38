"""One process against two ranks on two (simulated) hosts.

    python -m benchmarks.hosts [--model-kind qwen3 | --model PATH] [--rounds 3]
    python -m benchmarks.hosts --pipeline --model-kind qwen2

The two ranks run tensor-parallel (or with --pipeline, pipelined: a model
mlx-lm pipelines, as the qwen2 fixture) over the ring backend, each in its own
network namespace (testkit/netns.py; needs root on Linux). Figures (medians
over --rounds, the two setups alternating which goes first): time to first
token and generated tokens per second for 1 client, and for 8 clients at
once (streamed, distinct prompts).

On this CPU machine both ranks share the same cores, so the figures show
what the collectives cost (two ranks do the work of one, plus an all_sum
per layer over the bridge), not the speed-up real hosts give a model that
needs them.
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from benchmarks.__main__ import resolve_model
from benchmarks.harness import Client, add_model_args, median, print_figures, session
from compat.launch import OURS, ServerProcess
from testkit import netns


async def burst(url, tokenizer, clients: int, max_tokens: int, tag: str):
    """`clients` streamed requests at once: (median TTFT, tokens per second
    over the burst's wall time)."""
    client = Client(url, tokenizer, max_tokens)
    async with session() as http:
        await client.chat(http, [{"role": "user", "content": "Warm up."}], stream=True,
                          record=False)
        tic = time.perf_counter()
        rows = await asyncio.gather(*[
            client.chat(http, [{"role": "user", "content":
                                f"{tag}: tell me a long story about river {i}."}],
                        stream=True) for i in range(clients)])
        seconds = time.perf_counter() - tic
    tokens = sum(r.output_tokens or len(r.arrivals) for r in rows)
    return median([r.ttft for r in rows]), tokens / seconds


def measure(url, tokenizer, max_tokens, round_no):
    out = {}
    for clients in (1, 8):
        ttft, rate = asyncio.run(burst(url, tokenizer, clients, max_tokens,
                                       f"round {round_no}"))
        out[f"{clients} client(s): TTFT (s)"] = ttft
        out[f"{clients} client(s): tokens/s"] = rate
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, "attention")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pipeline", action="store_true",
                        help="the ranks pipelined instead of tensor-parallel")
    args = parser.parse_args(argv)
    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"can't simulate hosts here: {reason}")
    work = Path(tempfile.mkdtemp(prefix="mlx_lm_plus-hosts-"))
    model = resolve_model(args, work)
    tokenizer = load_tokenizer(Path(model))
    runs = {"one process": [], "two ranks": []}
    with netns.Hosts(2) as hosts:
        for r in range(args.rounds):
            order = ["one process", "two ranks"][:: 1 if r % 2 == 0 else -1]
            for name in order:
                logs = work / f"{name.replace(' ', '-')}-{r}"
                logs.mkdir()
                if name == "one process":
                    server = ServerProcess(OURS, ["--model", model], log=logs / "server.log")
                else:
                    server = netns.RankServer(
                        hosts, ["--model", model, *(["--pipeline"] if args.pipeline else [])],
                        logs)
                with server:
                    runs[name].append(measure(server.url, tokenizer, args.max_tokens, r))
    figures = {}
    for key in runs["one process"][0]:
        one = median([run[key] for run in runs["one process"]])
        two = median([run[key] for run in runs["two ranks"]])
        figures[key] = {"one process": round(one, 4), "two ranks": round(two, 4),
                        "two / one": round(two / one, 3) if one else None}
    print(f"model: {model}; {'pipelined' if args.pipeline else 'tensor-parallel'}; "
          f"rounds: {args.rounds}; max_tokens {args.max_tokens}")
    print_figures(figures)


if __name__ == "__main__":
    main()
