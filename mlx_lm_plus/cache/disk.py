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

The tier's rooms: disk_format.py (the file, the identity), disk_index.py
(the index in memory, DiskTier's base) and disk_writer.py (what the writer
thread runs, a mixin of DiskTier).
"""

import errno
import fcntl
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
import xxhash

from mlx_lm_plus.cache.disk_format import (
    FORMAT,
    _NAME,
    _SUFFIX,
    _SUM_AT,
    _SUM_ZERO,
    _compact,
    _describe,
    _host_views,
    _key_name,
    _read_header,
    _rebuild_layer,
    _signed,
)
from mlx_lm_plus.cache.disk_index import DiskEntry, DiskIndex
from mlx_lm_plus.cache.disk_writer import _STOP, DiskWriter, _Write, _unlink
from mlx_lm_plus.cache.layers import cache_nbytes, trims_to_any_prefix
from mlx_lm_plus.cache.radix import TOKENS
from mlx_lm_plus.logs import warn_once

_INDEX = "index.sqlite"


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


class DiskTier(DiskIndex, DiskWriter):
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
        super().__init__()  # the index: its tree and totals
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

    # -- an entry's file --

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name + _SUFFIX)

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


def _damaged(error: Exception) -> bool:
    """Whether a read failed because of the file (torn, corrupt, replaced by
    a link, gone: _read's ValueErrors, a header that doesn't parse) rather
    than the moment (memory, file descriptors, an I/O error)."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOENT, errno.ELOOP, errno.EISDIR)
    return isinstance(error, (ValueError, KeyError, IndexError, TypeError, struct.error))
