"""How an entry of the disk tier (disk.py) is laid out on disk, and how a
model is identified: `model_identity` names the folder a model's entries
live in, `_key_name` an entry's file; the rest writes and reads the file.

Its own room: what a file holds outlives the code around it (an entry
written by one version is read by the next: FORMAT is part of every
identity, and _MOVED_MODULES/_MOVED_CLASSES resolve the classes older files
name), while the tier's index, threads and eviction change freely.

A file holds the key's token ids (tensor "tokens", int64: image ids are
negative) and every state array of every layer ("a0", "a1", ...); its
metadata holds each layer's class (module:name), its `state`'s structure
(the arrays' places, the scalars) and its other attributes, the ones
without arrays (what `state` leaves out: MRopeKVCache.rope_delta,
layers.StoredKV's layer class and dtype), as JSON; the entry's kind; and an
xxh3 checksum of the whole file (the header's first field, its own 16 digits
hashed as zeros), so a flipped digit of a layer's offset is caught as surely
as a flipped bit of its keys. A layer is rebuilt as mlx_lm's
load_prompt_cache does (`cls.from_state(state)`), then its attributes are
set; a layer that would not come back whole (a class not importable from
mlx_lm/mlx_lm_plus/mlx_vlm, an attribute of another kind) is not written.
Safetensors as mx.save_safetensors writes it, read with mx.load; written
here rather than by save_prompt_cache, whose loader only knows mlx_lm's own
classes and keeps nothing outside `state`.
"""

import hashlib
import importlib
import json
import os
import re
import struct
from array import array
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import QuantizedKVCache

from mlx_lm_plus.cache.layers import compact

# Part of every identity: a change of the file format starts a new folder.
# 2: the checksum covers the whole file (header and metadata too).
FORMAT = "mlx_lm_plus.disk_cache/2"
_SUFFIX = ".safetensors"
# An entry's file name (less the suffix): _key_name's 40 hex digits. Names
# read from the index are checked against it before they make a path.
_NAME = re.compile(r"[0-9a-f]{40}")
# Every file's header begins with its checksum's field, 16 hex digits at a
# fixed place (hashed as zeros); the metadata are read back from it.
_SUM_HEAD = b'{"__metadata__":{"xxh3":"'
_SUM_AT = 8 + len(_SUM_HEAD)
_SUM_ZERO = "0" * 16
# The longest header read (a layer's description is a few hundred bytes).
_MAX_HEADER = 16 << 20
# The libraries whose code computes and interprets the cached state.
_LIBRARIES = ("mlx", "mlx-metal", "mlx-lm", "mlx-vlm", "mlx-lm-plus")

# Files whose metadata make up a model's identity (weights, adapters,
# configs, tokenizers); configs are hashed by content as well.
_IDENTITY_SUFFIXES = (".safetensors", ".json", ".gguf", ".npz", ".bin",
                      ".model", ".tiktoken")
_CONTENT_FILES = ("config.json", "adapter_config.json")

# mx dtype -> safetensors dtype, numpy view for the bytes (bfloat16 has no
# numpy type: its bytes go as uint16).
_DTYPES = {
    mx.bool_: ("BOOL", None), mx.uint8: ("U8", None), mx.uint16: ("U16", None),
    mx.uint32: ("U32", None), mx.uint64: ("U64", None), mx.int8: ("I8", None),
    mx.int16: ("I16", None), mx.int32: ("I32", None), mx.int64: ("I64", None),
    mx.float16: ("F16", None), mx.float32: ("F32", None),
    mx.bfloat16: ("BF16", mx.uint16),
}
if hasattr(mx, "float64"):
    _DTYPES[mx.float64] = ("F64", None)
