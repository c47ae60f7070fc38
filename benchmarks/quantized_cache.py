"""Quantized prompt cache storage (--prompt-cache-bits): bytes held per token
and what it does to greedy generation, in process (no server).

    python -m benchmarks.quantized_cache                   # the demo model
    python -m benchmarks.quantized_cache --model PATH
    python -m benchmarks.quantized_cache --quick           # a tiny fixture

For each prompt (a two-turn conversation), the first turn is prefilled into
a cache once. For each setting (unquantized, 8 bits, 4 bits) a PromptStore
with that `bits` takes a copy of it, the second turn's prompt fetches it
back (a "prefix" hit: dequantized for 8 and 4), and the model goes on
greedily over the rest of the prompt and `--max-tokens` generated tokens.
Per setting it prints: tokens held per byte relative to unquantized (the
entries' KV bytes, and with the index's bytes), greedy agreement (the share
of generated tokens equal to the unquantized run's, position by position,
and how many sequences are identical), the largest absolute logit
difference on the first step after the cached prefix (and over every
prompt position after it), and the store's insert (quantize) and fetch
(dequantize) times.
"""

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_lm_plus.cache.store import PromptStore
from mlx_lm_plus.planning.checkpoints import common_prefix

SYSTEM = ("You are a careful assistant for a small town library. You answer in "
          "plain sentences, you give dates and names when you know them, and "
          "you say so when you do not know something.")

CONVERSATIONS = [
    ("Our reading group meets on Tuesday evenings in the back room. This month "
     "we read a novel about a lighthouse keeper who writes letters to his "
     "daughter across the sea, and several members asked for books like it. "
     "Can you suggest what we might read next, and why?",
     "Three ideas: another epistolary novel, a book about the sea, or a story "
     "about family far apart. Each keeps what the group liked: letters, "
     "distance and a quiet setting.",
     "Which of those would work best for a group of twelve people who read slowly?"),
    ("The children's corner needs new shelves. We have a budget of four hundred "
     "dollars, the wall is three meters wide, and the shelves must be low enough "
     "for a six year old to reach the top row. What should we look for when we "
     "buy them, and where should they go in the room?",
     "Look for sturdy shelves no taller than one meter, with rounded corners, "
     "fixed to the wall. Put them away from the door, near the reading rug.",
     "How many books will fit on shelves like that?"),
    ("A visitor asked how to find old newspapers from the nineteen fifties about "
     "the flood that closed the river bridge. We keep some papers on microfilm "
     "and the county archive has others. Explain the steps a visitor should "
     "follow, from our catalogue to the archive, in the right order.",
     "First search our catalogue for the newspaper titles and years, then read "
     "the microfilm we hold, then ask the county archive for the missing issues.",
     "What should the visitor bring to the county archive?"),
    ("We want to start a small workshop that teaches older adults to use email "
     "and video calls with their grandchildren. We have four laptops, a "
     "projector and two volunteers on Saturday mornings. Plan the first three "
     "sessions so that nobody feels left behind.",
     "Session one: turning on the laptop and opening email. Session two: "
     "writing and answering a message. Session three: a first video call.",
     "What should we do if one person moves much faster than the others?"),
    ("Write a short notice for the front door explaining that the library will "
     "close early on Friday for the staff training day, that returned books can "
     "go in the outside box, and that the online catalogue stays open. Keep it "
     "friendly and clear, and mention the usual opening hours on Saturday.",
     "Notice: on Friday the library closes at noon for staff training. Please "
     "use the outside box for returns. The online catalogue stays open.",
     "Can you make it shorter, for a small card by the desk?"),
    ("A member donated forty boxes of books from her late father, mostly "
     "history, maps and travel guides, some of them more than a century old. "
     "How should we sort them, which ones might be worth keeping in the local "
     "collection, and what should we do with the rest?",
     "Sort by subject and age first. Keep local history, old maps of the county "
     "and anything rare; offer the rest to the book sale or other libraries.",
     "How do we tell whether an old map is rare?"),
]


def conversations(tokenizer, n):
    """(prompt tokens, tokens of the cached first turn) for n conversations."""
    out = []
    for user1, reply, user2 in CONVERSATIONS[:n]:
        first = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": user1},
                 {"role": "assistant", "content": reply}]
        whole = first + [{"role": "user", "content": user2}]
        prompt = list(tokenizer.apply_chat_template(whole, add_generation_prompt=True))
        turn = list(tokenizer.apply_chat_template(first))
        out.append((prompt, common_prefix(prompt, turn)))
    return out


def continue_greedy(model, cache, rest, max_tokens):
    """Logits over `rest` (prompt tokens after the cached prefix), then
    `max_tokens` greedy tokens."""
    logits = model(mx.array(rest)[None], cache=cache)[0].astype(mx.float32)
    tokens, last = [], logits[-1]
    for _ in range(max_tokens):
        token = mx.argmax(last).item()
        tokens.append(token)
        last = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
    mx.eval(logits)
    return logits, tokens


