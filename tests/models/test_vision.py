"""Vision-language models through mlx-vlm (tiny random Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, Qwen3.5, Gemma 3, SmolVLM and Idefics3): images in the cache key by
fingerprint, the vision tower skipped for cached images, image requests
batched with text requests, all equal to cold runs and to mlx-vlm's own
generation."""

import base64
import itertools
import io

import pytest
from PIL import Image, PngImagePlugin

from testkit.engine_harness import SEQUENTIAL, EngineRunner


def png(color, size=(56, 56), **save):
    out = io.BytesIO()
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 7):  # some structure, not a flat colour
        image.putpixel((x, x % size[1]), (x * 4 % 256, 90, 200))
    image.save(out, format="PNG", **save)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts):
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return {"role": "user", "content": content}


def hf_format(messages):
    """The messages as a Hugging Face chat template takes images: parts of
    type "image" (what mlx-vlm's own users render their prompts with)."""
    return [{**m, "content": [{"type": "image"} if p.get("type") == "image_url" else p
                              for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]


RED, BLUE, GREEN = png((200, 30, 30)), png((30, 30, 200)), png((30, 160, 40), size=(84, 56))


def noise(seed, size=(84, 84)):
    """A picture whose every patch differs (flat pictures hide mixed-up patches)."""
    import numpy as np

    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5_vl",
                                        "qwen3_5_moe_vl", "gemma3_vl", "smolvlm", "idefics3_vl"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def runner(fixture_path, kind):
    r = EngineRunner(fixture_path(kind))
    yield r
    r.close()


@pytest.fixture(scope="module")
def cold(fixture_path, kind):
    """The same model with no prompt cache (a zero budget keeps nothing)."""
    r = EngineRunner(fixture_path(kind), max_bytes=0)
    yield r
    r.close()


def calls(r):
    return r.loaded.processor.calls


def test_matches_mlx_vlm_generate(runner, fixture_path, kind, tmp_path):
    """Our path (vision tower, prefill, BatchGenerator on the text model)
    gives mlx-vlm's own greedy tokens."""
    import mlx_vlm
    from mlx_vlm.generate.dispatch import stream_generate

    model, processor = mlx_vlm.load(str(fixture_path(kind)))
    messages = [user(image_part(GREEN), "What is in this picture?")]
    path = tmp_path / "green.png"
    path.write_bytes(base64.b64decode(GREEN.partition(",")[2]))
    prompt = processor.tokenizer.apply_chat_template(hf_format(messages),
                                                     add_generation_prompt=True, tokenize=False)
    reference = [r.token for r in stream_generate(model, processor, prompt, image=[str(path)],
                                                  max_tokens=12, temperature=0.0)][:12]
    tokens, _, _ = runner.run({"messages": messages, "max_tokens": 12})
    assert tokens == reference


@pytest.mark.parametrize("name", ["one image", "two images", "image then text follow-ups"])
def test_output_with_cache_equals_cold(runner, cold, kind, name):
    if name == "one image":
        conversations = [[user(image_part(RED), "Describe the picture.")]]
    elif name == "two images":
        conversations = [[user(image_part(RED), "and", image_part(GREEN), "Compare them.")]]
    else:
        first = [user(image_part(BLUE), "What colour is it?")]
        conversations = [first]
    for messages in conversations:
        warm, _, _ = runner.run({"messages": messages, "max_tokens": 10})
        again, prompt, cached = runner.run({"messages": messages, "max_tokens": 10})
        reference, _, _ = cold.run({"messages": messages, "max_tokens": 10})
        assert warm == again == reference
        assert cached == prompt - 1
        if name == "image then text follow-ups":
            history = list(messages)
            for turn in ("Are you sure?", "Say it again in other words."):
                reply = runner.loaded.tokenizer.decode(again)
                history += [{"role": "assistant", "content": reply}, user(turn)]
                before, previous_prompt = calls(runner), prompt
                again, prompt, cached = runner.run({"messages": history, "max_tokens": 10})
                reference, _, _ = cold.run({"messages": history, "max_tokens": 10})
                assert again == reference
                assert calls(runner) == before  # the image was in the cache
                # Reused at least the whole previous prompt, image included
                # (and the reply as far as its re-tokenized text gives the
                # tokens the random model generated). A hybrid cache can't be
                # cut back: its entry at the previous prompt's end holds all
                # but the last token, which the batch computes with the
                # first token of the reply. Nor can Gemma 3's sliding-window
                # layers once the conversation is longer than the window.
                uncuttable = kind.startswith("qwen3_5") or kind == "gemma3_vl"
                assert cached >= previous_prompt - uncuttable


def test_same_image_hits_reencoded_hits_different_image_misses(runner, cold):
    question = "What is in this picture?"
    first, prompt, _ = runner.run({"messages": [user(image_part(GREEN), question)], "max_tokens": 8})
    before = calls(runner)

    # The same picture, another question: a hit through the image, no vision tower.
    other, prompt2, cached = runner.run(
        {"messages": [user(image_part(GREEN), "Name its colour.")], "max_tokens": 8})
    assert calls(runner) == before
    assert other == cold.run({"messages": [user(image_part(GREEN), "Name its colour.")],
                              "max_tokens": 8})[0]
    vision = runner.loaded.processor
    tokens, plan_images = vision.prepare(
        runner.loaded.tokenizer.apply_chat_template(
            hf_format([user(image_part(GREEN), "Name its colour.")]), add_generation_prompt=True,
            tokenize=False), [GREEN])
    assert cached >= plan_images.images[0].end

    # The same pixels re-encoded (other compression, a metadata chunk): a hit.
    meta = PngImagePlugin.PngInfo()
    meta.add_text("comment", "re-saved by another program")
    reencoded = png((30, 160, 40), size=(84, 56), compress_level=1, pnginfo=meta)
    assert reencoded != GREEN
    again, _, cached = runner.run(
        {"messages": [user(image_part(reencoded), question)], "max_tokens": 8})
    assert again == first and cached == prompt - 1 and calls(runner) == before

    # A different picture at the same place: a miss from that image on, and
    # the answer is the cold answer about the new picture.
    new_picture = png((230, 200, 20), size=(84, 56))  # never sent before
    changed, _, cached = runner.run(
        {"messages": [user(image_part(new_picture), question)], "max_tokens": 8})
    assert calls(runner) == before + 1
    assert cached <= plan_images.images[0].vision_start
    reference, _, _ = cold.run(
        {"messages": [user(image_part(new_picture), question)], "max_tokens": 8})
    assert changed == reference != first


def test_concurrent_image_and_text_requests_equal_sequential(runner, cold):
    bodies = [
        {"messages": [user(image_part(RED), "One.")], "max_tokens": 12},
        {"messages": [{"role": "user", "content": "A text request about boats."}], "max_tokens": 12},
        {"messages": [user(image_part(BLUE), "Two.")], "max_tokens": 9},
        {"messages": [user(image_part(GREEN), "and", image_part(RED), "Three.")], "max_tokens": 11},
        {"messages": [{"role": "user", "content": "Another text one, longer " * 5}], "max_tokens": 7},
    ]
    runner.engine.store.clear()
    together = runner.run_all(bodies)
    alone = [cold.run(b)[0] for b in bodies]
    assert together == alone


def test_ends_at_the_models_end_tokens(runner, kind):
    """Every end token the model's configs name stops generation (Gemma 3's
    <end_of_turn> is in config.json, not its tokenizer's eos)."""
    import json
    from pathlib import Path

    config = json.loads((Path(runner.loaded.model_key[0]) / "config.json").read_text())
    ends = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    for end in ends if isinstance(ends, list) else [ends]:
        tokens, _, _ = runner.run({"messages": [user(image_part(RED), "Stop.")],
                                   "max_tokens": 6, "logit_bias": {str(end): 100}})
        assert tokens in ([], [end]), (end, tokens)


def test_gemma3_pad_tokens_are_plain_tokens(runner, cold, kind):
    """A client's "<pad>" text gives the same answer warm and cold (mlx-vlm's
    merge zeroes pads only in the stretch it embeds, which depends on the
    cached prefix; here pads are tokens everywhere)."""
    if kind != "gemma3_vl":
        pytest.skip("Gemma 3's merge")
    runner.engine.store.clear()
    first = [user(image_part(RED), "Look <pad><pad> at it <pad>")]
    both = first + [{"role": "assistant", "content": "A red <pad> one."},
                    user(image_part(GREEN), "And <pad> this?")]
    for messages in (first, both):
        body = {"messages": messages, "max_tokens": 8}
        assert runner.run(body)[0] == cold.run(body)[0]
    assert runner.run({"messages": both, "max_tokens": 8})[2] > 0  # (warm: a cached prefix)


def test_rope_deltas_match_mlx_vlm(runner, kind):
    """Our per-image M-RoPE delta is mlx-vlm's rope index delta."""
    import mlx.core as mx

    if not kind.startswith("qwen"):
        pytest.skip("no M-RoPE")

    vision = runner.loaded.processor
    text = runner.loaded.tokenizer.apply_chat_template(
        [user(image_part(GREEN), "x", image_part(RED), "y")], add_generation_prompt=True,
        tokenize=False)
    tokens, images = vision.prepare(text, [GREEN, RED])
    grid = mx.array([img.grid for img in images.images])
    _, deltas = vision.vlm.language_model.get_rope_index(mx.array(tokens)[None], grid)
    assert images.delta_at(len(tokens)) == int(deltas[0, 0].item())


def test_over_http_stream_stats_metrics_and_bad_images(fixture_path, tmp_path):
    """A live server on the VL fixture: image requests streamed and not,
    the vision figures in /v1/stats and /metrics, bad images a 400 that
    harms nothing."""
    from compat.launch import OURS, ServerProcess, parse_sse

    with ServerProcess(OURS, ["--model", str(fixture_path("qwen2_vl"))],
                       log=tmp_path / "server.log") as server:
        body = {"messages": [user(image_part(RED), "What is it?")], "max_tokens": 8}
        status, first = server.post("/v1/chat/completions", body)
        assert status == 200, first
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, _, raw = server.request("POST", "/v1/chat/completions",
                                        {**body, "stream": True,
                                         "stream_options": {"include_usage": True}})
        events = [e for kind, e in parse_sse(raw) if kind == "data" and e != "[DONE]"]
        text = "".join(e["choices"][0]["delta"].get("content") or ""
                       for e in events if e.get("choices"))
        assert text == first["choices"][0]["message"]["content"]
        usage = events[-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1

        status, stats = server.get("/v1/stats")
        assert stats["engine"]["vision"] == {"images_encoded": 1, "images_from_cache": 1}
        # (The first may have come while the model loaded.)
        assert stats["engine"]["planned_at_admission"] <= 1
        assert [r["images"] for r in stats["requests"]] == [1, 1]
        assert any(e["images"] == 1 for e in stats["entries"])
        _, _, metrics = server.request("GET", "/metrics")
        assert b'mlx_lm_plus_vision_images_total{source="vision_tower"} 1.0' in metrics
        assert b"mlx_lm_plus_vision_seconds_count 1.0" in metrics

        for bad in ("data:image/png;base64,AAAA", "https://example.com/x.png"):
            status, r = server.post("/v1/chat/completions", {
                "messages": [user(image_part(bad), "?")], "max_tokens": 4})
            assert status == 400 and "Image 0" in r["error"], r
        assert server.get("/health") == (200, {"status": "ok"})
        status, again = server.post("/v1/chat/completions", body)
        assert status == 200 and again["choices"] == first["choices"]


def test_image_requests_are_planned_off_the_generation_thread(runner, cold):
    """Engine.plan runs the image processor on the caller's thread (the API's
    planning thread, with the images decoded there first): the generation
    thread uses that plan as it is, and the reply is the cold one. (MLX
    arrays made on one thread and used unevaluated on another fail.)"""
    import copy
    import threading

    from mlx_lm_plus.protocols.validation import parse_request
    from mlx_lm_plus.models.images import decode_images
    from testkit.engine_harness import Collect

    body = {"messages": [user(image_part(noise(11)), "Planned elsewhere?")], "max_tokens": 8}
    engine = runner.engine
    runner.loaded  # (plan() leaves a request for a model not loaded yet to the engine)
    # (A copy: planning converts the messages in place.)
    parsed = parse_request("/v1/chat/completions", copy.deepcopy(body), runner.args)
    parsed.request.images = decode_images([noise(11)])
    planned = []
    planner = threading.Thread(target=lambda: planned.append(
        engine.plan(parsed.request, parsed.args)))
    planner.start()
    planner.join()
    assert planned[0] is not None and parsed.request.images is None
    before = engine.planned_at_admission
    channel = Collect()
    engine.submit(channel, parsed.request, parsed.args, planned[0])
    tokens, _ = channel.result()
    assert engine.planned_at_admission == before
    assert tokens == cold.run(body)[0]


def test_image_prompts_are_counted_off_the_generation_thread(runner):
    """count_tokens of an image request: Engine.count_prompt plans it on the
    caller's thread (the API's planning thread), the image processor
    included, and counts what the request would be generated with."""
    import copy

    from mlx_lm_plus.protocols.validation import parse_request
    from mlx_lm_plus.models.images import decode_images

    body = {"messages": [user(image_part(noise(12)), "How many tokens?")], "max_tokens": 2}
    runner.loaded
    parsed = parse_request("/v1/chat/completions", copy.deepcopy(body), runner.args)
    parsed.request.images = images = decode_images([noise(12)])
    counted = runner.engine.count_prompt(parsed.request, parsed.args)
    assert parsed.request.images is images  # (read, not copied nor dropped)
    assert counted == runner.run(body)[1]


def test_image_plans_made_ahead_are_bounded(fixture_path):
    """Plans hold the processor's pixel arrays until admission: at most
    --prompt-concurrency image requests are planned ahead; the next one is
    left to admission (planned there, as before), until one goes."""
    import copy
    import gc

    from mlx_lm_plus.protocols.validation import parse_request
    from testkit.engine_harness import Collect

    r = EngineRunner(fixture_path("qwen2_vl"), argv=["--prompt-concurrency", "2"])
    try:
        r.loaded  # (plan() leaves a request for a model not loaded yet to the engine)
        body = {"messages": [user(image_part(RED), "What is it?")], "max_tokens": 4}

        def plan():
            parsed = parse_request("/v1/chat/completions", copy.deepcopy(body), r.args)
            return r.engine.plan(parsed.request, parsed.args)

        first, second = plan(), plan()
        assert first is not None and second is not None
        assert plan() is None  # (two held: the third is planned at admission)
        del first
        gc.collect()
        again = plan()
        assert again is not None
        # Admitted, a plan is no longer ahead, though its request holds it
        # (a sequential request would until it ends).
        parsed = parse_request("/v1/chat/completions", copy.deepcopy(body), r.args)
        held = r.engine.plan(parsed.request, parsed.args)
        assert held is None  # (two ahead again)
        held = second
        channel = Collect()
        r.engine.submit(channel, parsed.request, parsed.args, held)
        channel.result()
        assert held is second and plan() is not None
        # (Text requests are planned ahead whatever the images held.)
        parsed = parse_request("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "Text only."}]}, r.args)
        assert r.engine.plan(parsed.request, parsed.args) is not None
    finally:
        r.close()


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF"])
def test_image_formats(runner, fmt):
    out = io.BytesIO()
    frames = [Image.new("RGB", (56, 56), c) for c in ((200, 30, 30), (30, 200, 30))]
    if fmt == "GIF":  # an animation: its first frame is the picture
        frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    else:
        frames[0].save(out, format=fmt)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()
    from mlx_lm_plus.protocols.validation import parse_request

    parse_request("/v1/chat/completions", {"messages": [user(image_part(url), "?")]}, runner.args)
    tokens, prompt, _ = runner.run({"messages": [user(image_part(url), "What?")], "max_tokens": 4})
    assert len(tokens) == 4
    if fmt == "GIF":
        from mlx_lm_plus.models.images import decode_image, fingerprint

        assert fingerprint(decode_image(url)) == fingerprint(frames[0].convert("RGB"))


def test_image_prefill_in_small_chunks_and_resumed_mid_prompt(fixture_path, kind, cold):
    """Chunks of 3 tokens cut through the images (and Qwen3-VL's deepstack
    features), and a second image after a cached first one starts its
    stretch mid-prompt: both give the cold single-chunk answer."""
    r = EngineRunner(fixture_path(kind), argv=["--prefill-step-size", "3"])
    try:
        first = [user(image_part(noise(1)), "Look at this.")]
        both = first + [{"role": "assistant", "content": "I see it."},
                        user(image_part(noise(2)), "And now this one?")]
        for messages in (first, both):
            body = {"messages": messages, "max_tokens": 8}
            tokens, prompt, cached = r.run(body)
            assert tokens == cold.run(body)[0]
        assert cached > 0 and r.loaded.processor.calls == 2  # the first was not encoded again
    finally:
        r.close()


def test_shared_system_prompt_then_other_images(runner, cold):
    """Requests sharing a system prompt, each with its own picture, resume
    after the system prompt (stored while the first one's image stretch was
    prefilled) and run the vision tower once per new picture."""
    system = {"role": "system", "content": "You describe pictures for a catalogue. " * 6}
    runner.engine.store.clear()
    before = calls(runner)
    for i, seed in enumerate((11, 12, 13)):
        body = {"messages": [system, user(image_part(noise(seed)), "Describe it.")],
                "max_tokens": 8}
        tokens, prompt, cached = runner.run(body)
        assert tokens == cold.run(body)[0]
        assert calls(runner) == before + i + 1
        if i:
            system_end = runner.loaded.tokenizer.apply_chat_template(
                [system], tokenize=True)
            assert cached >= len(system_end)


def test_the_sequential_path_prefills_and_stores_images_as_the_batch(runner, cold):
    """On the sequential path an image is prefilled and checkpointed the
    same way, and what it stores serves a batched request after it."""
    runner.engine.store.clear()
    plain = {"messages": [user(image_part(noise(21)), "What is this?")], "max_tokens": 8}
    before = runner.sequential
    tokens, _, cached = runner.run({**plain, **SEQUENTIAL})
    assert runner.sequential == before + 1
    assert tokens == cold.run(plain)[0] and cached == 0
    before = calls(runner)
    other = {"messages": [user(image_part(noise(21)), "Anything else?")], "max_tokens": 8}
    tokens, _, cached = runner.run(other)
    assert tokens == cold.run(other)[0]
    assert calls(runner) == before and cached > 0


@pytest.mark.parametrize("family", ["qwen3_5_vl", "gemma3_vl", "smolvlm"])
def test_image_prompt_checkpoints(fixture_path, family):
    """Where an image prompt's plan puts its checkpoints: after the system
    prompt, at the end of each image, and at the start of the last user
    message, in the expanded (image tokens) positions."""
    from mlx_lm.server import CompletionRequest

    from mlx_lm_plus.planning.prompt import build_prompt
    from mlx_lm_plus.models.vision import load_vision_model

    _, tokenizer, vision = load_vision_model(str(fixture_path(family)))
    system = {"role": "system", "content": "You describe pictures."}
    messages = [system, user(image_part(noise(1)), "Describe it."),
                {"role": "assistant", "content": "It is noisy."},
                user(image_part(GREEN), "And this one?")]
    request = CompletionRequest("chat", "", messages, None, None)
    plan = build_prompt(tokenizer, vision, request, {})
    first, second = plan.vision.images
    assert first.end - first.start > 1 and second.end - second.start > 1
    ends = list(itertools.accumulate(len(s) for s in plan.segments[:-1]))
    # Both user messages start with their image: their content starts at
    # its <|vision_start|> (Qwen), or at the markup the processor writes
    # before the image's tokens (Gemma 3: a blank line and <start_of_image>;
    # Idefics3: the first tile's markers).
    system_end = len(tokenizer.apply_chat_template([system], tokenize=True))
    assert ends[1::2] == [first.end, second.end]
    if family.startswith("qwen"):
        assert ends[::2] == [first.vision_start, second.vision_start]
    assert system_end < ends[0] <= first.vision_start
    assert first.end < ends[2] <= second.vision_start
    # Each user message's content starts where the processor's markup for
    # its image does: the same few tokens before both images (the first
    # found without moving past an image, the second moved past the first
    # image's expansion: an off-by-one there makes them differ).
    t = plan.tokens
    assert 1 <= len(t[ends[0]:first.start]) <= 3
    assert t[ends[0]:first.start] == t[ends[2]:second.start]
    assert t[ends[0] - 1] == t[ends[2] - 1]  # (the newline ending a turn header)
    assert plan.segment_types[0] == "system"
    assert sum(plan.segments, []) == plan.tokens


def test_image_prompt_checkpoints_when_newlines_merge(fixture_path, tmp_path):
    """Gemma 3's real tokenizer merges runs of newlines, so the blank lines
    its processor writes around an image tokenize together with the
    template's. The message boundaries are still found (next to that
    whitespace), as many as with the fixture's tokenizer, none in an image."""
    import json
    import shutil

    from mlx_lm.server import CompletionRequest

    from mlx_lm_plus.planning.prompt import build_prompt
    from mlx_lm_plus.models.vision import load_vision_model

    merged = tmp_path / "gemma3_vl"
    shutil.copytree(fixture_path("gemma3_vl"), merged)
    spec = json.loads((merged / "tokenizer.json").read_text())
    vocab, n = spec["model"]["vocab"], len(spec["model"]["vocab"])
    for i, run in enumerate(("ĊĊ", "ĊĊĊ", "ĊĊĊĊ")):
        vocab[run] = n + i  # (planning only: never through the model)
    spec["model"]["merges"] += [["Ċ", "Ċ"], ["ĊĊ", "ĊĊ"], ["ĊĊ", "Ċ"]]
    (merged / "tokenizer.json").write_text(json.dumps(spec))

    messages = [{"role": "system", "content": "You are careful."},
                user(image_part(GREEN), "What is this?"),
                {"role": "assistant", "content": "A green square."},
                user("And this?", image_part(RED), "Compare.")]
    plans = []
    for path in (fixture_path("gemma3_vl"), merged):
        _, tokenizer, vision = load_vision_model(str(path))
        request = CompletionRequest("chat", "", json.loads(json.dumps(messages)), None, None)
        plans.append(build_prompt(tokenizer, vision, request, {}))
    plain, merged_plan = plans
    assert any(t >= n for t in merged_plan.tokens)  # (newlines did merge)
    assert merged_plan.segment_types == plain.segment_types
    assert "system" in merged_plan.segment_types and len(merged_plan.segments) == 5
    ends = list(itertools.accumulate(len(s) for s in merged_plan.segments[:-1]))
    assert all(merged_plan.vision.safe_prefix(e) == e for e in ends)
    assert sum(merged_plan.segments, []) == merged_plan.tokens


def test_decode_image_scales_down_to_the_processor_limit():
    from mlx_lm_plus.models.images import decode_image

    url = noise(1, size=(2000, 1000))
    small = decode_image(url, max_pixels=200_000)
    assert small.size[0] * small.size[1] <= 200_000
    assert abs(small.size[0] / small.size[1] - 2.0) < 0.01
    assert decode_image(url).size == (2000, 1000)  # no limit: as it is


async def test_images_decoded_off_the_generation_thread_with_keepalives(
        fixture_path, aiohttp_client, monkeypatch):
    """Pixels are decoded in an executor, not on the event loop or the
    generation thread; a stream gets keepalives while its image stretch is
    prefilled."""
    import copy
    import threading

    from compat.launch import parse_sse
    from mlx_lm_plus.models import images
    from mlx_lm_plus.http.server import make_app
    from mlx_lm_plus.app import build
    from mlx_lm_plus.config import parse_args

    threads = []
    real = images.decode_image
    monkeypatch.setattr(images, "decode_image", lambda *a, **kw: (
        threads.append(threading.current_thread().name), real(*a, **kw))[1])
    cli = parse_args(["--model", str(fixture_path("qwen2_vl")), "--prefill-step-size", "8"])
    engine, server = build(cli)
    submitted = []
    real_submit = engine.submit
    engine.submit = lambda channel, req, args, planned=None: (
        submitted.append(req), real_submit(channel, req, args, planned))[1]
    engine.start()
    try:
        client = await aiohttp_client(make_app(server))
        body = {"messages": [user(image_part(noise(5)), "What is it?")], "max_tokens": 3,
                "stream": True}
        r = await client.post("/v1/chat/completions", json=body)
        raw = await r.read()
        assert r.status == 200
        kinds = [kind for kind, _ in parse_sse(raw)]
        assert "comment" in kinds[: kinds.index("data")], kinds[:5]
        assert threads and "mlx_lm_plus-generation" not in threads
        assert threading.main_thread().name not in threads
        # Decoded images reached the engine, which let them go once planned.
        assert len(submitted) == 1 and submitted[0].images is None
    finally:
        engine.stop_and_join(timeout=30)


def test_image_prefill_stops_when_the_client_goes(fixture_path):
    from mlx_lm.server import Response

    r = EngineRunner(fixture_path("qwen2_vl"), argv=["--prefill-step-size", "2"])
    try:
        channel = r.submit({"messages": [user(image_part(noise(9)), "Describe it.")],
                            "max_tokens": 50})
        item = channel.items.get(timeout=60)
        assert isinstance(item, tuple), item  # progress before acceptance
        rest = channel.cancel_and_drain()
        assert not any(isinstance(i, Response) for i in rest)
        # Nothing of the abandoned stretch was stored; the engine goes on.
        tokens, _, _ = r.run({"messages": [user("plain text")], "max_tokens": 3})
        assert len(tokens) == 3
    finally:
        r.close()


def test_vision_load_leaves_the_hub_setting_as_it_was(fixture_path, monkeypatch):
    """Offline only while mlx-vlm loads a local folder: a later load of a
    repo name (--allow-model-loading) may still download."""
    import os

    import huggingface_hub.constants as hub

    from mlx_lm_plus.models.vision import load_vision_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    load_vision_model(str(fixture_path("qwen2_vl")))
    assert "HF_HUB_OFFLINE" not in os.environ and hub.HF_HUB_OFFLINE is False


@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm", "gemma3_vl"])
def test_image_scaling_is_known_before_the_model_loads(fixture_path, family):
    """Images decoded before the generation thread has loaded the model are
    scaled (and so fingerprinted) as later ones: the limit comes from the
    model folder, and equals the loaded processor's (Qwen's pixel limit;
    none for families whose processors resize to an edge or a square)."""
    from mlx_lm.server import ModelDescription

    from mlx_lm_plus.engine.engine import Engine
    from mlx_lm_plus.models.provider import ModelProvider
    from mlx_lm_plus.config import parse_args

    path = fixture_path(family)
    provider = ModelProvider(parse_args(["--model", str(path)]))
    engine = Engine(provider, store=None)
    default = ModelDescription("default_model", "default_model", None)
    before = engine.image_max_pixels(default)
    assert (before is not None) == family.startswith("qwen") and engine.serves_vision(default)
    provider.add(provider.load(provider.default_key))
    assert engine.image_max_pixels(default) == before


def test_kv_bits_leaves_vision_layers_as_they_are(fixture_path):
    """--kv-bits on Gemma 3 (sliding-window layers mlx-lm can't quantize:
    every request was a 500) and SmolVLM: answered, unquantized, as without
    it."""
    for family in ("gemma3_vl", "smolvlm"):
        quantized = EngineRunner(fixture_path(family),
                                 argv=["--kv-bits", "4", "--quantized-kv-start", "0"])
        plain = EngineRunner(fixture_path(family), max_bytes=0)
        try:
            for body in ({"messages": [user(image_part(RED), "What is it?")], "max_tokens": 6},
                         {"messages": [user("Only text.")], "max_tokens": 6}):
                assert quantized.run(body)[0] == plain.run(body)[0]
        finally:
            quantized.close()
            plain.close()


def test_images_prefilled_while_queued_count_in_flight(fixture_path):
    """Requests past a full batch wait in the generator's queue; an image
    request's image stretch was prefilled at admission, into a cache of its
    own, which counts against --prompt-cache-bytes while it waits (the
    store gives way), as the running requests' caches do."""
    import time

    from mlx_lm.server import Response

    r = EngineRunner(fixture_path("qwen2_vl"),
                     argv=["--decode-concurrency", "1", "--prompt-concurrency", "1"])
    try:
        word = r.loaded.tokenizer.encode(" the", add_special_tokens=False)[-1]
        running = r.submit({"messages": [{"role": "user", "content": "Tell a long story."}],
                            "max_tokens": 100000, "logit_bias": {str(word): 100}})
        tokens = 0
        while tokens < 3:
            tokens += isinstance(running.items.get(timeout=60), Response)
        waiting = [r.submit({"messages": [user(*[image_part(noise(10 * i + j))
                                                  for j in range(4)], f"Describe {i}.")],
                             "max_tokens": 2}) for i in range(3)]
        deadline = time.monotonic() + 120
        while not all(any(not isinstance(x, tuple) for x in list(c.items.queue))
                      for c in waiting):  # each admitted: its context is out
            assert time.monotonic() < deadline
            time.sleep(0.02)
        (batch,) = r.engine._batches.values()
        queued = list(batch.generator._unprocessed_sequences)
        assert len(queued) == 3
        theirs = sum(c.nbytes for p in queued for c in p[3])
        assert theirs > 0
        assert r.engine.in_flight_nbytes() >= theirs + sum(
            c.nbytes for c in batch.generator._generation_batch.prompt_cache)
        running.cancel()
        for c in waiting:
            c.result()
    finally:
        r.close()
