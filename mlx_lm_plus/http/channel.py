"""The hand-off from the generation thread to one request's handler.

The engine puts a request's events (`Channel`: a GenerationContext, (done,
total) progress, Responses, None at the end, or an exception) from its
thread; the handler awaits them on the event loop.
"""

import asyncio
import collections
from typing import Optional

from mlx_lm_plus.engine.channel import Channel

# What AsyncChannel.get returns when nothing came in time.
IDLE = object()


class AsyncChannel(Channel):
    """Thread-safe hand-off from the generation thread to one handler.

    Events wait in a deque; the handler awaits one future at a time. The
    engine hands over a whole step's events for all channels with one
    `call_soon_threadsafe` (`put_all`), so a step of a batch of 8 wakes the
    event loop once, not 8 times.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        self._ticked = False  # the heartbeat ticked (beat_every)

    def put(self, item):
        try:
            self._loop.call_soon_threadsafe(self._append, item)
        except RuntimeError:
            # The loop is closed: the server is shutting down.
            self.cancel()

    @staticmethod
    def put_all(events):
        by_loop = {}
        for channel, event in events:
            by_loop.setdefault(channel._loop, []).append((channel, event))
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_append_all, group)
            except RuntimeError:
                for channel, _ in group:
                    channel.cancel()

    def _append(self, item):
        self._items.append(item)
        self._append_nothing()

    async def get(self):
        """The next event; IDLE when the heartbeat (`beat_every`) ticked
        since the last IDLE and nothing came."""
        while not self._items:
            if self._ticked:
                self._ticked = False
                return IDLE
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def beat_every(self, seconds: float) -> None:
        """Tick every `seconds` until cancelled, so that a handler waiting
        for events gets IDLE now and then (keepalives). One timer a stream,
        not one a token: a timer armed and cancelled for every event cost
        the loop 1.7 us a token. (Not asyncio.wait_for either: on Python
        3.11 it returns a result that arrived in the same loop iteration as
        the task's cancellation, dropping the cancellation.)"""
        if not self.cancelled:
            self._loop.call_later(seconds, self._tick, seconds)

    def _tick(self, seconds: float) -> None:
        if self.cancelled:
            return
        self._ticked = True
        self._append_nothing()
        self.beat_every(seconds)

    def _append_nothing(self):
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def ready(self) -> bool:
        """Whether `get` would return at once."""
        return bool(self._items)


def _append_all(events):
    for channel, event in events:
        channel._append(event)
