"""Where a forward pass's time goes on the CPU, by kind of op, for prefill
and decode, on the demo model (or --model), loaded as the server loads it.

    python -m benchmarks.cpu_profile                    # the demo model
    python -m benchmarks.cpu_profile --keep-quantized   # its 4-bit weights
    python -m benchmarks.cpu_profile --model PATH --prompt 512 --steps 32

MLX has no per-op profiler for its CPU backend, so each module call is
timed alone: its inputs are evaluated first, then the call and its output
(`mx.eval` on both sides), and the time goes to its kind (the attention's
projections, the MLP's, the LM head, attention itself, RoPE, norms, the
embedding lookup). What is left of a timed pass (residual adds, the
activation, reshapes, dispatch) is "the rest". Forcing every call to finish
serializes what MLX would otherwise queue back to back, so the timed pass
is slower than a real one: both are printed, and the shares are of the
timed one. Decode is timed over --steps single-token steps after a
--prompt-token prefill, with the greedy pick (argmax) as its own kind.
"""

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict

from mlx_lm_plus.models.cpu import preload_fast_blas

preload_fast_blas()  # before MLX loads (models/cpu.py)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

PROJECTIONS = "attention projections (q, k, v, o)"
MLP = "MLP projections (gate, up, down)"
LM_HEAD = "LM head"
ATTENTION = "attention (scores, softmax, values)"
ROPE = "RoPE"
NORMS = "norms"
EMBEDDING = "embedding lookup"
ARGMAX = "argmax (greedy pick)"
REST = "the rest"
KINDS = (PROJECTIONS, MLP, LM_HEAD, ATTENTION, ROPE, NORMS, EMBEDDING, ARGMAX, REST)


def _kind_of_linear(path: str) -> str:
    if path.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
        return PROJECTIONS
    if path.endswith(("gate_proj", "up_proj", "down_proj")):
        return MLP
    return LM_HEAD


class OpTimer:
    """Module calls timed alone, by kind (see the module doc)."""

    def __init__(self, model):
        self.seconds: Dict[str, float] = defaultdict(float)
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.on = False
        self.inside = False

    def timed(self, kind, fn, *args, **kwargs):
        # (A call inside a timed one, as DecodeLinear's float32 path calls
        # nn.Linear's, is the outer call's time.)
        if not self.on or self.inside:
            return fn(*args, **kwargs)
        mx.eval([a for a in args if isinstance(a, mx.array)])
        tic = time.perf_counter()
        self.inside = True
        try:
            out = fn(*args, **kwargs)
            mx.eval(out)
        finally:
            self.inside = False
        self.seconds[kind] += time.perf_counter() - tic
        return out

    @contextmanager
    def installed(self, model):
        """Wrap the classes' calls (and the attention function the model's
        module calls) for the duration."""
        import importlib

        timer, undo = self, []

        def wrap(owner, attr, kind_of):
            original = getattr(owner, attr)

            def call(module, *args, **kwargs):
                return timer.timed(kind_of(module), original, module, *args, **kwargs)
            setattr(owner, attr, call)
            undo.append((owner, attr, original))

        def linear_kind(module):
            return _kind_of_linear(timer.paths.get(id(module), ""))

        from mlx_lm_plus.models.cpu_decode import DecodeEmbedding, DecodeLinear, NativeRMSNorm

        for cls in (nn.Linear, nn.QuantizedLinear, DecodeLinear):
            wrap(cls, "__call__", linear_kind)
        for cls in (nn.RMSNorm, nn.LayerNorm, NativeRMSNorm):
            wrap(cls, "__call__", lambda m: NORMS)
        for cls in (nn.Embedding, nn.QuantizedEmbedding, DecodeEmbedding):
            wrap(cls, "__call__", lambda m: EMBEDDING)
            wrap(cls, "as_linear", lambda m: LM_HEAD)  # (a tied LM head)
        ropes = {type(m) for _, m in model.named_modules() if "rope" in type(m).__name__.lower()}
        for cls in ropes:
            wrap(cls, "__call__", lambda m: ROPE)
        family = importlib.import_module(type(model).__module__)
        attention = getattr(family, "scaled_dot_product_attention", None)
        if attention is not None:
            def sdpa(*args, **kwargs):
                return timer.timed(ATTENTION, attention, *args, **kwargs)
            family.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            for owner, attr, original in reversed(undo):
                setattr(owner, attr, original)
            if attention is not None:
                family.scaled_dot_product_attention = attention


