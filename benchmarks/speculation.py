"""Prompt lookup (--prompt-lookup-tokens) against plain batching, A B.

    python -m benchmarks.speculation                     # the demo model
    python -m benchmarks.speculation --lines 300 --rounds 3
    python -m benchmarks.speculation --model-kind qwen3  # a tiny fixture

Each round starts the server twice, fresh (plain, then with
--prompt-lookup-tokens; the order alternates by round), and on each runs
two workloads, greedy, at 1 and at --concurrency streams:
- code_edit: a --lines-line Python file in the prompt and "write it out
  again with one name changed": the answer repeats its context.
- free: a story from a one-line prompt, greedy (a small model's story
  repeats itself: there is something to copy after all).
- sampled: the same at temperature 1, top_p 0.95: next to nothing repeats
  (text not compared: it is sampled).
- json_edit: structured output (response_format json_schema) that repeats
  its context: a JSON list of --lines / 6 records in the prompt, "return it
  with one record's price changed", the answer held to the records' schema
  (each position of a check masked as the grammar masks it).

Figures, medians over rounds: decode tokens/s of all streams together
(tokens after each stream's first over the time they took, from the last
first token to the first last one; one stream: its own), the ratio
lookup/plain, tokens per model step (generated tokens over the steps that
wrote them: one per step plus the proposals kept, from /v1/stats), and
whether each request's text was the same with and without proposals.
"""

import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.harness import (ab_parser, fixture_or_model, get_json, median, print_figures,
                                session, stream_chat, window_rate)
from compat.launch import OURS, ServerProcess

NAMES = ("total", "count", "price", "value", "index", "offset", "width", "height",
         "weight", "score", "limit", "amount", "length", "factor")


def source_file(lines: int, seed: int) -> str:
    """Python source of about `lines` lines: small functions, varied names."""
    rng = random.Random(seed)
    out = []
    n = 0
    while len(out) < lines:
        a, b, c = rng.sample(NAMES, 3)
        n += 1
        out += [f"def {a}_{b}_{n}({a}, {b}):",
                f'    """Return the {c} of {a} and {b}."""',
                f"    {c} = {a} * {rng.randint(2, 9)} + {b}",
                f"    if {c} > {rng.randint(10, 99)}:",
                f"        {c} -= {b}",
                f"    return {c}",
                ""]
    return "\n".join(out[:lines])


