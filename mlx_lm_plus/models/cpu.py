"""MLX on a Linux CPU at the machine's speed: a fast BLAS, and weights in the
format it multiplies fastest.

    preload_fast_blas()      # before anything imports mlx (server.py, first)
    log_blas()               # at start-up: which BLAS, and its GFLOP/s
    weights_for_cpu(model)   # at load: quantized / half weights -> float32

Why: the `mlx[cpu]` wheel links the reference (Netlib) BLAS it bundles. On
a 2-core x86-64 machine an fp32 512x576 @ 576x1536 matmul ran at 8 GFLOP/s
in MLX and at 258 with Debian's OpenBLAS loaded first. MLX calls BLAS only
for float32 matmuls: quantized ones run its own kernel, and bf16/fp16 ones
ran at 5-7 GFLOP/s either way. On the demo model (SmolLM2-135M, Q4_1),
prefill went from 10.6 to 289 tokens/s and decode from 9.1 to 19.6 with
OpenBLAS and the weights dequantized to float32 (in process; the
benchmark is `python -m benchmarks.cpu_speed`). Keeping the quantized
weights for single-token decode beside float32 ones for prefill decoded at
9.4: float32 throughout is faster on both.

How the BLAS is loaded: `ctypes.CDLL(path, RTLD_GLOBAL)` before libmlx is
loaded. libmlx finds `cblas_sgemm` through its bundled libblas, loaded with
it into the local scope of Python's dlopen; the global scope is searched
first, so the OpenBLAS already there wins. Nothing is re-executed and no
environment variable is needed. Where: `MLX_LM_PLUS_BLAS` (a library's
path, or "bundled" to keep the wheel's), else the first found of Debian's
and Ubuntu's OpenBLAS (`libopenblas0-pthread`, which scripts/setup installs
when it can), Fedora's, and `ctypes.util.find_library("openblas")`.
Only on Linux; the weights only where MLX runs on the CPU and the measured
rate is a fast BLAS's (at least 30 GFLOP/s), within the memory left for
them. (On a CUDA build the library is loaded but unused.)
"""

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
import time
from typing import Optional

CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
)
# What preload_fast_blas loaded (None: the wheel's own BLAS), and why not.
FAST_BLAS: Optional[str] = None
WHY_NOT: Optional[str] = None
# The CPU's fp32 matmul rate log_blas measured (None: not measured), and the
# least at which weights are made float32 (the reference BLAS: about 8).
RATE: Optional[float] = None
FAST_GFLOPS = 30.0


def _candidates():
    global WHY_NOT
    chosen = os.environ.get("MLX_LM_PLUS_BLAS")
    if chosen == "bundled":
        WHY_NOT = "MLX_LM_PLUS_BLAS=bundled"
        return []
    if chosen:
        return [chosen]
    arch = platform.machine()
    paths = [p.format(arch=arch) for p in CANDIDATES]
    found = ctypes.util.find_library("openblas")
    return [p for p in paths if os.path.exists(p)] + ([found] if found else [])


def preload_fast_blas() -> Optional[str]:
    """Load a fast BLAS into the global scope before MLX is loaded (see the
    module doc); its path, or None. Idempotent."""
    global FAST_BLAS, WHY_NOT
    if FAST_BLAS is not None or sys.platform != "linux":
        return FAST_BLAS
    if "mlx.core" in sys.modules:
        WHY_NOT = "MLX was loaded before a BLAS could be"
        return None
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            WHY_NOT = f"{path} did not load: {e}"
            continue
        FAST_BLAS = path
        return path
    WHY_NOT = WHY_NOT or ("no OpenBLAS found (on Debian or Ubuntu: apt-get install "
                          "libopenblas0-pthread)")
    return None


def on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def gflops(repeats: int = 5) -> float:
    """An fp32 512x576 @ 576x1536 matmul's rate on the CPU, in GFLOP/s."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.random.normal((512, 576))
        b = mx.random.normal((576, 1536))
        mx.eval(a @ b)
        tic = time.perf_counter()
        for _ in range(repeats):
            mx.eval(a @ b)
        seconds = (time.perf_counter() - tic) / repeats
    return 2 * 512 * 576 * 1536 / seconds / 1e9


def log_blas() -> None:
    """Which BLAS MLX's CPU matmuls run on, and how fast (where MLX runs on
    the CPU)."""
    if sys.platform != "linux" or not on_cpu():
        return
    global RATE
    rate = RATE = gflops()
    if FAST_BLAS:
        logging.info(f"CPU matmuls on {FAST_BLAS}: {rate:.0f} GFLOP/s (fp32)")
    else:
        logging.warning(
            f"CPU matmuls on the reference BLAS bundled with mlx[cpu]: {rate:.0f} GFLOP/s "
            f"(fp32), a tenth to a thirtieth of the machine's ({WHY_NOT})")


def converts(keep: bool = False) -> bool:
    """Whether weights_for_cpu makes a model's weights float32 here."""
    return (not keep and FAST_BLAS is not None and (RATE is None or RATE >= FAST_GFLOPS)
            and on_cpu())


