"""Decode steps from the quantized weights on a CPU (models/cpu_decode.py)
through our kernel (mlx_lm_plus/native). (Its speed is the benchmark's:
`python -m benchmarks run --model-kind demo --workload speed`.)"""

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_plus import native
from mlx_lm_plus.models import cpu, cpu_decode

kernels = native.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason=f"no CPU kernels: {native.why_not()}")


@pytest.mark.skipif(sys.platform != "linux", reason="scripts/setup builds them on Linux")
def test_scripts_setup_built_the_kernels_for_this_mlx():
    assert kernels is not None, native.why_not()
    assert kernels.MLX_VERSION_BUILT == mx.__version__


@needs_kernels
def test_a_module_built_from_other_sources_or_elsewhere_is_not_loaded(monkeypatch):
    """A stale module (a pull since the build, another mlx, another CPU)
    lacks kernels the code calls or holds instructions this CPU lacks: its
    stamp is not today's, and it is refused with the reason."""
    from mlx_lm_plus.native import build

    assert native._load.__wrapped__()[0] is not None  # (today's)
    monkeypatch.setattr(build, "cpu_features", lambda: "another-cpu")
    module, why = native._load.__wrapped__()
    assert module is None and "python -m mlx_lm_plus.native.build" in why
    monkeypatch.undo()
    monkeypatch.setattr(build, "STAMP", build.HERE / "no-such.stamp")
    assert native._load.__wrapped__()[0] is None
    monkeypatch.undo()
    # A stamp that can't be computed (a package installed without its
    # metadata) is a reason, not an exception at start-up.
    from importlib.metadata import PackageNotFoundError

    def no_metadata():
        raise PackageNotFoundError("nanobind")

    monkeypatch.setattr(build, "stamp", no_metadata)
    module, why = native._load.__wrapped__()
    assert module is None and "stamp" in why
    # Only instruction sets are the CPU's in the stamp: a hypervisor's or a
    # kernel's flags change with the host, not the code.
    assert build.flags_digest("flags : fma avx2 hypervisor pti") == \
        build.flags_digest("flags\t: avx2 md_clear fma")
    assert build.flags_digest("flags : fma avx2") != build.flags_digest("flags : fma avx2 avx512f")


def _reference(x, w, scales, biases, group_size, bits):
    """x @ dequantized(w).T in float64 numpy, from the packed bits."""
    packed = np.array(w).view(np.uint8)  # (uint32s, little-endian: low bits first)
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(w.shape[0], -1)
    else:
        q = packed.reshape(w.shape[0], -1)
    s = np.array(scales.astype(mx.float32), dtype=np.float64).repeat(group_size, axis=1)
    b = np.array(biases.astype(mx.float32), dtype=np.float64).repeat(group_size, axis=1)
    weight = q * s + b
    return np.array(x, dtype=np.float64) @ weight.T


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_kernel_equals_the_dequantized_product(bits, group_size, dtype):
    mx.random.seed(bits * 1000 + group_size)
    w = mx.random.normal((200, 384))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    x = mx.random.normal((16, 384))
    for rows in (1, 3, 8, 16):
        got = np.array(kernels.quantized_matvec(x[:rows], wq, scales, biases, group_size, bits))
        want = _reference(x[:rows], wq, scales, biases, group_size, bits)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # MLX's own quantized product agrees too (the layout is mx.quantize's).
    theirs = mx.quantized_matmul(x[:2], wq, scales.astype(mx.float32), biases.astype(mx.float32),
                                 transpose=True, group_size=group_size, bits=bits)
    ours = kernels.quantized_matvec(x[:2], wq, scales.astype(mx.float32),
                                    biases.astype(mx.float32), group_size, bits)
    assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-4).item()


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_its_batch(bits):
    """Every count of rows (each up to 8 compiled apart, more in one loop)
    gives each row the numbers it gets alone, bit for bit."""
    w = mx.random.normal((4096, 512))  # (large enough to be split over threads)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    x = mx.random.normal((16, 512))
    together = kernels.quantized_matvec(x, wq, scales, biases, 64, bits)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16):
        part = kernels.quantized_matvec(x[:rows], wq, scales, biases, 64, bits)
        for r in range(rows):
            alone = kernels.quantized_matvec(x[r : r + 1], wq, scales, biases, 64, bits)
            assert mx.array_equal(alone[0], part[r]).item(), (rows, r)
            assert mx.array_equal(alone[0], together[r]).item()
    # (Leading dimensions are rows too: a (batch, 1, K) decode input.)
    shaped = kernels.quantized_matvec(x[:4, None, :], wq, scales, biases, 64, bits)
    assert shaped.shape == (4, 1, 4096)
    assert mx.array_equal(shaped[:, 0], together[:4]).item()
    # Split over threads (MLX_LM_PLUS_KERNEL_THREADS), the same numbers.
    kernels.set_threads(2)
    try:
        split = kernels.quantized_matvec(x, wq, scales, biases, 64, bits)
    finally:
        kernels.set_threads(1)
    assert mx.array_equal(split, together).item()