def measure(model, tokenizer, settings, n_prompts, max_tokens, group_size):
    from mlx_lm.models.cache import make_prompt_cache

    rows = {bits: {"kv": 0, "total": 0, "equal": 0, "generated": 0, "identical": 0,
                   "first": 0.0, "prompt": 0.0, "insert": [], "fetch": []}
            for bits in settings}
    cached_tokens = prompt_tokens = 0
    for i, (prompt, split) in enumerate(conversations(tokenizer, n_prompts)):
        prefix, rest = prompt[:split], prompt[split:]
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(prefix)[None], cache=cache))
        cached_tokens += len(prefix)
        prompt_tokens += len(prompt)
        reference = None
        for bits in settings:
            store = PromptStore(max_bytes=1 << 40, bits=bits, group_size=group_size)
            start = time.perf_counter()
            store.insert("m", prefix, copy.deepcopy(cache))
            inserted = time.perf_counter()
            found = store.fetch("m", prompt)
            mx.eval([c.state for c in found.cache])
            fetched = time.perf_counter()
            assert (found.kind, found.cached) == ("prefix", len(prefix)), found
            (entry,) = store.entries()
            logits, tokens = continue_greedy(model, found.cache, rest, max_tokens)
            row = rows[bits]
            row["kv"] += entry.nbytes
            row["total"] += store.nbytes
            row["insert"].append(inserted - start)
            row["fetch"].append(fetched - inserted)
            if reference is None:
                reference = logits, tokens
            ref_logits, ref_tokens = reference
            diff = mx.abs(logits - ref_logits)
            row["first"] = max(row["first"], mx.max(diff[0]).item())
            row["prompt"] = max(row["prompt"], mx.max(diff).item())
            row["equal"] += sum(a == b for a, b in zip(tokens, ref_tokens))
            row["generated"] += len(tokens)
            row["identical"] += tokens == ref_tokens
        print(f"  prompt {i + 1}: {len(prompt)} tokens, {len(prefix)} cached", flush=True)
    base = rows[settings[0]]
    report = {"prompts": n_prompts, "prompt_tokens": prompt_tokens,
              "cached_tokens": cached_tokens, "max_tokens": max_tokens,
              "group_size": group_size, "settings": {}}
    for bits, row in rows.items():
        report["settings"][str(bits)] = {
            "tokens per byte vs unquantized (KV)": round(base["kv"] / row["kv"], 3),
            "tokens per byte vs unquantized (KV + index)": round(base["total"] / row["total"], 3),
            "KV bytes per cached token": round(row["kv"] / cached_tokens, 1),
            "greedy agreement": round(row["equal"] / row["generated"], 4),
            "identical sequences": f"{row['identical']}/{n_prompts}",
            "max |logit diff| first step": round(row["first"], 4),
            "max |logit diff| prompt after prefix": round(row["prompt"], 4),
            "insert ms (median)": round(statistics.median(row["insert"]) * 1e3, 2),
            "fetch ms (median)": round(statistics.median(row["fetch"]) * 1e3, 2),
        }
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder (default: the demo model, "
                   "or with --quick a tiny fixture)")
    p.add_argument("--quick", action="store_true",
                   help="2 prompts, 4 tokens, on the qwen3_mid fixture (head dim 64) "
                   "unless --model is given")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--group-size", type=int, default=64, help="as --kv-group-size")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    model_path = args.model
    if args.quick:
        args.prompts, args.max_tokens = min(args.prompts, 2), min(args.max_tokens, 4)
        if model_path is None:
            from testkit.fixtures import build_fixture

            model_path = str(build_fixture("qwen3_mid", Path(tempfile.mkdtemp(prefix="bench-"))))
    if model_path is None:
        from mlx_lm_plus.models.demo import demo_model_path

        model_path = str(demo_model_path())
    from mlx_lm import load

    model, tokenizer = load(model_path)
    settings = (None, 8, 4)
    start = time.perf_counter()
    report = measure(model, tokenizer, settings, args.prompts, args.max_tokens, args.group_size)
    report["model"] = model_path
    report["seconds"] = round(time.perf_counter() - start, 1)

    print(f"model: {model_path}")
    print(f"{report['prompts']} prompts, {report['prompt_tokens']} tokens, "
          f"{report['cached_tokens']} of them from the store; {args.max_tokens} greedy "
          f"tokens each; group size {args.group_size}; {report['seconds']} s")
    names = {None: "unquantized", 8: "8 bits", 4: "4 bits"}
    figures = list(report["settings"][str(settings[0])])
    print(f"{'':<44}" + "".join(f"{names[b]:>14}" for b in settings))
    for name in figures:
        print(f"{name:<44}" + "".join(
            f"{str(report['settings'][str(b)][name]):>14}" for b in settings))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
