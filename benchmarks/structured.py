"""Structured output: decode speed constrained vs unconstrained, and the mask cost.

    python -m benchmarks.structured                       # tiny qwen3 fixture
    python -m benchmarks.structured --kind qwen3 --repeats 5
    python -m benchmarks.structured --model PATH --max-tokens 256 --json out.json

Starts our server on the model and streams chat completions, greedy, with
thinking off, at batch 1 (one request) and batch 8 (8 concurrent requests),
each run once with `response_format` (a nested JSON schema) and once without.
The schema is chosen so that its output can not be complete within
max_tokens (a `notes` array of at least 100 strings: 2+ tokens each), so both
kinds of request run exactly max_tokens decode steps and are compared on the
same amount of work (a finished JSON would end the request early). Runs
alternate A B, B A, ... (timings drift on shared machines); figures are
medians over --repeats.

Decode tok/s of a request = (completion_tokens - 1) / (time of its last
streamed chunk - time of its first): the first token's time, prefill, is out.
At batch 8 the table gives the median per-request rate and the aggregate:
sum(completion_tokens - 1) / (last chunk of any request - first chunk of any
request). ratio = constrained / unconstrained (goal: >= 0.9). The e2e ratio
compares completion_tokens / (last chunk - request sent) instead: prefill
included, but not fooled by a stream whose first chunks arrive late and
bunched (a tiny model decodes faster than a busy event loop forwards chunks).

Mask cost per token, two ways:
  llguidance alone   constraints.mask_cost on the tokens of a valid instance
                     of the schema: one mask + one consume per token
  processor          a ConstraintProcessor in this process, driven by
                     mlx-lm's stream_generate for max_tokens steps:
                     mask_seconds / steps (consume + mask + building the
                     masked logits; the forward pass overlaps it); skip it
                     with --no-processor-timing (it loads the model here too)
"""

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import aiohttp

from benchmarks.harness import fixture_or_model, stream_chat
from compat.launch import OURS, ServerProcess

# A nested object whose JSON can not be complete within a few hundred tokens:
# `notes` needs 100+ items (each at least `""` and `, `). Strings dominate the
# output, as in most real structured answers; the other fields exercise
# integers, enums, booleans and a nested object before it.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "id": {"type": "integer", "minimum": 0},
        "meta": {
            "type": "object",
            "properties": {
                "lang": {"enum": ["en", "fr", "ja"]},
                "draft": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                         "maxItems": 4},
            },
            "required": ["lang", "draft", "tags"],
            "additionalProperties": False,
        },
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 40},
                  "minItems": 100},
    },
    "required": ["title", "id", "meta", "notes"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "report", "schema": SCHEMA, "strict": True}}
# A valid instance, for mask_cost (llguidance's per-token work on real tokens).
SAMPLE = {
    "title": "Notes from the river trip",
    "id": 4021,
    "meta": {"lang": "en", "draft": False, "tags": ["boat", "bread", "night"]},
    "notes": [f"note {i}: the boat left at dawn, calm water" [:40] for i in range(100)],
}


def _messages(i: int) -> List[dict]:
    return [{"role": "user",
             "content": f"Request {i}: write a report of the trip as JSON, with many notes."}]


