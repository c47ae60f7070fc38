"""The disk tier's writer thread: what DiskTier (disk.py) runs on a thread
of its own. `put` queues a _Write (the entry as numpy views of evaluated
arrays, and its metadata); the thread writes the file (disk_format.py),
then its row, evicts least recently used entries until the files fit the
budget, and writes the batched last uses and row deletions to SQLite
(`_evict` also runs at startup, `_sync_index` at `close`). It never
touches MLX (disk.py: Threads).

DiskWriter is a mixin of DiskTier rather than an object of its own: the
writer works on the tier's index, counters and SQLite connection under
the tier's one lock, as the tier's callers do. Its own room so that
disk.py holds what the callers' threads run, and this what the writer
runs.
"""

import errno
import logging
import os
import queue
import time
from array import array
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from mlx_lm_plus.cache.disk_format import _write_safetensors
from mlx_lm_plus.cache.disk_index import DiskEntry
from mlx_lm_plus.logs import warn_once


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


class DiskWriter:
    """What a DiskTier's writer thread runs (see the module doc)."""

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


def _unlink(path: str):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logging.warning(f"Prompt cache on disk: can't remove {path}: {e}")