# json_edit's records and their schema (the answer's response_format).
RECORD_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                     "price": {"type": "number"}, "tags": {
                                         "type": "array", "items": {"type": "string"}}},
    "required": ["id", "name", "price", "tags"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def records(count: int, seed: int) -> str:
    """A JSON object of `count` records, as RECORD_SCHEMA has them."""
    rng = random.Random(seed)
    items = [{"id": n, "name": f"{rng.choice(NAMES)} {rng.choice(NAMES)}",
              "price": round(rng.uniform(1, 99), 2),
              "tags": rng.sample(NAMES, 2)} for n in range(count)]
    return json.dumps({"items": items})


def bodies(workload: str, streams: int, lines: int, max_tokens: int) -> List[dict]:
    out = []
    for i in range(streams):
        extra: Dict[str, Any] = {}
        if workload == "json_edit":
            prompt = (f"Here is a JSON document:\n{records(max(2, lines // 6), seed=i)}\n"
                      f"Return the same JSON document, with the price of the record whose "
                      f"id is {i} changed to 1.5. Only the JSON.")
            extra = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "records", "schema": RECORD_SCHEMA}}}
        elif workload == "code_edit":
            text = source_file(lines, seed=i)
            old = NAMES[i % len(NAMES)]
            prompt = (f"Here is a Python file:\n```python\n{text}\n```\n"
                      f"Write out the whole file again, unchanged except that the "
                      f"variable `{old}` is renamed to `{old}_{i}`. Only the code.")
        else:
            prompt = f"Tell me a long story about a {NAMES[i]} in the mountains, {i}."
        sampling = ({"temperature": 1.0, "top_p": 0.95} if workload == "sampled"
                    else {"temperature": 0.0})
        out.append({"messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, **sampling, **extra})
    return out


async def _workload(url, batch):
    async with session() as http:
        # (Prompts are prefilled first, one request each, and not timed: the
        # figure is decode. Their answers are then generated together.)
        for body in batch:
            async with http.post(url + "/v1/chat/completions",
                                 json={**body, "max_tokens": 1, "stream": False}) as r:
                await r.read()
        before = (await get_json(http, url, "/v1/stats"))["engine"]
        results = await asyncio.gather(*(stream_chat(http, url, b) for b in batch))
        after = (await get_json(http, url, "/v1/stats"))["engine"]
    arrivals = [s.arrivals for s in results]
    tokens = [s.usage["completion_tokens"] for s in results]
    lookup_before, lookup_after = before.get("prompt_lookup"), after.get("prompt_lookup")
    accepted = (lookup_after["accepted_tokens"] - lookup_before["accepted_tokens"]
                if lookup_before and lookup_after else 0)
    generated = sum(tokens)
    return {"decode_tps": window_rate(arrivals, tokens),
            "tokens_per_step": round(generated / max(1, generated - accepted), 3),
            "generated": generated, "texts": [s.text for s in results]}


def main(argv=None) -> Dict[str, Any]:
    parser = ab_parser(__doc__.splitlines()[0], default_kind="", rounds=3)
    parser.add_argument("--lines", type=int, default=300, help="lines of the code_edit file")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--lookup-tokens", type=int, default=8,
                        help="--prompt-lookup-tokens of the lookup server")
    parser.add_argument("--workloads", default="code_edit,free,sampled")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-speculation-"))
    if args.model or args.model_kind:
        model = fixture_or_model(args, work)
    else:
        from mlx_lm_plus.models.demo import demo_model_path

        model = str(demo_model_path())
    cases = [(w, n) for w in args.workloads.split(",") for n in sorted({1, args.concurrency})]

    def measure(server, round_):
        out = {}
        for workload, streams in cases:
            out[f"{workload}@{streams}"] = asyncio.run(_workload(
                server.url, bodies(workload, streams, args.lines, args.max_tokens)))
        return out

    def describe(figures):
        return "  ".join(f"{k}: {v['decode_tps'] and round(v['decode_tps'], 1)} tok/s, "
                         f"{v['tokens_per_step']}/step" for k, v in figures.items())

    servers = {"plain": (OURS, []),
               "lookup": (OURS, ["--prompt-lookup-tokens", str(args.lookup_tokens)])}
    runs = {name: [] for name in servers}
    for round_ in range(args.rounds):
        # (A B, then B A: neither always goes first.)
        for name in list(servers)[::1 if round_ % 2 == 0 else -1]:
            command, extra = servers[name]
            with ServerProcess(command, ["--model", model, *extra],
                               log=work / f"{name}.log") as server:
                runs[name].append(measure(server, round_))
            print(f"round {round_ + 1} {name:>8}: {describe(runs[name][-1])}", flush=True)
    figures: Dict[str, Any] = {"model": model, "lines": args.lines, "rounds": args.rounds,
                               "max_tokens": args.max_tokens}
    for case in (f"{w}@{n}" for w, n in cases):
        plain = median([r[case]["decode_tps"] for r in runs["plain"]])
        lookup = median([r[case]["decode_tps"] for r in runs["lookup"]])
        figures[f"{case} plain tok/s"] = plain and round(plain, 2)
        figures[f"{case} lookup tok/s"] = lookup and round(lookup, 2)
        figures[f"{case} ratio"] = plain and lookup and round(lookup / plain, 3)
        figures[f"{case} tokens/step"] = median([r[case]["tokens_per_step"]
                                                 for r in runs["lookup"]])
        if not case.startswith("sampled"):
            figures[f"{case} same text"] = all(
                a[case]["texts"] == b[case]["texts"]
                for a in runs["plain"] for b in runs["lookup"])
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