# safetensors dtype -> bytes per element (what a header may name).
_ITEMSIZE = {name: d.size for d, (name, _) in _DTYPES.items()}
# Only cache classes from these packages are rebuilt from a file.
_CLASS_PACKAGES = ("mlx_lm.", "mlx_lm_plus.", "mlx_vlm.")
# Where our layer classes lived before the package was split into folders:
# entries written then name these modules, and still load.
_MOVED_MODULES = {
    "mlx_lm_plus.cache": "mlx_lm_plus.cache.store",
    "mlx_lm_plus.vision": "mlx_lm_plus.models.vision",
    "mlx_lm_plus.taps": "mlx_lm_plus.engine.taps",
    "mlx_lm_plus.quantized_batch": "mlx_lm_plus.engine.quantized_batch",
}
# Classes that moved out of a module (`module:qualname` as files name them),
# looked up before _MOVED_MODULES: StoredKV went from cache.py to
# cache/store.py, then to cache/layers.py. (Of the classes that moved with
# it, it is the only one a file names: SharedKV has no from_state, so no
# file holds one.)
_MOVED_CLASSES = {
    "mlx_lm_plus.cache:StoredKV": "mlx_lm_plus.cache.layers:StoredKV",
    "mlx_lm_plus.cache.store:StoredKV": "mlx_lm_plus.cache.layers:StoredKV",
    # A vision model's layer caches went from vision.py to models/vlm_text.py
    # (MRopeBatchKVCache too, but files hold rows, never a batch).
    "mlx_lm_plus.vision:MRopeKVCache": "mlx_lm_plus.models.vlm_text:MRopeKVCache",
    "mlx_lm_plus.vision:PlainKVCache": "mlx_lm_plus.models.vlm_text:PlainKVCache",
    "mlx_lm_plus.vision:PlainRotatingKVCache": "mlx_lm_plus.models.vlm_text:PlainRotatingKVCache",
    "mlx_lm_plus.models.vision:MRopeKVCache": "mlx_lm_plus.models.vlm_text:MRopeKVCache",
    "mlx_lm_plus.models.vision:PlainKVCache": "mlx_lm_plus.models.vlm_text:PlainKVCache",
    "mlx_lm_plus.models.vision:PlainRotatingKVCache":
        "mlx_lm_plus.models.vlm_text:PlainRotatingKVCache",
}


def _file_facts(path: str) -> str:
    st = os.stat(path)  # follows symlinks (the HF cache's blobs)
    return f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}"


def _hash_path(h, path: str, role: str):
    h.update(f"\0{role}\0".encode())
    if os.path.isfile(path):  # a GGUF file, say
        h.update(_file_facts(path).encode())
        return
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not name.endswith(_IDENTITY_SUFFIXES) or not os.path.isfile(full):
            continue
        h.update(_file_facts(full).encode() + b"\n")
        if name in _CONTENT_FILES:
            with open(full, "rb") as f:
                h.update(f.read())


def _local_path(path: str) -> Optional[str]:
    """A model's folder: the path itself, or a Hugging Face repo id's local
    snapshot (never downloaded here)."""
    if os.path.exists(path):
        return path
    try:
        from mlx_lm.utils import hf_repo_to_path

        return str(hf_repo_to_path(path))
    except Exception:
        return None


def _library_versions() -> str:
    """The installed versions of the libraries that compute a cached state
    (the model code, the kernels, this package's patches of them)."""
    from importlib import metadata

    versions = []
    for dist in _LIBRARIES:
        try:
            versions.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ",".join(versions)


def model_identity(model_path: str, adapter_path: Optional[str] = None,
                   extra: str = "") -> str:
    """A hex digest naming what a cached KV state depends on.

    config.json and adapter_config.json by content; every weight, adapter,
    config or tokenizer file of the model's and the adapter's folders (or the
    model file itself, a GGUF) by name, size and mtime_ns, so re-converting
    or re-quantizing a model in place changes it; the file format version;
    the versions of mlx, mlx-lm, mlx-vlm and this package (their model code
    and kernels compute the state: an upgrade starts a new folder rather
    than resume from states an older implementation computed); and `extra`,
    for what the caller configures beside the files (KV cache quantization,
    dtype). Where a path has no local files (a repo id not downloaded yet),
    its name stands in: call this after the model loaded.
    """
    h = hashlib.sha256(f"{FORMAT}\0{_library_versions()}\0{extra}".encode())
    for role, path in (("model", model_path), ("adapter", adapter_path)):
        if path is None:
            continue
        local = _local_path(str(path))
        if local is None:
            h.update(f"\0{role}\0name:{path}".encode())
        else:
            _hash_path(h, local, role)
    return h.hexdigest()[:32]


