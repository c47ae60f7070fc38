"""The command line's flags: upstream's and ours, in one argparse parser.

`mlx_lm_plus.server --model X ...` takes every flag `mlx_lm.server` 0.32.2
takes, with the same names, types and defaults (a test compares the two
parsers). Flags of our own are listed in OUR_FLAGS and never change the
meaning of an upstream flag. Its own module: a long declaration and
nothing else; the checks across flags and the typed Config built from
them are the package's door (config/__init__.py).
"""

import argparse
import json
import os

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from mlx_lm_plus.upstream import parse_size as _upstream_parse_size


def _parse_size(text):
    """mlx-lm's byte sizes ("512M", "2GB", "1000000"), with a usage error
    where it raises a KeyError ("1TB") or decimal.InvalidOperation ("-5"),
    which argparse lets out as a traceback."""
    try:
        return _upstream_parse_size(text)
    except (KeyError, ArithmeticError):
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: a number of bytes, or of M, MB, G or GB")


# Flags mlx_lm.server does not have. Documented in the README.
OUR_FLAGS = (
    "--prompt-cache-ttl",
    "--allow-model-loading",
    "--api-key",
    "--max-request-bytes",
    "--max-messages",
    "--max-images",
    "--max-image-bytes",
    "--max-image-pixels",
    "--allow-remote-images",
    "--remote-image-timeout",
    "--max-tokens-ceiling",
    "--max-queued-requests",
    "--shutdown-timeout",
    "--disable-metrics",
    "--allow-private-image-hosts",
    "--step-timeout",
    "--planning-timeout",
    "--distributed-timeout",
    "--watchdog-grace",
    "--max-request-image-pixels",
    "--strip-billing-header",
    "--keep-billing-header",
    "--cache-miss-text",
    "--keep-quantized",
    "--responses-store-size",
    "--responses-store-bytes",
    "--responses-store-ttl",
    "--prompt-cache-bits",
    "--prompt-cache-dir",
    "--prompt-cache-disk-bytes",
    "--models-dir",
    "--models-config",
    "--max-loaded-models",
    "--model-ttl",
    "--model-load-timeout",
    "--prompt-lookup-tokens",
)

# --prompt-cache-disk-bytes when only --prompt-cache-dir is given.
DEFAULT_DISK_BYTES = "10GB"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="MLX Http Server (mlx_lm_plus, drop-in for mlx_lm.server)."
    )
    _add_upstream_flags(parser)
    _add_our_flags(parser)
    return parser


