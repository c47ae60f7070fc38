"""The generation loop's housekeeping, a part of `Engine` (engine.py): at
each turn (and between the tokens and prefill chunks of a request served
alone, `tick`), a finished model load is taken, the requests set aside get
their keepalives, idle models past their TTL or keep_alive are unloaded,
and MLX's buffer cache goes back to the system once nothing runs.
"""

import gc
import time

import mlx.core as mx

from mlx_lm_plus.errors import EngineUnavailable

# Seconds between two looks at idle models (TTL, keep_alive).
HOUSEKEEPING_EVERY = 0.25
# Seconds between two keepalives to the requests set aside (waiting for a
# model to load or for room): a stream's client and proxies see it is alive.
KEEPALIVE_EVERY = 5.0


class Housekeeping:
    """(A part of `Engine`: it uses its residency, scheduler, batches,
    embedding runner, planner and store.)"""

    def tick(self):
        """What can't wait for the loop while a request is served
        sequentially (called between its tokens and prefill chunks too): a
        finished or overdue load, keepalives to the requests set aside."""
        self.residency.poll_load()
        now = time.monotonic()
        # A keepalive once a request has waited KEEPALIVE_EVERY (a stream's
        # headers go then: a short wait keeps its real status code); parked
        # ones too, which may wait for another request's whole prefill.
        held = [r for b in self._batches.values() for r in b.held_back()]
        for request in self.scheduler.pending + held:
            channel = request[0]
            since = getattr(channel, "set_aside_at", None)
            if since is not None and now - since >= KEEPALIVE_EVERY:
                channel.set_aside_at = now
                channel.put((0, 0))

    def _housekeeping(self):
        """`_tick`; idle models past their TTL or keep_alive are unloaded;
        MLX's buffer cache is cleared after DELETE /v1/cache once nothing
        runs."""
        loading = self.residency.loading
        now = time.monotonic()
        if now - self._housekept < HOUSEKEEPING_EVERY and (
                loading is None or not loading[1].done()):
            return  # (a finished load is taken at once: its requests wait)
        self._housekept = now
        self.tick()
        self.store.drop_stale_read_ahead()  # (a quiet server lets them go too)
        if self._clear_buffers and not self._any_active():
            self._clear_buffers = False
            gc.collect()
            mx.clear_cache()
        if self.residency.unloaded and not self._any_active() and not self.scheduler.pending:
            # An unloaded model's buffers back to the system (its weights went
            # with their last reference: no cycles, so no gc.collect, which
            # holds the GIL ~50 ms).
            self.residency.unloaded = False
            mx.clear_cache()
        busy = {key for key in self.model_provider.loaded if self._in_use(key)}
        busy |= self.scheduler.waiting_for() | {self._current_key}
        self.residency.unload_idle(busy)

    def _any_active(self) -> bool:
        return any(b.active for b in self._batches.values()) or self.embeddings.active

    def _in_use(self, key) -> bool:
        batch = self._batches.get(key)
        return self.embeddings.uses(key) or (
            batch is not None and (batch.active or bool(batch.held_back())))

    def _unloading(self, key):
        """Model `key` is being unloaded (residency.py): its batch and plans
        go."""
        batch = self._batches.pop(key, None)
        if batch is not None:
            # (Never with requests in it: _in_use. Were it so, they are
            # answered rather than left waiting.)
            for r in batch.results.values():
                r["channel"].put(EngineUnavailable(f"Model {key[0]} was unloaded"))
            batch.close()
        self.embeddings.fail(EngineUnavailable(f"Model {key[0]} was unloaded"), key)
        self.planner.forget(key)
