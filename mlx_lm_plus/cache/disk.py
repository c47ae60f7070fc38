"""DiskTier: the prompt cache's second tier, on disk, kept across restarts.

Entries leaving memory (PromptStore evictions) are handed to `put`, which
returns at once: a writer thread owned by the tier writes them. `find`
answers from an in-memory radix tree of the stored keys (read from the
SQLite index at startup, so conversations resume after a restart) and `load`
reads a hit back into cache objects on the calling thread.

Layout: `<directory>/<identity>/` holds one safetensors file per entry
(`<blake2b of the key>.safetensors`), `index.sqlite` (one row per file: the
key as an int64 BLOB, sizes, kind, trimmable flag, last use) and `lock`.
`identity` comes from `model_identity` (config, weights' and adapters' file
metadata, format version, mlx/mlx-lm/mlx-vlm/mlx-lm-plus versions, caller's
extras), so another model, quantization or implementation never reads these
entries: it has its own folder. The folder is the owner's only (0700, files
0600: they hold prompts' token ids); one that is a symbolic link or another
user's is refused (no tier); names read from the index must be 40 hex digits
before they make a path.

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

Reading (`load`): the header is read and checked first (a regular file of
the size written, not followed through a link; the tensors tile the data
exactly); then mx.load reads the arrays in the background, in file order,
while the calling thread hashes each one's buffer as it arrives: every byte
read once, no copy, the checksum over exactly the arrays handed out. The
key in the file must be the one the index found it under.

Crash safety: a file is written to `*.tmp`, fsynced, renamed, and only then
gets its row; at startup stray `*.tmp` files, rows without a file (or with a
file of another size) and files without a row are deleted. A file that fails
to load (torn, truncated, checksum or key mismatch, not a regular file) is a
miss: it is deleted and counted, never raised. An index SQLite cannot open
or lock (another process holds it) leaves the tier off and everything kept;
only one it reads as damaged is started over. A write error (ENOSPC or any other) drops that
write, counts it, logs one warning and pauses writing for `pause_s`; reads
go on. Another process using the same folder: the second one gets no disk
tier (a lock file), rather than deleting the first one's files.

Threads: `put`, `find`, `load` run on the generation thread, the writer on
its own; `clear` (DELETE /v1/cache) on an HTTP handler's, and only unlinks
files and edits the in-memory index under the lock. MLX streams are per
thread (mlx 0.32: "There is no Stream(cpu, 0) in current thread" for any
array the writer would have to compute, such as a slice), so the writer never touches MLX: `put` makes the arrays contiguous
and evaluated on the caller's thread and hands the writer zero-copy numpy
views (bfloat16 viewed as uint16); the writer only hashes and writes bytes.
The in-memory index is shared under a lock; SQLite is used by one thread at a
time (startup, then the writer, then `close`); `last_used` updates and row
deletions from `load` are handed to the writer in batches.
"""

import errno
import fcntl
import hashlib
import importlib
import json
import logging
import os
import queue
import re
import sqlite3
import stat
import struct
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import QuantizedKVCache

from mlx_lm_plus.cache.layers import cache_nbytes, compact, trims_to_any_prefix
from mlx_lm_plus.cache.radix import TOKENS, Node, descend, matching
from mlx_lm_plus.logs import warn_once

# Part of every identity: a change of the file format starts a new folder.
# 2: the checksum covers the whole file (header and metadata too).
FORMAT = "mlx_lm_plus.disk_cache/2"
_SUFFIX = ".safetensors"
_INDEX = "index.sqlite"
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


