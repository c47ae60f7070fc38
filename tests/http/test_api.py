"""The HTTP layer alone: aiohttp handlers against a scripted engine."""

import asyncio
import json
import threading
from argparse import Namespace

import pytest
from mlx_lm.server import GenerationContext, Response
from mlx_lm.generate import TextStateMachine

from mlx_lm_plus.http.server import RUNNER_OPTIONS, Server, make_app
from mlx_lm_plus.errors import EngineUnavailable, PromptError
from mlx_lm_plus.config import parse_args


class ScriptedEngine:
    """Answers each submission from a script, on another thread like the real one."""

    @staticmethod
    def serves_vision(model):
        return False

    @staticmethod
    def image_max_pixels(model):
        return None

    @staticmethod
    def models():
        return [{"id": "m", "loaded": True, "pinned": True, "task": "generate"}]

    def __init__(self, script=None):
        self.script = script or []
        self.healthy = True
        self.channels = []
        self.requests = []

    @property
    def is_healthy(self):
        return self.healthy

    @property
    def unhealthy_reason(self):
        return None if self.healthy else "generation thread died: RuntimeError('boom')"

    def submit(self, channel, request, args, planned=None):
        if not self.healthy:
            raise EngineUnavailable("generation thread died")
        self.channels.append(channel)
        self.requests.append(request)
        threading.Thread(target=self._play, args=(channel,), daemon=True).start()

    def _play(self, channel):
        for item in self.script:
            if callable(item):
                item(channel)
            else:
                channel.put(item)


def ctx(prompt_len=5, cached=2):
    return GenerationContext(False, False, None, TextStateMachine(), "normal",
                             list(range(prompt_len)), cached)


def tokens(*texts, finish="stop"):
    return [Response(t, i, -0.1, finish if i == len(texts) - 1 else None, ())
            for i, t in enumerate(texts)] + [None]


async def served(aiohttp_client, app):
    """A test client of `app` served as app.serve serves it (RUNNER_OPTIONS;
    aiohttp's TestServer only takes runner options in start_server)."""
    from aiohttp.test_utils import TestServer

    test_server = TestServer(app)
    await test_server.start_server(**RUNNER_OPTIONS)
    return await aiohttp_client(test_server)


def make_client(aiohttp_client, engine, argv=(), protocols=()):
    """A test client of a Server on `engine` serving model "m", with the
    wire `protocols` added (chat completions alone by default)."""
    args = parse_args(["--model", "m", *argv])
    provider = Namespace(is_served=lambda desc: True, get=lambda key: None, served=["m"],
                         key_for=lambda desc: (desc.model, desc.adapter, None),
                         defaults_for=lambda name: args, name_for=lambda key: "m",
                         vocab_size=lambda key: None, task=lambda key: "generate")
    server = Server(args, engine, provider, "fp")
    for protocol in protocols:
        server.add_protocol(protocol)
    return served(aiohttp_client, make_app(server))


async def test_cors_allowed_origins_echo_and_vary(aiohttp_client):
    client = await make_client(aiohttp_client, ScriptedEngine(),
                               ["--allowed-origins", "http://a.test,http://b.test"])
    r = await client.get("/health", headers={"Origin": "http://b.test"})
    assert r.headers["Access-Control-Allow-Origin"] == "http://b.test"
    assert r.headers["Vary"] == "Origin"
    r = await client.get("/health", headers={"Origin": "http://evil.test"})
    assert "Access-Control-Allow-Origin" not in r.headers
    assert r.headers["Access-Control-Allow-Methods"] == "*"


async def test_body_errors(aiohttp_client):
    client = await make_client(aiohttp_client, ScriptedEngine())
    r = await client.post("/v1/chat/completions", data=b"\xff\xfe{}",
                          headers={"Content-Type": "application/json"})
    assert r.status == 400 and "UTF-8" in (await r.json())["error"]

    async def chunks():
        yield b'{"messages": []}'

    r = await client.post("/v1/chat/completions", data=chunks())
    assert r.status == 411
    assert await r.json() == {"error": "Content-Length header is required"}


