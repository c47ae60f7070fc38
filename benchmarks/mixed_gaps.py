"""Streams beside seeded and drafted ones: does any stream wait longer
because two of eight carry a `seed` and two speculate with a draft model?

    python -m benchmarks.mixed_gaps                          # tiny fixture
    python -m benchmarks.mixed_gaps --against-tree /tmp/old  # an older checkout too
    python -m benchmarks.mixed_gaps --model PATH --max-tokens 64
    python -m benchmarks.mixed_gaps --draft --model-kind qwen3_mid  # drafts too

Each round starts each server fresh and sends eight streams at once, twice:
all plain, then the same eight with two of them seeded (temperature 0.8,
`seed`) and, with `--draft`, two more speculating with the draft model
(`num_draft_tokens` 3; the server runs with `--draft-model`, by default the
small qwen3 fixture beside `--model-kind qwen3_mid`; the others
send `num_draft_tokens` 0). For each stream, its largest gap (the
request's send counts as the first arrival, so waiting to start counts)
with those pairs against the same stream's without; printed per server,
medians over rounds: the worst stream's ratio and the median one. Upstream
0.32.2 (and this server before seeds joined the batch) runs a seeded
request alone once the batch has drained, so the seeded streams wait for
all the others; before drafts joined the batch, every request of a server
with `--draft-model` ran alone.
"""

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.harness import (ab_parser, fixture_or_model, median, print_figures, session,
                                stream_chat)
from compat.launch import OURS, ServerProcess

STREAMS, SEEDED, DRAFTED = 8, (0, 1), (2, 3)


def body(i: int, mixed: bool, max_tokens: int, draft: bool) -> dict:
    out = {"messages": [{"role": "user", "content": f"Stream {i}: tell me about the sea."}],
           "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if mixed and i in SEEDED:
        out.update(seed=100 + i, temperature=0.8)
    if draft:
        out["num_draft_tokens"] = 3 if mixed and i in DRAFTED else 0
    return out


async def _stream(http, url: str, request: dict) -> float:
    """The largest gap between arrivals, the send counting as the first."""
    streamed = await stream_chat(http, url, request)
    times = [streamed.sent] + streamed.arrivals
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


async def _eight(url: str, mixed: bool, max_tokens: int, draft: bool) -> List[float]:
    async with session() as http:
        return await asyncio.gather(*(
            _stream(http, url, body(i, mixed, max_tokens, draft)) for i in range(STREAMS)))


def main(argv=None) -> Dict[str, Any]:
    parser = ab_parser(__doc__.splitlines()[0], default_kind="qwen3", rounds=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--draft", action="store_true",
                        help="two streams speculate with a draft model")
    parser.add_argument("--draft-model", help="the draft (default: the fixture --draft-kind)")
    parser.add_argument("--draft-kind", default="qwen3",
                        help="the draft's fixture (qwen3: 2 layers of 64, beside "
                             "--model-kind qwen3_mid's 8 of 512)")
    parser.add_argument("--against-tree", type=Path,
                        help="another checkout of this project: its server, beside ours")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-mixed-gaps-"))
    model = fixture_or_model(args, work)
    draft = args.draft_model or (fixture_or_model(argparse.Namespace(model=None), work,
                                                  args.draft_kind) if args.draft else None)
    servers = {"ours": None}
    if args.against_tree:
        servers["theirs"] = args.against_tree.resolve()
    runs = {name: [] for name in servers}
    for round_ in range(args.rounds):
        for name, cwd in servers.items():
            argv = ["--model", model] + (["--draft-model", draft] if args.draft else [])
            with ServerProcess(OURS, argv, cwd=cwd, log=work / f"{name}.log") as server:
                asyncio.run(_eight(server.url, False, 4, args.draft))  # (warm: loaded, compiled)
                plain = asyncio.run(_eight(server.url, False, args.max_tokens, args.draft))
                mixed = asyncio.run(_eight(server.url, True, args.max_tokens, args.draft))
            ratios = [s / p for s, p in zip(mixed, plain)]
            runs[name].append({"worst": max(ratios), "median": median(ratios),
                               "seeded_streams": max(ratios[i] for i in SEEDED),
                               "plain_largest_gap": max(plain),
                               "mixed_largest_gap": max(mixed)})
            if args.draft:
                runs[name][-1]["drafted_streams"] = max(ratios[i] for i in DRAFTED)
            print(f"round {round_ + 1} {name:>6}: largest-gap ratios "
                  f"{[round(r, 2) for r in ratios]}", flush=True)
    figures: Dict[str, Any] = {"model": model, "draft": draft, "rounds": args.rounds,
                               "max_tokens": args.max_tokens}
    for name in servers:
        for key in ("worst", "median", "seeded_streams", "drafted_streams",
                    "plain_largest_gap", "mixed_largest_gap"):
            if key not in runs[name][0]:
                continue
            label = (f"{name} {key} (s)" if key.endswith("gap")
                     else f"{name} {key} stream ratio")
            figures[label] = round(median([r[key] for r in runs[name]]), 3)
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
