"""Connections that are not in a request: a deadline for a request's head,
and room kept for real requests when too many connections are open.

A connection costs a file descriptor, and mlx-lm sets the process's soft
limit to 2,048 when it is imported. Clients that open connections and send
half a request line (a slowloris), or keep-alive pools that are never used
again, took every descriptor: 2,100 such connections left /health without an
answer, on upstream's server (which held them for good) and on ours (aiohttp
held them for its keepalive_timeout, 3,630 s by default in an AppRunner).
Once the descriptors are gone, accept fails and so does every file the
server opens (the disk tier, a model being loaded).

So a connection gets HEAD_SECONDS to send a request's head, from its opening
or from its previous response, as with aiohttp's own `run_app` (its
keepalive_timeout); and when the open connections reach `max_open`, a new
one closes the connection that has waited longest without a request in
progress (an idle keep-alive connection, or one still sending its head). A
connection in a request (its body being read, its answer being written) is
never closed for another: those are bounded by the body and write timeouts
(api.py), and by --max-queued-requests.
"""

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from typing import Dict

from aiohttp import web

# Seconds a connection gets to send a whole request head, counted from its
# opening or from the end of its previous response (aiohttp's
# keepalive_timeout: the same timer closes an idle keep-alive connection).
HEAD_SECONDS = 75.0
# Descriptors kept for everything but counted connections: files the disk
# tier writes and reads, its SQLite index, model files, pipes, logs; and
# connections accepted and not yet counted, or closed and not yet let go (a
# burst of new connections is accepted up to the listen backlog, 128, at
# a time, and those closed to make room free their descriptors a loop
# iteration later).
FD_RESERVE = 512
# Seconds between two warnings that every connection is in a request.
WARN_EVERY = 60.0


def default_max_open() -> int:
    """The file limit, less what files need (a quarter of a small limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(1, soft - min(FD_RESERVE, soft // 4))


class ConnectionLimit:
    """The open connections in the order they last had nothing to do; those
    in a request apart (not to be closed)."""

    def __init__(self, max_open: int):
        self.max_open = max_open
        # RequestHandler -> None, least recently busy first
        self.waiting: "OrderedDict[object, None]" = OrderedDict()
        self.busy: Dict[object, int] = {}  # RequestHandler -> requests in progress
        self.closed = 0  # connections closed to make room
        self._warned_at = float("-inf")

    def open_connections(self) -> int:
        return len(self.waiting) + len(self.busy)

    def accept(self, make_handler):
        """aiohttp's protocol factory (`runner.server`), each connection
        counted from its opening to its loss."""
        return lambda: _Counted(make_handler(), self)

    def opened(self, handler) -> None:
        if self.open_connections() >= self.max_open:
            self._make_room()
        self.waiting[handler] = None

    def lost(self, handler) -> None:
        self.waiting.pop(handler, None)
        self.busy.pop(handler, None)

    def _make_room(self) -> None:
        if not self.waiting:
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY:
                self._warned_at = now
                logging.warning(f"{self.open_connections()} connections open, each in a "
                                f"request: a new one is accepted beyond the limit "
                                f"({self.max_open})")
            return
        handler, _ = self.waiting.popitem(last=False)
        self.closed += 1
        handler.force_close()  # (its loss comes later: it is no longer counted)

    @web.middleware
    async def middleware(self, request, handler):
        connection = request.protocol
        counted = connection in self.waiting or connection in self.busy
        if counted:
            self.waiting.pop(connection, None)
            self.busy[connection] = self.busy.get(connection, 0) + 1
        try:
            return await handler(request)
        finally:
            left = self.busy.get(connection, 0) - 1
            if left > 0:
                self.busy[connection] = left
            elif counted and self.busy.pop(connection, None) is not None:
                self.waiting[connection] = None  # (now the most recent)


class _Counted(asyncio.Protocol):
    """aiohttp's RequestHandler, with its opening and its loss told to the
    limit. (Only a protocol's own calls pass here; aiohttp's code holds
    the handler itself.)"""

    def __init__(self, handler, limit: ConnectionLimit):
        self.handler, self.limit = handler, limit

    def connection_made(self, transport):
        self.limit.opened(self.handler)
        self.handler.connection_made(transport)

    def connection_lost(self, exc):
        self.limit.lost(self.handler)
        self.handler.connection_lost(exc)

    def data_received(self, data):
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received()

    def pause_writing(self):
        self.handler.pause_writing()

    def resume_writing(self):
        self.handler.resume_writing()


class LimitedRunner(web.AppRunner):
    """An AppRunner whose sites accept connections through `limit`."""

    def __init__(self, app: web.Application, limit: ConnectionLimit, **kwargs):
        super().__init__(app, **kwargs)
        self.limit = limit
        self._factory = None

    @property
    def server(self):
        server = super().server
        if server is None:
            return None
        if self._factory is None:
            self._factory = self.limit.accept(server)
        return self._factory
