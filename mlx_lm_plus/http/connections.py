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
one makes room, taking first of these:
  * the connection that has waited longest without a request in progress
    (an idle keep-alive connection, one still sending its head, or one whose
    answer its client is not reading), if it has waited NEW_GRACE seconds
    (connections accepted together must not close one another before
    their heads are read): aborted, its descriptor freed at once;
  * the request whose body has been coming longest: answered 503, and its
    connection closed (its body would hold the connection up to the body
    timeouts, api.py);
  * none: a connection whose request was accepted is never closed for
    another (at most --decode-concurrency + --max-queued-requests of them
    are in flight); the new one is let in beyond the limit, into the
    descriptors kept in reserve.
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
# connections accepted and not yet counted, let in beyond the limit, or
# given a 503 and not yet let go (a burst of new connections is accepted
# up to the listen backlog, 128, at a time).
FD_RESERVE = 512
# Seconds a connection waits before it can be closed to make room: a new
# one's head is read within a loop iteration or two of its opening.
NEW_GRACE = 0.25
# Seconds between two warnings that no connection could make room.
WARN_EVERY = 60.0


def default_max_open() -> int:
    """The file limit, less what files need (a quarter of a small limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(1, soft - min(FD_RESERVE, soft // 4))


class ConnectionLimit:
    """The open connections: those without a request in progress in the
    order they began to wait, those in a request apart; and the requests
    whose bodies are coming, oldest first."""

    def __init__(self, max_open: int, clock=time.monotonic):
        self.max_open = max_open
        self.clock = clock
        # RequestHandler -> when it began to wait, longest waiting first
        self.waiting: "OrderedDict[object, float]" = OrderedDict()
        self.busy: Dict[object, int] = {}  # RequestHandler -> requests in progress
        # RequestHandler -> its asyncio transport, until the connection is
        # lost (aiohttp forgets it at a close that still has bytes to send)
        self.transports: Dict[object, asyncio.Transport] = {}
        # id(request) -> a future its handler waits on while its body comes
        # (the reason it is given up, as its result), oldest first
        self.bodies: "OrderedDict[int, asyncio.Future]" = OrderedDict()
        self.given_up = set()  # id(request) whose body was given up, until answered
        self.closed = 0  # connections closed, or bodies given up, to make room
        self._warned_at = float("-inf")

    def open_connections(self) -> int:
        return len(self.waiting) + len(self.busy)

    def accept(self, make_handler):
        """aiohttp's protocol factory (`runner.server`), each connection
        counted from its opening to its loss."""
        return lambda: _Counted(make_handler(), self)

    def opened(self, handler, transport) -> None:
        if self.open_connections() >= self.max_open:
            self._make_room()
        self.waiting[handler] = self.clock()
        self.transports[handler] = transport

    def lost(self, handler) -> None:
        self.waiting.pop(handler, None)
        self.busy.pop(handler, None)
        self.transports.pop(handler, None)

    def _close(self, handler, abort: bool) -> None:
        # Aborted where bytes are still to be sent: a close keeps the
        # descriptor until the client has read them, and a client that
        # reads nothing would keep it for good. (Also when aiohttp closed
        # the connection itself, its keep-alive timer for one: the
        # connection stays counted until its loss.)
        transport = self.transports.get(handler)
        if transport is not None and (abort or transport.get_write_buffer_size()):
            transport.abort()
        handler.force_close()

    def receiving(self, request) -> asyncio.Future:
        """A request's body is coming: the future its handler waits on
        beside the body, given the reason when the body is given up (the
        request is then answered with a 503, api.Server._receive)."""
        given_up = self.bodies[id(request)] = asyncio.get_running_loop().create_future()
        return given_up

    def received(self, request) -> None:
        self.bodies.pop(id(request), None)

    def give_up_bodies(self, why: str) -> None:
        """Every body still coming is given up (at shutdown)."""
        while self.bodies:
            self._give_up(why)

    def _give_up(self, why: str) -> None:
        request_id, given_up = self.bodies.popitem(last=False)
        if not given_up.done():
            self.given_up.add(request_id)
            given_up.set_result(why)

    def _make_room(self) -> None:
        if self.waiting:
            handler, since = next(iter(self.waiting.items()))
            if self.clock() - since >= NEW_GRACE:
                del self.waiting[handler]
                self.closed += 1
                self._close(handler, abort=True)
                return
        if self.bodies:
            self.closed += 1
            self._give_up(f"Server busy: {self.open_connections()} connections open")
            return
        now = self.clock()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            logging.warning(f"{self.open_connections()} connections open and none to close: "
                            f"a new one is let in beyond the limit ({self.max_open})")

    @web.middleware
    async def middleware(self, request, handler):
        connection = request.protocol
        counted = connection in self.waiting or connection in self.busy
        if counted:
            self.waiting.pop(connection, None)
            self.busy[connection] = self.busy.get(connection, 0) + 1
        try:
            response = await handler(request)
            if id(request) in self.given_up and response is not None:
                # Its 503 written out, then the connection closed (counted
                # until it is gone, a loop iteration later): the rest of its
                # body is not read (aiohttp would read it for up to 10 s
                # before closing).
                response.force_close()  # (Connection: close)
                transport = self.transports.get(connection)
                if not response.prepared and transport is not None and not transport.is_closing():
                    try:
                        await response.prepare(request)
                        await response.write_eof()
                    except ConnectionError:
                        pass  # (its client went away meanwhile)
                self._close(connection, abort=False)
            return response
        finally:
            self.given_up.discard(id(request))
            left = self.busy.get(connection, 0) - 1
            if left > 0:
                self.busy[connection] = left
            elif (counted and self.busy.pop(connection, None) is not None
                  and connection in self.transports):  # (not lost: counted, if closing)
                # (Its answer may still be being written: if its client
                # doesn't read it, the connection is one to close.)
                self.waiting[connection] = self.clock()


class _Counted(asyncio.Protocol):
    """aiohttp's RequestHandler, with its opening and its loss told to the
    limit. (Only a protocol's own calls pass here; aiohttp's code holds
    the handler itself.)"""

    def __init__(self, handler, limit: ConnectionLimit):
        self.handler, self.limit = handler, limit

    def connection_made(self, transport):
        self.limit.opened(self.handler, transport)
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