async def _one(session, url: str, i: int, max_tokens: int, constrained: bool) -> Dict[str, Any]:
    body = {
        "messages": _messages(i),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if constrained:
        body["response_format"] = RESPONSE_FORMAT
    streamed = await stream_chat(session, url, body)
    start, usage, finish = streamed.sent, streamed.usage, streamed.finish
    first, last = (streamed.arrivals[0], streamed.arrivals[-1]) if streamed.arrivals \
        else (None, None)
    tokens = usage["completion_tokens"] if usage else None
    rate = None
    if tokens and tokens > 1 and last is not None and last > first:
        rate = (tokens - 1) / (last - first)
    e2e = tokens / (last - start) if tokens and last is not None else None
    return {"start": start, "first": first, "last": last, "tokens": tokens, "rate": rate,
            "e2e": e2e, "finish": finish, "text": streamed.text}


async def _run(url: str, batch: int, max_tokens: int, constrained: bool, offset: int):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        rows = await asyncio.gather(*[_one(session, url, offset + i, max_tokens, constrained)
                                      for i in range(batch)])
    firsts = [r["first"] for r in rows if r["first"] is not None]
    lasts = [r["last"] for r in rows if r["last"] is not None]
    steps = sum((r["tokens"] or 1) - 1 for r in rows)
    aggregate = steps / (max(lasts) - min(firsts)) if firsts and max(lasts) > min(firsts) else None
    return {
        "per_request": statistics.median([r["rate"] for r in rows if r["rate"]] or [0.0]),
        "e2e": statistics.median([r["e2e"] for r in rows if r["e2e"]] or [0.0]),
        "aggregate": aggregate,
        "tokens": [r["tokens"] for r in rows],
        "finish": sorted({r["finish"] for r in rows}),
        "json_prefix_ok": all(r["text"].startswith('{"title": "') for r in rows)
        if constrained else None,
    }


def measure_server(model: str, batches: List[int], repeats: int, max_tokens: int,
                   log: Optional[Path] = None) -> Dict[str, Any]:
    """{batch: {"constrained": [run...], "free": [run...]}} on one server."""
    out: Dict[int, Dict[str, list]] = {b: {"constrained": [], "free": []} for b in batches}
    args = ["--model", model, "--max-tokens", str(max_tokens),
            "--decode-concurrency", str(max(batches))]
    with ServerProcess(OURS, args, log=log) as server:
        offset = 0
        # Warm-up: compile the schema, load the tokenizer's llguidance view,
        # and run the first (slow) batches of both kinds.
        for batch in batches:
            for constrained in (True, False):
                asyncio.run(_run(server.url, batch, min(max_tokens, 16), constrained, offset))
                offset += batch
        for rep in range(repeats):
            for batch in batches:
                order = (True, False) if rep % 2 == 0 else (False, True)  # A B, then B A
                for constrained in order:
                    run = asyncio.run(_run(server.url, batch, max_tokens, constrained, offset))
                    offset += batch
                    out[batch]["constrained" if constrained else "free"].append(run)
    return out


def processor_timing(model_path: str, max_tokens: int) -> Dict[str, float]:
    """A ConstraintProcessor driven by stream_generate in this process."""
    from mlx_lm import load, stream_generate

    from mlx_lm_plus.planning.constraints import ConstraintProcessor
    from mlx_lm_plus.planning.grammars import compile_response_format

    model, tokenizer = load(model_path)
    grammar = compile_response_format(RESPONSE_FORMAT)
    prompt = tokenizer.apply_chat_template(_messages(0), add_generation_prompt=True,
                                           enable_thinking=False)
    best = None
    for _ in range(3):
        proc = ConstraintProcessor(grammar, tokenizer, after_think=True)
        tic = time.perf_counter()
        n = 0
        for _ in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                 logits_processors=[proc]):
            n += 1
        total = time.perf_counter() - tic
        stats = proc.stats()
        stats["tokens"] = n
        stats["total_ms_per_token"] = 1e3 * total / max(n, 1)
        if best is None or stats["mask_ms_per_step"] < best["mask_ms_per_step"]:
            best = stats
    assert proc.error is None, proc.error
    return best


