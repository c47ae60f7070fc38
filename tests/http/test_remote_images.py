"""--allow-remote-images: validated first, bounded in time and bytes, no
private targets (checked after DNS and after every redirect) unless
--allow-private-image-hosts, and one error text for every failure.

Image servers here listen on loopback only: 127.0.0.1 plays the private
network, and 127.0.0.2 plays a public host where `is_public` is patched to
say so. Nothing else is ever contacted (names resolve through a fake
resolver; other addresses are only given to the checks, never connected to).
"""

import asyncio
import base64
import io
import logging
import socket
import time
from argparse import Namespace

import pytest
from aiohttp import web
from PIL import Image
from yarl import URL

from tests.http.test_api import ScriptedEngine, ctx, make_client, tokens

ONE_TEXT = "Image 0: could not fetch the remote image"
CHAT = "/v1/chat/completions"


def png_bytes(size=(8, 8), color=(1, 2, 3)):
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


PICTURE = png_bytes()


def image_body(*urls, messages=1):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    one = {"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}
    return {"messages": [one] * messages}


class ImageServer:
    """An aiohttp app serving PICTURE and friends, counting every request."""

    def __init__(self):
        self.hits = []
        self.server = None

    def app(self):
        async def serve(request):
            name = request.match_info["name"]
            self.hits.append(name)
            if name == "a.png":
                return web.Response(body=PICTURE, content_type="image/png")
            if name == "slow.png":
                await asyncio.sleep(float(request.query.get("s", 5)))
                return web.Response(body=PICTURE, content_type="image/png")
            if name == "big.png":
                return web.Response(body=b"x" * int(request.query.get("n", 5000)),
                                    content_type="image/png")
            if name == "big-chunked.png":
                response = web.StreamResponse(headers={"Content-Type": "image/png"})
                response.enable_chunked_encoding()
                await response.prepare(request)
                for _ in range(10):
                    await response.write(b"x" * 1000)
                await response.write_eof()
                return response
            if name == "not-an-image.png":
                return web.Response(body=b"hello", content_type="image/png")
            if name == "missing.png":
                return web.Response(status=404, text="no")
            if name == "to":  # a redirect to ?url=
                raise web.HTTPFound(request.query["url"])
            if name == "loop":
                raise web.HTTPFound("/loop")
            if name == "chain":  # n more redirects, then the picture
                n = int(request.query["n"])
                raise web.HTTPFound(f"/chain?n={n - 1}" if n > 1 else "/a.png")
            return web.Response(status=500)

        app = web.Application()
        app.router.add_get("/{name}", serve)
        return app

    async def start(self, aiohttp_server, host="127.0.0.1"):
        self.server = await aiohttp_server(self.app(), host=host)
        return self

    def url(self, name, host=None):
        return f"http://{host or self.server.host}:{self.server.port}/{name}"


@pytest.fixture
async def private(aiohttp_server):
    """The image server on 127.0.0.1 (loopback: never allowed by default)."""
    return await ImageServer().start(aiohttp_server)


@pytest.fixture
async def public(aiohttp_server, monkeypatch):
    """The image server on 127.0.0.2, which `is_public` is told is public."""
    from mlx_lm_plus.http import remote_images

    real = remote_images.is_public
    monkeypatch.setattr(remote_images, "is_public", lambda a: a == "127.0.0.2" or real(a))
    return await ImageServer().start(aiohttp_server, host="127.0.0.2")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(aiohttp_client, *flags, engine=None):
    engine = engine or ScriptedEngine([ctx(), *tokens("ok", "")])
    return make_client(aiohttp_client, engine, ["--allow-remote-images", *flags])


async def post(c, body):
    r = await c.post(CHAT, json=body)
    return r.status, await r.read()


def the_one_text(status, raw, index=0):
    assert (status, raw) == (400, b'{"error": "Image %d: could not fetch the remote image"}'
                             % index), raw
    return True


# -- no private targets, one text --


async def test_loopback_refused_closed_port_the_same_and_nothing_fetched(
        aiohttp_client, private, caplog):
    c = await client(aiohttp_client)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_plus.http.remote_images"):
        open_port = await post(c, image_body(private.url("a.png")))
        closed = await post(c, image_body(f"http://127.0.0.1:{closed_port()}/a.png"))
        ipv6 = await post(c, image_body(f"http://[::1]:{closed_port()}/a.png"))
    assert the_one_text(*open_port)
    assert closed == open_port and ipv6 == open_port  # the same bytes
    assert private.hits == []
    assert "not allowed" in caplog.text and private.url("a.png") in caplog.text


async def test_every_failure_gives_the_same_bytes(aiohttp_client, private):
    """With private hosts allowed: connection refused, 404, too large,
    undecodable, too many pixels all answer the same body."""
    c = await client(aiohttp_client, "--allow-private-image-hosts",
                     "--max-image-bytes", "4000", "--max-image-pixels", "32",
                     "--remote-image-timeout", "2")
    answers = [await post(c, image_body(url)) for url in (
        f"http://127.0.0.1:{closed_port()}/a.png",
        private.url("missing.png"),
        private.url("big.png"),
        private.url("not-an-image.png"),
        private.url("a.png"),  # 8x8 = 64 pixels > 32
    )]
    assert the_one_text(*answers[0])
    assert all(a == answers[0] for a in answers), answers


async def test_private_hosts_flag_fetches_into_a_data_url(aiohttp_client, private):
    engine = ScriptedEngine([ctx(), *tokens("ok", "")])
    c = await client(aiohttp_client, "--allow-private-image-hosts", engine=engine)
    status, raw = await post(c, image_body(private.url("a.png")))
    assert status == 200, raw
    part = engine.requests[-1].messages[0]["content"][0]
    assert part == {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(PICTURE).decode()}}
    assert private.hits == ["a.png"]