async def test_engine_down_is_503_and_health_says_so(aiohttp_client):
    engine = ScriptedEngine()
    engine.healthy = False
    client = await make_client(aiohttp_client, engine)
    r = await client.get("/health")
    reason = "generation thread died: RuntimeError('boom')"
    assert (r.status, await r.json()) == (503, {"status": "unavailable", "reason": reason})
    r = await client.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status == 503 and r.headers["Retry-After"] == "1"
    assert await r.json() == {"error": f"Generation engine unavailable: {reason}"}


async def test_prompt_error_is_400(aiohttp_client):
    engine = ScriptedEngine([PromptError("Only 'text' content type is supported.")])
    client = await make_client(aiohttp_client, engine)
    r = await client.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "x"}]})
    assert (r.status, await r.json()) == (400, {"error": "Only 'text' content type is supported."})


async def test_stream_keepalives_then_chunks(aiohttp_client):
    engine = ScriptedEngine([ctx(), (2, 5), (5, 5), *tokens("Hel", "lo", "")])
    client = await make_client(aiohttp_client, engine)
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "stream": True,
        "stream_options": {"include_usage": True}})
    body = (await r.read()).decode()
    blocks = [b for b in body.split("\n\n") if b]
    assert blocks[:2] == [": keepalive 2/5", ": keepalive 5/5"]
    data = [json.loads(b[6:]) for b in blocks[2:-1]]
    assert blocks[-1] == "data: [DONE]"
    assert [d["choices"][0]["delta"].get("content") for d in data[:-1]] == ["Hel", "lo", None]
    assert data[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                 "prompt_tokens_details": {"cached_tokens": 2}}


async def test_client_disconnect_cancels_the_request(aiohttp_client):
    started = threading.Event()
    # The engine accepts the request and then "decodes" forever.
    engine = ScriptedEngine([ctx(), lambda ch: started.set()])
    client = await make_client(aiohttp_client, engine)
    for stream in (False, True):
        started.clear()
        task = asyncio.create_task(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "stream": stream}))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        await asyncio.sleep(0.1)
        if stream:
            # The headers are in: the client reads a little and hangs up.
            response = await task
            assert response.status == 200
            response.close()
        else:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        channel = engine.channels[-1]
        for _ in range(50):
            if channel.cancelled:
                break
            await asyncio.sleep(0.05)
        assert channel.cancelled, f"stream={stream}"


async def test_api_key_guards_everything_but_health(aiohttp_client):
    engine = ScriptedEngine([ctx(), *tokens("ok", "")])
    client = await make_client(aiohttp_client, engine, ["--api-key", "s3cret"])
    assert (await client.get("/health")).status == 200
    assert (await client.options("/v1/chat/completions")).status == 204
    body = {"messages": [{"role": "user", "content": "x"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic s3cret"}, {"Authorization": "Bearers3cret"}):
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert await r.json() == {"error": "Invalid or missing API key"}
    assert (await client.get("/v1/models")).status == 401
    assert engine.channels == []
    r = await client.post("/v1/chat/completions", json=body,
                          headers={"Authorization": "Bearer s3cret"})
    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "ok"
    # The scheme's case doesn't matter (RFC 7235).
    assert (await client.get("/v1/models", headers={"Authorization": "bearer s3cret"})
            ).status == 200


async def test_limits_body_size_messages_max_tokens(aiohttp_client):
    engine = ScriptedEngine([ctx(), *tokens("ok", "")])
    client = await make_client(aiohttp_client, engine, [
        "--max-request-bytes", "2000", "--max-messages", "3", "--max-tokens-ceiling", "64"])
    big = {"messages": [{"role": "user", "content": "x" * 3000}]}
    r = await client.post("/v1/chat/completions", json=big)
    assert r.status == 413
    assert await r.json() == {"error": "Request body is larger than 2000 bytes (--max-request-bytes)"}
    four = {"messages": [{"role": "user", "content": "hi"}] * 4}
    r = await client.post("/v1/chat/completions", json=four)
    assert r.status == 400 and "Too many messages: 4" in (await r.json())["error"]
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 65})
    assert (r.status, await r.json()) == (400, {
        "error": "max_tokens must be at most 64 on this server (--max-tokens-ceiling)"})
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + "A" * 400}}]}]}
    client2 = await make_client(aiohttp_client, engine, ["--max-image-bytes", "200"])
    r = await client2.post("/v1/chat/completions", json=image)
    assert (r.status, await r.json()) == (413, {
        "error": "Image 0 is larger than 200 bytes (--max-image-bytes)"})
    assert engine.channels == []  # none of them reached the engine
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}] * 3, "max_tokens": 64})
    assert r.status == 200, await r.text()
    assert len(engine.channels) == 1


