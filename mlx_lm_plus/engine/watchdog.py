"""The watchdog (--step-timeout, and --distributed-timeout under
mx.distributed): the generation thread says what it starts (`beat`) and when
it waits for work (`idle`); a unit of work past its limit is a hang. A stuck
MLX call can't be interrupted, so a hang ends the process, after every
request is answered, for a supervisor to restart it."""

import math
import time
from threading import Thread
from typing import Callable, Optional

# Exit status of a process whose generation thread hung (EX_SOFTWARE): a
# supervisor restarts it (docs/flags.md: systemd and launchd examples).
HANG_EXIT_STATUS = 70


class Watchdog:
    """`on_hang(reason)` runs on the watchdog's thread when a unit of work
    outlasts its limit (the engine answers everyone and exits); the thread
    ends when `stopped()`. The limits are set before `start`:
    `step_timeout` (0: none), and under mx.distributed
    `distributed_timeout` (None elsewhere)."""

    def __init__(self, on_hang: Callable[[str], None], stopped: Callable[[], bool]):
        self.step_timeout: float = 0
        self.distributed_timeout: Optional[float] = None
        self.on_hang = on_hang
        self.stopped = stopped
        # What the generation thread is busy with and since when, or None
        # while it waits for work or loads a model.
        self.busy: Optional[tuple] = None

    def beat(self, what: str, limit: Optional[tuple] = None):
        """The generation thread starts a unit of work (a step, a chunk);
        `limit`: its own (seconds, the flag that sets them), else limit()."""
        self.busy = (what, time.monotonic(), limit)

    def idle(self):
        self.busy = None

    def limit(self) -> float:
        """Seconds a unit of work may take: --step-timeout, and under
        mx.distributed at most --distributed-timeout, since a rank that is
        gone (its host down, its link cut) shows as a collective that never
        returns, between requests too (the hand-off every loop turn)."""
        limits = [self.step_timeout or math.inf]
        if self.distributed_timeout is not None:
            limits.append(self.distributed_timeout or math.inf)
        return min(limits)

    def start(self):
        if self.limit() < math.inf:
            Thread(target=self._watch, name="mlx_lm_plus-watchdog", daemon=True).start()

    def _watch(self):
        limit = self.limit()
        while not self.stopped():
            time.sleep(min(1.0, limit / 4))
            busy = self.busy
            if busy is not None:
                what, since, own = busy
                seconds, flag = own or (limit, None)
                if time.monotonic() - since > seconds:
                    self._hang(what, time.monotonic() - since, seconds, flag)
                    return
            # (Plans made ahead are not watched: a slow one fails its own
            # request, past --planning-timeout; see planning/lanes.py.)

    def _hang(self, what: str, seconds: float, limit: float, flag: Optional[str]):
        """`flag`: what set `limit` (None: the watchdog's own)."""
        if flag is None:
            flag = "--distributed-timeout" if limit != self.step_timeout else "--step-timeout"
        self.on_hang(f"generation stuck: {what} has run for {seconds:.0f} s ({flag} {limit:g})")
