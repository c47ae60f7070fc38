"""Bytes an 8-turn conversation's cache entries hold, against its longest
entry alone (state-only checkpoints over shared attention KV).

    python -m benchmarks.checkpoint_chain                  # fixtures
    python -m benchmarks.checkpoint_chain --model PATH --turns 8

The conversation runs through the engine in process (greedy, as a chat
client sends it: each turn resends the history). Then, for the store as it
is, printed: its entries, its bytes (KV, states and index), what the same
entries took as full copies (every entry its own KV: the store before the
tree held the KV) and what the longest entry takes alone in an empty store.
The goal is chain / longest <= 1.2: the checkpoints add only their
recurrent states.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.cache_reuse import SYSTEM, _reply, _user
from mlx_lm_plus.cache.layers import cache_nbytes
from mlx_lm_plus.cache.store import PromptStore

KINDS = ("qwen3_5", "mamba2", "gemma3_text", "qwen3")


def chain_figures(model_path: str, turns: int, max_tokens: int = 16) -> dict:
    from testkit.engine_harness import EngineRunner

    runner = EngineRunner(model_path)
    try:
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            messages.append({"role": "user", "content": _user(0, t)})
            tokens, _, _ = runner.run({"messages": messages, "max_tokens": max_tokens})
            text = runner.loaded.tokenizer.decode(tokens)
            messages.append({"role": "assistant", "content": _reply(text)})
        store = runner.store
        entries = store.entries()
        longest = max(entries, key=lambda e: e.ntokens)
        whole = {e: store.stored_cache(e) for e in entries}
        alone = PromptStore(max_bytes=1 << 40, bits=store.bits, group_size=store.group_size)
        alone.insert("m", list(longest.key), whole[longest], longest.kind)
        copies = sum(cache_nbytes(c) for c in whole.values())
        kinds = sorted({e.kind for e in entries})
        return {
            "entries": len(entries),
            "kinds": ",".join(kinds),
            "longest entry tokens": longest.ntokens,
            "chain bytes": store.nbytes,
            "as full copies": copies + store.index_bytes,
            "longest alone": alone.nbytes,
            "chain / longest": round(store.nbytes / alone.nbytes, 3),
            "full copies / longest": round((copies + store.index_bytes) / alone.nbytes, 3),
        }
    finally:
        runner.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder (default: the fixtures)")
    p.add_argument("--kind", action="append", help=f"fixture kinds (default: {KINDS})")
    p.add_argument("--turns", type=int, default=8)
    args = p.parse_args(argv)

    if args.model:
        models = {args.model: args.model}
    else:
        from testkit.fixtures import build_fixture

        work = Path(tempfile.mkdtemp(prefix="bench-chain-"))
        models = {k: str(build_fixture(k, work)) for k in (args.kind or KINDS)}
    out = {}
    names = ("entries", "kinds", "longest entry tokens", "chain bytes", "as full copies",
             "longest alone", "chain / longest", "full copies / longest")
    print(f"{args.turns}-turn conversation: bytes held (goal: chain / longest <= 1.2)")
    print(f"{'model':<14}" + "".join(f"{n:>22}" for n in names))
    for name, path in models.items():
        out[name] = chain_figures(path, args.turns)
        print(f"{Path(name).name:<14}" + "".join(f"{out[name][n]!s:>22}" for n in names))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