def _dequantized_kinds() -> tuple:
    """The layers mlx-lm's dequantize_model dequantizes (MoE experts too)."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)


def float32_bytes(model) -> int:
    """The bytes `model`'s weights take as float32, dequantized."""
    from mlx.utils import tree_flatten

    total = 0
    for _, m in model.named_modules():
        if isinstance(m, _dequantized_kinds()):
            total += m.weight.size * (32 // m.bits) * 4  # (packed in uint32s)
            # Less the packed weight and its scales and biases, counted
            # below as the float32 they would have been.
            total -= m.weight.nbytes
            for v in (m.get("scales"), m.get("biases")):
                total -= 0 if v is None else (v.size * 4 if _floating(v) else v.nbytes)
    params = tree_flatten(model.parameters())
    return total + sum(v.size * 4 if _floating(v) else v.nbytes for _, v in params)


def converted_bytes(model) -> int:
    """The bytes `model`'s weights take once weights_for_cpu converted them:
    float32, and the quantized forms kept beside them for decode
    (cpu_decode.py)."""
    from mlx_lm_plus.models.cpu_decode import forms_nbytes, quantized_forms

    return float32_bytes(model) + forms_nbytes(quantized_forms(model))


def _floating(v) -> bool:
    import mlx.core as mx

    return mx.issubdtype(v.dtype, mx.floating)


def weights_for_cpu(model, keep: bool = False,
                    room: Optional[int] = None) -> Optional[int]:
    """Where MLX runs on the CPU with a fast BLAS (see `converts`): the
    model's quantized layers dequantized (mlx-lm's dequantize_model) and
    its floating weights made float32, which BLAS multiplies (see the
    module doc), if they fit in `room` bytes. Returns the bytes the weights
    grew by, or None when left as they were."""
    if not converts(keep):
        return None
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    from mlx_lm_plus.models.cpu_decode import (forms_nbytes, keep_quantized_forms,
                                               quantized_forms, use_native_layers)

    def nbytes():
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    # Decode steps keep reading the quantized weights where our kernel can
    # (cpu_decode.py): they stay beside the float32 ones, where they fit.
    forms = quantized_forms(model)
    float32 = float32_bytes(model)
    before, after = nbytes(), float32 + forms_nbytes(forms)
    if after == before:
        return None  # (float32 already)
    if room is not None and after > room >= float32:
        forms, after = {}, float32  # (float32 alone: prefill's speed)
    if room is not None and after > room:
        logging.warning(
            f"Weights kept as they are: as float32 for the CPU's BLAS they would take "
            f"{after / 1e9:.2f} GB, more than the {room / 1e9:.2f} GB left for them "
            "(--keep-quantized keeps every model's)")
        return None
    if any(isinstance(m, _dequantized_kinds()) for _, m in model.named_modules()):
        _float32_scales(model)
        dequantize_model(model)
    model.set_dtype(mx.float32)  # (floating parameters only)
    keep_quantized_forms(model, forms)  # (after: their scales keep their dtype)
    use_native_layers(model)
    mx.eval(model.parameters())
    return nbytes() - before


def _float32_scales(model) -> None:
    """Affine layers' scales and biases made float32 before dequantizing:
    mx.dequantize computes in their dtype, so fp16 or bf16 ones would give
    float32 weights rounded to 16 bits (0.5% off with bf16), where the
    decode kernel (cpu_decode.py) computes scale * q + bias in float32:
    prefill and decode would then run on different weights, and a stream's
    greedy text would depend on its batch and on the prompt cache. (The
    quantized forms kept for the kernel were taken before: theirs keep
    their dtype, widened exactly in the kernel.)"""
    import mlx.core as mx

    for _, m in model.named_modules():
        scales, biases = m.get("scales"), m.get("biases")
        if (isinstance(m, _dequantized_kinds()) and getattr(m, "mode", "affine") == "affine"
                and isinstance(scales, mx.array) and mx.issubdtype(scales.dtype, mx.floating)):
            m.scales = scales.astype(mx.float32)
            if isinstance(biases, mx.array):
                m.biases = biases.astype(mx.float32)


def weights_identity(model_converted: bool, native_kernels: bool = False) -> str:
    """What a disk tier's identity adds for how this process computes on the
    CPU: KV computed from float32 weights, on another BLAS or by our
    kernels (cpu_decode.py) differs in its last bits from the quantized
    model's, and would be read back as its."""
    if not on_cpu():
        return ""
    blas = os.path.basename(FAST_BLAS) if FAST_BLAS else "bundled"
    return (f",cpu_blas={blas}" + (",weights=float32" if model_converted else "")
            + (",kernels=native,attention=native" if native_kernels else ""))