async def test_queue_limit_is_503_with_retry_after(aiohttp_client):
    release = threading.Event()
    # Each request is accepted, then holds its place until released.
    engine = ScriptedEngine([ctx(), lambda ch: release.wait(10), *tokens("ok", "")])
    client = await make_client(aiohttp_client, engine, [
        "--decode-concurrency", "1", "--max-queued-requests", "1"])
    body = {"messages": [{"role": "user", "content": "x"}]}
    held = [asyncio.create_task(client.post("/v1/chat/completions", json=body))
            for _ in range(2)]
    for _ in range(100):
        if len(engine.channels) == 2:
            break
        await asyncio.sleep(0.02)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 503 and r.headers["Retry-After"] == "1"
    assert "Server busy: 2 requests in flight" in (await r.json())["error"]
    assert len(engine.channels) == 2
    release.set()
    assert [(await t).status for t in held] == [200, 200]
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200


async def test_requests_whose_bodies_never_come_hold_no_place(aiohttp_client):
    """A place in flight is taken once a request's body is in: clients that
    open requests and never send their bodies don't turn real ones away."""
    engine = ScriptedEngine([ctx(), *tokens("ok", "")])
    client = await make_client(aiohttp_client, engine, [
        "--decode-concurrency", "1", "--max-queued-requests", "1"])
    stalled = []
    for _ in range(3):  # more than the 2 places
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        stalled.append(writer)
    await asyncio.sleep(0.2)  # (their handlers wait for the rest of the body)
    body = {"messages": [{"role": "user", "content": "x"}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    for writer in stalled:
        writer.close()


async def test_bytes_of_bodies_being_received_are_bounded(aiohttp_client, monkeypatch):
    """What bodies still coming hold is bounded by the bytes received (at
    least twice --max-request-bytes): past it, the request whose bytes went
    over gets a 503; a connection that sent nothing holds nothing."""
    from mlx_lm_plus.http import intake as api

    monkeypatch.setattr(api, "RECEIVING_BYTES", 0)  # (the bound: 2 x 2000 bytes)
    engine = ScriptedEngine([ctx(), *tokens("ok", "")])
    client = await make_client(aiohttp_client, engine, ["--max-request-bytes", "2000"])
    held = []
    for _ in range(2):  # 1,990 bytes each held, of 1,999
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1999\r\n\r\n"
                     + b"{" + b" " * 1989)
        await writer.drain()
        held.append(writer)
    await asyncio.sleep(0.3)  # (received: their handlers wait for the rest)
    small = {"messages": [{"role": "user", "content": "x"}]}
    r = await client.post("/v1/chat/completions", json=small)  # 3,980 + its ~50: over
    assert r.status == 503 and "request bodies being received" in (await r.json())["error"]
    held.pop().close()
    await asyncio.sleep(0.3)
    assert (await client.post("/v1/chat/completions", json=small)).status == 200
    for writer in held:
        writer.close()


async def test_a_body_too_slow_is_a_408_one_that_keeps_a_rate_goes_on(aiohttp_client,
                                                                      monkeypatch, caplog):
    """As Apache's mod_reqtimeout: a body gets BODY_IDLE_SECONDS, plus a
    second per BODY_MIN_RATE bytes received; a trickle can't hold its bytes
    for ever, an upload at the rate goes on. A client that goes away mid-body
    is no error."""
    from mlx_lm_plus.http import intake as api

    monkeypatch.setattr(api, "BODY_IDLE_SECONDS", 0.5)
    monkeypatch.setattr(api, "BODY_MIN_RATE", 2000)
    engine = ScriptedEngine([ctx(), *tokens("ok", "")])
    client = await make_client(aiohttp_client, engine, [])
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 3000}]}).encode()

    async def send(pieces, pause):
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        step = -(-len(body) // pieces)
        for n, i in enumerate(range(0, len(body), step)):
            if n == 20 or reader.at_eof() or reader._buffer:  # (answered already)
                break
            try:
                writer.write(body[i:i + step])
                await writer.drain()
            except ConnectionResetError:
                break
            await asyncio.sleep(pause)
        status = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        return status, n

    # ~3 KB over 1.2 s: at 2.5 KB/s, past the 0.5 s.
    assert (await send(6, 0.2))[0].startswith(b"HTTP/1.1 200"), "an upload at the rate"
    # A byte every 0.3 s: never idle for 0.5 s, but far below the rate: a
    # 408 within a few bytes (not after the 20 sent, idle then).
    status, sent = await send(len(body), 0.3)
    assert status.startswith(b"HTTP/1.1 408") and sent < 10, (status, sent)
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()  # (gone mid-body)
    await asyncio.sleep(0.3)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_a_body_that_stops_coming_is_a_408(aiohttp_client, monkeypatch):
    from mlx_lm_plus.http import intake as api

    monkeypatch.setattr(api, "BODY_IDLE_SECONDS", 0.3)
    engine = ScriptedEngine([])
    client = await make_client(aiohttp_client, engine, [])
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    status = await asyncio.wait_for(reader.readline(), 10)
    assert status.startswith(b"HTTP/1.1 408"), status
    writer.close()
    assert engine.channels == []


async def test_remote_images_only_with_the_flag_and_within_limits(aiohttp_client, aiohttp_server):
    import base64
    import io

    from aiohttp import web
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, format="PNG")
    picture = out.getvalue()

    async def serve(request):
        if request.path == "/slow.png":
            await asyncio.sleep(5)
        if request.path == "/big.png":
            return web.Response(body=b"x" * 5000, content_type="image/png")
        return web.Response(body=picture, content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", serve)
    images = await aiohttp_server(app)

    def body(name):
        return {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{images.port}/{name}"}},
            {"type": "text", "text": "?"}]}]}

    engine = ScriptedEngine([ctx(), *tokens("ok", "")])
    off = await make_client(aiohttp_client, engine)
    r = await off.post("/v1/chat/completions", json=body("a.png"))
    assert r.status == 400 and "--allow-remote-images" in (await r.json())["error"]

    on = await make_client(aiohttp_client, engine, [
        "--allow-remote-images", "--allow-private-image-hosts", "--max-image-bytes", "4000",
        "--remote-image-timeout", "1"])
    r = await on.post("/v1/chat/completions", json=body("a.png"))
    assert r.status == 200, await r.text()
    part = engine.requests[-1].messages[0]["content"][0]
    assert part["image_url"]["url"] == (
        "data:image/png;base64," + base64.b64encode(picture).decode())
    r = await on.post("/v1/chat/completions", json=body("big.png"))
    # Every failure answers the same text (tests/http/test_remote_images.py).
    assert (r.status, await r.json()) == (400, {"error": "Image 0: could not fetch the remote image"})
    r = await on.post("/v1/chat/completions", json=body("slow.png"))
    assert r.status == 400 and "could not fetch" in (await r.json())["error"]
    assert len(engine.requests) == 1


