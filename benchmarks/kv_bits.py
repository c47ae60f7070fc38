"""--kv-bits under load: burst throughput with a quantized KV cache, batched.

    python -m benchmarks.kv_bits                      # qwen3_mid fixture (head dim 64)
    python -m benchmarks.kv_bits --model-kind qwen3_kv --max-tokens 128
                                                      # tiny, head dim 64: a step
                                                      # costs ~the same for 1 row or 8
    python -m benchmarks.kv_bits --rounds 5 --max-tokens 128
    python -m benchmarks.kv_bits --model PATH --json out.json

Servers, each with --quantized-kv-start 0 where it has --kv-bits (so short
prompts are quantized too):

  ours kv4 / ours kv8    mlx_lm_plus.server --kv-bits 4 / 8 (batched,
                         quantized_batch.py)
  ours float             mlx_lm_plus.server without --kv-bits
  upstream kv4 / kv8     mlx_lm.server --kv-bits 4 / 8 (one request at a time)

A burst is `--clients` concurrent non-streaming chat completions, greedy,
`--max-tokens` each, prompts distinct per client and round (so no burst hits
the prompt cache). Throughput = completion tokens of the burst / (last reply
- first request sent). Each round starts every server fresh, warms it up
(one small burst) and measures one burst; the order alternates (A B ..., then
... B A) because timings drift on shared machines. Figures are medians over
the rounds; ratios are medians of the per-round ratios (goals: ours kvN /
ours float >= 0.8, ours kvN / upstream kvN >= 3).

KV memory, two figures:
  peak batch KV    in this process, the same burst through a bare
                   BatchGenerator / QuantizedBatchGenerator: the largest sum of
                   the batch's cache `nbytes` (prompt and decode batches,
                   buffers as allocated: padded rows, 256-position steps), read
                   between steps (the float keys a layer's last float call
                   attends live only inside that call)
  server peak      ours only (/v1/stats memory.mlx_peak_bytes after the
                   burst): MLX's peak allocation of the server process,
                   weights and activations included
"""

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from benchmarks.harness import add_model_args, fixture_or_model, get_json, median, session
from compat.launch import OURS, UPSTREAM, ServerProcess

def messages(client: int, round_: int) -> List[dict]:
    """A short prompt (decode dominates), distinct per client and round."""
    return [{"role": "user", "content": f"Round {round_}, traveller {client}: the ferry "
             "leaves the north pier at seven. Describe the crossing in detail."}]


def configs(bits: List[int]):
    """(name, command, extra args) of every server."""
    out = [(f"ours kv{b}", OURS, ["--kv-bits", str(b), "--quantized-kv-start", "0"])
           for b in bits]
    out.append(("ours float", OURS, []))
    out += [(f"upstream kv{b}", UPSTREAM, ["--kv-bits", str(b), "--quantized-kv-start", "0"])
            for b in bits]
    return out


async def burst(url: str, clients: int, max_tokens: int, round_: int) -> Dict[str, Any]:
    async def one(http, i):
        body = {"messages": messages(i, round_), "max_tokens": max_tokens,
                "temperature": 0.0}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {await r.text()}")
            reply = await r.json()
        return reply["usage"]["completion_tokens"], time.perf_counter()

    async with session() as http:
        start = time.perf_counter()
        done = await asyncio.gather(*[one(http, i) for i in range(clients)])
        tokens = sum(t for t, _ in done)
        seconds = max(end for _, end in done) - start
        stats = await get_json(http, url, "/v1/stats")
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "mlx_peak_bytes": stats["memory"]["mlx_peak_bytes"] if stats else None}


def run_round(name, command, extra, model, args, round_, log) -> Dict[str, Any]:
    server_args = ["--model", model, *extra]
    with ServerProcess(command, server_args, log=log) as server:
        asyncio.run(burst(server.url, args.clients, 4, -1 - round_))  # warm-up
        result = asyncio.run(burst(server.url, args.clients, args.max_tokens, round_))
    print(f"  round {round_ + 1} {name:<14} {result['tok_s']:8.1f} tok/s "
          f"({result['tokens']} tokens in {result['seconds']:.2f} s)", flush=True)
    return result


def peak_batch_kv(model_path: str, bits: List[Optional[int]], clients: int,
                  max_tokens: int) -> Dict[str, int]:
    """{setting: the largest sum of batch cache nbytes over the burst's steps}."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from mlx_lm_plus.engine.quantized_batch import QuantizedBatchGenerator

    model, tokenizer = load(model_path)
    prompts = [tokenizer.apply_chat_template(messages(i, 0), add_generation_prompt=True)
               for i in range(clients)]
    out = {}
    for b in bits:
        if b is None:
            generator = BatchGenerator(model)
        else:
            generator = QuantizedBatchGenerator(model, kv_bits=b, quantized_kv_start=0)
        generator.insert(prompts, max_tokens=[max_tokens] * clients)
        peak = 0
        while any(generator.next()):
            caches = generator._prompt_batch.prompt_cache + generator._generation_batch.prompt_cache
            peak = max(peak, sum(c.nbytes for c in caches))
        generator.close()
        out["float" if b is None else f"kv{b}"] = peak
    return out


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_bits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "qwen3_mid")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bits", type=int, action="append", help="--kv-bits (default: 4 and 8)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    bits = args.bits or [4, 8]

    work = Path(tempfile.mkdtemp(prefix="bench-kv-bits-"))
    if not args.model:
        args.model = fixture_or_model(args, work / "fixtures")
    model = args.model
    servers = configs(bits)
    raw: Dict[str, List[Dict[str, Any]]] = {name: [] for name, _, _ in servers}
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else servers[::-1]  # A B ..., then ... B A
        for name, command, extra in order:
            raw[name].append(run_round(name, command, extra, model, args, r,
                                       work / f"{name.replace(' ', '_')}.log"))
    peaks = peak_batch_kv(model, [None, *bits], args.clients, args.max_tokens)

    def rate(name):
        return median([x["tok_s"] for x in raw[name]])

    def ratio(a, b):
        return median([x["tok_s"] / y["tok_s"] for x, y in zip(raw[a], raw[b])])

    print()
    print(f"model: {model}   {args.clients} clients x {args.max_tokens} tokens   "
          f"rounds {args.rounds}   {platform.machine()} {platform.system()}")
    print()
    print("| server | burst tok/s (median) | server MLX peak MB |")
    print("|---|---:|---:|")
    for name, _, _ in servers:
        peak = median([x["mlx_peak_bytes"] for x in raw[name]])
        print(f"| {name} | {_fmt(rate(name))} | {_fmt(peak and peak / 1e6)} |")
    print()
    ratios = {}
    for b in bits:
        ratios[f"ours kv{b} / ours float"] = ratio(f"ours kv{b}", "ours float")
        ratios[f"ours kv{b} / upstream kv{b}"] = ratio(f"ours kv{b}", f"upstream kv{b}")
    for name, value in ratios.items():
        goal = ">= 0.8" if "float" in name else ">= 3"
        print(f"{name:<28} {value:6.2f}x   (goal {goal})")
    print()
    print(f"peak batch KV, {args.clients} requests (sum of cache nbytes at the largest "
          "batch, in process):")
    for name, value in peaks.items():
        print(f"  {name:<6} {value / 1e6:8.2f} MB   ({value / peaks['float']:.3f}x float)")
    report = {
        "command": "python -m benchmarks.kv_bits " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "model": model, "clients": args.clients, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "tok_s": {name: rate(name) for name in raw},
        "ratios": ratios, "peak_batch_kv_bytes": peaks, "raw": raw,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
