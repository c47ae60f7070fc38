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
was built for another mlx (a C++ extension must match the libmlx it links)
or a nanobind whose types mlx.core does not share (checked by one call at
load); callers then use MLX's. They are CPU only: callers use them where
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


@functools.lru_cache(maxsize=None)
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

    try:
        from mlx_lm_plus.native import _cpu_kernels
    except ImportError as e:
        return None, f"not built ({e}; python -m mlx_lm_plus.native.build builds them)"
    if _cpu_kernels.MLX_VERSION != mx.__version__:
        return None, (f"built for mlx {_cpu_kernels.MLX_VERSION}, not the installed "
                      f"{mx.__version__} (python -m mlx_lm_plus.native.build builds them again)")
    try:
        with mx.stream(mx.cpu):
            w = mx.sin(mx.arange(8 * 64, dtype=mx.float32)).reshape(8, 64)
            x = mx.cos(mx.arange(2 * 64, dtype=mx.float32)).reshape(2, 64)
            w, scales, biases = mx.quantize(w, group_size=32, bits=4)
            ours = _cpu_kernels.quantized_matvec(x, w, scales, biases, 32, 4)
            theirs = mx.quantized_matmul(x, w, scales, biases, group_size=32, bits=4)
            ok = mx.allclose(ours, theirs, rtol=1e-4, atol=1e-4).item()
    except (TypeError, ValueError, RuntimeError) as e:
        return None, f"they do not run with this mlx.core ({e})"
    if not ok:
        return None, "they computed a wrong answer at load"
    try:
        threads = int(os.environ.get("MLX_LM_PLUS_KERNEL_THREADS", "1"))
        _cpu_kernels.set_threads(max(1, min(threads, os.cpu_count() or 1)))
    except ValueError:
        return None, "MLX_LM_PLUS_KERNEL_THREADS is not a number"
    return _cpu_kernels, None


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
    else:
        logging.info(f"CPU kernels: MLX's own ({why_not()})")
