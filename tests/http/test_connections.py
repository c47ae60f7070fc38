"""Connections that are not in a request (connections.py), through the
server's own `app.serve`: a half-sent head can't hold its connection for
long, and when connections run short the one waiting longest without a
request is closed for a new one, never one in a request."""

import asyncio
import socket
import threading

from mlx_lm_plus import app as app_module
from mlx_lm_plus.http.server import RUNNER_OPTIONS, Server
from mlx_lm_plus.http.connections import HEAD_SECONDS, NEW_GRACE, ConnectionLimit, default_max_open
from mlx_lm_plus.config import parse_args
from tests.http.test_api import ScriptedEngine, ctx, tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Engine(ScriptedEngine):
    def stop(self):  # (app.serve's shutdown, for what is still in flight)
        pass


def _server(engine) -> Server:
    from argparse import Namespace

    args = parse_args(["--model", "m", "--shutdown-timeout", "1"])
    provider = Namespace(is_served=lambda desc: True, get=lambda key: None, served=["m"],
                         key_for=lambda desc: (desc.model, desc.adapter, None),
                         defaults_for=lambda name: args, name_for=lambda key: "m",
                         vocab_size=lambda key: None, task=lambda key: "generate")
    return Server(args, engine, provider, "fp")


async def _serving(server):
    port, stop = _free_port(), asyncio.Event()
    task = asyncio.create_task(app_module.serve(server, "127.0.0.1", port, stop))
    for _ in range(100):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.05)
    return port, stop, task


async def _open(port, data: bytes):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def _closed(reader, within: float) -> bool:
    """Whether the server closed the connection (EOF) within `within` s."""
    try:
        await asyncio.wait_for(reader.read(), within)  # (what was left, to the end)
        return True
    except asyncio.TimeoutError:
        return False
    except ConnectionResetError:
        return True


HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"