async def test_admin_endpoints_refuse_other_origins(aiohttp_client, fixture_path):
    """No web page on another origin (or another host name resolving here)
    may clear the cache or read the stats of a server without an API key;
    the completion endpoints keep upstream's CORS."""
    from mlx_lm_plus.app import build

    async def serve(argv=()):
        engine, server = build(parse_args(["--model", str(fixture_path("qwen3")), *argv]))
        cleared = []
        engine.clear_cache = lambda: cleared.append(1) or {}
        return await aiohttp_client(make_app(server)), cleared

    client, cleared = await serve()
    evil = {"Origin": "http://evil.test"}
    r = await client.options("/v1/cache", headers={
        **evil, "Access-Control-Request-Method": "DELETE"})
    assert "Access-Control-Allow-Origin" not in r.headers
    assert "Access-Control-Allow-Methods" not in r.headers
    r = await client.delete("/v1/cache", headers=evil)
    assert r.status == 403 and "another origin" in (await r.json())["error"]
    assert cleared == []
    for headers in (evil, {"Sec-Fetch-Site": "cross-site"}, {"Host": "rebound.evil.test:8080"}):
        r = await client.get("/v1/stats", headers=headers)
        assert r.status == 403, headers
        r = await client.get("/metrics", headers=headers)
        assert r.status == 403, headers
    # Same origin (the dashboard), or no browser at all: allowed.
    own = f"http://{client.server.host}:{client.server.port}"
    for headers in ({}, {"Origin": own}, {"Sec-Fetch-Site": "same-origin"},
                    {"Host": "localhost:8080"}):
        r = await client.get("/v1/stats", headers=headers)
        assert r.status == 200, headers
        assert "Access-Control-Allow-Origin" not in r.headers
    r = await client.delete("/v1/cache")
    assert r.status == 200 and cleared == [1]
    # Upstream's CORS stays on the other endpoints.
    r = await client.get("/health", headers=evil)
    assert r.headers["Access-Control-Allow-Origin"] == "*"

    # With a key, a caller that has it may come from anywhere.
    keyed, cleared = await serve(["--api-key", "k"])
    r = await keyed.delete("/v1/cache", headers=evil)
    assert r.status == 401 and cleared == []
    r = await keyed.delete("/v1/cache", headers={**evil, "Authorization": "Bearer k"})
    assert r.status == 200 and cleared == [1]