# -- the file format --


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve_class(name: str) -> type:
    """A class named in a file: only from mlx_lm, mlx_lm_plus or mlx_vlm."""
    module, _, qualname = name.partition(":")
    if not module.startswith(_CLASS_PACKAGES) or not qualname:
        raise ValueError(f"not a known class: {name}")
    module, _, qualname = _MOVED_CLASSES.get(name, name).partition(":")
    obj = importlib.import_module(_MOVED_MODULES.get(module, module))
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ValueError(f"not a class: {name}")
    return obj


def _encode(value, arrays: List[mx.array]):
    """A layer's state or attribute as JSON. Arrays go to `arrays` and are
    named by their place; tuples, dicts, classes and dtypes are tagged
    (QuantizedKVCache's buffers are tuples; mlx_lm_plus.cache.layers.StoredKV
    keeps its layer's class, dtype and attributes)."""
    if isinstance(value, mx.array):
        arrays.append(value)
        return {"a": len(arrays) - 1}
    if isinstance(value, tuple):
        return {"t": [_encode(v, arrays) for v in value]}
    if isinstance(value, list):
        return [_encode(v, arrays) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"d": {k: _encode(v, arrays) for k, v in value.items()}}
    if isinstance(value, mx.Dtype):
        return {"dtype": str(value).rsplit(".", 1)[-1]}
    if isinstance(value, type):
        if _resolve_class(_type_name(value)) is not value:
            raise ValueError(f"{_type_name(value)} can't be found by name")
        return {"class": _type_name(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"not serializable: {type(value).__name__}")


def _decode(value, arrays: Dict[str, mx.array]):
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "a" in value:
        return arrays[f"a{value['a']}"]
    if "t" in value:
        return tuple(_decode(v, arrays) for v in value["t"])
    if "d" in value:
        return {k: _decode(v, arrays) for k, v in value["d"].items()}
    if "dtype" in value:
        dtype = getattr(mx, value["dtype"])
        if not isinstance(dtype, mx.Dtype):
            raise ValueError(f"not a dtype: {value['dtype']}")
        return dtype
    return _resolve_class(value["class"])


def _describe(c, arrays: List[mx.array]) -> Dict[str, Any]:
    """A layer as its file keeps it: class, `state` (rebuilt by from_state,
    as mlx_lm's load_prompt_cache does) and the attributes beside it, such as
    MRopeKVCache.rope_delta: every instance attribute without arrays in it
    (the ones with arrays are the state's). Raises ValueError for a layer
    that would not come back whole."""
    cls = type(c)
    if _resolve_class(_type_name(cls)) is not cls or not hasattr(cls, "from_state"):
        raise ValueError(f"{_type_name(cls)} can't be rebuilt by name")
    attrs = {}
    for k, v in vars(c).items():
        held: List[mx.array] = []
        try:
            encoded = _encode(v, held)
        except ValueError:
            continue  # cache objects (CacheList's): the state's too
        if not held:
            attrs[k] = encoded
    state = c.state
    probe = cls.from_state(state)  # the arrays shared, nothing copied
    missing = set(vars(c)) - set(vars(probe)) - set(attrs)
    if missing:
        raise ValueError(f"{_type_name(cls)}: {sorted(missing)} would be lost")
    return {"class": _type_name(cls), "state": _encode(state, arrays), "attrs": attrs}


def _rebuild_layer(layer: Dict[str, Any], arrays: Dict[str, mx.array]):
    c = _resolve_class(layer["class"]).from_state(_decode(layer["state"], arrays))
    for k, v in layer["attrs"].items():
        setattr(c, k, _decode(v, arrays))
    return c


def _host_views(arrays: List[mx.array]) -> List[Tuple[str, np.ndarray]]:
    """(safetensors dtype, zero-copy numpy view) of each array, made on the
    caller's thread: contiguous and evaluated, so the writer reads memory and
    never has MLX compute anything (mx.contiguous of a contiguous array
    shares its buffer)."""
    views = []
    for a in arrays:
        if a.dtype not in _DTYPES:
            raise ValueError(f"dtype {a.dtype} is not supported")
        name, as_type = _DTYPES[a.dtype]
        a = mx.contiguous(a)
        views.append((name, a.view(as_type) if as_type is not None else a))
    mx.eval([v for _, v in views])
    return [(name, np.asarray(v)) for name, v in views]


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


def _header(tensors: Dict[str, Tuple[str, np.ndarray]], metadata: Dict[str, str]) -> bytes:
    """A file's length prefix and JSON header, the checksum's digits zeros
    (its field first, at _SUM_AT)."""
    meta = {k: v for k, v in metadata.items() if k != "xxh3"}
    header: Dict[str, Any] = {"__metadata__": {"xxh3": _SUM_ZERO, **meta}}
    offset = 0
    for name, (dtype, a) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(head)) + head