def test_address_checks_without_connecting():
    from mlx_lm_plus.http.remote_images import Refused, check_url, is_public

    closed = Namespace(allow_private_image_hosts=False)
    opened = Namespace(allow_private_image_hosts=True)
    for url in ("http://127.0.0.1/", "http://10.1.2.3/", "http://192.168.0.1/",
                "http://172.16.0.1/", "http://169.254.169.254/latest/meta-data/",
                "http://100.64.0.1/", "http://0.0.0.0/", "http://[::1]/",
                "http://[fe80::1]/", "http://[fd00::1]/", "http://[::ffff:127.0.0.1]/",
                "http://127.1/", "http://2130706433/", "ftp://8.8.8.8/x.png",
                "file:///etc/passwd",
                # IPv6 forms carrying a private IPv4 address (NAT64, 6to4,
                # IPv4-compatible, IPv4-translated, Teredo)
                "http://[64:ff9b::a9fe:a9fe]/", "http://[64:ff9b:1::a00:5]/",
                "http://[2002:7f00:1::1]/", "http://[::127.0.0.1]/",
                "http://[::ffff:0:7f00:1]/", "http://[2001:0:4136:e378:8000:63bf:f5fe:fffe]/"):
        with pytest.raises(Refused):
            check_url(URL(url), closed)
    for url in ("http://8.8.8.8/x.png", "https://[2606:4700::1111]/x.png",
                "http://images.example/x.png"):  # a name: the resolver checks it
        check_url(URL(url), closed)
    check_url(URL("http://127.0.0.1/"), opened)
    check_url(URL("http://169.254.169.254/"), opened)
    assert is_public("8.8.8.8") and not is_public("224.0.0.1") and not is_public("x")
    assert is_public("64:ff9b::808:808")  # NAT64 of a public address


# -- validated before anything is fetched --


async def test_the_whole_request_is_validated_before_any_fetch(aiohttp_client, private):
    c = await client(aiohttp_client, "--allow-private-image-hosts",
                     "--max-images", "16", "--max-messages", "4")
    status, raw = await post(c, image_body(*[private.url("a.png")] * 17))
    assert status == 400 and b"Too many images: 17" in raw, raw
    status, raw = await post(c, image_body(private.url("a.png"), messages=5))
    assert status == 400 and b"Too many messages: 5" in raw, raw
    status, raw = await post(c, {**image_body(private.url("a.png")), "temperature": "hot"})
    assert status == 400 and b"temperature" in raw, raw
    assert private.hits == []
    # A text completion has no messages: nothing to fetch.
    r = await c.post("/v1/completions", json={"prompt": "x", **image_body(private.url("a.png"))})
    assert r.status == 200, await r.text()
    assert private.hits == []
    status, raw = await post(c, image_body(*[private.url("a.png")] * 16))
    assert status == 200, raw
    assert private.hits == ["a.png"] * 16


# -- redirects, each hop checked --


async def test_redirects_are_checked_hop_by_hop_and_bounded(aiohttp_client, private, public):
    c = await client(aiohttp_client)
    assert (await post(c, image_body(public.url("a.png"))))[0] == 200  # 127.0.0.2 is "public"
    to_private = public.url("to") + "?url=" + private.url("a.png")
    assert the_one_text(*await post(c, image_body(to_private)))
    assert private.hits == []
    public.hits.clear()
    assert the_one_text(*await post(c, image_body(public.url("loop"))))
    assert public.hits == ["loop"] * 4  # the request and 3 redirects
    assert (await post(c, image_body(public.url("chain?n=3"))))[0] == 200
    assert the_one_text(*await post(c, image_body(public.url("chain?n=4"))))


# -- names: the addresses they resolve to are checked, then connected to --


class FakeResolver:
    def __init__(self, names):
        self.names = names

    async def resolve(self, host, port=0, family=socket.AF_INET):
        if host not in self.names:
            raise OSError(f"no such name: {host}")
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": 0} for a in self.names[host]]

    async def close(self):
        pass