async def test_unexpected_error_is_a_json_500(aiohttp_client, monkeypatch):
    engine = ScriptedEngine()
    client = await make_client(aiohttp_client, engine)
    app_server = client.server.app.router.routes()._routes[0].handler.__self__

    def broken(path):
        raise KeyError("boom")

    monkeypatch.setattr(app_server, "list_models", broken)
    r = await client.get("/v1/models")
    assert r.status == 500
    assert "KeyError" in (await r.json())["error"]
    assert (await client.get("/health")).status == 200


async def test_compressed_bodies_and_odd_paths_get_our_answers(aiohttp_client):
    """Found by the fuzzer: a compressed body (aiohttp decoded it, and a
    half-sent one hung), and a path with a newline (aiohttp's text 404)."""
    import gzip

    client = await make_client(aiohttp_client, ScriptedEngine([ctx(), *tokens("ok", "")]))
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for encoding, data in (("gzip", gzip.compress(body)), ("br", body), ("deflate", b"{}")):
        r = await client.post("/v1/completions", data=data,
                              headers={"Content-Encoding": encoding,
                                       "Content-Type": "application/json"})
        assert r.status == 415 and "Content-Encoding" in (await r.json())["error"]
    r = await client.get("/v1/models/%0A")
    assert r.status in (200, 404) and r.headers["Content-Type"] == "application/json"
    r = await client.post("/v1/completions", json={"prompt": "hi", "messages": [[]],
                                                   "max_tokens": 2})
    assert r.status == 200, await r.text()  # a text completion's messages are unused


async def test_api_key_in_either_header(aiohttp_client):
    """x-api-key (Anthropic's clients) or Bearer: either one right will do."""
    engine = ScriptedEngine([ctx(), *tokens("hi")])
    client = await make_client(aiohttp_client, engine, ["--api-key", "k"])
    body = {"messages": [{"role": "user", "content": "x"}]}
    for headers, status in [({"x-api-key": "k"}, 200), ({"Authorization": "Bearer k"}, 200),
                            ({"x-api-key": "wrong", "Authorization": "Bearer k"}, 200),
                            ({"x-api-key": "wrong"}, 401), ({}, 401),
                            ({"x-api-key": "\xff\xfe"}, 401)]:
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status == status, headers


async def test_a_stream_write_gives_up_on_a_client_that_reads_nothing(monkeypatch):
    """aiohttp has no write timeout: a client that never read its stream
    held its handler, and its place in flight, for good (with
    --max-queued-requests places, that many such clients turned every
    request away). A write that waits WRITE_TIMEOUT drops the connection
    and raises as a disconnect; a write the socket takes at once runs no
    timer."""
    import asyncio

    from aiohttp import web

    from mlx_lm_plus.http import replies as api

    class Transport:
        buffered = 0
        aborted = False

        def get_write_buffer_size(self):
            return self.buffered

        def abort(self):
            self.aborted = True

    writes = []

    async def write(self, data):
        writes.append(data)
        if Transport.buffered:
            await asyncio.Event().wait()  # the client reads nothing

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(api, "WRITE_TIMEOUT", 0.2)
    transport = Transport()
    response = api._StreamResponse(transport, status=200)
    await response.write(b"data: 1\n\n")
    assert writes == [b"data: 1\n\n"] and not transport.aborted
    Transport.buffered = 1 << 20
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(response.write(b"data: 2\n\n"), 5)
    assert transport.aborted


