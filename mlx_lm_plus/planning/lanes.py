"""Lanes: a thread each for one kind of per-request work done before a
request is queued (planning its prompt, compiling its constraint), so that
the cheap requests of a kind never wait behind the expensive ones.

A lane runs one job at a time, in arrival order. It may bound the jobs it
holds (running, and waiting for its thread): past that bound a request is
turned away at once (LaneBusy, a 503) rather than queued for minutes. A
request waits at most its deadline: then it gets a LaneBusy, and its job is
dropped if it has not started. A started job can't be stopped (neither
tokenizers nor llguidance can be interrupted): it runs to its end, and the
count of held jobs falls only then, so the bound is on the work really
queued. A job that runs past a quarter of the deadline while others wait
no longer holds the lane up: a spare thread takes the jobs behind it (at
most MAX_SPARE at once; the thread of the slow job ends with it). No job,
however slow, ends the process: only its own request fails.
"""

import asyncio
import collections
import concurrent.futures
import threading
import time
from typing import Callable, Optional

# Threads a lane may add while jobs run past their deadline.
MAX_SPARE = 2


class LaneBusy(RuntimeError):
    """The lane is full, or the request's job did not end by its deadline:
    the server is busy (503 with Retry-After), the request was not wrong."""


class Lane:
    def __init__(self, name: str, max_held: Optional[int] = None):
        self.name = name
        self.max_held = max_held
        self.held = 0  # jobs submitted and not ended (running or waiting)
        self._jobs = collections.deque()  # (Future, fn, args) not started
        self._cond = threading.Condition()
        self._idle = 0  # threads waiting for a job
        self._started = {}  # thread -> when its running job started (None: none)

    async def run(self, fn: Callable, *args, deadline: float,
                  still_wanted: Callable[[], Optional[Exception]] = lambda: None):
        """fn(*args) on the lane's thread, within `deadline` seconds.
        `still_wanted`, asked every second while waiting: an exception to
        give up with (the engine went down, say), or None."""
        job = self._submit(fn, args, deadline / 4)
        waiting = asyncio.wrap_future(job)
        # (Its outcome is read even when nobody waits for it any more.)
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        try:
            while True:
                left = end - loop.time()
                if left <= 0:
                    raise LaneBusy(f"Server busy: {self.name} for this request took longer "
                                   f"than {deadline:g} s (--planning-timeout)")
                done, _ = await asyncio.wait({waiting}, timeout=min(1.0, deadline / 4, left))
                if done:
                    return waiting.result()
                self._spare_for_slow_jobs(deadline / 4)
                error = still_wanted()
                if error is not None:
                    raise error
        except BaseException:
            # (A job not started yet is dropped now, and holds no place; a
            # running one ends on its own.)
            self._drop(job)
            waiting.cancel()
            raise

    def _submit(self, fn, args, slow: float) -> concurrent.futures.Future:
        job = concurrent.futures.Future()
        with self._cond:
            if self.max_held is not None and self.held >= self.max_held:
                raise LaneBusy(f"Server busy: {self.held} requests already wait for "
                               f"{self.name} (at most {self.max_held})")
            self.held += 1
            self._jobs.append((job, fn, args))
            try:
                if self._idle == 0 and not self._started:
                    self._add_thread()
                else:
                    self._spare_for_slow_jobs(slow)
            except RuntimeError as e:  # (no thread could be started)
                self._jobs.pop()
                self.held -= 1
                raise LaneBusy(f"Server busy: no thread for {self.name}: {e}") from e
            self._cond.notify()
        return job

    def _drop(self, job: concurrent.futures.Future) -> None:
        """Cancel `job`; one not started leaves the queue and its place."""
        with self._cond:
            if job.cancel():
                for i, queued in enumerate(self._jobs):
                    if queued[0] is job:
                        del self._jobs[i]
                        self.held -= 1
                        break

    def _spare_for_slow_jobs(self, slow: float) -> None:
        """Jobs wait while every thread runs one that has run over `slow`
        seconds: add a thread (MAX_SPARE beyond the lane's one, at most)."""
        with self._cond:
            now = time.monotonic()
            if (self._jobs and not self._idle and len(self._started) <= MAX_SPARE
                    and all(t is not None and now - t > slow
                            for t in self._started.values())):
                try:
                    self._add_thread()
                except RuntimeError:  # (the running threads go on)
                    pass

    def _add_thread(self) -> None:
        """(Holding the lock.) RuntimeError: no thread could be started."""
        thread = threading.Thread(target=self._work, name=f"mlx_lm_plus-{self.name}",
                                  daemon=True)
        self._started[thread] = None
        try:
            thread.start()
        except BaseException:
            del self._started[thread]
            raise

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._jobs:
                    # One thread waits for work; spares end once idle.
                    if len(self._started) > 1:
                        del self._started[me]
                        return
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                job, fn, args = self._jobs.popleft()
                self._started[me] = time.monotonic()
            result = error = None
            running = job.set_running_or_notify_cancel()  # (False: given up before)
            if running:
                try:
                    result = fn(*args)
                except BaseException as e:
                    error = e
            with self._cond:  # (counted out before its request hears of it)
                self._started[me] = None
                self.held -= 1
            if error is not None:
                job.set_exception(error)
            elif running:
                job.set_result(result)
            # (Not held while this thread waits for the next job: a plan
            # holds an image request's pixels.)
            job = fn = args = result = error = None
