"""DiskTier (mlx_lm_plus/cache/disk.py): the prompt cache's disk tier.

Tiny caches (a few tokens, 2 heads of 8 dims) on CPU: round trips of every
cache class, restarts, identities, torn and corrupt files, a process killed
mid-write, a full disk, LRU eviction, lookup semantics, and the writer
thread writing while another thread computes with MLX.
"""

import copy
import errno
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from array import array
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlx_lm_plus.cache import disk as disk_cache
from mlx_lm_plus.cache import disk_index, disk_writer
from mlx_lm_plus.cache.disk import DiskTier
from mlx_lm_plus.cache.disk_format import model_identity
from mlx_lm_plus.models.vlm_text import MRopeKVCache, PlainKVCache, PlainRotatingKVCache

ROOT = Path(__file__).resolve().parents[2]


def kv(n, dtype=mx.float16, cls=KVCache, seed=0, dim=8):
    """A cache holding n tokens in buffers of exactly n (as PromptStore
    entries are: compacted)."""
    c = cls()
    mx.random.seed(seed)
    c.keys = mx.random.normal((1, 2, n, dim)).astype(dtype)
    c.values = mx.random.normal((1, 2, n, dim)).astype(dtype)
    c.offset = n
    mx.eval(c.keys, c.values)
    return c


def arrays_cache(seed=0):
    mx.random.seed(seed)
    c = ArraysCache(3)
    c[0] = mx.random.normal((1, 3, 16))
    c[2] = mx.random.normal((1, 2, 4, 4)).astype(mx.bfloat16)  # c[1] stays None
    return c


def rotating(seed=0, cls=RotatingKVCache):
    c = cls(max_size=8, keep=2)
    mx.random.seed(seed)
    c.update_and_fetch(mx.random.normal((1, 2, 6, 8)), mx.random.normal((1, 2, 6, 8)))
    for _ in range(5):  # past max_size: rotated in place
        c.update_and_fetch(mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8)))
    return c


def quantized(seed=0, grown=False):
    c = QuantizedKVCache(group_size=32, bits=4)
    mx.random.seed(seed)
    k, v = mx.random.normal((1, 2, 5, 32)), mx.random.normal((1, 2, 5, 32))
    if grown:  # buffers of 256 tokens
        c.update_and_fetch(k, v)
    else:
        c.keys, c.values, c.offset = mx.quantize(k, 32, 4), mx.quantize(v, 32, 4), 5
    return c


def mrope(n=4, delta=-17):
    c = kv(n, mx.bfloat16, MRopeKVCache, seed=3)
    c.rope_delta = delta
    return c


def flat(cache):
    """Every layer's class, state leaves and plain attributes, comparable."""
    out = []
    for c in cache:
        leaves = []
        for path, v in tree_flatten(c.state):
            if isinstance(v, mx.array):
                mx.eval(v)
                leaves.append((path, "array", str(v.dtype), v.shape,
                               v.view(mx.uint8).tolist() if v.size else []))
            else:
                leaves.append((path, v))
        attrs = {k: v for k, v in vars(c).items() if isinstance(v, (int, float, str))}
        out.append((type(c), shape_of(c.state), leaves, attrs))
    return out


def shape_of(state):
    """The state's containers (tuple or list) with arrays as "A"."""
    if isinstance(state, (tuple, list)):
        return (type(state).__name__, [shape_of(s) for s in state])
    return "A" if isinstance(state, mx.array) else state


def copy_of(cache):
    return copy.deepcopy(cache)


@pytest.fixture
def tier_dir(tmp_path):
    return str(tmp_path / "disk")


def make_tier(path, max_bytes=1 << 30, identity="m1", **kw):
    t = DiskTier(path, max_bytes, identity, **kw)
    assert t.enabled
    return t


def stored(tier, key, cache, kind="prompt"):
    tier.put(key, cache, kind)
    assert tier.flush(10)


def files(tier, pattern="*"):
    return sorted(p.name for p in Path(tier.path).glob(pattern))


# -- the file format --


def test_round_trip_every_cache_class(tier_dir):
    chunked = ChunkedKVCache(chunk_size=16)
    chunked.update_and_fetch(mx.ones((1, 2, 5, 8)), mx.zeros((1, 2, 5, 8)))
    cache = [kv(5), kv(5, mx.float32), mrope(), arrays_cache(), rotating(), quantized(),
             CacheList(kv(5, seed=4), arrays_cache(seed=5)), chunked,
             kv(3, cls=PlainKVCache, seed=6), rotating(seed=7, cls=PlainRotatingKVCache)]
    before = flat(cache)
    key = [5, -(1 << 62), 7, 1, 2]  # an image fingerprint among the tokens
    t = make_tier(tier_dir)
    stored(t, key, cache)
    covered, handle = t.find(key + [9])
    assert covered == 5 and handle.ntokens == 5 and handle.kind == "prompt"
    back = t.load(handle)
    assert flat(back) == before
    assert back[2].rope_delta == -17 and isinstance(back[2], MRopeKVCache)
    assert [type(c) for c in back[-2:]] == [PlainKVCache, PlainRotatingKVCache]
    grown = quantized(grown=True)  # its buffers: tuples (mx.quantize: lists)
    stored(t, [3, 3], [grown])
    assert isinstance(t.load(t.find([3, 3, 3])[1])[0].keys, tuple)
    # The key is in the file as well (int64, negative ids intact).
    path = os.path.join(t.path, handle.name + ".safetensors")
    assert mx.load(path)["tokens"].tolist() == key
    assert t.snapshot()["hits"] == 2
    t.close()