async def test_images_are_checked_off_the_event_loop(aiohttp_client, aiohttp_server,
                                                     monkeypatch):
    """Each image's base64 is decoded to check it (~2 ms a MB): for chat
    completions, Anthropic Messages (once more, strictly) and fetched remote
    images, never on the event loop, where ten large images stalled every
    stream for half a second."""
    import base64
    import io

    from aiohttp import web
    from PIL import Image

    from mlx_lm_plus.protocols import anthropic as anthropic_api; from mlx_lm_plus.http import remote_images; from mlx_lm_plus.protocols import validation
    from mlx_lm_plus.protocols.anthropic import AnthropicProtocol

    threads = []

    def recording(f):
        def wrapper(*a, **kw):
            threads.append(threading.get_ident())
            return f(*a, **kw)
        return wrapper

    monkeypatch.setattr(validation, "b64decode", recording(validation.b64decode))
    monkeypatch.setattr(anthropic_api, "b64decode", recording(anthropic_api.b64decode))
    monkeypatch.setattr(remote_images, "_validate_images",
                        recording(remote_images._validate_images))

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, format="PNG")
    data = base64.b64encode(out.getvalue()).decode()

    async def picture(request):
        return web.Response(body=out.getvalue(), content_type="image/png")

    images = web.Application()
    images.router.add_get("/a.png", picture)
    host = await aiohttp_server(images)

    engine = ScriptedEngine([ctx(), *tokens("ok", "")])
    client = await make_client(aiohttp_client, engine,
                               ["--allow-remote-images", "--allow-private-image-hosts"],
                               [AnthropicProtocol()])
    loop_thread = threading.get_ident()

    def chat(url):
        return {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]}

    for path, body, calls in [
        ("/v1/chat/completions", chat(f"data:image/png;base64,{data}"), 1),
        ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}}]}]}, 2),
        # (fetched: checked alone, then with the request's other images)
        ("/v1/chat/completions", chat(f"http://127.0.0.1:{host.port}/a.png"), 4),
    ]:
        threads.clear()
        r = await client.post(path, json=body)
        assert r.status == 200, await r.text()
        assert len(threads) == calls and loop_thread not in threads, path


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
async def test_silent_streams_get_keepalives_on_a_timer(aiohttp_client, monkeypatch, path):
    """A stream that waits in the queue, then prefills with no progress
    event for a while, gets a keepalive every KEEPALIVE_SECONDS: comments
    before its first frames, then the protocol's own (an Anthropic ping
    event; Responses: response.in_progress again; chat completions: a
    comment, its clients' only choice), and the answer
    after them."""
    import time as time_module

    from mlx_lm_plus.http import completion as api
    from mlx_lm_plus.protocols.anthropic import AnthropicProtocol
    from mlx_lm_plus.protocols.responses import ResponsesProtocol

    monkeypatch.setattr(api, "KEEPALIVE_SECONDS", 0.05)
    pause = lambda ch: time_module.sleep(0.4)  # noqa: E731
    engine = ScriptedEngine([pause, ctx(), pause, *tokens("Hel", "lo", "")])
    client = await make_client(aiohttp_client, engine,
                               protocols=[AnthropicProtocol(), ResponsesProtocol()])
    body = {"model": "m", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "x"}]}
    if path == "/v1/responses":
        body = {"model": "m", "input": "x", "stream": True}
    r = await client.post(path, json=body)
    assert r.status == 200
    blocks = [b for b in (await r.read()).decode().split("\n\n") if b]
    first = next(i for i, b in enumerate(blocks) if not b.startswith(":"))
    # Queued for 0.4 s: comments every 0.05 s (give or take a busy machine).
    assert first >= 3 and all(b == ": keepalive" for b in blocks[:first])
    if path == "/v1/chat/completions":  # (no frames of its own before the text)
        assert first >= 6 and "Hel" in blocks[first]
        return
    # Then prefill for 0.4 s with nothing to say: the protocol's keepalive.
    started = blocks[first:]
    text_at = next(i for i, b in enumerate(started) if "Hel" in b)
    # Events, not comments (the SDKs and Codex drop comments: their idle
    # timers count events only).
    assert not any(b.startswith(":") for b in started)
    if path == "/v1/messages":
        pings = [b for b in started[:text_at] if b.startswith("event: ping")]
        assert len(pings) >= 4  # (one comes with message_start)
    else:
        kinds = [json.loads(b.partition("data: ")[2])["type"] for b in started]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[2:text_at].count("response.in_progress") >= 3
        numbers = [json.loads(b.partition("data: ")[2])["sequence_number"] for b in started]
        assert numbers == list(range(len(numbers)))
    assert "lo" in "".join(started[text_at:])


