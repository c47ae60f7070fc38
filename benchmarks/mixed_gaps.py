"""Streams beside seeded ones: does any stream wait longer because two of
eight carry a `seed`?

    python -m benchmarks.mixed_gaps                          # tiny fixture
    python -m benchmarks.mixed_gaps --against-tree /tmp/old  # an older checkout too
    python -m benchmarks.mixed_gaps --model PATH --max-tokens 64

Each round starts each server fresh and sends eight streams at once, twice:
all unseeded, then the same eight with two of them seeded (temperature 0.8,
`seed`). For each stream, its largest gap (the request's send counts as the
first arrival, so waiting to start counts) with the seeded pair against the
same stream's without; printed per server, medians over rounds: the worst
stream's ratio and the median one. Upstream 0.32.2 (and this server before
seeds joined the batch) runs a seeded request alone once the batch has
drained, so the seeded streams wait for all the others.
"""

import asyncio
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.harness import (ab_parser, fixture_or_model, median, print_figures, session,
                                stream_chat)
from compat.launch import OURS, ServerProcess

STREAMS, SEEDED = 8, (0, 1)


def body(i: int, seeded: bool, max_tokens: int) -> dict:
    out = {"messages": [{"role": "user", "content": f"Stream {i}: tell me about the sea."}],
           "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if seeded:
        out.update(seed=100 + i, temperature=0.8)
    return out


async def _stream(http, url: str, request: dict) -> float:
    """The largest gap between arrivals, the send counting as the first."""
    streamed = await stream_chat(http, url, request)
    times = [streamed.sent] + streamed.arrivals
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


async def _eight(url: str, with_seeds: bool, max_tokens: int) -> List[float]:
    async with session() as http:
        return await asyncio.gather(*(
            _stream(http, url, body(i, with_seeds and i in SEEDED, max_tokens))
            for i in range(STREAMS)))


def main(argv=None) -> Dict[str, Any]:
    parser = ab_parser(__doc__.splitlines()[0], default_kind="qwen3", rounds=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--against-tree", type=Path,
                        help="another checkout of this project: its server, beside ours")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-mixed-gaps-"))
    model = fixture_or_model(args, work)
    servers = {"ours": None}
    if args.against_tree:
        servers["theirs"] = args.against_tree.resolve()
    runs = {name: [] for name in servers}
    for round_ in range(args.rounds):
        for name, cwd in servers.items():
            with ServerProcess(OURS, ["--model", model], cwd=cwd,
                               log=work / f"{name}.log") as server:
                asyncio.run(_eight(server.url, False, 4))  # (warm: loaded, compiled)
                plain = asyncio.run(_eight(server.url, False, args.max_tokens))
                seeded = asyncio.run(_eight(server.url, True, args.max_tokens))
            ratios = [s / p for s, p in zip(seeded, plain)]
            runs[name].append({"worst": max(ratios), "median": median(ratios),
                               "seeded_streams": max(ratios[i] for i in SEEDED)})
            print(f"round {round_ + 1} {name:>6}: largest-gap ratios "
                  f"{[round(r, 2) for r in ratios]}", flush=True)
    figures: Dict[str, Any] = {"model": model, "rounds": args.rounds,
                               "max_tokens": args.max_tokens}
    for name in servers:
        for key in ("worst", "median", "seeded_streams"):
            figures[f"{name} {key} stream ratio"] = round(
                median([r[key] for r in runs[name]]), 2)
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