def _add_upstream_flags(parser: argparse.ArgumentParser) -> None:
    """Upstream flags, verbatim in name, type and default."""
    parser.add_argument(
        "--model",
        type=str,
        help="The path to the MLX model weights, tokenizer, and config. "
        "Default: the embedded SmolLM2-135M-Instruct demo model. (mlx_lm_plus) "
        "May be given more than once to serve several models; the first is "
        "the default (requests without `model`) and stays loaded.",
    )
    parser.add_argument(
        "--adapter-path",
        type=str,
        help="Optional path for the trained adapter weights and config.",
    )
    parser.add_argument(
        "--host",
        type=str,
        default="127.0.0.1",
        help="Host for the HTTP server (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=8080,
        help="Port for the HTTP server (default: 8080)",
    )
    parser.add_argument(
        "--allowed-origins",
        type=lambda x: x.split(","),
        default="*",
        help="Allowed origins (default: *)",
    )
    parser.add_argument(
        "--draft-model",
        type=str,
        help="A model to be used for speculative decoding.",
        default=None,
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        help="Number of tokens to draft when using speculative decoding.",
        default=3,
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Enable trusting remote code for tokenizer",
    )
    parser.add_argument(
        "--log-level",
        type=str,
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="Set the logging level (default: INFO)",
    )
    parser.add_argument(
        "--chat-template",
        type=str,
        default="",
        help="Specify a chat template for the tokenizer",
        required=False,
    )
    parser.add_argument(
        "--use-default-chat-template",
        action="store_true",
        help="Use the default chat template",
    )
    parser.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="Default sampling temperature (default: 0.0)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="Default nucleus sampling top-p (default: 1.0)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="Default top-k sampling (default: 0, disables top-k)",
    )
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="Default min-p sampling (default: 0.0, disables min-p)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="Default maximum number of tokens to generate (default: 512)",
    )
    parser.add_argument(
        "--chat-template-args",
        type=json.loads,
        help="A JSON formatted string of arguments for the tokenizer's "
        """apply_chat_template, e.g. '{"enable_thinking":false}'""",
        default="{}",
    )
    parser.add_argument(
        "--decode-concurrency",
        type=int,
        default=32,
        help="When a request is batchable then decode that many requests in parallel",
    )
    parser.add_argument(
        "--prompt-concurrency",
        type=int,
        default=8,
        help="When a request is batchable then process that many prompts in parallel",
    )
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="Step size for prefill processing (default: 2048)",
    )
    parser.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="Maximum number of distinct KV caches to hold in the prompt cache",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=_parse_size,
        help="Maximum size in bytes of the KV caches",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        help="Number of bits for KV cache quantization (e.g., 4 or 8). "
        "Requests are batched (a batched quantized KV cache); models with "
        "sliding-window layers and mlx-vlm models are served one at a time.",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        help="Group size for KV cache quantization (default: 64)",
    )
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=DEFAULT_QUANTIZED_KV_START,
        help="Token position to start KV cache quantization "
        f"(default: {DEFAULT_QUANTIZED_KV_START})",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="Use pipelining instead of tensor parallelism",
    )


