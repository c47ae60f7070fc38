"""Decode steps on a CPU from the quantized weights, prefill from float32,
and RoPE and RMSNorm in one op each (our kernels, mlx_lm_plus.native).

    forms = quantized_forms(model)      # before cpu.weights_for_cpu dequantizes
    ... dequantize_model(model); model.set_dtype(mx.float32) ...
    keep_quantized_forms(model, forms)  # each such layer now holds both
    use_native_layers(model)            # nn.RoPE, nn.RMSNorm -> NativeRoPE, NativeRMSNorm

Why two forms: prefill multiplies many rows at once, where float32 weights
and a BLAS are fastest (cpu.py); a decode step multiplies a few rows, where
time goes into reading the weights, and 4-bit ones are an eighth of the
bytes. MLX's CPU quantized_matmul reads them slower than BLAS reads float32
ones, so this uses our kernel (mlx_lm_plus.native) for calls of at most
`DECODE_ROWS` rows. The cost is the quantized weights kept beside the
float32 ones: 18% more weight memory for 4-bit ones with fp16 scales (98 MB
for the demo model's 440 of float32), counted in the model's bytes.

Results equal the float32 path's up to float rounding (the kernel sums
scale * dot(q, x) + bias * sum(x) per group, where the float32 weight holds
scale * q + bias rounded: cpu.weights_for_cpu dequantizes with float32
scales for that), and a row's result does not depend on the other rows of
its call.

RoPE and RMSNorm: MLX 0.32 runs mx.fast.rope on a CPU as a graph of about
20 ops and mx.fast.rms_norm as one of 6; at one position a call, RoPE's
cost a fifth of a decode step once the matmuls read quantized weights.
NativeRoPE and NativeRMSNorm are the same arithmetic in one op each
(float32 inputs; anything else goes to mx.fast). Only mlx.nn.RoPE and
mlx.nn.RMSNorm themselves are replaced: the scaled RoPE variants (Llama
3's, YaRN, SuScaled) compute their frequencies otherwise, and models' own
norm classes (Gemma's 1 + weight) differ; they keep theirs.
"""

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_lm_plus import native
from mlx_lm_plus.models import cpu_attention

# Calls with at most this many rows of x use the quantized form: a decode
# step of a batch of up to 8, or a speculative check of a few rows.
DECODE_ROWS = 8


class QuantizedForm:
    """One layer's quantized weight as mx.quantize made it."""

    def __init__(self, module):
        self.weight, self.scales, self.biases = module.weight, module.scales, module.biases
        self.group_size, self.bits = module.group_size, module.bits

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


def _usable(module) -> bool:
    kernels = native.kernels()
    return (kernels is not None
            and type(module) in (nn.QuantizedLinear, nn.QuantizedEmbedding)
            and getattr(module, "mode", "affine") == "affine"
            and module.bits in (4, 8) and module.group_size in (32, 64, 128)
            and module.get("biases") is not None)


def quantized_forms(model) -> Dict[str, QuantizedForm]:
    """The quantized layers the kernel can decode from, by module name
    (none where the kernels are not built). Not those whose quantized form
    nothing would read: an embedding unless the model ties its output head
    to it (only then does it multiply, through `as_linear`: the model's
    `args.tie_word_embeddings` says, else the absence of a head module), a
    layer a DoRA adapter wraps (it multiplies by the layer's weight
    itself)."""
    modules = dict(model.named_modules())
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", None)
    if not isinstance(tied, bool):
        tied = not any(name.rpartition(".")[2] in ("lm_head", "output", "embed_out")
                       for name in modules)

    def read(name, m) -> bool:
        if type(m) is nn.QuantizedEmbedding and not tied:
            return False
        parent = modules.get(name.rpartition(".")[0])
        return type(parent).__name__ != "DoRALinear"

    return {name: QuantizedForm(m) for name, m in modules.items()
            if _usable(m) and read(name, m)}


def forms_nbytes(forms: Dict[str, QuantizedForm]) -> int:
    return sum(f.nbytes for f in forms.values())