def test_loaded_caches_keep_generating_like_the_original(tier_dir):
    """Not only equal arrays: the next token's update gives the same keys."""
    cache = [kv(5), rotating(), quantized()]
    expect = []
    for c, n in zip(copy_of(cache), (8, 8, 32)):
        mx.random.seed(9)
        expect.append(tree_flatten(c.update_and_fetch(mx.random.normal((1, 2, 1, n)),
                                                      mx.random.normal((1, 2, 1, n)))))
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], cache)
    back = t.load(t.find([1, 2, 3, 4])[1])
    for c, n, want in zip(back, (8, 8, 32), expect):
        mx.random.seed(9)
        got = tree_flatten(c.update_and_fetch(mx.random.normal((1, 2, 1, n)),
                                              mx.random.normal((1, 2, 1, n))))
        assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(got, want))
    t.close()


def test_compacted_to_the_tokens_held(tier_dir):
    """KV buffers come in steps of 256 tokens; only the tokens held are written."""
    c, k = quantized(grown=True), KVCache()
    k.update_and_fetch(mx.ones((1, 2, 5, 8)), mx.ones((1, 2, 5, 8)))
    assert c.keys[0].shape[2] == 256 and k.keys.shape[2] == 256
    t = make_tier(tier_dir)
    stored(t, [1, 2], [k, c])
    back = t.load(t.find([1, 2, 3])[1])
    assert back[0].keys.shape[2] == 5 and back[1].keys[0].shape[2] == 5
    assert t.snapshot()["bytes"] < 8000
    t.close()


def test_quantized_store_layers_round_trip(tier_dir):
    """What a PromptStore with --prompt-cache-bits evicts (its quantized
    layers keep their layer's class, dtype and attributes) comes back whole."""
    from mlx_lm_plus.cache import layers as cache_layers

    if not hasattr(cache_layers, "quantize_for_store"):
        pytest.skip("no quantized storage in mlx_lm_plus.cache.layers")
    layers = [kv(4, mx.bfloat16, dim=32), kv(4, mx.bfloat16, MRopeKVCache, seed=2, dim=32)]
    layers[1].rope_delta = 11
    stored_layers = cache_layers.quantize_for_store(layers, 4, 32)
    want = flat(cache_layers.restore_from_store(stored_layers, trim=1))
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3, 4], stored_layers)
    back = t.load(t.find([1, 2, 3, 4, 5])[1])
    assert [type(c) for c in back] == [type(c) for c in stored_layers]
    restored = cache_layers.restore_from_store(back, trim=1)
    assert flat(restored) == want and restored[1].rope_delta == 11
    t.close()


@pytest.mark.parametrize("stored_kv_module", ["mlx_lm_plus.cache", "mlx_lm_plus.cache.store"])
@pytest.mark.parametrize("vision_module", ["mlx_lm_plus.vision", "mlx_lm_plus.models.vision"])
def test_entries_naming_the_modules_before_the_split_still_load(tier_dir, monkeypatch,
                                                                stored_kv_module,
                                                                vision_module):
    """Files record layer classes as module:qualname. Entries written before
    the package moved into folders name mlx_lm_plus.vision and
    mlx_lm_plus.cache; those written before the layer helpers left the
    store name mlx_lm_plus.cache.store (StoredKV), and before a vision
    model's layer caches left models/vision.py, mlx_lm_plus.models.vision:
    they load as the classes that moved."""
    from mlx_lm_plus.cache import disk_format
    from mlx_lm_plus.cache.layers import quantize_for_store

    layers = [kv(3, cls=PlainKVCache, seed=6), kv(4, mx.bfloat16, MRopeKVCache, seed=2, dim=32)]
    layers = [layers[0]] + quantize_for_store(layers[1:], 4, 32)
    want = flat(layers)
    new_name = disk_format._type_name
    old_names = []

    def before_the_split(cls):  # as the files written then name the classes
        name = new_name(cls).replace("mlx_lm_plus.models.vlm_text:", f"{vision_module}:")
        name = name.replace("mlx_lm_plus.cache.layers:", f"{stored_kv_module}:")
        old_names.append(name) if name != new_name(cls) else None
        return name

    monkeypatch.setattr(disk_format, "_type_name", before_the_split)
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], layers)
    t.close()
    assert {n.split(":")[0] for n in old_names} == {vision_module, stored_kv_module}
    t = make_tier(tier_dir)
    back = t.load(t.find([1, 2, 3, 4])[1])
    assert back is not None and flat(back) == want
    t.close()


@pytest.mark.parametrize("how", ["class", "attribute"])
def test_unsupported_cache_is_skipped_not_raised(tier_dir, how):
    class Custom(KVCache):  # not importable by name from a file
        pass

    if how == "class":
        layer = kv(3, cls=Custom)
    else:  # an attribute neither the state nor the file format covers
        layer = kv(3)
        layer.tokenizer = object()
    t = make_tier(tier_dir)
    t.put([1, 2], [kv(3), layer], "prompt")
    assert t.flush(10)
    snap = t.snapshot()
    assert snap["unsupported"] == 1 and snap["entries"] == 0 and snap["writes"] == 0
    assert files(t, "*.safetensors") == []
    t.close()


# -- restarts and identities --


def test_restart_finds_and_loads(tier_dir):
    t = make_tier(tier_dir)
    a, b = [kv(4, seed=1)], [mrope(6, delta=3)]
    want_a, want_b = flat(a), flat(b)
    stored(t, [1, 2, 3, 4], a, "checkpoint")
    stored(t, [9, 8, 7, 6, 5, 4], b)
    t.close()

    t2 = make_tier(tier_dir)
    snap = t2.snapshot()
    assert snap["entries"] == 2 and snap["tokens"] == 10 and snap["writes"] == 0
    covered, h = t2.find([1, 2, 3, 4, 5])
    assert covered == 4 and h.kind == "checkpoint"
    assert flat(t2.load(h)) == want_a
    covered, h = t2.find([9, 8, 7, 6, 5, 4, 3])
    assert covered == 6 and flat(t2.load(h)) == want_b
    t2.close()


