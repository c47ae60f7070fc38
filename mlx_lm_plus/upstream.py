"""The one door to mlx-lm's and mlx-vlm's private names and state.

We are a drop-in for mlx-lm 0.32.2 and reuse its pieces rather than
rewriting them, some of them private (`mlx_lm.server._make_sampler`, the
BatchGenerator's queues). Every such use goes through this module, which
checks on import that each name is there: on another mlx-lm, a renamed or
removed one fails the start with a message naming it, instead of a request
failing later with an AttributeError. (Functions whose bodies we replace
are in patches/, guarded by their source's hash.)
"""

import importlib
import inspect
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Iterator, List

WRITTEN_FOR = "0.32.2"

# BatchGenerator state we read: for the byte budget (what a batch holds),
# and in engine/taps.py's subclass (the prefill batch it taps).
_GENERATOR_STATE = ("_unprocessed_sequences", "_prompt_batch", "_generation_batch")


def mlx_lm_version() -> str:
    """The installed mlx-lm's version (patches/ and this module say it when
    what they were written for is not what they find)."""
    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return "unknown"


class UpstreamChanged(ImportError):
    """The installed mlx-lm lacks a private name this server uses."""


def _missing(what: str) -> UpstreamChanged:
    return UpstreamChanged(
        f"mlx_lm_plus needs {what}, which the installed mlx-lm {mlx_lm_version()} "
        f"lacks (written for mlx-lm {WRITTEN_FOR}): install mlx-lm=={WRITTEN_FOR}")


def _private(module: str, name: str):
    obj = getattr(importlib.import_module(module), name, None)
    if obj is None:
        raise _missing(f"{module}.{name}")
    return obj


def _check_generator_state():
    from mlx_lm.generate import BatchGenerator

    source = inspect.getsource(BatchGenerator)
    for name in _GENERATOR_STATE:
        if f"self.{name}" not in source:
            raise _missing(f"BatchGenerator.{name}")


make_sampler = _private("mlx_lm.server", "_make_sampler")
make_logits_processors = _private("mlx_lm.server", "_make_logits_processors")
format_top_logprobs = _private("mlx_lm.server", "_format_top_logprobs")
image_parts = _private("mlx_lm.server", "_image_parts")
image_url = _private("mlx_lm.server", "_image_url")
download = _private("mlx_lm.utils", "_download")
get_classes = _private("mlx_lm.utils", "_get_classes")
parse_size = _private("mlx_lm.utils", "_parse_size")
decode_image = _private("mlx_lm.server", "_decode_image")
make_vision = _private("mlx_lm.server", "_make_vision")
BaseCache = _private("mlx_lm.models.cache", "_BaseCache")
_check_generator_state()


def queued_caches(generator) -> Iterator[tuple]:
    """(uid, prompt cache) of each request queued in a BatchGenerator and
    not yet in prefill."""
    for sequence in generator._unprocessed_sequences:
        yield sequence[0], sequence[3]


def in_flight_caches(generator) -> List[Any]:
    """The layer caches of a BatchGenerator's prefill and decode batches."""
    return list(generator._prompt_batch.prompt_cache) + list(
        generator._generation_batch.prompt_cache)