async def test_names_resolving_to_private_addresses_are_refused(
        aiohttp_client, private, public, monkeypatch):
    from mlx_lm_plus.http import remote_images

    monkeypatch.setattr(remote_images, "make_resolver", lambda: FakeResolver({
        "private.test": ["127.0.0.1"],
        "public.test": ["127.0.0.2"],
        "mixed.test": ["127.0.0.2", "127.0.0.1"],
    }))
    c = await client(aiohttp_client)
    status, raw = await post(c, image_body(public.url("a.png", host="public.test")))
    assert status == 200, raw  # the fake resolver is the one used
    assert public.hits == ["a.png"]
    for url in (private.url("a.png", host="private.test"),
                public.url("a.png", host="mixed.test"),
                public.url("a.png", host="nowhere.test")):
        assert the_one_text(*await post(c, image_body(url)))
    # A redirect to a name is resolved and checked too.
    to_name = public.url("to") + "?url=" + private.url("a.png", host="private.test")
    assert the_one_text(*await post(c, image_body(to_name)))
    assert private.hits == [] and public.hits == ["a.png", "to"]


# -- one deadline and one byte budget for the whole set --


async def test_one_deadline_for_all_the_images(aiohttp_client, private):
    c = await client(aiohttp_client, "--allow-private-image-hosts",
                     "--remote-image-timeout", "0.5")
    start = time.monotonic()
    status, raw = await post(c, image_body(private.url("slow.png?s=5"),
                                           private.url("slow.png?s=5")))
    took = time.monotonic() - start
    assert the_one_text(status, raw)
    assert took < 2.0, took
    # Fetched concurrently: four images of 0.4 s each fit in 1.5 s.
    c = await client(aiohttp_client, "--allow-private-image-hosts",
                     "--remote-image-timeout", "1.5")
    status, raw = await post(c, image_body(*[private.url("slow.png?s=0.4")] * 4))
    assert status == 200, raw


async def test_byte_bounds_each_image_and_all_together(aiohttp_client, private):
    c = await client(aiohttp_client, "--allow-private-image-hosts",
                     "--max-image-bytes", "4000")
    assert the_one_text(*await post(c, image_body(private.url("big.png?n=5000"))))
    assert the_one_text(*await post(c, image_body(private.url("big-chunked.png"))))
    assert (await post(c, image_body(private.url("a.png"))))[0] == 200
    # Each within --max-image-bytes, together over --max-request-bytes.
    c = await client(aiohttp_client, "--allow-private-image-hosts",
                     "--max-image-bytes", "4000", "--max-request-bytes", "6000")
    status, raw = await post(c, image_body(private.url("big.png?n=3500"),
                                           private.url("big.png?n=3500")))
    assert status == 400 and b"could not fetch the remote image" in raw, raw


# -- a real vision model, the image fetched --


def test_vision_completion_from_a_remote_image(fixture_path):
    """The qwen2_vl fixture in-process: a fetched image answers as the same
    image sent as a data URL."""
    from aiohttp.test_utils import TestClient, TestServer

    from mlx_lm_plus.http.server import make_app
    from mlx_lm_plus.app import build
    from mlx_lm_plus.config import parse_args
    from tests.models.test_vision import png

    data_url = png((200, 30, 30))
    raw = base64.b64decode(data_url.partition(",")[2])

    async def main():
        async def serve(request):
            return web.Response(body=raw, content_type="image/png")

        images_app = web.Application()
        images_app.router.add_get("/red.png", serve)
        images = TestServer(images_app, host="127.0.0.1")
        await images.start_server()
        args = parse_args(["--model", str(fixture_path("qwen2_vl")), "--allow-remote-images",
                           "--allow-private-image-hosts"])
        engine, server = build(args)
        engine.start()
        try:
            async with TestClient(TestServer(make_app(server))) as c:
                answers = []
                for url in (data_url, f"http://127.0.0.1:{images.port}/red.png"):
                    r = await c.post(CHAT, json={"max_tokens": 6, "messages": [{
                        "role": "user", "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": "What is it?"}]}]})
                    assert r.status == 200, await r.text()
                    answers.append((await r.json())["choices"][0]["message"])
                assert answers[0] == answers[1]
        finally:
            await images.close()
            engine.stop_and_join(timeout=30)

    asyncio.run(main())


async def test_fetched_images_count_in_the_request_pixel_budget(aiohttp_client, private):
    """Each fetched image is within the per-image limits, but together they
    are over --max-request-image-pixels: refused, as the same images sent
    as data URLs are."""
    w, h = Image.open(io.BytesIO(PICTURE)).size
    c = await client(aiohttp_client, "--allow-private-image-hosts",
                     "--max-request-image-pixels", str(w * h * 2 - 1))
    status, raw = await post(c, image_body(private.url("a.png"), private.url("a.png")))
    assert status == 400 and b"in all" in raw, raw
    status, raw = await post(c, image_body(private.url("a.png")))
    assert status == 200, raw
