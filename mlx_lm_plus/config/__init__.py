"""The configuration, built once from the command line.

`parse_args` reads the flags (flags.py: the parser, upstream's flags and
ours), checks them across one another and returns a `Config`: every
setting, typed, read as attributes (upstream's own ModelProvider reads it
as it reads its argparse namespace). The package's door: the server and
the tests take parse_args and Config from here.
"""

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from mlx_lm_plus.config.flags import DEFAULT_DISK_BYTES, _parse_size, build_parser


def parse_args(argv=None) -> "Config":
    """The command line, checked, as a Config."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # --model may be repeated (upstream keeps the last): every one is
    # served, the first is the default.
    repeated = argparse.ArgumentParser(add_help=False)
    repeated.add_argument("--model", action="append")
    args.models = repeated.parse_known_args(argv)[0].model or []
    args.model = args.models[0] if args.models else None
    if args.max_loaded_models < 1 or args.model_ttl < 0 or args.model_load_timeout < 0:
        parser.error("--max-loaded-models must be at least 1, --model-ttl and "
                     "--model-load-timeout at least 0")
    if args.models_dir and not os.path.isdir(args.models_dir):
        parser.error(f"--models-dir {args.models_dir}: not a directory")
    if args.models_config or args.models_dir or len(args.models) > 1:
        from mlx_lm_plus.models.served import served_set

        try:  # (a bad config stops the server here, not at a request)
            served_set(args)
        except Exception as e:
            parser.error(f"the served models: {e}")
    # Upstream keeps the unsplit default "*"; `"*" in "*"` holds, so CORS code
    # works on both shapes. Normalise to a list for our own code.
    if isinstance(args.allowed_origins, str):
        args.allowed_origins = args.allowed_origins.split(",")
    if args.step_timeout < 0 or args.watchdog_grace < 0 or args.distributed_timeout < 0:
        parser.error("--step-timeout, --distributed-timeout and --watchdog-grace must be "
                     "at least 0")
    if not args.planning_timeout > 0:
        parser.error("--planning-timeout must be more than 0")
    if not 0 <= args.prompt_lookup_tokens <= 64:
        parser.error("--prompt-lookup-tokens must be from 0 to 64")
    if args.prompt_cache_bits is not None and args.kv_group_size not in (32, 64, 128):
        parser.error("--prompt-cache-bits needs a --kv-group-size of 32, 64 or 128")
    if args.kv_bits is not None:
        # Otherwise every request fails at its first quantization (upstream
        # answers each with an error); MLX's own message says why.
        import mlx.core as mx

        try:
            mx.quantize(mx.zeros((1, args.kv_group_size)), args.kv_group_size, args.kv_bits)
        except Exception as e:
            parser.error(f"--kv-bits {args.kv_bits} with --kv-group-size "
                         f"{args.kv_group_size}: {e}")
    if args.prompt_cache_disk_bytes is not None and not args.prompt_cache_dir:
        parser.error("--prompt-cache-disk-bytes needs --prompt-cache-dir")
    if args.prompt_cache_dir and args.prompt_cache_disk_bytes is None:
        args.prompt_cache_disk_bytes = _parse_size(DEFAULT_DISK_BYTES)
    return Config(**vars(args))


@dataclass
class Config:
    """Every flag's value (docs/flags.md says what each does). The defaults
    are the parser's (a test holds them equal), so a Config built in code
    is the server's with no flags."""

    # -- mlx_lm.server's flags --
    model: Optional[str] = None  # the default model (the first --model)
    adapter_path: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8080
    allowed_origins: List[str] = field(default_factory=lambda: ["*"])
    draft_model: Optional[str] = None
    num_draft_tokens: int = 3
    trust_remote_code: bool = False
    log_level: str = "INFO"
    chat_template: str = ""
    use_default_chat_template: bool = False
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    chat_template_args: Dict[str, Any] = field(default_factory=dict)
    decode_concurrency: int = 32
    prompt_concurrency: int = 8
    prefill_step_size: int = 2048
    prompt_cache_size: int = 10
    prompt_cache_bytes: Optional[int] = None
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    pipeline: bool = False
    prompt_lookup_tokens: int = 0
    # -- the prompt cache --
    prompt_cache_ttl: float = 1800.0
    prompt_cache_bits: Optional[int] = None
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk_bytes: Optional[int] = None
    # -- several models --
    models: List[str] = field(default_factory=list)  # every --model, in order
    models_dir: Optional[str] = None
    models_config: Optional[str] = None
    max_loaded_models: int = 3
    model_ttl: float = 0
    model_load_timeout: float = 1800
    allow_model_loading: bool = False
    # -- who may ask, and how much --
    api_key: Optional[str] = None
    max_request_bytes: int = 128 << 20
    max_messages: int = 4096
    max_images: int = 16
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 40_000_000
    max_request_image_pixels: int = 100_000_000
    allow_remote_images: bool = False
    allow_private_image_hosts: bool = False
    remote_image_timeout: float = 10.0
    max_tokens_ceiling: Optional[int] = None
    max_queued_requests: int = 256
    # -- time limits --
    shutdown_timeout: float = 10.0
    distributed_timeout: float = 300.0
    step_timeout: float = 900.0
    planning_timeout: float = 60.0
    watchdog_grace: float = 5.0
    # -- the rest --
    disable_metrics: bool = False
    strip_billing_header: bool = False  # (the default now: kept for old scripts)
    keep_billing_header: bool = False
    keep_quantized: bool = False
    cache_miss_text: bool = False
    responses_store_size: int = 1000
    responses_store_bytes: int = 64 << 20
    responses_store_ttl: float = 86400.0
