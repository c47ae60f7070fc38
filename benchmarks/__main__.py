"""Benchmarks side by side with upstream mlx_lm.server (or any other server).

    python -m benchmarks run --model-kind hybrid --workload multiturn --against upstream
    python -m benchmarks run --model-kind hybrid --all --rounds 3 --json out.json
    python -m benchmarks run --model PATH --all --against "my-server --flag"
    python -m benchmarks run --model-kind hybrid --workload multiturn --against-tree /tmp/old
        (/tmp/old: an earlier commit, e.g. `git archive HEAD~1 | tar -x -C /tmp/old`)

For each workload and round, each server is started fresh on a free
loopback port, driven with streaming clients, and stopped; the order
alternates (A B, then B A) because timings on shared machines drift. Counts
(recomputed / novel prompt tokens) do not drift; timings are reported as
medians over the rounds, and every figure as the ratio ours / theirs.

Model kinds: `attention` (tiny qwen3 fixture), `hybrid` (tiny qwen3_5),
`mid` (random qwen3, 8 layers, hidden 512: prefill dominates), `vision`
(tiny qwen2_vl), `vision-hybrid` (tiny qwen3_5 with vision), `demo` (the
embedded SmolLM2-135M), or any kind of testkit/fixtures.py.
"""

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from benchmarks.harness import add_model_args, fixture_or_model, median, session, window_rate
from benchmarks.workloads import (
    ADMISSION_STEP,
    OVERHEAD_TOKENS,
    VISION_WORKLOADS,
    WORKLOADS,
    Run,
    overhead_messages,
)
from compat.launch import OURS, UPSTREAM, ServerProcess

KINDS = {"attention": "qwen3", "hybrid": "qwen3_5", "mid": "qwen3_mid", "vision": "qwen2_vl",
         "vision-hybrid": "qwen3_5_vl"}


def resolve_model(args, work: Path) -> str:
    """The model both servers get: a folder here is made absolute (a server
    run in another checkout, --against-tree, resolves a relative one there)."""
    if not args.model and args.model_kind == "demo":
        from mlx_lm_plus.models.demo import demo_model_path

        return str(demo_model_path())
    args.model_kind = KINDS.get(args.model_kind, args.model_kind)
    model = fixture_or_model(args, work / "fixtures")
    return str(Path(model).resolve()) if Path(model).exists() else model


def bare_loop(model_path: str, max_tokens: int = OVERHEAD_TOKENS):
    """A bare BatchGenerator loop on the overhead prompts (loaded once): a
    function of the batch size giving (end-to-end tok/s, decode tok/s), where
    decode is each row's tokens after its first over the time from its first
    token to its last, summed over the rows (as the overhead workload counts
    a server's streams)."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = load(model_path)

    def tps(size: int):
        prompts = [tokenizer.apply_chat_template(overhead_messages(i), add_generation_prompt=True)
                   for i in range(size)]
        generator = BatchGenerator(model)
        generator.insert(prompts[:1], max_tokens=[4])  # warm-up
        while any(generator.next()):
            pass
        e2e, decode = [], []
        for _ in range(3):  # the median of three: single runs scatter here
            start = time.perf_counter()
            generator.insert(prompts, max_tokens=[max_tokens] * size)
            tokens, arrivals = 0, {}
            while True:
                prompt_responses, gen_responses = generator.next()
                if not prompt_responses and not gen_responses:
                    break
                now = time.perf_counter()
                tokens += len(gen_responses)
                for r in gen_responses:
                    arrivals.setdefault(r.uid, []).append(now)
            e2e.append(tokens / (time.perf_counter() - start))
            decode.append(window_rate(list(arrivals.values()),
                                      [len(a) for a in arrivals.values()]))
        generator.close()
        return median(e2e), median(decode)

    return tps


@dataclass
class Launch:
    """A server's command, and the checkout it runs in (None: this folder)."""
    command: List[str]
    cwd: Optional[Path] = None

    def server(self, args: List[str], log: Optional[Path] = None) -> ServerProcess:
        return ServerProcess(self.command, args, log=log, cwd=self.cwd,
                             env=dict(PYTHONPATH=str(self.cwd)) if self.cwd else None)


def run_once(command: Launch, model, name, args, tokenizer, bare, log) -> dict:
    extra = []
    if name == "memory":
        extra = ["--prompt-cache-bytes", str(args.memory_budget)]
    elif name == "admission":
        extra = ["--prefill-step-size", str(ADMISSION_STEP)]
    server = command.server(["--model", model, *extra], log=log)

    async def drive():
        async with session() as http:
            run = Run(server.url, tokenizer, http, args.max_tokens, args.smoke, bare)
            return await WORKLOADS[name](run)

    try:  # (stopped whatever happens, ^C too: its own session would outlive us)
        try:
            server.start()
        except (TimeoutError, RuntimeError, OSError):  # (upstream can't load SmolVLM)
            return {"error": f"the server did not start (its log: {log})"}
        try:
            return asyncio.run(drive())
        except RuntimeError as e:  # the server refused the workload's requests
            return {"error": str(e)[:120]}
    finally:
        server.stop()


