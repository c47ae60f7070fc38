"""How the generation thread answers a request: a channel per request, and
one hand-off per step for all of them (`deliver`)."""

import time
from typing import Optional


class Channel:
    """Where the generation thread sends a request's events.

    This base class drops them (the sink of ranks other than 0 under
    mx.distributed); the HTTP side subclasses it with an asyncio hand-off.
    `cancelled` is set by the consumer when its client went away.
    """

    cancelled = False
    cancelled_at: Optional[float] = None  # time.monotonic() of the cancel
    removed_at: Optional[float] = None  # when the engine let the request go
    set_aside_at: Optional[float] = None  # waiting for a model: its last keepalive

    def put(self, item):
        pass

    @staticmethod
    def put_all(events):
        """Put each (channel, event) pair (of this class), in order."""
        for channel, event in events:
            channel.put(event)

    def cancel(self):
        if not self.cancelled:
            self.cancelled_at = time.monotonic()
        self.cancelled = True

    def removed(self):
        """The engine dropped this cancelled request (disconnect latency)."""
        if self.removed_at is None:
            self.removed_at = time.monotonic()


def deliver(events):
    """Put (channel, event) pairs, in order, with one `put_all` per channel
    class (the HTTP side's makes it one hand-off to the event loop)."""
    groups = {}
    for channel, event in events:
        groups.setdefault(type(channel).put_all, []).append((channel, event))
    for put_all, group in groups.items():
        put_all(group)
