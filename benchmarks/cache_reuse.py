"""Prompt tokens recomputed per novel prompt token, ours vs upstream.

    python -m benchmarks.cache_reuse --kind qwen3_5            # tiny hybrid fixture
    python -m benchmarks.cache_reuse --model PATH --json out.json

For every request: recomputed = prompt_tokens - usage.cached_tokens (what the
server says it did not reuse), and novel = prompt tokens no earlier request
could have provided: the prompt minus its longest common prefix with any
earlier request's prompt + generated tokens. An ideal cache scores 1.0; a
cache that recomputes the history scores more. Both servers get the same
requests in the same order, one at a time, greedy.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from compat.launch import OURS, UPSTREAM, ServerProcess
from mlx_lm_plus.planning.checkpoints import common_prefix

SYSTEM = ("You are a meticulous travel-planning assistant. You answer with short "
          "numbered lists, you name every city, and you count the days. ") * 12


def _user(c, t, variant=""):
    return (f"Conversation {c}, turn {t}{variant}: plan the next day by the river, "
            f"the sea and the mountain village, with bread, fruit and a boat.")


def _reply(server_reply):
    # Replies go back with a reasoning block the template drops.
    return f"<think>checking the plan</think>{server_reply}"


def run_conversation(client, c, turns, extra, system=SYSTEM, edits=()):
    """Turns of one conversation; returns the final message list."""
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": _user(c, t)})
        reply = client(messages, extra)
        messages.append({"role": "assistant", "content": _reply(reply)})
    return messages


def workloads():
    """name -> function(client) sending that workload's requests."""

    def multiturn(client, extra=None):
        run_conversation(client, 0, 8, extra or {})

    def divergent(client):
        for i in range(6):
            client([{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": _user(i, 0, " (a different question)")}], {})

    def branch(client):
        messages = run_conversation(client, 0, 8, {})[:-1]  # ends with the 8th user message
        for v in range(4):  # edit/regenerate the last user message
            client(messages[:-1] + [{"role": "user", "content": _user(0, 7, f" variant {v}")}], {})
        fifth = 1 + 2 * 4  # index of the 5th user message
        for v in range(2):  # edit the 5th user message
            client(messages[:fifth] + [{"role": "user", "content": _user(0, 4, f" edit {v}")}], {})

    def interleaved(client):
        convs = {c: [{"role": "system", "content": f"Profile {c}. " + SYSTEM}] for c in range(6)}
        for t in range(4):
            for c in range(6):
                convs[c].append({"role": "user", "content": _user(c, t)})
                reply = client(convs[c], {})
                convs[c].append({"role": "assistant", "content": _reply(reply)})

    def seeded(client):
        multiturn(client, {"seed": 7})

    return {"multiturn": multiturn, "divergent": divergent, "branch": branch,
            "interleaved": interleaved, "seeded": seeded}


class Recorder:
    """Sends chat requests and keeps what the figures need."""

    def __init__(self, server, tokenizer, max_tokens):
        self.server, self.tok, self.max_tokens = server, tokenizer, max_tokens
        self.seen = []  # prompt + generated tokens of earlier requests
        self.rows = []

    def __call__(self, messages, extra):
        status, r = self.server.post("/v1/chat/completions", {
            "messages": messages, "max_tokens": self.max_tokens, "logprobs": True, **extra})
        if status != 200:
            raise RuntimeError(f"{status}: {r}")
        prompt = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        generated = [c["id"] for c in r["choices"][0]["logprobs"]["content"]]
        reusable = max((common_prefix(prompt, s) for s in self.seen), default=0)
        usage = r["usage"]
        assert usage["prompt_tokens"] == len(prompt), (usage, len(prompt))
        self.rows.append({"prompt": len(prompt), "novel": len(prompt) - reusable,
                          "recomputed": len(prompt) - usage["prompt_tokens_details"]["cached_tokens"]})
        self.seen.append(prompt + generated)
        return r["choices"][0]["message"]["content"] or ""


def measure(command, model, tokenizer, names, log_dir, max_tokens, skip_first):
    out = {}
    for name in names:
        with ServerProcess(command, ["--model", model], log=log_dir / f"{name}.log") as server:
            rec = Recorder(server, tokenizer, max_tokens)
            workloads()[name](rec)
        rows = rec.rows[skip_first.get(name, 0):]
        novel = sum(r["novel"] for r in rows)
        recomputed = sum(r["recomputed"] for r in rows)
        out[name] = {"requests": len(rec.rows), "novel": novel, "recomputed": recomputed,
                     "ratio": round(recomputed / max(novel, 1), 3)}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="qwen3_5", help="fixture kind to build (testkit/fixtures.py)")
    p.add_argument("--model", help="use this model folder instead of a fixture")
    p.add_argument("--workload", action="append", help="one of the workloads (default: all)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-"))
    model = args.model
    if model is None:
        from testkit.fixtures import build_fixture

        model = str(build_fixture(args.kind, work / "fixtures"))
    from mlx_lm import load

    tokenizer = load(model)[1]
    names = args.workload or list(workloads())
    # Interleaved: turns 2..4 only (the first turns of 6 new conversations are
    # all novel but the system prompts' shared words).
    skip_first = {"interleaved": 6}
    results = {}
    for label, command in (("upstream", UPSTREAM), ("ours", OURS)):
        (work / label).mkdir()
        results[label] = measure(command, model, tokenizer, names, work / label,
                                 args.max_tokens, skip_first)

    print(f"model: {args.model or 'fixture ' + args.kind}   (recomputed / novel prompt tokens; "
          "ideal 1.0)")
    print(f"{'workload':<12} {'upstream':>10} {'ours':>10}   novel tokens")
    for name in names:
        u, o = results["upstream"][name], results["ours"][name]
        print(f"{name:<12} {u['ratio']:>10.2f} {o['ratio']:>10.2f}   {o['novel']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
