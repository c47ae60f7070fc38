"""Connections that are not in a request (connections.py), through the
server's own `app.serve`: a half-sent head can't hold its connection for
long, and when connections run short the one waiting longest without a
request is closed for a new one, never one in a request."""

import asyncio
import socket

from mlx_lm_plus import app as app_module
from mlx_lm_plus.api import RUNNER_OPTIONS, Server
from mlx_lm_plus.connections import HEAD_SECONDS, ConnectionLimit, default_max_open
from mlx_lm_plus.server import parse_args
from tests.test_api import ScriptedEngine, ctx, tokens


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
                         vocab_size=lambda key: None)
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


async def test_a_connection_without_a_request_makes_room_for_a_new_one():
    server = _server(_Engine([ctx(), *tokens("ok", "")]))
    server.connections.max_open = 4
    port, stop, task = await _serving(server)
    try:
        body = b'{"messages": [{"role": "user", "content": "hi"}]}'
        # In a request: its body still coming (oldest of all).
        busy = await _open(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: %d"
                                 b"\r\n\r\n" % len(body) + body[:5])
        await asyncio.sleep(0.1)
        # Half-sent heads, then one opened before them that had a request
        # since: it waited least.
        idle = await _open(port, b"")
        halves = [await _open(port, HALF_HEAD) for _ in range(2)]
        await asyncio.sleep(0.1)
        idle[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in await asyncio.wait_for(idle[0].readline(), 5)
        assert server.connections.open_connections() == 4

        # A fifth: the half head sent first goes.
        fifth = await _open(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in await asyncio.wait_for(fifth[0].readline(), 5)
        assert await _closed(halves[0][0], 2)
        assert not await _closed(halves[1][0], 0.2)
        assert not await _closed(idle[0], 0.2)
        assert server.connections.closed == 1

        # More: the others without a request go, oldest first, never the
        # one in a request, whose body then comes and is answered.
        more = []  # (held: a writer collected closes its connection)
        for expected in (halves[1], idle, fifth):
            more.append(await _open(port, HALF_HEAD))
            assert await _closed(expected[0], 2)
        busy[1].write(body[5:])
        await busy[1].drain()
        status = await asyncio.wait_for(busy[0].readline(), 5)
        assert status.startswith(b"HTTP/1.1 200"), status
        assert server.connections.closed == 4
        assert server.connections.open_connections() <= 4
        for _, writer in more:
            writer.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_every_connection_in_a_request_lets_a_new_one_in(caplog):
    """With no connection to close, a new one is still served (beyond the
    limit, with a warning)."""
    server = _server(_Engine([ctx(), *tokens("ok", "")]))
    server.connections.max_open = 1
    port, stop, task = await _serving(server)
    try:
        busy = await _open(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: 50"
                                 b"\r\n\r\n{")
        await asyncio.sleep(0.1)
        reader, writer = await _open(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in await asyncio.wait_for(reader.readline(), 5)
        assert "each in a request" in caplog.text
        assert not await _closed(busy[0], 0.2)
        writer.close()
        busy[1].close()
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