def _add_our_flags(parser: argparse.ArgumentParser) -> None:
    """Our flags (OUR_FLAGS)."""
    parser.add_argument(
        "--prompt-cache-ttl",
        type=float,
        default=1800.0,
        help="(mlx_lm_plus) Seconds an unused prompt cache entry is kept "
        "(default: 1800; 0 keeps entries until evicted)",
    )
    parser.add_argument(
        "--prompt-cache-bits",
        type=int,
        choices=[4, 8],
        default=None,
        help="(mlx_lm_plus) Store the prompt cache's attention keys and values "
        "quantized to this many bits (group size: --kv-group-size), dequantized "
        "on reuse: --prompt-cache-bytes then holds about 1.9x (8) or 3.6x (4) "
        "the tokens of a float16 cache, but a reused prefix is no longer exact, so "
        "replies may differ from an uncached run (default: off)",
    )
    parser.add_argument(
        "--prompt-cache-dir",
        type=str,
        default=None,
        help="(mlx_lm_plus) Keep a second tier of the prompt cache on disk, in "
        "this folder: entries evicted from memory are written there (off the "
        "generation thread), read back when a request needs them, and found "
        "again after a restart; on SIGTERM/SIGINT the entries still in memory "
        "are written out, most recently used first, within --shutdown-timeout. "
        "Entries are kept per model identity (its config and weight files, "
        "adapters, --prompt-cache-bits, --kv-bits), so another model never "
        "reads them (default: off)",
    )
    parser.add_argument(
        "--prompt-cache-disk-bytes",
        type=_parse_size,
        default=None,
        help="(mlx_lm_plus) Most bytes of prompt cache files per model in "
        "--prompt-cache-dir, least recently used out first (default: "
        f"{DEFAULT_DISK_BYTES})",
    )
    parser.add_argument(
        "--models-dir",
        type=str,
        default=None,
        help="(mlx_lm_plus) Serve every model folder (one with a config.json) "
        "in this directory, named by its folder; each loads on its first "
        "request (default: none)",
    )
    parser.add_argument(
        "--models-config",
        type=str,
        default=None,
        help="(mlx_lm_plus) A JSON (or .yaml) file of models to serve: "
        '{"models": [{"path": ..., "name": ..., "aliases": [...], "pinned": '
        'true, "ttl": 600, "adapter_path": ..., "draft_model": ..., '
        '"defaults": {"temperature": 0.7, "max_tokens": 512}}]} (README: '
        "Several models)",
    )
    parser.add_argument(
        "--max-loaded-models",
        type=int,
        default=3,
        help="(mlx_lm_plus) Most models loaded at once; loading one more "
        "unloads the least recently used idle one (never one with running "
        "requests, never a pinned one). Memory bounds it too: the loaded "
        "weights and the prompt cache budget stay within the machine's "
        "(default: 3)",
    )
    parser.add_argument(
        "--model-ttl",
        type=float,
        default=0,
        help="(mlx_lm_plus) Unload a model that has been idle this many "
        "seconds (not a pinned one; a request's `keep_alive` overrides it for "
        "its model; default: 0, never)",
    )
    parser.add_argument(
        "--model-load-timeout",
        type=float,
        default=1800,
        help="(mlx_lm_plus) Give up a model load (a stalled disk or download) "
        "after this many seconds: the requests waiting for it get 404 and the "
        "next load starts afresh (default: 1800; 0: wait for ever)",
    )
    parser.add_argument(
        "--allow-model-loading",
        action="store_true",
        help="(mlx_lm_plus) Let requests load other local paths or repos named "
        "in `model`, `adapters` or `draft_model`, as upstream does (default: "
        "only the configured model; other names get 404)",
    )
    parser.add_argument(
        "--api-key",
        type=str,
        default=os.environ.get("MLX_LM_PLUS_API_KEY"),
        help="(mlx_lm_plus) Require `Authorization: Bearer KEY` on every "
        "endpoint but /health (default: $MLX_LM_PLUS_API_KEY, else none)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=128 * 1024**2,
        help="(mlx_lm_plus) Largest request body accepted; larger ones get 413 "
        "(default: 128 MiB)",
    )
    parser.add_argument(
        "--max-messages",
        type=int,
        default=4096,
        help="(mlx_lm_plus) Most messages in one chat request (default: 4096)",
    )
    parser.add_argument(
        "--max-images",
        type=int,
        default=16,
        help="(mlx_lm_plus) Most images in one request (default: 16)",
    )
    parser.add_argument(
        "--max-image-bytes",
        type=int,
        default=20 * 1024**2,
        help="(mlx_lm_plus) Largest encoded image; larger ones get 413 (default: 20 MiB)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=40_000_000,
        help="(mlx_lm_plus) Most pixels (width x height) in one image, checked "
        "before decoding (default: 40,000,000)",
    )
    parser.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="(mlx_lm_plus) Fetch http(s) image URLs (default: refused with 400; "
        "a server that fetches any URL a client names is a security hole)",
    )
    parser.add_argument(
        "--remote-image-timeout",
        type=float,
        default=10.0,
        help="(mlx_lm_plus) Seconds to fetch all the remote images of one request, "
        "together, redirects included (default: 10)",
    )
    parser.add_argument(
        "--max-tokens-ceiling",
        type=int,
        default=None,
        help="(mlx_lm_plus) Largest max_tokens a request may ask for; larger "
        "ones get 400 (default: no ceiling)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="(mlx_lm_plus) Requests that may wait beyond --decode-concurrency; "
        "more get 503 with Retry-After (default: 256)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="(mlx_lm_plus) Seconds running requests get to finish on "
        "SIGTERM/SIGINT before they are cancelled (default: 10)",
    )
    parser.add_argument(
        "--max-request-image-pixels",
        type=int,
        default=100_000_000,
        help="(mlx_lm_plus) Most pixels of all the images of one request together, "
        "checked before decoding (default: 100,000,000)",
    )
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=300.0,
        help="(mlx_lm_plus) Under mx.distributed, the most seconds any step may "
        "take (and the request hand-off between ranks, every loop turn): a rank "
        "whose host died or whose link was cut shows as a collective that never "
        "returns; past it the server answers 503, /health says why, and every rank "
        "exits with status 70. Keep it above the longest step: a batch's prefill of "
        "--prompt-concurrency x --prefill-step-size tokens (default: 300; 0: "
        "--step-timeout alone)",
    )
    parser.add_argument(
        "--prompt-lookup-tokens",
        type=int,
        default=0,
        help="(mlx_lm_plus) Speculative decoding in the batch from each request's "
        "own tokens: where its last tokens appeared before in its prompt or answer, "
        "propose up to this many of the tokens that followed, checked by the model "
        "in one pass (exact: the text is the text without it, at any temperature). "
        "0: off (default: 0)",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=900.0,
        help="(mlx_lm_plus) Seconds one generation step (a batch step, a prefill "
        "chunk, a vision tower call) may take before the server is declared "
        "stuck: /health turns 503, waiting requests get 503, and the process "
        "exits with status 70 for a supervisor to restart it (default: 900; "
        "0: no watchdog)",
    )
    parser.add_argument(
        "--planning-timeout",
        type=float,
        default=60.0,
        help="(mlx_lm_plus) Seconds a request may wait for its prompt to be "
        "planned and its structured-output constraint compiled, before it is "
        "queued; past it that request alone gets 503 with Retry-After "
        "(default: 60)",
    )
    parser.add_argument(
        "--watchdog-grace",
        type=float,
        default=5.0,
        help="(mlx_lm_plus) Seconds between a stuck step being detected and the "
        "process exiting, for clients to get their answers (default: 5)",
    )
    parser.add_argument(
        "--disable-metrics",
        action="store_true",
        help="(mlx_lm_plus) Turn off /metrics, the request history of /v1/stats "
        "and the per-request log line (default: on)",
    )
    parser.add_argument(
        "--allow-private-image-hosts",
        action="store_true",
        help="(mlx_lm_plus) With --allow-remote-images, also fetch from private, "
        "loopback, link-local and other non-global addresses: this lets any "
        "client make the server read from its own machine and network (local "
        "services, cloud metadata endpoints) (default: only global addresses)",
    )
    parser.add_argument(
        "--strip-billing-header",
        action="store_true",
        help="(mlx_lm_plus) Remove Claude Code's 'x-anthropic-billing-header:' "
        "lines from /v1/messages system prompts: the default (this flag is kept "
        "for command lines written when it was not); see --keep-billing-header",
    )
    parser.add_argument(
        "--keep-quantized",
        action="store_true",
        help="(mlx_lm_plus) Where MLX runs on a Linux CPU with a fast BLAS, keep a "
        "model's quantized (or half-precision) weights as they are instead of "
        "float32, which that BLAS multiplies 10-30x faster (default: float32 there, "
        "at 2-8x the weights' memory)",
    )
    parser.add_argument(
        "--cache-miss-text",
        action="store_true",
        help="(mlx_lm_plus) Add a few tokens of text from both sides of a prompt "
        "cache miss to its explanation (the request log line, /v1/stats): the "
        "request's own prompt and a stored prompt, which may be another client's "
        "(default: the position, the part of the prompt and the message only)",
    )
    parser.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="(mlx_lm_plus) Keep Claude Code's 'x-anthropic-billing-header:' lines "
        "in /v1/messages system prompts. They are billing metadata for Anthropic's "
        "servers and differ between sessions (and, in older Claude Code versions, "
        "between requests), so kept, the prompt cache can't reuse a shared system "
        "prompt across sessions (default: removed)",
    )
    parser.add_argument(
        "--responses-store-size",
        type=int,
        default=1000,
        help="(mlx_lm_plus) Responses kept for GET /v1/responses/{id} and "
        "previous_response_id, least recently used first out (default: 1000; "
        "0: none kept)",
    )
    parser.add_argument(
        "--responses-store-bytes",
        type=_parse_size,
        default=64 * 1024**2,
        help="(mlx_lm_plus) Bytes of stored responses and their conversations, "
        "counted as JSON; held as Python objects they take up to about 5 times "
        "that (default: 64MB)",
    )
    parser.add_argument(
        "--responses-store-ttl",
        type=float,
        default=86400.0,
        help="(mlx_lm_plus) Seconds a stored response is kept (default: 86400; "
        "0: no expiry)",
    )