def _signed(head: bytes, digest: str) -> bytes:
    return head[:_SUM_AT] + digest.encode() + head[_SUM_AT + len(_SUM_ZERO):]


def _write_safetensors(path: str, tensors: Dict[str, Tuple[str, np.ndarray]],
                       metadata: Dict[str, str]) -> None:
    """Write a safetensors file (what mx.save_safetensors writes, from numpy
    views, so that no MLX runs on the writer thread), owner-only, and fsync
    it. Its checksum (metadata "xxh3") is an xxh3 of the whole file with
    the checksum's own 16 digits read as zeros: the data, and the header
    that says how to read them (shapes, dtypes, each layer's offset)."""
    head = _header(tensors, metadata)
    h = xxhash.xxh3_64(head)
    for _, a in tensors.values():
        h.update(_bytes_of(a))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(os.open(path, flags, 0o600), "wb") as f:
        f.write(_signed(head, h.hexdigest()))
        for _, a in tensors.values():
            f.write(_bytes_of(a))
        f.flush()
        os.fsync(f.fileno())


def _read_header(fd: int, size: int) -> Tuple[bytes, List[str], Dict[str, str]]:
    """A file's length prefix and header as read, its tensors' names in the
    order of their data, and its metadata. Raises ValueError unless the
    tensors tile the rest of the file exactly, so that hashing them in that
    order hashes every byte after the header."""
    first = os.pread(fd, 8, 0)
    if len(first) != 8:
        raise ValueError("no header")
    (n,) = struct.unpack("<Q", first)
    if not _SUM_AT - 8 + len(_SUM_ZERO) < n <= min(_MAX_HEADER, size - 8):
        raise ValueError(f"header length {n}")
    head = os.pread(fd, n, 8)
    if len(head) != n or not head.startswith(_SUM_HEAD):
        raise ValueError("not this format's header")
    header = json.loads(head)
    meta = header.pop("__metadata__")
    spans = []
    for name, t in header.items():
        count = 1
        for d in t["shape"]:
            if type(d) is not int or d < 0:
                raise ValueError(f"{name}: shape {t['shape']}")
            count *= d
        begin, end = t["data_offsets"]
        if end - begin != count * _ITEMSIZE[t["dtype"]]:
            raise ValueError(f"{name}: {end - begin} bytes for {t['shape']} {t['dtype']}")
        spans.append((begin, end, name))
    spans.sort()
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise ValueError(f"{name}: data at {begin}, expected {at}")
        at = end
    if 8 + n + at != size:
        raise ValueError(f"{size - 8 - n - at} bytes beside the tensors")
    return first + head, [name for _, _, name in spans], meta


def _compact(cache: List[Any]) -> List[Any]:
    """Only the tokens held go to disk: layers.compact for KV caches, and
    QuantizedKVCache's buffers (also allocated in steps of 256) cut alike."""
    for c in cache:
        if (isinstance(c, QuantizedKVCache) and c.keys is not None
                and c.keys[0].shape[2] > c.offset):
            c.keys, c.values = (tuple(mx.contiguous(x[..., : c.offset, :]) for x in kv)
                                for kv in (c.keys, c.values))
    return compact(cache)


def _key_name(tokens: array) -> str:
    return hashlib.blake2b(tokens.tobytes(), digest_size=20).hexdigest()
