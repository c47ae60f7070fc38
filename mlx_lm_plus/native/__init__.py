"""Our own CPU kernels, an MLX extension (src/cpu_kernels.cpp), where MLX's
are missing or slow on a CPU.

    from mlx_lm_plus import native
    if native.kernels() is not None:
        y = native.kernels().quantized_matvec(x, w, scales, biases, group_size, bits)

Why: decode on a CPU is bound by the bytes of weights read per token. MLX
0.32's CPU `quantized_matmul` reads 4-bit weights (an eighth of float32's
bytes) four times slower than its float32 BLAS matvec reads float32 ones,
so the fastest MLX decode was float32 weights (docs/cpu.md). The kernel
here reads the packed bytes at the memory's speed, a few rows of x at once.

Built by `python -m mlx_lm_plus.native.build` (scripts/setup), for this
machine and the installed mlx. `kernels()` is None where it was not built,
where its stamp is not today's (built from other sources, for another mlx,
nanobind or Python, or on another CPU: build.py), where its mlx headers
were another version's, or where it does not compute right with this
mlx.core (a few checks at load, each kernel and each scales dtype);
callers then use MLX's. They are CPU only: callers use them where
MLX runs on the CPU. `MLX_LM_PLUS_NATIVE=0` turns them off.

Threads: one, MLX's CPU stream thread, unless `MLX_LM_PLUS_KERNEL_THREADS`
says more (then OpenMP's split a large weight). Through the server on this
2-core machine one decoded the demo model at 44.5 tokens/s and two at
31-37 (their spinning takes the core the generation thread and the event
loop run on); a machine with cores to spare may gain from more.
"""

import functools
import logging
import os
from typing import Optional


def kernels():
    """The extension module, or None (see the module doc); `why_not()` says
    why."""
    return _load()[0]


def why_not() -> Optional[str]:
    return _load()[1]


@functools.lru_cache(maxsize=None)
def _load():
    if os.environ.get("MLX_LM_PLUS_NATIVE", "1") == "0":
        return None, "MLX_LM_PLUS_NATIVE=0"
    import mlx.core as mx

    from mlx_lm_plus.native import build

    again = "python -m mlx_lm_plus.native.build builds them again"
    if not list(build.HERE.glob("_cpu_kernels*.so")):
        return None, "not built (python -m mlx_lm_plus.native.build builds them)"
    try:
        stamped, today = build.STAMP.read_text(), build.stamp()
    except Exception as e:  # (a package without metadata, an unreadable stamp)
        return None, f"their stamp can't be checked ({e!r}; {again})"
    if stamped != today:
        return None, f"built from other sources, versions or CPU than these ({again})"
    try:
        from mlx_lm_plus.native import _cpu_kernels
    except ImportError as e:
        return None, f"not loadable ({e}; {again})"
    # (A build of mlx from source says 0.32.5.dev20261129+abc: its headers 0.32.5.)
    if _cpu_kernels.MLX_VERSION_BUILT != mx.__version__.split(".dev")[0].split("+")[0]:
        return None, (f"built with mlx {_cpu_kernels.MLX_VERSION_BUILT}'s headers, not the "
                      f"installed {mx.__version__}'s ({again})")
    try:
        ok = _check(_cpu_kernels)
    except (TypeError, ValueError, RuntimeError, AttributeError) as e:
        return None, f"they do not run with this mlx.core ({e}; {again})"
    if not ok:
        return None, "they computed a wrong answer at load"
    try:
        threads = int(os.environ.get("MLX_LM_PLUS_KERNEL_THREADS", "1"))
        _cpu_kernels.set_threads(max(1, min(threads, os.cpu_count() or 1)))
    except ValueError:
        return None, "MLX_LM_PLUS_KERNEL_THREADS is not a number"
    return _cpu_kernels, None


def _check(module) -> bool:
    """Each kernel, once, against MLX's own op (every scales dtype of the
    matvec: each is its own code)."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        x = mx.cos(mx.arange(2 * 64, dtype=mx.float32)).reshape(2, 64)
        w, scales, biases = mx.quantize(mx.sin(mx.arange(8 * 64, dtype=mx.float32)).reshape(8, 64),
                                        group_size=32, bits=4)
        checks = []
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            s, b = scales.astype(dtype).astype(mx.float32), biases.astype(dtype).astype(mx.float32)
            checks.append((module.quantized_matvec(x, w, scales.astype(dtype),
                                                   biases.astype(dtype), 32, 4),
                           mx.quantized_matmul(x, w, s, b, group_size=32, bits=4)))
        w8, s8, b8 = mx.quantize(mx.sin(mx.arange(8 * 64, dtype=mx.float32)).reshape(8, 64),
                                 group_size=64, bits=8)
        checks.append((module.quantized_matvec(x, w8, s8, b8, 64, 8),
                       mx.quantized_matmul(x, w8, s8, b8, group_size=64, bits=8)))
        q = x.reshape(1, 2, 1, 64)
        checks.append((module.rope(q, 64, False, 10000.0, 1.0, mx.array(3)),
                       mx.fast.rope(q, 64, traditional=False, base=10000.0, scale=1.0, offset=3)))
        checks.append((module.rms_norm(x, x[0], 1e-5), mx.fast.rms_norm(x, x[0], 1e-5)))
        return all(mx.allclose(a, b, rtol=1e-4, atol=1e-4).item() for a, b in checks)


def log_kernels() -> None:
    """Say at start-up whether decode uses them, where MLX runs on the CPU.
    (The first call loads them: at start-up, on the main thread, before
    the generation thread evaluates anything.)"""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return
    module = kernels()
    if module is not None:
        logging.info("CPU kernels: quantized decode steps on mlx_lm_plus.native")
    elif why_not() == "MLX_LM_PLUS_NATIVE=0":
        logging.info(f"CPU kernels: MLX's own ({why_not()})")
    else:
        # (Decode of a 4-bit model runs at about half the speed.)
        logging.warning(f"CPU kernels: MLX's own ({why_not()})")
