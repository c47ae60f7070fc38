"""What planning a prompt costs: build_prompt (template, tokens, checkpoint
boundaries) against one apply_chat_template(tokenize=True), the least any
server does, on multi-turn conversations of growing size: a prompt the
planner has seen nothing of, and the next turn of a conversation whose last
turn it planned (encoded from where it leaves that one).

    python -m benchmarks.planning --model-kind qwen3_5 --tokens 1700 20000
"""

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from mlx_lm.server import CompletionRequest
from mlx_lm.utils import load_tokenizer

from benchmarks.harness import add_model_args, fixture_or_model
from mlx_lm_plus.planning import checkpoints as prompt
from mlx_lm_plus.planning.prompt import build_prompt
from testkit.fixtures import WORDS


def conversation(tokenizer, target: int, seed: int = 0):
    """System, then user and assistant turns until about `target` tokens."""
    rng = random.Random(seed)

    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    messages = [{"role": "system", "content": "You are a helpful assistant. " + text(40)}]
    while True:
        messages.append({"role": "user", "content": text(rng.randint(20, 120))})
        n = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if n >= target:
            return messages, n
        messages.append({"role": "assistant", "content": text(rng.randint(40, 200))})


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, "qwen3_5")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1700, 20000])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(Path(fixture_or_model(args, Path(tempfile.mkdtemp()))))
    for target in args.tokens:
        messages, n = conversation(tokenizer, target)
        request = CompletionRequest("chat", "", messages, None, None)
        # The turn before: the conversation up to its last user message.
        before = messages[:-2] if len(messages) > 2 else messages[:1]
        previous = CompletionRequest("chat", "", before, None, None)
        plan = build_prompt(tokenizer, None, request, {})

        def forget():  # (what it encoded; not whether the tokenizer passed its checks)
            for recent in prompt._RECENT.values():
                recent.entries = []

        def cold():
            forget()
            return build_prompt(tokenizer, None, request, {})

        def next_turn():
            forget()
            build_prompt(tokenizer, None, previous, {})
            start = time.perf_counter()
            build_prompt(tokenizer, None, request, {})
            return time.perf_counter() - start

        first = timed(cold, args.repeats)
        following = statistics.median(next_turn() for _ in range(args.repeats))
        once = timed(lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                     args.repeats)
        print(f"{n} tokens, {len(messages)} messages, segments "
              f"{[len(s) for s in plan.segments]}: build_prompt {first * 1e3:.2f} ms "
              f"({first / once:.2f}x), the next turn of a conversation {following * 1e3:.2f} ms "
              f"({following / once:.2f}x); one apply_chat_template {once * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
