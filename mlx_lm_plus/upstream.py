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


def package_version(package: str) -> str:
    """An installed package's version ("unknown" if it isn't installed):
    patches/ and this module say it when what they were written for is not
    what they find."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def mlx_lm_version() -> str:
    return package_version("mlx-lm")


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


# GenerationBatch as engine/speculation.py's subclass steps it (its pending
# token and logprobs, counts, stop matchers, token contexts), and the
# BatchKVCache it trims, rolls and strips: the sources of the methods that
# keep that state, as written for 0.32.2.
_GENERATION_BATCH_SOURCES = {
    ("GenerationBatch", "__init__"):
        "dc828c7f63bfb07f54e78e944b8b82e836f4f5a567754750dfca567bcfda050f",
    ("GenerationBatch", "next"): "5d2a3d229fba02a9f651477510a7ef3907418cc34c0455e77af285a850b5507f",
    ("GenerationBatch", "filter"): "27a2165cf672969fa3f443090037da1ebbbc00c73d81acb340398c4beba0d2c4",
    ("GenerationBatch", "extend"): "4019e7eaf5d6782f85da9081791d06140b8b9c7e44ae8224c43f98fea544ef7b",
    ("GenerationBatch", "extract_cache"):
        "2bd85c31aa640057e3bac5b23de1208f98f19a863c939710cabd1411c43b23e3",
    ("BatchKVCache", "trim"): "6432d5408a453cedfe7a3406815768a9eef7be9ca2068f69c15d6d65545ba199",
    ("BatchKVCache", "prepare"): "86bc845de708c2746a7f5a3e17ec14666f5d4a4a2b94897c8fe33873cd81e734",
    ("BatchKVCache", "finalize"): "6f06abded406dab4490dcf9a482b1aa6e31ff3ae2016dcad0400447c3376afaf",
    ("BatchKVCache", "filter"): "d7a4d2b5a763bc69fbff2b7ab5d2c08d4ebae54ca398b681daa02241b3db7fea",
    ("BatchKVCache", "update_and_fetch"):
        "d099a9c8781d7d67b9f3777e2246b0dd67a92937c174cacc29b8a4f27e4f8847",
    ("BatchKVCache", "extend"): "672663f4062ad14249ac5f9d1434250e0743f7ef1e664d0db655e23db84ce890",
    ("BatchKVCache", "extract"): "1da09ad23757559ebbd51dcce51958b208b9b5d587c77c227cc761d1e26354ff",
    ("BatchKVCache", "make_mask"): "17cab343ff407f6c461bcd3cc94753c012d51a07863fe765ed46b9913211a525",
    ("TokenBuffer", "update_and_fetch"):
        "d7a0067bb938393fd31fc6229930e79c4ac6e940f05cba34cefdb586d218aa24",
    # A draft's batched KV (drafting.py) and recurrent states set back per
    # row (rollback.py); the batch's rows joining and leaving through the
    # generator (the draft's rows follow them).
    ("BatchKVCache", "merge"): "b35ecc517f9540d3f2a27310f4db1a026a27437b9cc0bd2762878596cfd575ce",
    ("ArraysCache", "extend"): "21d9fe379c71c0c75baf320a34abea0f62ce33734335524f566196b9b17239fa",
    ("ArraysCache", "filter"): "32a1a2fa51781d15a9f1fcfa1d3d25a3b137b56ada9c1a3f68314718ed48248d",
    ("ArraysCache", "extract"): "9a02c24bbc0e5125e006f1e7124b9b006a9f40f27f0e3d067ff101051ddd1199",
    ("ArraysCache", "make_mask"): "8c9427ee13a0bfba86d0ec20b51a9d5fd746d146ef5cc7b95a8845f6b87b6601",
    ("ArraysCache", "merge"): "ddf0151cf065e679c08d4906c9325c777389d684e53195f45e5cba6d180fe524",
    # Sliding windows trimmed, rolled and put in order (batch_kv.py), and
    # a draft's set aside (its one-token updates write in place) and
    # restored, merged, extended and extracted (drafting.py).
    ("BatchRotatingKVCache", "_update_in_place"):
        "d93175cfdbeba9f82d9b1ade10db9608e9733fb8a0a3e10df20317d9bb591bff",
    ("BatchRotatingKVCache", "_update_concat"):
        "d3c0b179840f7267c8ca9c7b68cefec762241dc505fbc3bb427f6c0ce9d41af0",
    ("BatchRotatingKVCache", "_temporal_order"):
        "f3c9890fb5936905472084504df8b55d2d7aee88e7a8dc28871f26983d78e70e",
    ("BatchRotatingKVCache", "merge"):
        "6a0aee6e80cfff1c803b9a7b59619b418b702816e3cc0c24f8f2097c9c06ed1b",
    ("BatchRotatingKVCache", "extend"):
        "ea0fe885baf05f0386e67361423a2e919386151f55c799913355d9cf86cb23ec",
    ("BatchRotatingKVCache", "extract"):
        "afc13de65f6d3d3ae21cb6e79a0d148aca2fa95d2bb6a8abd50c67de50c3ca8d",
    ("BatchRotatingKVCache", "trim"): "5b2cc3b88ce96aca2db7e534a5027f5733815c57587db7591d119853cb441ca0",
    ("BatchRotatingKVCache", "make_mask"):
        "ee6af6b6a2675bfd14d5a293392bdec0c738012c40eda1b27187d07597e6b43a",
    ("BatchGenerator", "_next"): "eb3a4e361dc2c19eafd28e901155828fd4602d63e26c431ca9ffbf079302c665",
    ("BatchGenerator", "remove"): "705e7de06f06d7dea6bdbcd762395e3216fd428f475e28fd51adac6c98c49dd7",
}
_as_written = {}


def generation_batch_as_written() -> bool:
    """Whether GenerationBatch and BatchKVCache keep their state as
    speculation.py expects (worked out once)."""
    if "result" not in _as_written:
        import hashlib

        from mlx_lm.generate import BatchGenerator, GenerationBatch
        from mlx_lm.models.cache import (ArraysCache, BatchKVCache, BatchRotatingKVCache,
                                          TokenBuffer)

        owners = {"GenerationBatch": GenerationBatch, "BatchKVCache": BatchKVCache,
                  "TokenBuffer": TokenBuffer, "ArraysCache": ArraysCache,
                  "BatchRotatingKVCache": BatchRotatingKVCache,
                  "BatchGenerator": BatchGenerator}
        _as_written["result"] = all(
            hashlib.sha256(inspect.getsource(getattr(owners[owner], name)).encode())
            .hexdigest() == sha for (owner, name), sha in _GENERATION_BATCH_SOURCES.items())
    return _as_written["result"]


def generation_batch(generator):
    """A BatchGenerator's decode batch (one object for its life)."""
    return generator._generation_batch


def queued_caches(generator) -> Iterator[tuple]:
    """(uid, prompt cache) of each request queued in a BatchGenerator and
    not yet in prefill."""
    for sequence in generator._unprocessed_sequences:
        yield sequence[0], sequence[3]


def in_flight_caches(generator) -> List[Any]:
    """The layer caches of a BatchGenerator's prefill and decode batches."""
    return list(generator._prompt_batch.prompt_cache) + list(
        generator._generation_batch.prompt_cache)
