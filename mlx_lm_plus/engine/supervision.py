"""The generation thread's supervision, a part of `Engine` (engine.py): the
loop restarted when it dies, every request it held answered, and the
watchdog's shutdown when a step never returns.

A failure inside one request or one batch step is handled below this level
(the admission guard, a batch's step guard). What still escapes the loop (a
bug, a fault in MLX) lands in `_run`: every request the thread held gets an
EngineUnavailable, /health says 503 and new completions fail fast while the
loop restarts with the models it had loaded; past `max_restarts` crashes in
`restart_window` seconds it stays down and says so, rather than crash-loop.
A hang can't be interrupted: `_shut_down` answers everyone and ends the
process (`exit_process`) for a supervisor to restart.
"""

import gc
import logging
import time
from typing import List

from mlx_lm_plus.engine.channel import Channel
from mlx_lm_plus.engine.distributed import group_end_reason, group_lost_error, is_group_lost
from mlx_lm_plus.engine.watchdog import HANG_EXIT_STATUS
from mlx_lm_plus.errors import EngineUnavailable


class Supervision:
    """(A part of `Engine`: it uses its loop, batches, scheduler, embedding
    runner, group and watchdog, and the restart policy Engine.__init__
    sets.)"""

    def _run(self):
        """The generation thread: run the loop, and restart it if it dies.

        Failures inside one request or one batch step are handled below this
        level. Anything that still escapes (a bug, a fault in MLX) lands here:
        every request the thread held gets an EngineUnavailable, /health says
        503 and new completions fail fast while the loop restarts with the
        model it had loaded. Past max_restarts crashes in restart_window
        seconds it stays down and says so, rather than crash-loop.
        """
        while not self._stop:
            try:
                self._generate()
                return
            except BaseException as e:
                self._idle()  # nothing runs now: not a stuck step
                if self.hung:
                    return  # the watchdog answers everyone and ends the process
                if self._is_distributed and self._stop and is_group_lost(e):
                    # Stopping anyway (the others were stopped with this one).
                    logging.warning(f"The distributed group ended while stopping: {e}")
                    self._fail_held(EngineUnavailable("server shutting down"))
                    self.scheduler.fail_queue(EngineUnavailable("server shutting down"))
                    return
                if self._is_distributed:
                    # Every rank must take the same steps: a loop restarted
                    # on this rank alone would wait on the others forever.
                    what = group_end_reason(e)
                    logging.exception(f"mlx_lm_plus: {what}: {e!r}")
                    self._shut_down(f"{what}: {e}")
                    return
                logging.exception(f"mlx_lm_plus generation thread died: {e!r}")
                self.unhealthy_reason = f"generation thread died: {e!r}"
                self._fail_held(EngineUnavailable(f"generation engine failed: {e!r}"))
                now = time.monotonic()
                self._crash_times = [
                    t for t in self._crash_times if now - t < self.restart_window
                ] + [now]
                if len(self._crash_times) > self.max_restarts or not isinstance(e, Exception):
                    self.unhealthy_reason += " (not restarted: too many failures)"
                    self.scheduler.fail_queue(EngineUnavailable(self.unhealthy_reason))
                    return
                time.sleep(self.restart_delay)
                if self.hung:
                    return
                self.restarts += 1
                logging.warning(f"Restarting the generation loop (restart {self.restarts})")
                self.unhealthy_reason = None

    def _held_channels(self) -> List[Channel]:
        """The channel of every request the generation thread has taken."""
        held = []
        for batch in list(self._batches.values()):
            held += [r["channel"] for r in list(batch.results.values())]
            held += [r[0] for r in batch.held_back()]
        held += [r[0] for r in list(self.scheduler.pending)]
        held += self.embeddings.channels()
        held += [c for c in (self._current, self._admitting, self.scheduler.admitting,
                             self.scheduler.handing_off) if c is not None]
        return held

    def _fail_held(self, error: Exception):
        """Answer every request the generation thread had taken with `error`."""
        held = self._held_channels()
        for batch in self._batches.values():
            try:
                batch.close()
            except Exception:
                pass
        self._batches, self._current, self._admitting = {}, None, None
        self.embeddings.forget()
        self.scheduler.pending = []
        for channel in held:
            channel.put(error)
        gc.collect()

    def _group_lost(self, e: BaseException) -> EngineUnavailable:
        """The 503 of a request held when the distributed group ended. /health
        says it from now on, before that request's client can ask (the
        thread's _shut_down then adds when the process exits)."""
        self.unhealthy_reason = f"{group_end_reason(e)}: {e}"
        return group_lost_error(e)

    def _unavailable(self) -> EngineUnavailable:
        return EngineUnavailable(
            f"Generation engine unavailable: {self.unhealthy_reason or 'not running'}"
        )

    def _shut_down(self, reason: str):
        """The engine can't go on: /health says why, every request held or
        queued gets a 503 with the reason, and after --watchdog-grace seconds
        the process exits (status 70) for a supervisor to restart it (under
        mx.distributed: the whole group, every rank exits so)."""
        grace = self.cli_args.watchdog_grace
        with self._shutting_down:  # (the watchdog and the generation thread)
            if self.hung:
                return
            self.hung = True
        self.unhealthy_reason = f"{reason}; the process exits in {grace:g} s"
        logging.critical(f"Watchdog: {self.unhealthy_reason}")
        error = self._unavailable()
        held = []
        try:
            held = self._held_channels()
        except Exception:  # the stuck thread changed them under us: best effort
            logging.exception("Watchdog: could not list every held request")
        for channel in held:
            channel.put(error)
            channel.cancel()
        self.scheduler.fail_queue(error)
        self.group.fail_clear(error)
        time.sleep(grace)
        logging.critical(f"Watchdog: exiting with status {HANG_EXIT_STATUS}")
        logging.shutdown()
        self.exit_process(HANG_EXIT_STATUS)