def combine(per_round):
    """Medians of numbers over rounds; other values from the first round."""
    out = {}
    for key in dict.fromkeys(k for r in per_round for k in r):
        values = [r.get(key) for r in per_round]
        if all(isinstance(v, (int, float)) or v is None for v in values):
            out[key] = median([v for v in values if v is not None])
        else:
            out[key] = values[0]
    return out


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    if isinstance(v, list):
        return " ".join(_fmt(x) for x in v)
    return str(v)


def print_table(name, results, labels):
    ours, theirs = results[labels[0]], results[labels[1]]
    print(f"\n## {name}")
    print(f"{'figure':<44} {labels[1]:>12} {labels[0]:>12} {'ours/theirs':>12}")
    for key in dict.fromkeys([*ours, *theirs]):
        a, b = ours.get(key), theirs.get(key)
        ratio = (f"{a / b:.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float))
                 and b else "-")
        if isinstance(a, (list, str)) or isinstance(b, (list, str)):
            print(f"{key + ' (round 1)':<44}\n    {labels[1]}: {_fmt(b)}\n    {labels[0]}: {_fmt(a)}")
        else:
            print(f"{key:<44} {_fmt(b):>12} {_fmt(a):>12} {ratio:>12}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run workloads against both servers")
    add_model_args(p, "hybrid")  # kinds: see KINDS, demo, or a fixture
    p.add_argument("--workload", action="append", choices=list(WORKLOADS))
    p.add_argument("--all", action="store_true", help="every workload")
    p.add_argument("--against", default="upstream",
                   help='"upstream" (mlx_lm.server 0.32.2) or a launch command that takes '
                        "--model, --host and --port (run in this folder: a `python -m "
                        "mlx_lm_plus.server` there imports this folder's code, whatever "
                        "PYTHONPATH says; see --against-tree)")
    p.add_argument("--against-tree", type=Path,
                   help="another checkout of this project (an earlier commit): its server, "
                        "run in that folder, is the other side")
    p.add_argument("--rounds", type=int, default=2, help="A B rounds (alternating order)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--memory-budget", type=int, default=4 << 20,
                   help="--prompt-cache-bytes of both servers in the memory workload")
    p.add_argument("--smoke", action="store_true", help="short workloads: does it all run")
    p.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    if args.against_tree:
        args.against_tree = args.against_tree.resolve()
        if not (args.against_tree / "mlx_lm_plus" / "server.py").is_file():
            parser.error(f"--against-tree {args.against_tree}: no mlx_lm_plus/server.py there")

    names = list(WORKLOADS) if args.all or not args.workload else args.workload
    work = Path(tempfile.mkdtemp(prefix="mlx_lm_plus-bench-"))
    model = resolve_model(args, work)
    from mlx_lm_plus.models.vision import is_vision_model

    if not is_vision_model(model):
        names = [n for n in names if n not in VISION_WORKLOADS]
    labels = ("ours", "upstream" if args.against == "upstream" and not args.against_tree
              else "theirs")
    if args.against_tree:
        other = Launch(OURS, args.against_tree)
    else:
        other = Launch(UPSTREAM if args.against == "upstream" else shlex.split(args.against))
    servers = {labels[0]: Launch(OURS), labels[1]: other}

    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    bare = bare_loop(model) if "overhead" in names else None

    report = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "model": model, "model_kind": None if args.model else args.model_kind,
        "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rounds": args.rounds, "smoke": args.smoke, "workloads": {},
        "servers": {label: {"command": launch.command, "cwd": str(launch.cwd or os.getcwd())}
                    for label, launch in servers.items()},
    }
    try:
        import mlx.core as mx
        import mlx_lm

        report["machine"]["mlx"] = mx.__version__
        report["machine"]["mlx_lm"] = mlx_lm.__version__
    except Exception:
        pass
    for label, launch in servers.items():
        print(f"{label}: {' '.join(launch.command)} (in {launch.cwd or os.getcwd()})")
    print(f"model: {model}\nmachine: {report['machine']}\nrounds: {args.rounds} "
          f"(alternating order), max_tokens {args.max_tokens}{', smoke' if args.smoke else ''}")
    for name in names:
        per_round = {label: [] for label in labels}
        for r in range(args.rounds):
            order = labels if r % 2 == 0 else labels[::-1]
            for label in order:
                log = work / f"{name}-{label}-{r}.log"
                per_round[label].append(
                    run_once(servers[label], model, name, args, tokenizer, bare, log))
        results = {label: combine(per_round[label]) for label in labels}
        report["workloads"][name] = {"median": results, "rounds": per_round}
        print_table(name, results, labels)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"\nfigures written to {args.json}")
    return report


if __name__ == "__main__":
    main()