def llguidance_timing(model_path: str) -> Dict[str, float]:
    from mlx_lm.utils import load_tokenizer

    from mlx_lm_plus.planning.constraints import mask_cost
    from mlx_lm_plus.planning.grammars import compile_response_format

    tokenizer = load_tokenizer(Path(model_path))
    return mask_cost(compile_response_format(RESPONSE_FORMAT), tokenizer, json.dumps(SAMPLE),
                     repeat=5)


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def summarize(raw: Dict[int, Dict[str, list]]) -> List[Dict[str, Any]]:
    rows = []
    for batch, runs in raw.items():
        row: Dict[str, Any] = {"batch": batch}
        for kind in ("constrained", "free"):
            row[f"{kind} tok/s per request"] = statistics.median(
                r["per_request"] for r in runs[kind])
            row[f"{kind} e2e tok/s"] = statistics.median(r["e2e"] for r in runs[kind])
            aggregates = [r["aggregate"] for r in runs[kind] if r["aggregate"]]
            row[f"{kind} tok/s aggregate"] = statistics.median(aggregates) if aggregates else None
            row[f"{kind} tokens"] = sorted({t for r in runs[kind] for t in r["tokens"]})
            row[f"{kind} finish"] = sorted({f for r in runs[kind] for f in r["finish"]})
        row["constrained json ok"] = all(r["json_prefix_ok"] for r in runs["constrained"])
        free = row["free tok/s per request"]
        row["ratio per request"] = row["constrained tok/s per request"] / free if free else None
        fe = row["free e2e tok/s"]
        row["ratio e2e"] = row["constrained e2e tok/s"] / fe if fe else None
        fa, ca = row["free tok/s aggregate"], row["constrained tok/s aggregate"]
        row["ratio aggregate"] = ca / fa if fa and ca else None
        rows.append(row)
    return rows


def print_table(rows, mask, proc, args):
    print(f"model: {args.model or 'fixture ' + args.kind}   max_tokens {args.max_tokens}   "
          f"repeats {args.repeats}   {platform.machine()} {platform.system()}")
    print()
    print("| batch | unconstrained tok/s | constrained tok/s | ratio | "
          "unconstrained agg tok/s | constrained agg tok/s | agg ratio | e2e ratio | "
          "tokens/request |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tokens = sorted(set(r["free tokens"]) | set(r["constrained tokens"]))
        print(f"| {r['batch']} | {_fmt(r['free tok/s per request'])} | "
              f"{_fmt(r['constrained tok/s per request'])} | "
              f"{_fmt(r['ratio per request'], '.3f')}x | "
              f"{_fmt(r['free tok/s aggregate'])} | {_fmt(r['constrained tok/s aggregate'])} | "
              f"{_fmt(r['ratio aggregate'], '.3f')}x | {_fmt(r['ratio e2e'], '.3f')}x | "
              f"{tokens} |")
    print("tok/s: decode rate per request, (completion_tokens - 1) / (last chunk - first "
          "chunk), median; agg: all requests of a batch together; e2e ratio: the same ratio "
          "for completion_tokens / (last chunk - request sent), prefill included")
    print()
    if mask:
        print(f"mask cost, llguidance alone ({mask['tokens']} tokens of a valid instance): "
              f"median {mask['median_us']:.1f} us/token, p90 {mask['p90_us']:.1f} us, "
              f"max {mask['max_us']:.1f} us")
    if proc:
        print(f"mask cost, ConstraintProcessor in stream_generate ({proc['steps']} steps): "
              f"{1e3 * proc['mask_ms_per_step']:.1f} us/token "
              f"(whole step {1e3 * proc['total_ms_per_token']:.1f} us/token)")
    ok = all(r["constrained json ok"] for r in rows)
    finishes = sorted({f for r in rows for k in ("free finish", "constrained finish")
                       for f in r[k]})
    print(f"constrained outputs start as the schema's JSON: {ok}; finish reasons: {finishes}")


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="qwen3", help="fixture kind to build (testkit/fixtures.py)")
    p.add_argument("--model", help="use this model folder instead of a fixture")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128,
                   help="decode steps per request (the schema can't finish before 200)")
    p.add_argument("--batch", type=int, action="append",
                   help="concurrent requests (repeatable; default: 1 and 8)")
    p.add_argument("--no-processor-timing", action="store_true",
                   help="skip the in-process ConstraintProcessor timing (loads the model)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    batches = args.batch or [1, 8]

    work = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    model = fixture_or_model(args, work / "fixtures", kind=args.kind)

    raw = measure_server(model, batches, args.repeats, args.max_tokens, log=work / "server.log")
    rows = summarize(raw)
    mask = llguidance_timing(model)
    proc = None if args.no_processor_timing else processor_timing(model, args.max_tokens)
    print_table(rows, mask, proc, args)
    report = {
        "command": "python -m benchmarks.structured " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "model": args.model or args.kind,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "mask_cost_llguidance": mask,
        "mask_cost_processor": proc,
        "raw": {str(b): v for b, v in raw.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
