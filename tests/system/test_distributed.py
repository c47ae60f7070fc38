"""Under `mlx.launch --backend ring -n 2`, ours answers as upstream does.

The ring backend runs on CPU on one machine: rank 0 serves HTTP, both ranks
compute (the request is shared with an all_sum, as upstream does).
"""

import shutil
import sys
from pathlib import Path

import pytest

from compat.launch import ServerProcess
from testkit.engine_harness import SEQUENTIAL

LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
REQUESTS = [
    {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 10},
    {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 10,
     "seed": 5},
    {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 10,
     **SEQUENTIAL},
    {"prompt": "Once upon a time", "max_tokens": 8},
]


def answers(server):
    out = []
    for body in REQUESTS:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        status, r = server.post(path, body, timeout=120)
        assert status == 200, r
        choice = r["choices"][0]
        out.append(choice.get("text", choice.get("message", {}).get("content")))
    return out


def free_ports(n: int) -> int:
    """The first of `n` consecutive loopback ports free now (mlx.launch gives
    rank i the port --starting-port + i; one taken, or in TIME_WAIT from an
    earlier server, and the ring can't bind)."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            held = []
            for port in range(first, first + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no consecutive free ports")


def ring(program, model, port, log):
    return ServerProcess(
        [LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(free_ports(2)), "--",
         program, "--model", str(model)],
        [], log=log, port=port, startup_timeout=180,
    )


@pytest.mark.skipif(not Path(LAUNCH).exists(), reason="mlx.launch not installed")
def test_ring_two_ranks_same_answers_as_upstream(fixture_path, tmp_path):
    from compat.launch import free_port

    model = fixture_path("qwen3")
    bindir = Path(sys.executable).parent
    results = {}
    for name in ("mlx_lm.server", "mlx_lm_plus.server"):
        with ring(str(bindir / name), model, free_port(), tmp_path / f"{name}.log") as s:
            results[name] = answers(s)
            assert s.get("/health") == (200, {"status": "ok"})
    assert results["mlx_lm_plus.server"] == results["mlx_lm.server"]
    assert all(results["mlx_lm.server"])


def test_requests_handed_to_other_ranks_unpickle_and_nothing_else(fixture_path):
    """What rank 0 hands the other ranks unpickles there (a chat with a
    decoded image, tools, a forced call and a JSON schema, a completion);
    anything else on the ring's unauthenticated TCP is refused (a function,
    a class that is not part of a request), never run."""
    import base64
    import io
    import os
    import pickle
    import subprocess

    from PIL import Image

    from mlx_lm_plus.planning.grammars import ForcedToolCall, Grammar, StrictToolCalls
    from mlx_lm_plus.engine.distributed import _unpickle
    from mlx_lm_plus.config import parse_args
    from mlx_lm_plus.protocols.validation import parse_request
    from mlx_lm_plus.models.images import decode_images

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    args = parse_args(["--model", str(fixture_path("qwen3"))])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = parse_request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}],
        "tools": tools, "logit_bias": {"3": 1.0}, "stop": ["x"], "seed": 3,
        "logprobs": True, "top_logprobs": 2}, args)
    # Photos and screenshots carry metadata PIL keeps in `info` (EXIF
    # rationals, PNG text chunks): none of it is handed on.
    from PIL import PngImagePlugin

    exif = Image.Exif()
    exif[0x0112] = 6  # (rotated: the orientation path)
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 6), (9, 9, 9)).save(jpeg, format="JPEG", exif=exif, dpi=(72.5, 72.5))
    text = PngImagePlugin.PngInfo()
    text.add_itxt("XML:com.adobe.xmp", "<x:xmpmeta/>")
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (5, 5, 5)).save(png, format="PNG", pnginfo=text)
    urls = [url] + [f"data:image/{kind};base64," + base64.b64encode(b.getvalue()).decode()
                    for kind, b in (("jpeg", jpeg), ("png", png))]
    chat.request.images = decode_images(urls, None)
    completion = parse_request("/v1/completions", {"prompt": "hi", "max_tokens": 3}, args)
    for constraint in (Grammar('{"type": "object"}', "json_schema", {"type": "object"}),
                       ForcedToolCall(tools, "f"), StrictToolCalls(tools), None):
        chat.request.constraint = constraint
        for parsed in (chat, completion):
            sent = (parsed.request, parsed.args)
            got = _unpickle(pickle.dumps(sent))
            assert got == sent

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch /tmp/pwned-by-the-ring",))

    for evil in (Payload(), subprocess.Popen, eval, pickle.Unpickler):
        with pytest.raises(pickle.UnpicklingError, match="is not part of a request"):
            _unpickle(pickle.dumps(evil))


def test_every_rank_looks_before_loading(fixture_path, tmp_path):
    """What each rank checks before any loads a model under mx.distributed
    (a load failing on one rank leaves the others in its collectives): the
    same config on every host, weights, a family mlx-lm has and can split
    the way asked."""
    import json
    import shutil

    from mlx_lm_plus.models.folders import loadable_fingerprint

    qwen3, qwen2 = fixture_path("qwen3"), fixture_path("qwen2")
    assert loadable_fingerprint(qwen3) == loadable_fingerprint(qwen3)
    assert loadable_fingerprint(qwen3) != loadable_fingerprint(fixture_path("llama"))
    assert isinstance(loadable_fingerprint(qwen2, pipeline=True), int)
    with pytest.raises(ValueError, match="can't be pipelined"):
        loadable_fingerprint(qwen3, pipeline=True)
    with pytest.raises(ValueError, match="can't be split tensor-parallel"):
        loadable_fingerprint(fixture_path("gemma3_text"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(qwen3 / "config.json", no_weights)
    with pytest.raises(FileNotFoundError, match="no weights"):
        loadable_fingerprint(no_weights)
    no_index = tmp_path / "no_index"
    shutil.copytree(qwen2, no_index)
    (no_index / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match="index"):
        loadable_fingerprint(no_index, pipeline=True)
    unknown = tmp_path / "unknown"
    shutil.copytree(qwen3, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such"}))
    with pytest.raises(ValueError):
        loadable_fingerprint(unknown)