async def _not_reading(port):
    """A connection whose client reads nothing (a small receive buffer, so
    the server's answers soon wait in its transport)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return await asyncio.open_connection(sock=sock)


def _held_completion():
    """An engine whose first completion waits until `release` is set."""
    release = threading.Event()
    engine = _Engine([ctx(), lambda channel: release.wait(30), *tokens("ok", "")])
    return engine, release


COMPLETION = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n")
BODY = b'{"messages": [{"role": "user", "content": "hi"}]}'


async def _in_flight(port, engine):
    """A connection in a request: a completion the engine is generating."""
    connection = await _open(port, COMPLETION % len(BODY) + BODY)
    for _ in range(100):
        if engine.channels:
            break
        await asyncio.sleep(0.02)
    return connection


async def test_a_connection_without_a_request_makes_room_for_a_new_one():
    engine, release = _held_completion()
    server = _server(engine)
    server.connections.max_open = 4
    port, stop, task = await _serving(server)
    try:
        busy = await _in_flight(port, engine)  # (oldest of all)
        # Half-sent heads, then one opened before them that had a request
        # since: it waited least.
        idle = await _open(port, b"")
        halves = [await _open(port, HALF_HEAD) for _ in range(2)]
        await asyncio.sleep(0.1)
        idle[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in await asyncio.wait_for(idle[0].readline(), 5)
        assert server.connections.open_connections() == 4
        await asyncio.sleep(NEW_GRACE)

        # A fifth: the half head sent first goes.
        fifth = await _open(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in await asyncio.wait_for(fifth[0].readline(), 5)
        assert await _closed(halves[0][0], 2)
        assert not await _closed(halves[1][0], 0.2)
        assert not await _closed(idle[0], 0.2)
        assert server.connections.closed == 1

        # More: the others without a request go, oldest first, never the
        # one in a request, which is then answered.
        more = []  # (held: a writer collected closes its connection)
        for expected in (halves[1], idle, fifth):
            await asyncio.sleep(NEW_GRACE)
            more.append(await _open(port, HALF_HEAD))
            assert await _closed(expected[0], 2)
        release.set()
        status = await asyncio.wait_for(busy[0].readline(), 5)
        assert status.startswith(b"HTTP/1.1 200"), status
        assert server.connections.closed == 4
        assert server.connections.open_connections() <= 4
        for _, writer in more:
            writer.close()
    finally:
        release.set()
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_body_that_is_not_coming_makes_room_with_a_503():
    """Heads of requests whose bodies never come are not requests in
    progress: with no connection idle, the body waited on longest is given
    up (a 503), and a new connection is served."""
    server = _server(_Engine())
    server.connections.max_open = 3
    port, stop, task = await _serving(server)
    try:
        bodies = []
        for _ in range(3):
            bodies.append(await _open(port, COMPLETION % 100 + b"{"))
            await asyncio.sleep(0.05)
        await asyncio.sleep(NEW_GRACE)
        reader, writer = await _open(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in await asyncio.wait_for(reader.readline(), 5)
        answer = await asyncio.wait_for(bodies[0][0].read(4096), 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"Server busy" in answer, answer
        assert b"the request body was still coming" in answer
        assert b"Connection: close" in answer
        assert await _closed(bodies[0][0], 1)  # (at once: the rest of its body isn't read)
        for other in bodies[1:]:
            assert not await _closed(other[0], 0.1)
        assert server.connections.closed == 1
        for _, w in [*bodies, (reader, writer)]:
            w.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_connections_opened_together_are_served_when_none_can_make_room(caplog):
    """Every connection in a request: new ones are let in beyond the limit
    (with a warning), and those opened together don't close one another
    before their heads are read."""
    engine, release = _held_completion()
    server = _server(engine)
    server.connections.max_open = 1
    port, stop, task = await _serving(server)
    try:
        busy = await _in_flight(port, engine)
        together = await asyncio.gather(*[
            _open(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") for _ in range(8)])
        for reader, _ in together:
            assert b"200" in await asyncio.wait_for(reader.readline(), 5)
        assert server.connections.closed == 0
        assert "none to close" in caplog.text
        release.set()
        assert (await asyncio.wait_for(busy[0].readline(), 5)).startswith(b"HTTP/1.1 200")
        for _, writer in [*together, busy]:
            writer.close()
    finally:
        release.set()
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_connection_closed_for_room_frees_its_descriptor_at_once():
    """A connection whose client reads none of its answers is closed for
    room at once (aborted): a close would keep its socket until the client
    read what was written."""
    server = _server(_Engine())
    server.connections.max_open = 2
    port, stop, task = await _serving(server)
    try:
        reader, writer = await _not_reading(port)
        writer.write(b"GET /dashboard HTTP/1.1\r\nHost: x\r\n\r\n" * 300)
        await asyncio.sleep(0.5)  # (its answers fill both buffers)
        (stuck,) = server.connections.waiting
        assert stuck.transport.get_write_buffer_size() > 0
        stuck_socket = stuck.transport.get_extra_info("socket")
        await asyncio.sleep(NEW_GRACE)
        other = await _open(port, HALF_HEAD)
        new = await _open(port, HALF_HEAD)  # (the third: room is made)
        for _ in range(50):
            if stuck_socket.fileno() == -1:
                break
            await asyncio.sleep(0.02)
        assert stuck_socket.fileno() == -1, "the socket is still held"
        assert server.connections.closed == 1
        for w in (writer, other[1], new[1]):
            w.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_half_sent_head_gets_head_seconds(monkeypatch):
    """A connection gets HEAD_SECONDS for a request's head (aiohttp's
    keepalive_timeout, an hour by default in an AppRunner), counted from
    its opening or its last response; a request that runs longer is not
    cut."""
    assert RUNNER_OPTIONS["keepalive_timeout"] == HEAD_SECONDS <= 120
    monkeypatch.setitem(RUNNER_OPTIONS, "keepalive_timeout", 0.5)
    server = _server(_Engine([ctx(), *tokens("ok", "")]))
    port, stop, task = await _serving(server)
    try:
        half = await _open(port, HALF_HEAD)
        assert await _closed(half[0], 3)
        # A body that takes 1.5 s (its request already in progress).
        body = b'{"messages": [{"role": "user", "content": "hi"}]}'
        reader, writer = await _open(port, b"POST /v1/chat/completions HTTP/1.1\r\n"
                                           b"Host: x\r\nContent-Type: application/json\r\n"
                                           b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(3):
            await asyncio.sleep(0.5)
            writer.write(body[i * 10:(i + 1) * 10])
            await writer.drain()
        writer.write(body[30:])
        status = await asyncio.wait_for(reader.readline(), 5)
        assert status.startswith(b"HTTP/1.1 200"), status
        writer.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def test_the_limit_leaves_descriptors_for_files(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (2048, 4096))
    assert default_max_open() == 2048 - 512
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (256, 4096))
    assert default_max_open() == 192
    assert ConnectionLimit(5).open_connections() == 0


async def test_bodies_given_up_as_their_clients_leave_log_no_error(caplog):
    """At shutdown, bodies still coming are given up while their clients
    close: a 503 that can't be written is no error."""
    server = _server(_Engine())
    port, stop, task = await _serving(server)
    bodies = [await _open(port, COMPLETION % 100 + b"{") for _ in range(5)]
    await asyncio.sleep(1.3)  # (none sent a byte in the last second: not waited for)
    for _, writer in bodies:
        writer.close()
    stop.set()
    await asyncio.wait_for(task, 30)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_a_connection_aiohttp_closed_with_answers_unread_is_aborted_for_room(monkeypatch):
    """aiohttp's keep-alive timer closes a connection whose client reads
    nothing, and forgets its transport, which keeps the socket until the
    client reads: the connection stays counted, and making room aborts it."""
    monkeypatch.setitem(RUNNER_OPTIONS, "keepalive_timeout", 1.0)
    server = _server(_Engine())
    port, stop, task = await _serving(server)
    try:
        reader, writer = await _not_reading(port)
        # Answers that fill the socket's buffers, then one more at a time
        # until some wait in the transport's (each answered: then idle).
        writer.write(b"GET /dashboard HTTP/1.1\r\nHost: x\r\n\r\n" * 150)
        await asyncio.sleep(0.3)
        (stuck,) = server.connections.waiting
        for _ in range(400):
            if stuck.transport.get_write_buffer_size():
                break
            writer.write(b"GET /dashboard HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.02)
        stuck_socket = stuck.transport.get_extra_info("socket")
        await asyncio.sleep(1.5)  # (past the keep-alive timer)
        assert stuck.transport is None and stuck_socket.fileno() != -1  # (closed, held)
        assert server.connections.open_connections() == 1
        server.connections.max_open = 1
        new = await _open(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in await asyncio.wait_for(new[0].readline(), 5)
        for _ in range(50):
            if stuck_socket.fileno() == -1:
                break
            await asyncio.sleep(0.02)
        assert stuck_socket.fileno() == -1, "the socket is still held"
        for w in (writer, new[1]):
            w.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