@needs_kernels
def test_bad_arguments_are_refused_not_run():
    wq, scales, biases = mx.quantize(mx.random.normal((64, 128)), group_size=32, bits=4)
    x = mx.random.normal((2, 128))
    bad = [
        (x.astype(mx.float16), wq, scales, biases, 32, 4),  # x not float32
        (x, wq, scales, biases, 64, 4),  # group size of other scales
        (x, wq, scales, biases, 32, 8),  # other bits
        (x, wq, scales, biases, 48, 4),  # no such group size
        (x, mx.zeros((64, 8), dtype=mx.uint32), scales, biases, 32, 2),  # no such bits
        (mx.random.normal((2, 256)), mx.zeros((64, 16), dtype=mx.uint32),
         mx.zeros((64, 1)), mx.zeros((64, 1)), 256, 4),  # (shapes agree; the size is refused)
        (mx.random.normal((2, 64)), wq, scales, biases, 32, 4),  # K differs
        (mx.random.normal((17, 128)), wq, scales, biases, 32, 4),  # too many rows
        (x, wq.astype(mx.int32), scales, biases, 32, 4),
        (x, wq, scales, biases.astype(mx.float16), 32, 4),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            mx.eval(kernels.quantized_matvec(*args))
    # Nothing was harmed: a good call still computes.
    assert mx.allclose(kernels.quantized_matvec(x, wq, scales, biases, 32, 4),
                       mx.quantized_matmul(x, wq, scales, biases, group_size=32, bits=4),
                       rtol=1e-4, atol=1e-4).item()


def _quantized(fixture_path):
    model, tok = load(str(fixture_path("qwen3")))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, tok


def _converted_layers(fixture_path, monkeypatch, kind):
    """The layers of `kind` of the quantized fixture once weights_for_cpu
    converted it (as on a CPU with a fast BLAS)."""
    model, _ = _quantized(fixture_path)
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    assert cpu.weights_for_cpu(model)
    return [m for _, m in model.named_modules() if isinstance(m, kind)]


@needs_kernels
def test_converted_models_decode_from_the_quantized_weights(fixture_path, monkeypatch):
    """weights_for_cpu keeps each quantized layer's weights beside its
    float32 ones: a decode step's few rows go through the kernel (counted),
    a prefill's many through float32, and the logits match the quantized
    model's either way; the bytes kept are counted."""
    model, tok = _quantized(fixture_path)
    prompt = mx.array(tok.encode("The harbour master counted seven brass lanterns."))[None]
    assert prompt.shape[1] > cpu_decode.DECODE_ROWS

    def logits_of(m):
        cache = make_prompt_cache(m)
        first = m(prompt, cache=cache)[:, -1]
        step = m(mx.array([[7]]), cache=cache)[:, -1]
        return first, step

    quantized_first, quantized_step = logits_of(model)
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    need = cpu.converted_bytes(model)
    grown = cpu.weights_for_cpu(model)
    from mlx.utils import tree_flatten

    assert grown and sum(v.nbytes for _, v in tree_flatten(model.parameters())) == need
    layers = [m for _, m in model.named_modules()
              if isinstance(m, (cpu_decode.DecodeLinear, cpu_decode.DecodeEmbedding))]
    # (q, k, v, o, gate, up, down a layer; lm_head: the fixture's head is
    # its own, so its embedding only looks up rows and keeps no copy.)
    assert len(layers) == 2 * 7 + 1
    assert cpu_decode.runs_native_kernels(model)

    calls = []
    real = kernels.quantized_matvec

    class Counting:
        def quantized_matvec(self, x, *args):
            calls.append(x.size // x.shape[-1])
            return real(x, *args)

        def __getattr__(self, name):  # (the RoPE kernel)
            return getattr(kernels, name)

    monkeypatch.setattr(cpu_decode.native, "kernels", lambda: Counting())
    first, step = logits_of(model)
    assert calls and set(calls) == {1}  # the step's rows; the prompt's went to float32
    assert len(calls) == len(layers)  # (every layer that kept its quantized weights)
    assert mx.allclose(first, quantized_first, atol=1e-4).item()
    assert mx.allclose(step, quantized_step, atol=1e-4).item()


@needs_kernels
def test_nothing_kept_without_the_kernels_or_with_keep_quantized(fixture_path, monkeypatch):
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    model, _ = _quantized(fixture_path)
    assert cpu.weights_for_cpu(model, keep=True) is None
    monkeypatch.setattr(cpu_decode.native, "kernels", lambda: None)
    assert cpu.weights_for_cpu(model)
    assert not cpu_decode.runs_native_kernels(model)
    assert cpu.converted_bytes(model) == cpu.float32_bytes(model)


def test_the_disk_tier_knows_the_kernels_compute(monkeypatch):
    monkeypatch.setattr(cpu, "FAST_BLAS", "/usr/lib/x/libopenblas.so.0")
    assert cpu.weights_identity(True, True) == \
        ",cpu_blas=libopenblas.so.0,weights=float32,kernels=native,attention=native"


@needs_kernels
@pytest.mark.parametrize("traditional", [False, True])
def test_the_rope_kernel_equals_mlx_s(traditional):
    mx.random.seed(3)
    cases = [
        ((1, 4, 1, 16), 16, 10000.0, 1.0, 0),
        ((3, 2, 7, 24), 16, 500000.0, 0.5, 37),  # dims < D: the rest passes
        ((2, 3, 1, 64), 64, 10000.0, 1.0, mx.array([5, 4097], dtype=mx.int32)),  # per row
        ((2, 3, 5, 32), 32, 1000.0, 2.0, mx.array([0, 9])),
    ]
    for shape, dims, base, scale, offset in cases:
        x = mx.random.normal(shape)
        theirs = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale,
                              offset=offset)
        off = offset if isinstance(offset, mx.array) else mx.array(offset)
        ours = kernels.rope(x, dims, traditional, base, scale, off)
        assert ours.shape == x.shape
        # An angle of float32 at position p is off by about p ulps of 1: at
        # 4,097 both implementations differ from float64 by 1e-4 or 2e-4.
        # (Apart from that, the same arithmetic: 2e-7 at position 5.)
        far = (off.max().item() + shape[2]) * scale
        assert mx.allclose(ours, theirs, rtol=1e-5, atol=2e-5 + 3e-7 * far).item(), (shape, offset)
        assert mx.array_equal(ours[..., dims:], x[..., dims:]).item()
    with pytest.raises(ValueError):
        kernels.rope(mx.zeros((1, 2, 3, 8), dtype=mx.float16), 8, False, 1e4, 1.0, mx.array(0))
    with pytest.raises(ValueError):
        kernels.rope(mx.zeros((1, 2, 3, 8)), 6, False, 1e4, 1.0, mx.array([1, 2, 3]))


@needs_kernels
def test_converted_models_run_rope_in_one_op(fixture_path, monkeypatch):
    """nn.RoPE layers become NativeRoPE; with a BatchKVCache's per-row
    offsets too, they give nn.RoPE's numbers; other dtypes go to mx.fast."""
    ropes = _converted_layers(fixture_path, monkeypatch, nn.RoPE)
    assert ropes and all(type(m) is cpu_decode.NativeRoPE for m in ropes)
    rope = ropes[0]
    plain = nn.RoPE(rope.dims, rope.traditional, rope.base, rope.scale)
    x = mx.random.normal((3, 4, 1, rope.dims))
    offsets = mx.array([0, 17, 300], dtype=mx.int32)
    assert mx.allclose(rope(x, offsets), plain(x, offsets), rtol=1e-5, atol=2e-5).item()
    assert mx.allclose(rope(x, 12), plain(x, 12), rtol=1e-5, atol=2e-5).item()
    half = x.astype(mx.float16)
    assert mx.array_equal(rope(half, 3), plain(half, 3)).item()


@needs_kernels
def test_the_rms_norm_kernel_equals_mlx_s():
    mx.random.seed(4)
    for shape in [(1, 1, 576), (3, 5, 64), (2, 1, 4, 24), (7,)]:
        x = mx.random.normal(shape) * 3
        w = mx.random.normal((shape[-1],))
        for eps in (1e-6, 1e-5):
            ours = kernels.rms_norm(x, w, eps)
            theirs = mx.fast.rms_norm(x, w, eps)
            assert ours.shape == x.shape
            assert mx.allclose(ours, theirs, rtol=1e-5, atol=1e-6).item(), shape
    with pytest.raises(ValueError):
        kernels.rms_norm(mx.zeros((2, 8)), mx.zeros((7,)), 1e-5)
    with pytest.raises(ValueError):
        kernels.rms_norm(mx.zeros((2, 8), dtype=mx.bfloat16), mx.zeros((8,)), 1e-5)


@needs_kernels
def test_converted_models_run_rms_norm_in_one_op(fixture_path, monkeypatch):
    norms = _converted_layers(fixture_path, monkeypatch, nn.RMSNorm)
    assert norms and all(type(m) is cpu_decode.NativeRMSNorm for m in norms)
    norm = norms[0]
    plain = nn.RMSNorm(norm.weight.shape[0], norm.eps)
    plain.weight = norm.weight
    x = mx.random.normal((2, 3, norm.weight.shape[0]))
    assert mx.allclose(norm(x), plain(x), rtol=1e-5, atol=1e-6).item()
    half = x.astype(mx.float16)
    assert mx.array_equal(norm(half), plain(half)).item()


@needs_kernels
def test_inputs_laid_out_otherwise_are_read_right():
    """Views (transposes, strided slices) and empty inputs: as their
    contiguous copies; nothing read out of bounds."""
    mx.random.seed(5)
    w = mx.random.normal((96, 128))
    wq, scales, biases = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((128, 3)).T  # (3, 128), columns apart
    assert mx.allclose(kernels.quantized_matvec(x, wq, scales, biases, 32, 4),
                       kernels.quantized_matvec(mx.array(np.array(x)), wq, scales, biases, 32, 4),
                       rtol=0, atol=0).item()
    every_other = (wq[::2], scales[::2], biases[::2])  # rows apart
    want = mx.quantized_matmul(x, *every_other, group_size=32, bits=4)
    assert mx.allclose(kernels.quantized_matvec(x, *every_other, 32, 4), want,
                       rtol=1e-4, atol=1e-4).item()
    empty = kernels.quantized_matvec(mx.zeros((0, 128)), wq, scales, biases, 32, 4)
    assert empty.shape == (0, 96) and mx.eval(empty) is None
    with pytest.raises(ValueError):
        kernels.quantized_matvec(mx.zeros((2, 0)), mx.zeros((96, 0), dtype=mx.uint32),
                                 mx.zeros((96, 0)), mx.zeros((96, 0)), 32, 4)

    q = mx.random.normal((2, 5, 3, 16)).transpose(0, 2, 1, 3)  # (B, H, T, D), as attention's
    offsets = mx.array([3, 0, 11, 0], dtype=mx.int32)[::2]
    assert mx.allclose(kernels.rope(q, 16, False, 1e4, 1.0, offsets),
                       mx.fast.rope(q, 16, traditional=False, base=1e4, scale=1.0,
                                    offset=offsets), rtol=1e-5, atol=2e-5).item()
    assert kernels.rope(mx.zeros((1, 2, 0, 8)), 8, False, 1e4, 1.0, mx.array(0)).shape == \
        (1, 2, 0, 8)

    h = mx.random.normal((24, 4)).T
    weight = mx.random.normal((48,))[::2]
    assert mx.allclose(kernels.rms_norm(h, weight, 1e-5), mx.fast.rms_norm(h, weight, 1e-5),
                       rtol=1e-5, atol=1e-6).item()


def _logits_at_each_position(model, prompt):
    """Prefill's logits for the prompt's last position (float32 path: more
    than DECODE_ROWS rows) against a decode step's for the same position
    (the kernel: one row), after the prompt less its last token."""
    cache = make_prompt_cache(model)
    whole = model(prompt)[:, -1]
    model(prompt[:, :-1], cache=cache)
    step = model(prompt[:, -1:], cache=cache)[:, -1]
    return whole, step


@needs_kernels
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_prefill_and_decode_run_on_the_same_weights_whatever_the_scales_dtype(
        fixture_path, monkeypatch, dtype):
    """Published 4-bit models keep bf16 or fp16 scales: the float32 weights
    prefill multiplies must be the kernel's scale * q + bias in float32, not
    rounded to the scales' dtype (0.5% off with bf16), or a stream's greedy
    text depends on its batch and on the prompt cache."""
    model, tok = _quantized(fixture_path)
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales, m.biases = m.scales.astype(dtype), m.biases.astype(dtype)
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    assert cpu.weights_for_cpu(model)
    prompt = mx.array(tok.encode("The harbour master counted seven brass lanterns."))[None]
    whole, step = _logits_at_each_position(model, prompt)
    assert mx.abs(whole - step).max().item() < 1e-4 * max(1.0, mx.abs(whole).max().item())


@needs_kernels
def test_a_model_with_room_for_float32_but_not_both_is_converted_without_the_copies(
        fixture_path, monkeypatch):
    model, _ = _quantized(fixture_path)
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    room = cpu.float32_bytes(model)
    assert cpu.converted_bytes(model) > room
    assert cpu.weights_for_cpu(model, room=room)
    assert not any(isinstance(m, (cpu_decode.DecodeLinear, nn.QuantizedLinear))
                   for _, m in model.named_modules())


@needs_kernels
def test_no_copy_kept_that_nothing_reads(fixture_path):
    """A layer a DoRA adapter wraps (DoRA multiplies by the layer's weight
    itself) and an embedding beside its own output head keep no quantized
    copy; a LoRA-wrapped layer (LoRA calls it) keeps one."""
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    model, _ = _quantized(fixture_path)
    attention = model.model.layers[0].self_attn
    attention.q_proj = DoRALinear.from_base(attention.q_proj)
    attention.k_proj = LoRALinear.from_base(attention.k_proj)
    names = set(cpu_decode.quantized_forms(model))
    assert "model.layers.0.self_attn.q_proj.linear" not in names
    assert "model.layers.0.self_attn.k_proj.linear" in names
    assert "model.embed_tokens" not in names and "lm_head" in names


def test_moe_experts_are_counted_as_they_will_be(monkeypatch):
    """float32_bytes (the room check) counts quantized MoE experts at their
    float32 size, as dequantize_model makes them."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import SwitchLinear

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = SwitchLinear(64, 32, 8)
            self.head = nn.Linear(64, 16)

    model = Experts()
    nn.quantize(model, group_size=32, bits=4)
    for _, m in model.named_modules():
        if hasattr(m, "scales"):
            m.scales, m.biases = m.scales.astype(mx.bfloat16), m.biases.astype(mx.bfloat16)
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    predicted = cpu.float32_bytes(model)
    monkeypatch.setattr(cpu_decode.native, "kernels", lambda: None)  # (float32 alone)
    assert cpu.weights_for_cpu(model)
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == predicted
