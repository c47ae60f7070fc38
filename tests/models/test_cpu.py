"""cpu.py: a fast BLAS loaded before MLX, and float32 weights where MLX runs
on the CPU with it. (Its speed is the benchmark's: `python -m benchmarks run
--model-kind demo --workload speed`.)"""

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from mlx_lm_plus.models import cpu

PROBE = ("from mlx_lm_plus.models.cpu import preload_fast_blas; import sys; "
         "first = preload_fast_blas(); import mlx.core; "
         "from mlx_lm_plus.models import cpu; print(first, cpu.WHY_NOT is None)")


def _probe(env_blas=None):
    import os

    env = dict(os.environ)
    env.pop("MLX_LM_PLUS_BLAS", None)
    if env_blas is not None:
        env["MLX_LM_PLUS_BLAS"] = env_blas
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload is for Linux")
def test_a_fast_blas_is_loaded_before_mlx_unless_told_not_to(monkeypatch):
    monkeypatch.delenv("MLX_LM_PLUS_BLAS", raising=False)  # (conftest.py's)
    assert _probe("bundled")[0] == "None"
    assert _probe("/nonexistent/libopenblas.so.0") == ["None", "False"]  # (and says why)
    found = [p for p in cpu._candidates() if p]
    if not found:
        pytest.skip("no OpenBLAS on this machine (apt-get install libopenblas0-pthread)")
    assert _probe()[0] == found[0]


def test_too_late_once_mlx_is_loaded():
    code = ("import mlx.core; from mlx_lm_plus.models import cpu; "
            "print(cpu.preload_fast_blas(), cpu.WHY_NOT)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.startswith("None MLX was loaded before"), (out.stdout, out.stderr)


def test_weights_made_float32_give_the_quantized_model_s_logits(fixture_path, monkeypatch):
    """A quantized model's weights dequantized to float32: the same logits to
    rounding; nothing happens without a fast BLAS, with --keep-quantized, or
    off the CPU."""
    model, tok = load(str(fixture_path("qwen3")))
    nn.quantize(model, group_size=32, bits=4)
    prompt = mx.array(tok.encode("The harbour master counted seven brass lanterns."))[None]
    quantized = model(prompt)
    monkeypatch.setattr(cpu, "FAST_BLAS", None)
    assert cpu.weights_for_cpu(model) is None
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    assert cpu.weights_for_cpu(model, keep=True) is None
    grown = cpu.weights_for_cpu(model)
    assert grown > 0
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in model.named_modules())
    # (Beside them, the packed quantized weights decode steps read:
    # test_cpu_decode.py.)
    params = __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters())
    assert all(v.dtype == mx.float32 for k, v in params if not k.endswith("quantized_weight"))
    assert mx.allclose(model(prompt), quantized, atol=1e-3).item()


def test_weights_that_would_not_fit_are_kept(fixture_path, monkeypatch):
    model, _ = load(str(fixture_path("qwen3")))
    nn.quantize(model, group_size=32, bits=4)
    monkeypatch.setattr(cpu, "FAST_BLAS", "/some/libopenblas.so.0")
    need = cpu.converted_bytes(model)
    # (Room for float32 alone converts without the kept quantized weights:
    # test_cpu_decode.py.)
    assert cpu.weights_for_cpu(model, room=cpu.float32_bytes(model) - 1) is None
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    grown = cpu.weights_for_cpu(model, room=need)
    from mlx.utils import tree_flatten

    assert grown and sum(v.nbytes for _, v in tree_flatten(model.parameters())) == need
    # A slow library (the measured rate): left alone.
    monkeypatch.setattr(cpu, "RATE", 8.0)
    assert not cpu.converts()


def test_the_disk_tier_knows_how_the_weights_compute(monkeypatch):
    monkeypatch.setattr(cpu, "FAST_BLAS", "/usr/lib/x/libopenblas.so.0")
    assert cpu.weights_identity(True) == ",cpu_blas=libopenblas.so.0,weights=float32"
    monkeypatch.setattr(cpu, "FAST_BLAS", None)
    assert cpu.weights_identity(False) == ",cpu_blas=bundled"


def test_the_server_says_which_blas(fixture_path, tmp_path, monkeypatch):
    from compat.launch import OURS, ServerProcess

    # (The other tests' servers keep the bundled BLAS: conftest.py.)
    monkeypatch.delenv("MLX_LM_PLUS_BLAS", raising=False)
    found = cpu._candidates()
    log = tmp_path / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))], log=log):
        pass
    text = log.read_text()
    if found:  # (the library it loaded, by name: not the reference BLAS's warning)
        assert f"CPU matmuls on {found[0]}: " in text, text[-2000:]
    else:
        assert "CPU matmuls on the reference BLAS bundled with mlx[cpu]" in text