def _own_folder(path: str):
    """Refuse a folder that is a symbolic link or another user's (its files
    would be read as this model's states, its index's names turned into
    paths); keep it owner-only (files hold prompts' token ids and states)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "not a directory (a symbolic link?)")
    if st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"owned by uid {st.st_uid}, not this user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


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


# -- the in-memory index --


@dataclass(eq=False)
class DiskEntry:
    """A stored entry; `find` hands it out as the handle for `load`."""
    name: str
    ntokens: int
    nbytes: int  # the file's size
    trimmable: bool
    kind: str
    last_used: float
    node: Any = field(default=None, repr=False)


@dataclass
class _Write:
    name: str
    tokens: array
    tensors: Dict[str, Tuple[str, np.ndarray]]
    metadata: Dict[str, str]
    nbytes: int  # the arrays' bytes (queue accounting)
    trimmable: bool
    kind: str
    epoch: int = 0  # the tier's clears when it was queued
    last_used: Optional[float] = None  # (time.time()) its last use in memory


_STOP = object()


class DiskTier:
    """Prompt caches on disk for one model identity (see the module doc)."""

    # Writing stops for this long after a write error (a full disk).
    pause_s = 60.0
    # Writes that would leave less free space than this are not tried.
    min_free_bytes = 64 << 20
    # How long SQLite waits for a lock another process holds on the index.
    busy_timeout = 5.0

    def __init__(self, directory: str, max_bytes: int, identity: str,
                 max_queue_bytes: Optional[int] = None):
        if not re.fullmatch(r"[0-9A-Za-z_-]+", identity):
            raise ValueError(f"bad identity {identity!r}")
        self.identity = identity
        self.path = os.path.join(directory, identity)
        self.max_bytes = max_bytes
        # Evicted caches wait in memory for the writer: bounded. One entry
        # is always taken when nothing waits (a long context may be larger).
        self.max_queue_bytes = (max_queue_bytes if max_queue_bytes is not None
                                else min(max_bytes // 4, 1 << 30))
        self.enabled = False
        self._lock = threading.Lock()
        self._root = Node(None, array(TOKENS), 0)
        self._entries: Dict[str, DiskEntry] = {}
        self._bytes = 0
        self._tokens = 0
        self._trimmable = 0
        self._pending: set = set()  # names queued or being written
        self._queued_bytes = 0
        self._jobs = 0  # queued or being written (for flush)
        self._idle = threading.Condition(self._lock)
        self._touched: Dict[str, float] = {}  # name -> last_used, for SQLite
        self._deleted: set = set()  # rows to delete (found bad, cleared, evicted)
        # Names whose files are being removed with the lock released: not
        # written again until they are gone (a new file would be removed).
        self._unlinking: set = set()
        self._full_until = 0.0
        self._stopping = False
        self._epoch = 0  # clears so far: a write queued before one is dropped
        self.stats = dict.fromkeys(
            ("hits", "misses", "writes", "write_errors", "dropped_writes",
             "corrupt", "read_errors", "evictions", "unsupported"), 0)
        self._queue: "queue.Queue" = queue.Queue()
        self._db = None
        self._lockfile = None
        self._writer: Optional[threading.Thread] = None
        if max_bytes <= 0:
            return
        try:
            os.makedirs(directory, exist_ok=True)
            try:
                os.mkdir(self.path, 0o700)
            except FileExistsError:
                pass
            _own_folder(self.path)
            self._lockfile = open(os.open(
                os.path.join(self.path, "lock"),
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "r+")
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            logging.warning(f"Prompt cache on disk disabled: {self.path}: {e}"
                            + (" (in use by another process)"
                               if e.errno in (errno.EAGAIN, errno.EACCES) else ""))
            if self._lockfile is not None:
                self._lockfile.close()
                self._lockfile = None
            return
        try:
            self._open_index()
        except (OSError, sqlite3.Error) as e:
            logging.warning(f"Prompt cache on disk disabled: {self.path}: {e}")
            self._release()
            return
        self.enabled = True
        self._writer = threading.Thread(target=self._run, name="disk-cache-writer",
                                        daemon=True)
        self._writer.start()

    # -- startup --

    def _connect(self):
        # Used by one thread at a time: startup, the writer, close.
        index = os.path.join(self.path, _INDEX)
        # Owner-only, as SQLite then makes its -wal and -shm files.
        os.close(os.open(index, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        db = sqlite3.connect(index, check_same_thread=False, timeout=self.busy_timeout)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS entries (name TEXT PRIMARY KEY, "
                       "key BLOB NOT NULL, ntokens INTEGER NOT NULL, nbytes INTEGER NOT NULL, "
                       "trimmable INTEGER NOT NULL, kind TEXT NOT NULL, "
                       "created REAL NOT NULL, last_used REAL NOT NULL)")
            rows = db.execute("SELECT name, key, ntokens, nbytes, trimmable, kind, "
                              "last_used FROM entries").fetchall()
        except BaseException:
            db.close()
            raise
        return db, rows

    def _open_index(self):
        try:
            self._db, rows = self._connect()
        except sqlite3.OperationalError:
            # Locked, unopenable, an I/O error: not a damaged index. The tier
            # stays off and the index and its files are kept for next time.
            raise
        except sqlite3.DatabaseError as e:  # "file is not a database", "malformed"
            # A damaged index: start over (its files go below, rowless).
            logging.warning(f"Prompt cache on disk: index unreadable ({e}), starting empty")
            for suffix in ("", "-wal", "-shm"):
                try:
                    os.remove(os.path.join(self.path, _INDEX + suffix))
                except FileNotFoundError:
                    pass
            self._db, rows = self._connect()
        files = {}
        for name in os.listdir(self.path):
            full = os.path.join(self.path, name)
            if not name.endswith((".tmp", _SUFFIX)):
                continue
            st = os.lstat(full)  # a link is never followed, only removed
            if stat.S_ISDIR(st.st_mode):
                continue
            if (name.endswith(_SUFFIX) and stat.S_ISREG(st.st_mode)
                    and _NAME.fullmatch(name[: -len(_SUFFIX)])):
                files[name[: -len(_SUFFIX)]] = st.st_size
            else:  # a write cut short (killed, crashed), or not a file of ours
                _unlink(full)
        stale = []
        for name, key, ntokens, nbytes, trimmable, kind, last_used in rows:
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                stale.append(name)  # never made into a path
                continue
            tokens = array(TOKENS)
            try:
                tokens.frombytes(key)
            except (TypeError, ValueError):
                tokens = array(TOKENS)
            if (files.pop(name, None) != nbytes or len(tokens) != ntokens
                    or ntokens == 0 or name in self._entries):
                stale.append(name)  # no file, or not the one written
                _unlink(self._file(name))
                continue
            self._add(DiskEntry(name, ntokens, nbytes, bool(trimmable), kind,
                                last_used), tokens)
        for name in files:  # written, but its row never committed
            _unlink(self._file(name))
        if stale:
            with self._db:
                self._db.executemany("DELETE FROM entries WHERE name = ?",
                                     [(n,) for n in stale])
        self._evict()
        if self._entries:
            logging.info(f"Prompt cache on disk: {len(self._entries)} entries, "
                         f"{self._bytes / 1e6:.1f} MB in {self.path}")

    # -- the index (callers hold self._lock, or own the tier alone) --

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name + _SUFFIX)

    def _add(self, entry: DiskEntry, tokens: array):
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = node.children[tokens[pos]] = Node(node, tokens[pos:], len(tokens))
                node, pos = child, len(tokens)
                break
            m = matching(child.edge, tokens, pos)
            if m < len(child.edge):  # split the edge after m tokens
                upper = Node(node, child.edge[:m], node.depth + m)
                child.edge, child.parent = child.edge[m:], upper
                upper.children[child.edge[0]] = child
                node.children[upper.edge[0]] = upper
                child = upper
            node, pos = child, pos + m
        if node.entry is not None:
            self._remove(node.entry, prune=False)
        entry.node, node.entry = node, entry
        self._entries[entry.name] = entry
        self._bytes += entry.nbytes
        self._tokens += entry.ntokens
        self._trimmable += entry.trimmable

    def _remove(self, entry: DiskEntry, prune: bool = True):
        node, entry.node = entry.node, None
        node.entry = None
        del self._entries[entry.name]
        self._bytes -= entry.nbytes
        self._tokens -= entry.ntokens
        self._trimmable -= entry.trimmable
        if not prune:
            return
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.edge[0]]
            node.parent, node = None, node.parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()  # fold into its only child
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child

    def _descend(self, key: array):
        """radix.descend from the index's root."""
        return descend(self._root, key)

    @staticmethod
    def _nearest_trimmable(node: Node) -> Optional[Node]:
        """The shallowest trimmable entry in `node`'s subtree."""
        best, stack = None, [node]
        while stack:
            n = stack.pop()
            if best is not None and n.depth >= best.depth:
                continue
            if n.entry is not None and n.entry.trimmable:
                best = n
                continue
            stack.extend(n.children.values())
        return best

    # -- the generation thread's side --

    def find(self, key: Sequence[int], trimmable_ok: bool = True, count: bool = True
             ) -> Optional[Tuple[int, DiskEntry]]:
        """The best entry for `key`: (tokens of `key` it covers, handle).

        The longest stored prefix of `key` shorter than it (one token at
        least is left to compute); or, with `trimmable_ok` and when it covers
        more, a trimmable entry sharing a longer common prefix with `key`
        (an exact one, a longer one, a sibling), usable up to
        min(common, len(key) - 1). `load` returns the entry's whole cache:
        the caller trims `handle.ntokens - covered` tokens off. count=False:
        a miss is not counted (a look ahead of the fetch that counts it).
        """
        if not self.enabled or not key:
            return None
        tokens = array(TOKENS, key)
        with self._lock:
            node, common, on_path, partial = self._descend(tokens)
            usable = [n for n in on_path if n.depth < len(tokens)]
            best = usable[-1] if usable else None
            target = min(common, len(tokens) - 1)
            if trimmable_ok and self._trimmable and target > (best.depth if best else 0):
                donor = self._nearest_trimmable(partial or node)
                if donor is not None:
                    return target, donor.entry
            if best is not None:
                return best.depth, best.entry
            if count:
                self.stats["misses"] += 1
            return None

    def key_of(self, handle: DiskEntry) -> Optional[List[int]]:
        """The token ids of a stored entry (its node's path), or None once it
        has left the tier."""
        tokens = self._key_tokens(handle)
        return None if tokens is None else tokens.tolist()

    def _key_tokens(self, handle: DiskEntry) -> Optional[array]:
        with self._lock:
            node, edges = handle.node, []
            if node is None or self._entries.get(handle.name) is not handle:
                return None
            while node is not None:
                edges.append(node.edge)
                node = node.parent
        tokens = array(TOKENS)
        for edge in reversed(edges):
            tokens.extend(edge)
        return tokens

    def load(self, handle: DiskEntry, count: bool = True) -> Optional[List[Any]]:
        """The entry's whole cache, read back (same classes), or None: a file
        that is gone, torn or corrupt is deleted, counted, and a miss.
        Either way the entry counts as used now (eviction goes by last
        use: an entry read ahead stays on disk until its fetch puts it back
        into memory). count=False: a read ahead of its use, which `used`
        counts as a hit once a fetch takes it."""
        path = self._file(handle.name)
        try:
            cache = self._read(handle, path)
        except Exception as e:
            if not _damaged(e):
                # Out of memory or file descriptors, an I/O error: the moment
                # failed, not the file. A miss now; the file stays for later.
                with self._lock:
                    if count:
                        self.stats["misses"] += 1
                    self.stats["read_errors"] += 1
                logging.warning(f"Prompt cache on disk: could not read {path} now: {e!r}")
                return None
            with self._lock:
                if count:  # (a read ahead's fetch counts its own miss)
                    self.stats["misses"] += 1
                if self._entries.get(handle.name) is not handle:
                    return None  # evicted (or replaced) since `find`
                # Under the lock: a new write of this key can't be queued
                # before the bad file is gone.
                _unlink(path)
                self._remove(handle)
                self._deleted.add(handle.name)
                self.stats["corrupt"] += 1
            logging.warning(f"Prompt cache on disk: dropped unreadable {path}: {e}")
            return None
        self.used(handle, count)
        return cache

    def not_trimmable(self, handle: DiskEntry) -> None:
        """Offer the entry for its own key only from now on (in this
        process: a row's flag on disk is as it was written)."""
        with self._lock:
            handle.trimmable = False

    def used(self, handle: DiskEntry, count: bool = True):
        """The entry's use (eviction goes by last use), and a hit if `count`."""
        with self._lock:
            if count:
                self.stats["hits"] += 1
            current = self._entries.get(handle.name)  # rewritten since: the same key
            if current is not None:
                current.last_used = self._touched[handle.name] = time.time()

    def _read(self, handle: DiskEntry, path: str) -> List[Any]:
        """The entry's file read, checked and rebuilt; raises if it is not
        the file written for `handle`, whole and unchanged."""
        # Not following a link; not blocking on a FIFO planted in its place.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != handle.nbytes:
                raise ValueError(f"{st.st_size} bytes, {handle.nbytes} written")
            head, order, meta = _read_header(fd, st.st_size)
        finally:
            os.close(fd)
        if meta.get("format") != FORMAT or meta.get("identity") != self.identity:
            raise ValueError("not this tier's file")
        arrays = mx.load(path)  # lazy: read by MLX's stream below
        ordered = [arrays[name] for name in order]
        # Every byte once: MLX reads the arrays in the file's order in the
        # background while this thread hashes each one as it arrives (its
        # memoryview waits for it; xxhash lets go of the GIL), straight from
        # the arrays' own buffers, which are what the caches get.
        mx.async_eval(ordered)
        h = xxhash.xxh3_64(_signed(head, _SUM_ZERO))
        for a in ordered:
            h.update(memoryview(a))
        if h.hexdigest() != head[_SUM_AT:_SUM_AT + len(_SUM_ZERO)].decode():
            raise ValueError("checksum mismatch")
        if arrays["tokens"].dtype != mx.int64 or arrays["tokens"].ndim != 1:
            raise ValueError("bad key tensor")
        tokens = array(TOKENS)
        tokens.frombytes(memoryview(arrays["tokens"]).cast("B"))
        # The key the index found it under (None: it left the index since).
        key = self._key_tokens(handle)
        if (key is not None and tokens != key) or _key_name(tokens) != handle.name:
            raise ValueError("key mismatch")
        return [_rebuild_layer(layer, arrays) for layer in json.loads(meta["layers"])]

    def put(self, key: Sequence[int], cache: List[Any], kind: str = "prompt",
            last_used: Optional[float] = None) -> None:
        """Queue `cache` (covering exactly `key`) for writing; returns at
        once. The tier takes ownership of the cache. `last_used`: its last
        use (time.time()), which the tier's eviction goes by (default: now).
        A key already on disk is only touched; writes are dropped (and
        counted) while the queue is full or writing is paused after an
        error."""
        if not self.enabled or not key or self._writer is None:
            return
        tokens = array(TOKENS, key)
        name = _key_name(tokens)
        try:
            estimate = cache_nbytes(cache)
        except Exception:  # (a layer without nbytes: found out below)
            estimate = 0
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                entry.last_used = self._touched[name] = max(
                    entry.last_used, last_used or time.time())
                return
            if name in self._pending or name in self._unlinking:
                return
            # Before the copy below, which costs the caller (the generation
            # thread) as much as the write would have: a full queue drops it.
            if time.monotonic() < self._full_until or (
                    self._jobs and self._queued_bytes + estimate > self.max_queue_bytes):
                self.stats["dropped_writes"] += 1
                return
            epoch = self._epoch  # a clear from now on drops this write
        try:
            arrays: List[mx.array] = []
            layers = [_describe(c, arrays) for c in _compact(cache)]
            views = _host_views(arrays) + [("I64", np.frombuffer(tokens, np.int64))]
            trimmable = trims_to_any_prefix(cache)
        except Exception as e:
            with self._lock:
                self.stats["unsupported"] += 1
            warn_once((self.path, "unsupported"), f"Prompt cache on disk: not storing "
                            f"this model's caches: {e}")
            return
        tensors = {f"a{i}": v for i, v in enumerate(views[:-1])}
        tensors["tokens"] = views[-1]
        metadata = {"format": FORMAT, "identity": self.identity, "kind": kind,
                    "layers": json.dumps(layers, separators=(",", ":"))}
        nbytes = sum(v.nbytes for _, v in views)
        job = _Write(name, tokens, tensors, metadata, nbytes, trimmable, kind, epoch, last_used)
        with self._lock:
            if (name in self._pending or name in self._entries or name in self._unlinking
                    or epoch != self._epoch):
                return
            if nbytes > self.max_bytes or (
                    self._jobs and self._queued_bytes + nbytes > self.max_queue_bytes):
                self.stats["dropped_writes"] += 1
                return
            self._pending.add(name)
            self._queued_bytes += nbytes
            self._jobs += 1
        self._queue.put(job)

    def clear(self) -> int:
        """Drop every entry (DELETE /v1/cache). Returns the entries dropped."""
        names = self.clear_index()
        self.remove_files(names)
        return len(names)

    def clear_index(self) -> List[str]:
        """Drop every entry from the index (no lookup finds them from now
        on), their rows when the writer next syncs it; writes queued or
        under way are dropped too (the writer sees the clear: `_epoch`).
        Returns the names whose files `remove_files` must then remove."""
        with self._lock:
            self._epoch += 1
            names = list(self._entries)
            self._forget(names)
        return names

    def _forget(self, names: List[str]):
        """Take entries out of the index, their files to remove (callers
        hold the lock)."""
        for name in names:
            self._remove(self._entries[name])
            self._touched.pop(name, None)
            self._deleted.add(name)
            self._unlinking.add(name)

    def remove_files(self, names: List[str]):
        """Remove the files of entries taken out of the index, with the lock
        released: a file takes a millisecond or more (thousands of them held
        every lookup, and the generation thread behind it, for seconds).
        (At startup a file without its row is removed: a crash here leaves
        none behind.)"""
        try:
            for name in names:
                _unlink(self._file(name))
        finally:
            with self._lock:
                self._unlinking.difference_update(names)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the queued writes are done; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._jobs == 0, timeout)

    def close(self, timeout: Optional[float] = 30.0):
        """Finish the queued writes (up to `timeout`), stop the writer, save
        the last uses, close the index and release the folder."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self.flush(timeout)
            self._stopping = True  # what is still queued is dropped
            self._queue.put(_STOP)
            writer.join(timeout)
            if writer.is_alive():  # stuck in a write: leave it the index
                logging.warning("Prompt cache on disk: writer still busy at close")
                self.enabled = False
                return
        if self._db is not None:
            try:
                self._sync_index()
            except sqlite3.Error:
                pass
        self._release()
        self.enabled = False

    def _release(self):
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._lockfile is not None:
            self._lockfile.close()  # releases the flock
            self._lockfile = None

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "enabled": self.enabled,
                "directory": self.path,
                "entries": len(self._entries),
                "bytes": self._bytes,
                "tokens": self._tokens,
                "max_bytes": self.max_bytes,
                "queued_bytes": self._queued_bytes,
                **self.stats,
                "full": time.monotonic() < self._full_until,
            }

    # -- the writer thread --

    def _run(self):
        while True:
            try:
                job = self._queue.get(timeout=1.0)
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            try:
                if job is not None:
                    self._write(job)
                self._sync_index()
            except Exception as e:  # nothing may end the writer
                warn_once((self.path, "writer"), f"Prompt cache on disk: writer error: {e!r}")
            finally:
                if job is not None:
                    with self._idle:
                        self._pending.discard(job.name)
                        self._queued_bytes -= job.nbytes
                        self._jobs -= 1
                        self._idle.notify_all()

    def _write(self, job: _Write):
        if job.epoch != self._epoch:  # cleared since it was queued
            return
        if self._stopping or time.monotonic() < self._full_until:
            with self._lock:
                self.stats["dropped_writes"] += 1
            return
        path = self._file(job.name)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            free = os.statvfs(self.path)
            if free.f_bavail * free.f_frsize < job.nbytes + self.min_free_bytes:
                raise OSError(errno.ENOSPC, "too little free space left")
            _write_safetensors(tmp, job.tensors, job.metadata)
            os.replace(tmp, path)
            size = os.path.getsize(path)
            now = time.time()
            last_used = min(job.last_used or now, now)
            with self._lock:
                if job.epoch != self._epoch:  # cleared while it was written
                    _unlink(path)
                    return
                self._deleted.discard(job.name)
            with self._db:
                self._db.execute(
                    "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (job.name, job.tokens.tobytes(), len(job.tokens), size,
                     int(job.trimmable), job.kind, now, last_used))
        except Exception as e:  # ENOSPC, EIO, a full or broken index...
            _unlink(tmp)
            _unlink(path)
            with self._lock:
                self.stats["write_errors"] += 1
                paused = time.monotonic() >= self._full_until
                self._full_until = time.monotonic() + self.pause_s
            if paused:
                logging.warning(f"Prompt cache on disk: write failed ({e}); not "
                                f"writing for {self.pause_s:.0f} s, reads go on")
            return
        job.tensors = {}  # the arrays may go now
        with self._lock:
            if job.epoch != self._epoch:  # cleared during the insert
                _unlink(path)
                self._deleted.add(job.name)  # its row
                return
            self._add(DiskEntry(job.name, len(job.tokens), size, job.trimmable,
                                job.kind, last_used), job.tokens)
            self.stats["writes"] += 1
        self._evict()

    def _evict(self):
        """Least recently used entries go until the files fit max_bytes."""
        with self._lock:
            over = self._bytes - self.max_bytes
            if over <= 0:
                return
            victims = []
            for entry in sorted(self._entries.values(), key=lambda e: e.last_used):
                if over <= 0:
                    break
                over -= entry.nbytes
                victims.append(entry.name)
            self._forget(victims)  # (their rows go at the next _sync_index)
            self.stats["evictions"] += len(victims)
        self.remove_files(victims)

    def _sync_index(self):
        """Write the batched last-use updates and row deletions to SQLite."""
        with self._lock:
            touched, self._touched = self._touched, {}
            deleted, self._deleted = self._deleted, set()
        if not touched and not deleted:
            return
        with self._db:  # one transaction
            self._db.executemany("UPDATE entries SET last_used = ? WHERE name = ?",
                                 [(t, n) for n, t in touched.items()])
            self._db.executemany("DELETE FROM entries WHERE name = ?",
                                 [(n,) for n in deleted])


def _damaged(error: Exception) -> bool:
    """Whether a read failed because of the file (torn, corrupt, replaced by
    a link, gone: _read's ValueErrors, a header that doesn't parse) rather
    than the moment (memory, file descriptors, an I/O error)."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOENT, errno.ELOOP, errno.EISDIR)
    return isinstance(error, (ValueError, KeyError, IndexError, TypeError, struct.error))


def _unlink(path: str):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logging.warning(f"Prompt cache on disk: can't remove {path}: {e}")
