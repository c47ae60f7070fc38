"""The Gemma 3, SmolVLM/Idefics3 and Mistral 3 fixtures load offline in mlx-vlm and
its own generation sees the image: greedy output depends on the image, and is
repeatable."""

import json

import pytest
from PIL import Image

from testkit.fixtures import VLM_KINDS

# Image tokens one 64x64 image becomes (see _gemma3_files / _idefics3_files /
# _mistral3_files; Mistral 3's [IMG_BREAK] and [IMG_END] are not counted).
IMAGE_TOKENS = {"gemma3_vl": 4, "smolvlm": 20, "idefics3_vl": 20, "mistral3_vl": 4}


@pytest.fixture(scope="module", params=sorted(VLM_KINDS))
def loaded(request, fixture_path):
    from mlx_vlm import load

    path = fixture_path(request.param)
    model, processor = load(str(path))
    special = json.loads((path / "fixture.json").read_text())["special_token_ids"]
    return request.param, model, processor, special


def greedy(model, processor, image):
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    prompt = apply_chat_template(processor, model.config, "What is it?",
                                 num_images=0 if image is None else 1)
    images = None if image is None else [image]
    return [r.token for r in stream_generate(model, processor, prompt, image=images,
                                             max_tokens=8, temperature=0)]


def test_image_steers_greedy_output(loaded):
    kind, model, processor, _ = loaded
    assert model.config.model_type == VLM_KINDS[kind]
    red = Image.new("RGB", (64, 64), (255, 0, 0))
    blue = Image.new("RGB", (64, 64), (0, 0, 255))
    first = greedy(model, processor, red)
    assert len(first) >= 8
    assert greedy(model, processor, red) == first  # deterministic
    assert greedy(model, processor, blue) != first
    assert greedy(model, processor, None) != first


def test_image_token_count(loaded, tmp_path):
    kind, model, processor, special = loaded
    from mlx_vlm.prompt_utils import apply_chat_template

    path = tmp_path / "blue.png"  # images may be given as paths too
    Image.new("RGB", (64, 64), (0, 0, 255)).save(path)
    prompt = apply_chat_template(processor, model.config, "What is it?", num_images=1)
    inputs = processor(text=[prompt], images=[Image.open(path)])
    image_id = model.config.image_token_index
    assert int((inputs["input_ids"] == image_id).sum()) == IMAGE_TOKENS[kind]
    for token in greedy(model, processor, str(path)):
        assert token not in special  # a random model never stops or emits markup