def load(model_path, keep_quantized: bool):
    from mlx_lm import load as mlx_lm_load

    from mlx_lm_plus.models.cpu import weights_for_cpu

    model, tokenizer = mlx_lm_load(str(model_path))
    grown = weights_for_cpu(model, keep=keep_quantized)
    return model, tokenizer, grown


def profile(model, prompt_tokens: int, steps: int, repeats: int):
    """{phase: {"real": s, "timed": s, "kinds": {kind: s}}}, medians over
    `repeats` of a prefill of `prompt_tokens` and `steps` decode steps."""
    from mlx_lm.models.cache import make_prompt_cache

    timer = OpTimer(model)
    prompt = mx.array([[(i * 7919) % 1000 + 100 for i in range(prompt_tokens)]])
    runs = defaultdict(list)

    def prefill():
        cache = make_prompt_cache(model)
        logits = model(prompt, cache=cache)
        mx.eval(logits)
        return cache, mx.argmax(logits[:, -1, :], axis=-1)

    def decode(cache, token):
        for _ in range(steps):
            logits = model(token[:, None], cache=cache)
            token = timer.timed(ARGMAX, mx.argmax, logits[:, -1, :], axis=-1)
            mx.eval(token)

    with timer.installed(model):
        prefill()  # (warm-up)
        for _ in range(repeats):
            for timed in (False, True):
                timer.on = timed
                timer.seconds.clear()
                tic = time.perf_counter()
                cache, token = prefill()
                runs[("prefill", timed)].append((time.perf_counter() - tic,
                                                 dict(timer.seconds)))
                timer.seconds.clear()
                tic = time.perf_counter()
                decode(cache, token)
                runs[("decode", timed)].append(((time.perf_counter() - tic) / steps,
                                                {k: v / steps for k, v in timer.seconds.items()}))
        timer.on = False
    out = {}
    for phase in ("prefill", "decode"):
        real = statistics.median(t for t, _ in runs[(phase, False)])
        timed_runs = runs[(phase, True)]
        timed = statistics.median(t for t, _ in timed_runs)
        kinds = {k: statistics.median(s.get(k, 0.0) for _, s in timed_runs) for k in KINDS if k != REST}
        kinds[REST] = max(0.0, timed - sum(kinds.values()))
        out[phase] = {"real": real, "timed": timed, "kinds": kinds}
    return out


def decode_ops(model) -> Dict[str, int]:
    """The ops of one decode step's graph (after a 4-token prompt), by
    primitive: MLX dispatches each to its CPU thread on its own."""
    import collections
    import re
    import tempfile

    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[101, 102, 103, 104]]), cache=cache))
    mx.eval([c.state for c in cache])
    logits = model(mx.array([[105]]), cache=cache)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, logits)
        dot = f.read()
    # (Nodes of ops are boxes; arrays are named by letters.)
    return dict(collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: the demo model)")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="keep its weights as they are (not float32 for the BLAS)")
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    parser.add_argument("--steps", type=int, default=32, help="decode steps")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from mlx_lm_plus.models import cpu

    path = args.model
    if path is None:
        from mlx_lm_plus.models.demo import demo_model_path

        path = demo_model_path()
    model, _, grown = load(path, args.keep_quantized)
    rate = cpu.gflops()
    print(f"model: {path}")
    print(f"weights: {'float32 (grew by %.0f MB)' % (grown / 1e6) if grown else 'as stored'}; "
          f"BLAS: {cpu.FAST_BLAS or 'bundled'} ({rate:.0f} GFLOP/s fp32)")
    result = profile(model, args.prompt, args.steps, args.repeats)
    for phase, unit, per in (("prefill", f"{args.prompt} tokens", args.prompt),
                             ("decode", "one token", 1)):
        r = result[phase]
        print(f"\n{phase} ({unit}): {1e3 * r['real']:.1f} ms real "
              f"({per / r['real']:.1f} tok/s), {1e3 * r['timed']:.1f} ms with every call "
              "timed alone")
        print("| kind of op | ms | share |\n|---|---:|---:|")
        for kind, seconds in sorted(r["kinds"].items(), key=lambda kv: -kv[1]):
            if phase == "prefill" and kind == ARGMAX:
                continue
            print(f"| {kind} | {1e3 * seconds:.2f} | {100 * seconds / r['timed']:.0f}% |")
    ops = decode_ops(model)
    result["decode_ops"] = ops
    top = ", ".join(f"{name} {n}" for name, n in sorted(ops.items(), key=lambda kv: -kv[1])[:8])
    print(f"\nops in a decode step's graph: {sum(ops.values())} ({top}, ...)")
    return result


if __name__ == "__main__":
    main()