def test_other_identity_sees_nothing(tier_dir):
    t = make_tier(tier_dir, identity="m1")
    stored(t, [1, 2, 3], [kv(3)])
    t.close()
    other = make_tier(tier_dir, identity="m2")
    assert other.find([1, 2, 3, 4]) is None and other.snapshot()["entries"] == 0
    other.close()
    # ... and starting it did not remove the first one's entries.
    t = make_tier(tier_dir, identity="m1")
    assert t.find([1, 2, 3, 4])[0] == 3
    t.close()


def test_second_user_of_a_folder_gets_no_tier(tier_dir):
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    second = DiskTier(tier_dir, 1 << 30, "m1")
    assert not second.enabled and second.find([1, 2, 3, 4]) is None
    second.put([4, 5], [kv(2)], "prompt")  # a no-op, not an error
    second.close()
    assert t.find([1, 2, 3, 4])[0] == 3 and files(t, "*.safetensors")
    t.close()


def test_last_use_survives_a_restart(tier_dir):
    t = make_tier(tier_dir)
    stored(t, [1, 1], [kv(2)])
    stored(t, [2, 2], [kv(2)])
    t.load(t.find([1, 1, 0])[1])  # [1, 1] is now the most recently used
    t.close()
    size = DiskTier(tier_dir, 1 << 30, "m1")
    per_entry = size.snapshot()["bytes"] // 2
    size.close()
    # A budget for two entries: adding a third evicts [2, 2], not [1, 1].
    t = make_tier(tier_dir, max_bytes=2 * per_entry + per_entry // 2)
    stored(t, [3, 3], [kv(2)])
    assert t.find([2, 2, 0]) is None and t.find([1, 1, 0])[0] == 2
    t.close()


# -- damaged files --


def test_truncated_file_is_a_counted_miss(tier_dir):
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    stored(t, [1, 2], [kv(2)])
    covered, h = t.find([1, 2, 3, 4])
    assert covered == 3
    path = os.path.join(t.path, h.name + ".safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    assert t.load(h) is None
    assert not os.path.exists(path)
    snap = t.snapshot()
    assert snap["corrupt"] == 1 and snap["misses"] == 1 and snap["entries"] == 1
    assert t.find([1, 2, 3, 4])[0] == 2  # the shorter entry still serves
    t.close()
    t = make_tier(tier_dir)  # and the row went with the file
    assert t.snapshot()["entries"] == 1 and t.find([1, 2, 3, 4])[0] == 2
    t.close()


@pytest.mark.parametrize("damage", ["flip_data", "garbage_header", "missing", "empty"])
def test_corrupt_or_missing_file_is_a_miss(tier_dir, damage):
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    (name,) = files(t, "*.safetensors")
    path = os.path.join(t.path, name)
    data = open(path, "rb").read()
    if damage == "flip_data":  # one bit of the keys off: the checksum sees it
        at = 8 + int.from_bytes(data[:8], "little") + 3
        data = data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
    elif damage == "garbage_header":
        data = data[:8] + b"x" * 16 + data[24:]
    elif damage == "empty":
        data = b""
    if damage == "missing":
        os.remove(path)
    else:
        open(path, "wb").write(data)
    assert t.load(t.find([1, 2, 3, 4])[1]) is None
    assert not os.path.exists(path)
    assert t.snapshot()["corrupt"] == 1 and t.find([1, 2, 3, 4]) is None
    # The same key can be stored again.
    stored(t, [1, 2, 3], [kv(3)])
    assert t.load(t.find([1, 2, 3, 4])[1]) is not None
    t.close()


@pytest.mark.parametrize("failure", [
    RuntimeError("[malloc] Unable to allocate 1073741824 bytes"),
    MemoryError(),
    OSError(errno.EMFILE, "Too many open files"),
    OSError(errno.EIO, "Input/output error"),
])
def test_a_read_that_fails_for_the_moment_keeps_the_file(tier_dir, monkeypatch, failure):
    """Out of memory or descriptors, an I/O error: the moment failed, not the
    file. A miss, counted as a read error; the entry stays and serves the
    next read (it used to be deleted and counted corrupt, under the load
    that made the read fail)."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    real = disk_cache.mx.load

    def fail(*a, **kw):
        raise failure

    monkeypatch.setattr(disk_cache.mx, "load", fail)
    assert t.load(t.find([1, 2, 3, 4])[1]) is None
    snap = t.snapshot()
    assert (snap["corrupt"], snap["read_errors"], snap["misses"], snap["entries"]) == (0, 1, 1, 1)
    assert len(files(t, "*.safetensors")) == 1
    monkeypatch.setattr(disk_cache.mx, "load", real)
    assert flat(t.load(t.find([1, 2, 3, 4])[1])) == flat([kv(3)])
    t.close()


def test_a_link_in_place_of_a_file_is_removed(tier_dir, tmp_path):
    """O_NOFOLLOW refuses a link (ELOOP): the file's fault, not the moment's."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    (name,) = files(t, "*.safetensors")
    path = os.path.join(t.path, name)
    target = tmp_path / "elsewhere"
    os.replace(path, target)
    os.symlink(target, path)
    assert t.load(t.find([1, 2, 3, 4])[1]) is None
    assert not os.path.lexists(path) and target.exists()
    assert t.snapshot()["corrupt"] == 1 and t.find([1, 2, 3, 4]) is None
    t.close()


def test_startup_cleans_strays(tier_dir):
    t = make_tier(tier_dir)
    for k in ([1], [2], [3], [4]):
        stored(t, k + [0], [kv(2)])
    t.close()
    d = Path(t.path)
    names = sorted(d.glob("*.safetensors"))
    (d / "abc.safetensors.123.tmp").write_bytes(b"partial")  # a cut write
    names[0].unlink()  # a row without its file
    shutil.copy(names[1], d / ("0" * 40 + ".safetensors"))  # a file without a row
    with open(names[2], "ab") as f:  # a file that is not the one written
        f.write(b"extra")
    t = make_tier(tier_dir)
    assert t.snapshot()["entries"] == 2
    assert sorted(d.glob("*.safetensors")) == sorted([names[1], names[3]])
    assert not list(d.glob("*.tmp"))
    t.close()
    rows = sqlite3.connect(str(d / "index.sqlite")).execute(
        "SELECT COUNT(*) FROM entries").fetchone()[0]
    assert rows == 2


def test_unreadable_index_starts_empty(tier_dir):
    t = make_tier(tier_dir)
    stored(t, [1, 2], [kv(2)])
    t.close()
    for p in Path(t.path).glob("index.sqlite*"):
        p.write_bytes(b"this is not a database" * 100)
    t = make_tier(tier_dir)
    assert t.snapshot()["entries"] == 0 and not files(t, "*.safetensors")
    stored(t, [1, 2], [kv(2)])  # and it works again
    assert t.find([1, 2, 3])[0] == 2
    t.close()


def test_partial_files_of_a_killed_writer(tier_dir):
    """What a kill -9 leaves: a partial temp file (mid-write), a complete
    file whose row was never committed (between rename and insert)."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    t.close()
    (name,) = files(t, "*.safetensors")
    data = (Path(t.path) / name).read_bytes()
    (Path(t.path) / f"{'1' * 40}.safetensors.999.tmp").write_bytes(data[: len(data) // 2])
    (Path(t.path) / f"{'2' * 40}.safetensors").write_bytes(data)
    t = make_tier(tier_dir)
    assert files(t, "*.safetensors") == [name] and not files(t, "*.tmp")
    assert t.find([7, 8]) is None and t.load(t.find([1, 2, 3, 4])[1]) is not None
    t.close()


KILLED_WRITER = """
import os, sys, threading, time
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm_plus.cache import disk_writer
from mlx_lm_plus.cache.disk import DiskTier

def kv(n):
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
    return c

t = DiskTier(sys.argv[1], 1 << 30, "m1")
t.put([1, 2, 3], [kv(3)], "prompt")
assert t.flush(10)

def stuck(path, tensors, metadata):  # half a file, then the process dies
    with open(path, "xb") as f:
        f.write(b"\\0" * 100)
        f.flush()
    print("writing", flush=True)
    time.sleep(60)

disk_writer._write_safetensors = stuck
t.put([4, 5, 6], [kv(3)], "prompt")
time.sleep(60)
"""


def test_process_killed_mid_write(tier_dir):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_WRITER), tier_dir],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        d = Path(tier_dir) / "m1"
        assert list(d.glob("*.tmp"))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    t = make_tier(tier_dir)  # the dead process's lock is gone with it
    assert not files(t, "*.tmp")
    assert t.find([4, 5, 6, 7]) is None  # the cut write: a miss
    assert t.load(t.find([1, 2, 3, 4])[1]) is not None  # the committed one
    t.close()


def test_checksum_covers_the_header(tier_dir):
    """One bit of a layer's offset in the metadata (a digit of the JSON): the
    arrays are intact, the state they would make is not. A miss."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    (name,) = files(t, "*.safetensors")
    path = os.path.join(t.path, name)
    data = bytearray(open(path, "rb").read())
    at = data.index(b'\\"offset\\":3')  # in the layers' JSON, inside the metadata
    data[at + len(b'\\"offset\\":')] ^= 1  # "3" -> "2"
    open(path, "wb").write(bytes(data))
    assert mx.load(path)["a0"].shape == (1, 2, 3, 8)  # still a readable file
    assert t.load(t.find([1, 2, 3, 4])[1]) is None
    assert t.snapshot()["corrupt"] == 1 and not os.path.exists(path)
    t.close()


def test_file_of_another_format_is_a_miss(tier_dir):
    """A safetensors file of the same arrays and metadata, as another writer
    (or an older format) lays it out: deleted as unreadable, never a crash."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    (name,) = files(t, "*.safetensors")
    path = os.path.join(t.path, name)
    arrays, meta = mx.load(path, return_metadata=True)
    os.remove(path)
    mx.save_safetensors(path, arrays, {**meta, "format": "mlx_lm_plus.disk_cache/1"})
    handle = t.find([1, 2, 3, 4])[1]
    handle.nbytes = os.path.getsize(path)
    assert t.load(handle) is None and t.snapshot()["corrupt"] == 1
    t.close()


def test_load_checks_the_key_the_index_found(tier_dir):
    """An index row whose key is off by one token (SQLite keeps no checksums)
    must not hand the file's cache to a prompt it was never computed for."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    t.close()
    db = sqlite3.connect(os.path.join(t.path, "index.sqlite"))
    with db:
        db.execute("UPDATE entries SET key = ?", (array("q", [1, 2, 4]).tobytes(),))
    db.close()
    t = make_tier(tier_dir)
    covered, handle = t.find([1, 2, 4, 5])
    assert covered == 3  # the index says [1, 2, 4]; the file holds [1, 2, 3]
    assert t.load(handle) is None and t.snapshot()["corrupt"] == 1
    t.close()


def test_index_names_never_make_paths(tier_dir, tmp_path):
    """A row whose name walks out of the folder (a damaged or planted index)
    is dropped; the file it names is not touched."""
    victim = tmp_path / "victim.safetensors"  # tier_dir/m1/../../victim
    victim.write_bytes(b"someone's weights")
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    t.close()
    db = sqlite3.connect(os.path.join(t.path, "index.sqlite"))
    with db:
        db.execute("INSERT INTO entries VALUES (?, ?, 2, 99, 1, 'prompt', 0, 0)",
                   ("../../victim", array("q", [7, 8]).tobytes()))
    db.close()
    t = make_tier(tier_dir)
    assert victim.read_bytes() == b"someone's weights"
    assert t.snapshot()["entries"] == 1 and t.find([7, 8, 9]) is None
    t.close()
    rows = sqlite3.connect(os.path.join(t.path, "index.sqlite")).execute(
        "SELECT name FROM entries").fetchall()
    assert len(rows) == 1 and rows[0][0] != "../../victim"


def test_locked_index_is_kept(tier_dir, monkeypatch):
    """An index another process holds locked (a sqlite3 shell, a backup) is
    not a damaged one: the tier stays off this time, and neither the index
    nor the entries' files are deleted."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    t.close()
    monkeypatch.setattr(DiskTier, "busy_timeout", 0.2, raising=False)
    other = sqlite3.connect(os.path.join(t.path, "index.sqlite"), isolation_level=None)
    other.execute("PRAGMA locking_mode=EXCLUSIVE")
    other.execute("BEGIN EXCLUSIVE")
    try:
        locked = DiskTier(tier_dir, 1 << 30, "m1")
        assert not locked.enabled
        locked.close()
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert len(files(t, "*.safetensors")) == 1
    t = make_tier(tier_dir)
    assert t.snapshot()["entries"] == 1 and t.load(t.find([1, 2, 3, 4])[1]) is not None
    t.close()


RELEASE_FIFO = """
import os, sys, time
time.sleep(float(sys.argv[2]))
try:  # a writer that goes at once: a reader blocked in open() gets EOF
    os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
except OSError:  # no reader, or no FIFO any more
    pass
"""


def test_fifo_in_place_of_a_file_is_a_miss(tier_dir):
    """Something that is not a regular file where an entry's file was. A
    FIFO blocks whoever opens it for reading, and mx.load holds the GIL
    meanwhile: the whole server would stop (event loop included). Another
    process lets a blocked open go after 3 s, so that a failure ends."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    (name,) = files(t, "*.safetensors")
    path = os.path.join(t.path, name)
    os.remove(path)
    os.mkfifo(path)
    handle = t.find([1, 2, 3, 4])[1]
    release = subprocess.Popen([sys.executable, "-c", RELEASE_FIFO, path, "3"])
    try:
        start = time.monotonic()
        assert t.load(handle) is None
        assert time.monotonic() - start < 2, "load blocked on a FIFO"
        assert t.snapshot()["corrupt"] == 1 and not os.path.exists(path)
    finally:
        release.kill()  # done already where load blocked
        release.wait()
    t.close()


def test_folder_is_private(tier_dir):
    """Entries hold prompts' token ids (and states they can be read back
    from): the identity's folder and its files are the owner's only."""
    old = os.umask(0o022)
    try:
        t = make_tier(tier_dir)
        stored(t, [1, 2, 3], [kv(3)])
    finally:
        os.umask(old)
    assert os.stat(t.path).st_mode & 0o077 == 0
    for name in files(t):
        assert os.stat(os.path.join(t.path, name)).st_mode & 0o077 == 0, name
    t.close()


def test_folder_that_is_a_link_or_another_users_is_refused(tier_dir, tmp_path, monkeypatch):
    """An identity's folder planted as a symbolic link (into someone's model
    folder, say) would have startup delete every *.safetensors there as a
    file without a row; one owned by another user could feed this server
    states. Both: no disk tier, nothing deleted."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "model.safetensors").write_bytes(b"weights")
    os.makedirs(tier_dir)
    os.symlink(models, os.path.join(tier_dir, "m1"))
    t = DiskTier(tier_dir, 1 << 30, "m1")
    assert not t.enabled
    t.close()
    assert (models / "model.safetensors").read_bytes() == b"weights"

    t = make_tier(tier_dir, identity="m2")
    t.close()
    owner = os.stat(t.path).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    t = DiskTier(tier_dir, 1 << 30, "m2")
    assert not t.enabled
    t.close()


# -- a full disk --


def test_full_disk_stops_writing_and_keeps_serving(tier_dir, monkeypatch, caplog):
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    real = disk_writer._write_safetensors
    calls = []

    def full(path, tensors, metadata):
        calls.append(path)
        with open(path, "xb") as f:  # a partial file, as a real ENOSPC leaves
            f.write(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_writer, "_write_safetensors", full)
    monkeypatch.setattr(t, "pause_s", 0.5)
    stored(t, [4, 5, 6], [kv(3)])
    snap = t.snapshot()
    assert snap["write_errors"] == 1 and snap["full"] and snap["entries"] == 1
    assert not files(t, "*.tmp") and len(files(t, "*.safetensors")) == 1
    assert sum("write failed" in r.message for r in caplog.records) == 1
    # Paused: the next writes are dropped without trying.
    stored(t, [7, 8], [kv(2)])
    stored(t, [7, 9], [kv(2)])
    assert len(calls) == 1 and t.snapshot()["dropped_writes"] == 2
    # Reads go on.
    assert t.load(t.find([1, 2, 3, 4])[1]) is not None
    assert t._writer.is_alive()
    # After the pause (space freed), writing resumes.
    monkeypatch.setattr(disk_writer, "_write_safetensors", real)
    time.sleep(0.6)
    assert not t.snapshot()["full"]
    stored(t, [4, 5, 6], [kv(3)])
    assert t.find([4, 5, 6, 7])[0] == 3 and t.snapshot()["writes"] == 2
    t.close()


def test_index_write_error_leaves_no_file(tier_dir, monkeypatch):
    t = make_tier(tier_dir)

    class Broken:
        def __init__(self, db):
            self.db = db

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def execute(self, *a):
            raise sqlite3.OperationalError("database or disk is full")

        executemany = execute

        def close(self):
            self.db.close()

    monkeypatch.setattr(t, "_db", Broken(t._db))
    stored(t, [1, 2], [kv(2)])
    snap = t.snapshot()
    assert snap["write_errors"] == 1 and snap["entries"] == 0
    assert not files(t, "*.safetensors") and not files(t, "*.tmp")
    t.close()


def test_writer_survives_unexpected_errors(tier_dir, monkeypatch, caplog):
    t = make_tier(tier_dir)
    real = t._sync_index

    def boom():
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(t, "_sync_index", boom)
    stored(t, [1, 2], [kv(2)])
    stored(t, [3, 4], [kv(2)])
    assert t._writer.is_alive() and t.snapshot()["writes"] == 2
    assert sum("writer error" in r.message for r in caplog.records) == 1
    monkeypatch.setattr(t, "_sync_index", real)
    stored(t, [5, 6], [kv(2)])
    assert t.find([5, 6, 7])[0] == 2
    t.close()


def test_queue_is_bounded(tier_dir, monkeypatch):
    release = threading.Event()
    real = disk_writer._write_safetensors

    def slow(*a):
        release.wait(10)
        real(*a)

    monkeypatch.setattr(disk_writer, "_write_safetensors", slow)
    t = make_tier(tier_dir, max_queue_bytes=1000)
    t.put([1], [kv(40)], "prompt")  # 2560 bytes: taken, the queue was empty
    t.put([2], [kv(2)], "prompt")  # 128 more: over 1000, dropped
    t.put([1], [kv(40)], "prompt")  # already queued: ignored
    assert t.snapshot()["dropped_writes"] == 1
    assert not t.flush(0.05)
    release.set()
    assert t.flush(10)
    snap = t.snapshot()
    assert snap["writes"] == 1 and snap["entries"] == 1 and snap["queued_bytes"] == 0
    t.close()


def test_clear_drops_writes_queued_before_it(tier_dir, monkeypatch):
    """DELETE /v1/cache forgets what was cached: an entry being written and
    one waiting in the queue when it comes never land (nor come back after a
    restart); what is put after it does."""
    started, release = threading.Event(), threading.Event()
    real = disk_writer._write_safetensors

    def slow(*a):
        started.set()
        release.wait(10)
        real(*a)

    monkeypatch.setattr(disk_writer, "_write_safetensors", slow)
    t = make_tier(tier_dir)
    t.put([1, 2, 3], [kv(3)], "prompt")  # being written...
    assert started.wait(10)
    t.put([4, 5, 6], [kv(3)], "prompt")  # ...and queued
    assert t.clear() == 0
    t.put([7, 8, 9], [kv(3)], "prompt")  # after the clear: kept
    release.set()
    assert t.flush(10)
    assert t.find([1, 2, 3, 4]) is None and t.find([4, 5, 6, 7]) is None
    assert t.find([7, 8, 9, 1])[0] == 3 and len(files(t, "*.safetensors")) == 1
    t.close()
    t = make_tier(tier_dir)
    assert t.snapshot()["entries"] == 1 and t.find([1, 2, 3, 4]) is None
    t.close()


def test_clear_while_a_put_copies_drops_that_write(tier_dir, monkeypatch):
    """A put copies its entry out of MLX (long for a large one) before it
    queues it: a DELETE /v1/cache meanwhile must drop that write too."""
    real = disk_cache._host_views
    t = make_tier(tier_dir)

    def cleared_meanwhile(arrays):
        t.clear()
        return real(arrays)

    monkeypatch.setattr(disk_cache, "_host_views", cleared_meanwhile)
    t.put([1, 2, 3], [kv(3)], "prompt")
    assert t.flush(10)
    assert t.snapshot()["entries"] == 0 and not files(t, "*.safetensors")
    monkeypatch.setattr(disk_cache, "_host_views", real)
    stored(t, [1, 2, 3], [kv(3)])  # a later put is written
    assert t.snapshot()["entries"] == 1
    t.close()


def _unlinks_watched(monkeypatch, *locks):
    """disk_cache._unlink, noting for each file removed whether `locks` were
    free meanwhile (a lock held would stall every lookup behind it)."""
    real, seen = disk_cache._unlink, []

    def watched(path):
        free = [lock.acquire(blocking=False) for lock in locks]
        for lock, took in zip(locks, free):
            if took:
                lock.release()
        seen.append(all(free))
        real(path)

    monkeypatch.setattr(disk_cache, "_unlink", watched)
    return seen


def test_clear_removes_files_with_the_locks_released(tier_dir, tmp_path, monkeypatch):
    """DELETE /v1/cache with thousands of files took seconds of deletions
    under the tier's lock (inside the store's): every fetch and insert of
    the generation thread waited, and running streams froze."""
    from mlx_lm_plus.cache.store import PromptStore

    store = PromptStore(max_bytes=1 << 30)
    t = make_tier(tier_dir)
    store.attach_disk("m", t)
    for i in range(3):
        stored(t, [i + 1, 7, 7], [kv(3)])
    seen = _unlinks_watched(monkeypatch, t._lock, store._lock)
    store.clear()
    assert seen == [True, True, True]
    assert t.snapshot()["entries"] == 0 and not files(t, "*.safetensors")
    assert store.stats["cleared_on_disk"] == 3
    t.close()


def test_eviction_removes_files_with_the_lock_released(tier_dir, monkeypatch):
    probe = make_tier(tier_dir, identity="probe")
    stored(probe, [0, 0], [kv(4)])
    size = probe.snapshot()["bytes"]
    probe.close()
    t = make_tier(tier_dir, max_bytes=2 * size + size // 2)
    stored(t, [1, 1], [kv(4)])
    stored(t, [2, 2], [kv(4)])
    seen = _unlinks_watched(monkeypatch, t._lock)
    stored(t, [3, 3], [kv(4)])  # evicts [1, 1] on the writer thread
    assert seen == [True] and t.snapshot()["evictions"] == 1
    assert t.find([1, 1, 0]) is None and len(files(t, "*.safetensors")) == 2
    t.close()


def test_a_key_written_again_while_its_file_is_removed_is_not_lost(tier_dir, monkeypatch):
    """Files go with the lock released: a put of the same key meanwhile must
    not be written (and indexed) before the old file's removal, which would
    then remove the new file under its index row."""
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    real = disk_cache._unlink

    def put_meanwhile(path):
        t.put([1, 2, 3], [kv(3)], "prompt")
        assert t.flush(10)
        real(path)

    monkeypatch.setattr(disk_cache, "_unlink", put_meanwhile)
    t.clear()
    monkeypatch.setattr(disk_cache, "_unlink", real)
    found = t.find([1, 2, 3, 4])
    assert found is None or t.load(found[1]) is not None
    assert t.snapshot()["corrupt"] == 0
    stored(t, [1, 2, 3], [kv(3)])  # once removed, the key is written again
    assert t.load(t.find([1, 2, 3, 4])[1]) is not None
    t.close()


def test_full_queue_drops_a_put_before_copying_it(tier_dir, monkeypatch):
    """The caller (the generation thread, spilling an eviction) does not pay
    for a copy the full queue then drops."""
    release = threading.Event()
    real_write, real_views = disk_writer._write_safetensors, disk_cache._host_views
    copies = []
    monkeypatch.setattr(disk_writer, "_write_safetensors",
                        lambda *a: (release.wait(10), real_write(*a)))
    monkeypatch.setattr(disk_cache, "_host_views",
                        lambda arrays: (copies.append(1), real_views(arrays))[1])
    t = make_tier(tier_dir, max_queue_bytes=1000)
    t.put([1], [kv(40)], "prompt")  # taken: the queue was empty
    t.put([2], [kv(40)], "prompt")  # over the queue's bytes: dropped
    assert len(copies) == 1 and t.snapshot()["dropped_writes"] == 1
    release.set()
    assert t.flush(10)
    t.close()


def test_put_keeps_the_last_use_it_is_given(tier_dir):
    t = make_tier(tier_dir)
    t.put([1, 1], [kv(4)], "prompt", last_used=1000.0)
    t.put([2, 2], [kv(4)], "prompt")
    assert t.flush(10)
    assert t.find([1, 1, 0])[1].last_used == 1000.0
    assert abs(t.find([2, 2, 0])[1].last_used - time.time()) < 60
    t.put([1, 1], [kv(4)], "prompt", last_used=500.0)  # an older use: not moved back
    assert t.find([1, 1, 0])[1].last_used == 1000.0
    t.close()
    t = make_tier(tier_dir)  # and after a restart
    assert t.find([1, 1, 0])[1].last_used == 1000.0
    t.close()


# -- eviction --


def test_eviction_keeps_the_budget_and_goes_by_last_use(tier_dir):
    probe = make_tier(tier_dir, identity="probe")
    stored(probe, [0, 0], [kv(4)])
    size = probe.snapshot()["bytes"]
    probe.close()

    t = make_tier(tier_dir, max_bytes=3 * size + size // 2)
    for k in ([1, 1], [2, 2], [3, 3]):
        stored(t, k, [kv(4)])
    t.load(t.find([1, 1, 0])[1])  # [1, 1] used again: [2, 2] is now the oldest
    t.put([3, 3], [kv(4)], "prompt")  # already stored: touched, not rewritten
    stored(t, [4, 4], [kv(4)])
    snap = t.snapshot()
    assert snap["bytes"] <= snap["max_bytes"] and snap["entries"] == 3
    assert snap["evictions"] == 1 and snap["writes"] == 4
    assert t.find([2, 2, 0]) is None
    assert all(t.find(k + [0]) for k in ([1, 1], [3, 3], [4, 4]))
    assert len(files(t, "*.safetensors")) == 3
    stored(t, [5, 5], [kv(4)])
    stored(t, [6, 6], [kv(4)])
    assert t.find([1, 1, 0]) is None and t.find([3, 3, 0]) is None
    assert t.snapshot()["bytes"] <= t.max_bytes
    t.close()


def test_entry_over_the_budget_is_not_written(tier_dir):
    t = make_tier(tier_dir, max_bytes=500)
    stored(t, [1, 2], [kv(40)])
    assert t.snapshot()["entries"] == 0 and t.snapshot()["dropped_writes"] == 1
    t.close()


# -- lookup --


def test_find_prefix_entries(tier_dir):
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3], [kv(3)])
    stored(t, [1, 2, 3, 4, 5], [kv(5)])
    # The longest stored prefix, shorter than the key.
    assert t.find([1, 2, 3, 4, 5, 6], trimmable_ok=False)[0] == 5
    assert t.find([1, 2, 3, 4, 9], trimmable_ok=False)[0] == 3
    # The whole key is not offered as it is (a token must be left).
    covered, h = t.find([1, 2, 3, 4, 5], trimmable_ok=False)
    assert covered == 3 and h.ntokens == 3
    assert t.find([1, 2], trimmable_ok=False) is None
    assert t.find([7, 1, 2, 3, 4]) is None and t.find([]) is None
    assert t.snapshot()["misses"] == 2
    t.close()


def test_find_trimmable_common_prefix(tier_dir):
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3, 4, 5, 6], [kv(6)])
    stored(t, [1, 2], [kv(2)])
    # The exact key: the entry, usable up to one token short of it.
    covered, h = t.find([1, 2, 3, 4, 5, 6])
    assert (covered, h.ntokens) == (5, 6)
    # A sibling sharing 4 tokens beats the 2-token prefix.
    covered, h = t.find([1, 2, 3, 4, 9, 9])
    assert (covered, h.ntokens) == (4, 6)
    # A longer entry for a shorter key.
    covered, h = t.find([1, 2, 3])
    assert (covered, h.ntokens) == (2, 2)  # a prefix covering as much wins
    covered, h = t.find([1, 2, 3, 4])
    assert (covered, h.ntokens) == (3, 6)
    # The trimmed entry really trims to what it covers.
    cache = t.load(h)
    cache[0].trim(h.ntokens - covered)
    assert cache[0].offset == 3
    assert t.find([1, 2, 3, 4], trimmable_ok=False)[0] == 2
    t.close()


def test_find_never_offers_a_non_trimmable_entry_trimmed(tier_dir):
    t = make_tier(tier_dir)
    stored(t, [1, 2, 3, 4, 5, 6], [kv(6), arrays_cache()])  # hybrid: can't be cut
    assert t.find([1, 2, 3, 4, 9]) is None
    assert t.find([1, 2, 3, 4, 5, 6]) is None
    stored(t, [1, 2], [kv(2), arrays_cache()])
    assert t.find([1, 2, 3, 4, 9])[0] == 2
    # A deeper trimmable entry below a non-trimmable one is found.
    stored(t, [1, 2, 3, 4, 5, 6, 7, 8], [kv(8)])
    covered, h = t.find([1, 2, 3, 4, 5, 6, 7, 9])
    assert (covered, h.ntokens) == (7, 8) and h.trimmable
    # Below the point where the key leaves the tree, the shallowest
    # trimmable entry is offered, never the non-trimmable one above it.
    covered, h = t.find([1, 2, 3, 4, 9])
    assert (covered, h.ntokens) == (4, 8)
    t.close()


def test_find_after_removals_keeps_the_tree_right(tier_dir):
    """Eviction and corrupt entries prune and fold the radix tree."""
    t = make_tier(tier_dir)
    keys = [[1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 6, 7], [1, 9]]
    for k in keys:
        stored(t, k, [kv(len(k))])
    os.remove(os.path.join(t.path, t.find([1, 2, 4, 5, 0])[1].name + ".safetensors"))
    assert t.load(t.find([1, 2, 4, 5, 0])[1]) is None
    assert t.find([1, 2, 4, 5, 0], trimmable_ok=False) is None
    assert t.find([1, 2, 4, 6, 7, 0])[0] == 5
    covered, h = t.find([1, 2, 4, 5, 0])  # now only trimmed from [1, 2, 4, 6, 7]
    assert (covered, h.ntokens) == (3, 5)
    assert t.find([1, 9, 9])[0] == 2 and t.find([1, 2, 3, 3])[0] == 3
    t.close()


def test_find_is_fast_with_long_keys(tier_dir):
    """1000 entries of 100k-token keys (sharing 10 prefixes): lookups in
    milliseconds. Built in memory (the index only), without files."""
    t = make_tier(tier_dir)
    from array import array

    bases = [array("q", range(b * 10**6, b * 10**6 + 90_000)) for b in range(10)]
    with t._lock:
        for i in range(1000):
            tokens = bases[i % 10] + array("q", range(-i * 100 - 1, -i * 100 - 10_001, -1))
            t._add(disk_index.DiskEntry(f"{i:040d}", len(tokens), 1, True, "prompt", 0.0),
                   tokens)
    key = list(bases[3]) + list(range(-301, -10_301, -1)) + [5]
    start = time.perf_counter()
    for _ in range(10):
        covered, h = t.find(key)
    per_find = (time.perf_counter() - start) / 10
    assert covered == 100_000 and h.name == f"{3:040d}"
    assert per_find < 0.05, per_find
    t.close()


# -- threads --


def test_writer_alongside_mlx_compute(tier_dir):
    """The server's threads: this one generates (matmuls, put, find, load),
    the tier's writer writes meanwhile. 50 entries, every one back exactly."""
    t = make_tier(tier_dir)
    x = mx.random.normal((256, 256))
    want = {}
    for i in range(50):
        # Lazy slices of a fresh array: put must make them ready itself.
        full = mx.random.normal((1, 4, 130, 64)).astype(mx.bfloat16 if i % 2 else mx.float16)
        c = KVCache()
        c.keys, c.values, c.offset = full[..., :128, :] * 2, full[..., 1:129, :], 128
        t.put([i, i + 1, i + 2], [c], "prompt")  # the writer starts on it...
        for _ in range(3):  # ...while this thread computes
            x = mx.tanh(x @ x * 0.01) + 0.001
            mx.eval(x)
        want[i] = flat([c])
        if i % 10 == 9:
            assert t.flush(10)
            for j in range(i - 9, i + 1):
                assert flat(t.load(t.find([j, j + 1, j + 2, 0])[1])) == want[j]
    snap = t.snapshot()
    assert snap["writes"] == 50 and snap["hits"] == 50 and snap["write_errors"] == 0
    assert t._writer.is_alive()
    t.close()


# -- model identity --


def test_model_identity(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"\0" * 100)
    (model / "README.md").write_text("not part of it")
    base = model_identity(str(model))
    assert base == model_identity(str(model)) and len(base) == 32

    (model / "README.md").write_text("still not")
    assert model_identity(str(model)) == base

    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = model_identity(str(model))
    assert touched != base
    weights.write_bytes(b"\0" * 101)  # re-quantized: another size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    resized = model_identity(str(model))
    assert resized not in (base, touched)

    (model / "config.json").write_text('{"model_type": "llama", "x": 1}')
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns))
    current = model_identity(str(model))
    assert current != resized  # the config by content

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapters.safetensors").write_bytes(b"\0" * 10)
    other = tmp_path / "other"
    shutil.copytree(adapter, other)
    (other / "adapters.safetensors").write_bytes(b"\0" * 11)
    with_adapter = model_identity(str(model), str(adapter))
    assert with_adapter != current
    assert model_identity(str(model), str(other)) not in (current, with_adapter)
    assert model_identity(str(model), extra="kv_bits=4") != current

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 10)
    first = model_identity(str(gguf))
    gguf.write_bytes(b"GGUF" + b"\0" * 11)
    assert model_identity(str(gguf)) != first


def test_model_identity_follows_the_libraries(tmp_path, monkeypatch):
    """States computed by another mlx / mlx-lm / this package (their model
    code and kernels) are another identity's."""
    from importlib import metadata

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    base = model_identity(str(model))
    real = metadata.version
    for dist in ("mlx", "mlx-lm", "mlx-lm-plus"):
        monkeypatch.setattr(metadata, "version",
                            lambda d, dist=dist: "0.0.1" if d == dist else real(d))
        assert model_identity(str(model)) != base, dist
    monkeypatch.setattr(metadata, "version", real)
    assert model_identity(str(model)) == base
