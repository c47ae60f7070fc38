"""Vision-language families we don't batch, served through mlx-vlm's own
generation (vlm_generation.py): the tiny Mistral 3 fixture (Pixtral tower),
which mlx-lm would serve as text only, with "vision": "sequential" in the
models config. Its tokens are mlx-vlm's own; requests run one at a time."""

import base64
import json

import pytest

from testkit.engine_harness import EngineRunner
from tests.models.test_vision import GREEN, RED, hf_format, image_part, user


@pytest.fixture(scope="module")
def runner(fixture_path, tmp_path_factory):
    """m3: the fixture through mlx-vlm's generation; m3text: a copy of it
    (another key) served as mlx-lm serves it, text only, batched."""
    import shutil

    folder = tmp_path_factory.mktemp("m3")
    shutil.copytree(fixture_path("mistral3_vl"), folder / "copy")
    config = folder / "models.json"
    config.write_text(json.dumps({"models": [
        {"name": "m3", "path": str(fixture_path("mistral3_vl")), "vision": "sequential"},
        {"name": "m3text", "path": str(folder / "copy")}]}))
    # Small prefill chunks: the progress callback (cancellation, watchdog)
    # runs between them inside mlx-vlm's prefill.
    r = EngineRunner(fixture_path("qwen3"), argv=["--models-config", str(config),
                                                  "--prefill-step-size", "5"])
    yield r
    r.close()


@pytest.fixture(scope="module")
def reference(fixture_path, tmp_path_factory):
    """mlx-vlm's stream_generate on the prompt our template renders."""
    from pathlib import Path

    import mlx_vlm
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.generate.dispatch import stream_generate

    path = fixture_path("mistral3_vl")
    model, processor = mlx_vlm.load(str(path))
    tokenizer = load_tokenizer(Path(path))
    folder = tmp_path_factory.mktemp("images")

    def generate(messages, max_tokens):
        urls = [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image_url"]
        paths = []
        for k, url in enumerate(urls):
            paths.append(folder / f"{k}.png")
            paths[-1].write_bytes(base64.b64decode(url.partition(",")[2]))
        prompt = tokenizer.apply_chat_template(hf_format(messages), add_generation_prompt=True,
                                               tokenize=False)
        return [r.token for r in stream_generate(
            model, processor, prompt, image=[str(p) for p in paths] or None,
            max_tokens=max_tokens, temperature=0.0)][:max_tokens]
    return generate


CONVERSATIONS = {
    "one image": [user(image_part(GREEN), "What is in this picture?")],
    "two images": [user("Look:", image_part(RED), "and", image_part(GREEN), "Compare them.")],
    "text": [{"role": "user", "content": "A text request about boats."}],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_tokens_are_mlx_vlms_own(runner, reference, name):
    messages = CONVERSATIONS[name]
    before = runner.engine.vision_stats()
    tokens, prompt, cached = runner.run({"model": "m3", "messages": messages, "max_tokens": 10})
    assert tokens == reference(messages, 10)
    assert cached == 0  # (nothing is reused on this path)
    images = sum(p.get("type") == "image_url" for m in messages
                 if isinstance(m["content"], list) for p in m["content"])
    after = runner.engine.vision_stats()
    assert after["images_encoded"] - (before or {}).get("images_encoded", 0) == images


def test_concurrent_requests_each_as_alone_and_logits_processors_apply(runner):
    bodies = [{"model": "m3", "messages": CONVERSATIONS[n], "max_tokens": 6}
              for n in sorted(CONVERSATIONS)]
    alone = [runner.run(b)[0] for b in bodies]
    assert runner.run_all(bodies) == alone
    # A logit bias (a logits processor, given the prompt and the tokens so
    # far) steers mlx-vlm's generation too.
    forced = alone[0][0] + 1
    tokens, _, _ = runner.run({**bodies[0], "logit_bias": {str(forced): 100}})
    assert tokens == [forced] * 6


def test_logits_processors_see_the_whole_prompt(runner):
    """A repetition penalty over the prompt gives the tokens mlx-lm's own
    path gives for the same model (mlx-vlm hands its processors only the
    prompt's last token and what followed; a prompt-blind penalty differs)."""
    body = {"prompt": "zebra quartz violin harbor " * 6, "max_tokens": 12}
    penalized = {**body, "repetition_penalty": 5.0, "repetition_context_size": 1000}
    ours = runner.run({**penalized, "model": "m3"}, path="/v1/completions")[0]
    assert ours == runner.run({**penalized, "model": "m3text"}, path="/v1/completions")[0]
    assert ours != runner.run({**body, "model": "m3"}, path="/v1/completions")[0]


def test_which_path_a_folder_takes(fixture_path, tmp_path):
    """Batched for vision.py's families; mlx-vlm's generation for a family
    mlx-lm can't load, or when the config asks; else text only."""
    from mlx_lm_plus.models.folders import image_path
    from mlx_lm_plus.models.served import read_models_config

    assert image_path(fixture_path("gemma3_vl")) == "batched"
    assert image_path(fixture_path("smolvlm")) == "batched"
    assert image_path(fixture_path("mistral3_vl")) is None  # mlx-lm serves its text
    assert image_path(fixture_path("mistral3_vl"), sequential=True) == "sequential"
    assert image_path(fixture_path("qwen3")) is None
    folder = tmp_path / "idefics2"  # (mlx-vlm has Idefics2, mlx-lm does not)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "idefics2", "vision_config": {}, "text_config": {}}))
    assert image_path(folder) == "sequential"
    (folder / "config.json").write_text(json.dumps({"model_type": "idefics2"}))
    assert image_path(folder) is None  # no vision config: not a VLM folder
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llava", "vision_config": {}}))
    assert image_path(folder) is None  # mlx-lm serves LLaVA's text (as Mistral 3)

    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"path": str(folder), "vision": "batched"}]}))
    with pytest.raises(ValueError, match="`vision` may be"):
        read_models_config(config)