def _quantized_matmul(layer, x: mx.array) -> Optional[mx.array]:
    """x @ W.T from a layer's quantized form, or None where the float32
    path is the one to take (many rows, or x not float32)."""
    if x.dtype != mx.float32 or x.size > DECODE_ROWS * x.shape[-1]:
        return None
    return native.kernels().quantized_matvec(
        x, layer.quantized_weight, layer.scales, layer.biases, layer.group_size, layer.bits)


def _hold(layer, form: QuantizedForm) -> None:
    """The layer keeps the form (as parameters: counted in its bytes)."""
    layer.quantized_weight, layer.scales, layer.biases = form.weight, form.scales, form.biases
    layer.group_size, layer.bits = form.group_size, form.bits


class DecodeLinear(nn.Linear):
    """nn.Linear (float32 weight, and bias) beside its quantized form (see
    the module doc)."""

    def __init__(self, linear: nn.Linear, form: QuantizedForm):
        super().__init__(linear.weight.shape[1], linear.weight.shape[0], bias="bias" in linear)
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias
        _hold(self, form)

    def __call__(self, x: mx.array) -> mx.array:
        y = _quantized_matmul(self, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class DecodeEmbedding(nn.Embedding):
    """nn.Embedding (float32 lookups) whose `as_linear` (a tied output
    head) decodes from the quantized form."""

    def __init__(self, embedding: nn.Embedding, form: QuantizedForm):
        super().__init__(*embedding.weight.shape)
        self.weight = embedding.weight
        _hold(self, form)

    def as_linear(self, x: mx.array) -> mx.array:
        y = _quantized_matmul(self, x)
        return super().as_linear(x) if y is None else y


class NativeRoPE(nn.RoPE):
    """nn.RoPE whose float32 calls run our kernel (see the module doc)."""

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if x.dtype != mx.float32 or x.ndim != 4:
            return super().__call__(x, offset)
        if not isinstance(offset, mx.array):
            offset = mx.array(offset, dtype=mx.int32)
        return native.kernels().rope(x, self.dims, self.traditional, self.base, self.scale,
                                     offset)


class NativeRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose float32 calls run our kernel (see the module doc)."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 or self["weight"].dtype != mx.float32:
            return super().__call__(x)
        return native.kernels().rms_norm(x, self["weight"], self.eps)


def _native_norm(norm: nn.RMSNorm) -> NativeRMSNorm:
    native_norm = NativeRMSNorm(norm.weight.shape[0], norm.eps)
    native_norm.weight = norm.weight
    return native_norm


def use_native_layers(model) -> int:
    """Every mlx.nn.RoPE and mlx.nn.RMSNorm of `model` made a NativeRoPE or
    NativeRMSNorm where the kernels are built, and its attention ours
    (cpu_attention.py); how many layers."""
    if native.kernels() is None:
        return 0
    cpu_attention.install(model)
    replaced = []
    for name, m in model.named_modules():
        if type(m) is nn.RoPE:
            replaced.append((name, NativeRoPE(m.dims, m.traditional, m.base, m.scale)))
        elif type(m) is nn.RMSNorm:
            replaced.append((name, _native_norm(m)))
    from mlx.utils import tree_unflatten

    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)


def runs_native_kernels(model) -> bool:
    """Whether any layer of `model` computes with our kernels."""
    return cpu_attention.installed(model) or any(isinstance(m, (DecodeLinear, DecodeEmbedding, NativeRoPE, NativeRMSNorm))
               for _, m in model.named_modules())


def keep_quantized_forms(model, forms: Dict[str, QuantizedForm]) -> None:
    """Each layer named in `forms`, now dequantized, holds its quantized
    form too (DecodeLinear, DecodeEmbedding)."""
    if not forms:
        return
    modules = dict(model.named_modules())
    replaced = []
    for name, form in forms.items():
        module = modules.get(name)
        if type(module) is nn.Linear:
            replaced.append((name, DecodeLinear(module, form)))
        elif type(module) is nn.Embedding:
            replaced.append((name, DecodeEmbedding(module, form)))
    from mlx.utils import tree_unflatten

    model.update_modules(tree_unflatten(replaced))