def _tool_ctx():
    """A context whose text machine sees <tool_call>...</tool_call>."""
    def parser(text, tools):
        call = json.loads(text.strip())
        return {"name": call["name"], "arguments": call["arguments"]}

    machine = TextStateMachine({"normal": [("<tool_call>", "tool")],
                                "tool": [("</tool_call>", "normal")]})
    return GenerationContext(True, False, parser, machine, "normal", list(range(5)), 0)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
async def test_a_long_tool_call_is_not_silence(aiohttp_client, monkeypatch, path):
    """Tokens inside a tool call write nothing until the call closes: a
    stream gets its keepalives meanwhile, as during prefill."""
    import time as time_module

    from mlx_lm_plus.http import completion as api
    from mlx_lm_plus.protocols.anthropic import AnthropicProtocol
    from mlx_lm_plus.protocols.responses import ResponsesProtocol

    monkeypatch.setattr(api, "KEEPALIVE_SECONDS", 0.1)
    slow = lambda ch: time_module.sleep(0.03)  # noqa: E731
    pieces = ["<tool_call>", '{"name": "f", "arguments": {"x": "', *["a"] * 40, '"}}',
              "</tool_call>", ""]
    script = [_tool_ctx()]
    for r in tokens(*pieces):
        script += [slow, r] if r is not None else [None]
    client = await make_client(aiohttp_client, ScriptedEngine(script),
                               protocols=[AnthropicProtocol(), ResponsesProtocol()])
    tool = {"name": "f", "parameters": {"type": "object"}}
    chat = {"max_tokens": 99, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    body = {
        "/v1/chat/completions": {**chat, "tools": [{"type": "function", "function": tool}]},
        "/v1/messages": {**chat, "model": "m",
                         "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
        "/v1/responses": {"model": "m", "input": "x", "stream": True,
                          "tools": [{"type": "function", **tool}]},
    }[path]
    start = time_module.perf_counter()
    arrivals, raw = [start], b""
    r = await client.post(path, json=body)
    async for piece in r.content.iter_any():
        arrivals.append(time_module.perf_counter())
        raw += piece
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert '"f"' in raw.decode() and arrivals[-1] - start > 1.0
    # (the call's 40 tokens take 1.2 s: silence would be one gap of 1.2 s)
    assert max(gaps) < 0.6, (path, max(gaps))


async def test_a_disconnect_is_not_lost_to_an_arriving_event():
    """A handler cancelled (its client left) in the same loop iteration as an
    event arrives is cancelled, whether its channel has a heartbeat or not
    (asyncio.wait_for on Python 3.11 returned the event and dropped the
    cancellation)."""
    from mlx_lm_plus.http.channel import IDLE, AsyncChannel

    loop = asyncio.get_running_loop()
    for timeout in (None, 10.0):
        for _ in range(20):
            channel = AsyncChannel(loop)
            if timeout is not None:
                channel.beat_every(timeout)

            async def handler():
                try:
                    await channel.get()
                    await asyncio.sleep(0.01)
                    return "went on"
                except asyncio.CancelledError:
                    return "cancelled"

            task = asyncio.ensure_future(handler())
            await asyncio.sleep(0)
            channel._append("token")
            task.cancel()
            assert await task == "cancelled", timeout
    # An event that comes as the wait ends is never lost.
    for _ in range(50):
        channel = AsyncChannel(loop)
        channel.beat_every(0.001)
        loop.call_later(0.001, channel._append, "x")
        got = await channel.get()
        while got is IDLE:  # (ticks before it, as a wait ends)
            got = await channel.get()
        assert got == "x"
        channel.cancel()