def test_without_the_config_mistral3_is_text_only(fixture_path):
    from mlx_lm.server import ModelDescription

    from mlx_lm_plus.engine.engine import Engine
    from mlx_lm_plus.models.provider import ModelProvider
    from mlx_lm_plus.config import parse_args

    provider = ModelProvider(parse_args(["--model", str(fixture_path("mistral3_vl"))]))
    engine = Engine(provider, store=None)
    assert not engine.serves_vision(ModelDescription("default_model", "default_model", None))


def test_over_http_with_structured_output(fixture_path, tmp_path):
    """A live server: an image request for the sequential model answers,
    and a response_format holds mlx-vlm's generation to the schema (the
    constraint sees the whole prompt, then each token)."""
    from compat.launch import OURS, ServerProcess

    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [
        {"name": "m3", "path": str(fixture_path("mistral3_vl")), "vision": "sequential"}]}))
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    body = {"model": "m3", "messages": CONVERSATIONS["one image"], "max_tokens": 40}
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3")), "--models-config",
                              str(config)], log=tmp_path / "server.log") as server:
        status, plain = server.post("/v1/chat/completions", body)
        assert status == 200, plain
        status, held = server.post("/v1/chat/completions", {**body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
        assert status == 200, held
        answer = json.loads(held["choices"][0]["message"]["content"])
        assert answer in ({"answer": "yes"}, {"answer": "no"})
        assert held["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]
    assert "through mlx-vlm's own generation" in (tmp_path / "server.log").read_text()


def test_a_client_that_goes_stops_it(runner):
    """Progress between mlx-vlm's prefill chunks, and a cancelled request
    stops (in its prefill, or at its next token), harming nothing after."""
    from mlx_lm.server import Response

    channel = runner.submit({"model": "m3", "messages": [
        user(image_part(GREEN), "Describe it in many words. " * 4)], "max_tokens": 200})
    while not isinstance(item := channel.items.get(timeout=60), tuple):
        assert not isinstance(item, (Response, Exception)), item
    rest = channel.cancel_and_drain()
    assert sum(isinstance(i, Response) for i in rest) < 200
    tokens, _, _ = runner.run({"model": "m3", "messages": CONVERSATIONS["text"],
                               "max_tokens": 3})
    assert len(tokens) == 3


def test_a_template_only_in_chat_template_json(fixture_path, tmp_path):
    """A folder whose chat template is only the processor's
    (chat_template.json, as many llava-hf and Pixtral conversions): its image
    prompts are templated (mlx-lm's tokenizer alone has no template); with no
    template anywhere, image parts are refused rather than written as text."""
    import shutil

    from mlx_lm.server import CompletionRequest

    from mlx_lm_plus.planning.prompt import build_prompt
    from mlx_lm_plus.models.vlm_generation import load_mlx_vlm_model

    folder = tmp_path / "m3"
    shutil.copytree(fixture_path("mistral3_vl"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))

    def plan(path):
        _, tokenizer, generation = load_mlx_vlm_model(str(path))
        request = CompletionRequest("chat", "", json.loads(json.dumps(
            CONVERSATIONS["one image"])), None, None)
        return build_prompt(tokenizer, generation, request, {})

    assert len(plan(folder).vision.starts) == 1
    (folder / "chat_template.json").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        plan(folder)


def test_planned_off_the_generation_thread(runner, reference):
    """Engine.plan runs mlx-vlm's input preparation on the caller's thread
    (the API's planning thread): the generation thread uses that plan as it
    is, and the tokens are mlx-vlm's own."""
    import copy
    import threading

    from mlx_lm_plus.protocols.validation import parse_request
    from testkit.engine_harness import Collect

    messages = CONVERSATIONS["two images"]
    body = {"model": "m3", "messages": messages, "max_tokens": 10}
    runner.run({**body, "max_tokens": 1})  # (m3 loaded: plan() leaves other models to the engine)
    # (A copy: planning converts the messages in place.)
    parsed = parse_request("/v1/chat/completions", copy.deepcopy(body), runner.args)
    planned = []
    planner = threading.Thread(target=lambda: planned.append(
        runner.engine.plan(parsed.request, parsed.args)))
    planner.start()
    planner.join()
    assert planned[0] is not None
    before = runner.engine.planned_at_admission
    channel = Collect()
    runner.engine.submit(channel, parsed.request, parsed.args, planned[0])
    tokens, _ = channel.result()
    assert runner.engine.planned_at_admission == before
    assert tokens == reference(messages, 10)
