"""--allow-remote-images: fetch http(s) image URLs into data URLs.

Upstream mlx_lm.server fetches any URL a client names, unbounded, from the
server's own network. Here the fetch

- runs only once `parse_request` has accepted the whole body (message and
  image counts included), so a refused request fetches nothing;
- fetches a request's images concurrently, under one deadline for them all
  (--remote-image-timeout) and one byte budget (each image within
  --max-image-bytes, all of them together within --max-request-bytes);
- connects only to globally routable addresses unless
  --allow-private-image-hosts: the connector's resolver refuses a name when
  any address it resolves to is not allowed (the connector connects to the
  addresses the check saw, so DNS cannot answer differently in between), and
  IP-literal hosts, which aiohttp does not resolve, are checked before each
  request;
- follows no redirect by itself: at most MAX_REDIRECTS, by hand, each hop
  checked like the first;
- takes no proxy from the environment; http and https only.

The fetched bytes then get the checks a data URL gets (`_validate_images`:
bytes, header decode, pixels). Every failure answers the same text
(`fetch_error`), so a client learns nothing about the server's network (which
ports are open, which names resolve, what a host answers); the reason goes to
the server log only.
"""

import asyncio
import base64
import ipaddress
import logging
import re
import socket
from typing import List, Optional, Tuple

import aiohttp
from aiohttp.abc import AbstractResolver
from mlx_lm_plus.upstream import image_parts, image_url
from yarl import URL

from mlx_lm_plus.protocols.validation import RequestError, _validate_images

log = logging.getLogger(__name__)

MAX_REDIRECTS = 3
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_MIME = re.compile(r"^[A-Za-z0-9.+-]+/[A-Za-z0-9.+-]+$")


def fetch_error(index: int) -> RequestError:
    """The one answer to every remote image that could not be used."""
    return RequestError(f"Image {index}: could not fetch the remote image", 400)


def is_remote(url) -> bool:
    """An image URL this module fetches (the test `_validate_images` uses)."""
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def is_public(address: str) -> bool:
    """A globally routable unicast address: not private, loopback,
    link-local, shared (100.64/10), reserved, unspecified or multicast."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv6 forms that carry an IPv4 address reach that address (through
        # a NAT64 or 6to4 gateway, or a dual stack): judge the IPv4 one.
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip.sixtofour is not None:
            ip = ip.sixtofour
        elif ip.teredo is not None:
            ip = ip.teredo[1]
        elif any(ip in net for net in _EMBEDDING_IPV4):
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.is_global and not ip.is_multicast


# NAT64 (well-known and local-use prefixes), IPv4-compatible and
# IPv4-translated addresses: the last 32 bits are an IPv4 address.
_EMBEDDING_IPV4 = [ipaddress.ip_network(n) for n in (
    "64:ff9b::/96", "64:ff9b:1::/48", "::/96", "::ffff:0:0:0/96")]


def address_allowed(address: str, cli) -> bool:
    if cli.allow_private_image_hosts:
        return True
    return is_public(address)


class Refused(OSError):
    """A target this server does not fetch from (a reason for the log)."""


class _Failed(Exception):
    """A remote image that could not be used (a reason for the log)."""


def make_resolver() -> AbstractResolver:
    """The resolver the checking one asks (tests replace it)."""
    return aiohttp.DefaultResolver()


class CheckingResolver(AbstractResolver):
    """Resolves with `inner`, and refuses a name when any of its addresses
    is not allowed. As the connector's resolver, what it checks is what the
    connector connects to."""

    def __init__(self, inner: AbstractResolver, allowed):
        self._inner = inner
        self._allowed = allowed

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET):
        infos = await self._inner.resolve(host, port, family)
        if not infos:
            raise Refused(f"{host!r} resolves to no address")
        refused = [info["host"] for info in infos if not self._allowed(info["host"])]
        if refused:
            raise Refused(f"{host!r} resolves to {refused[0]}, which is not allowed "
                          "(--allow-private-image-hosts)")
        return infos

    async def close(self) -> None:
        await self._inner.close()


def _looks_like_ip(host: str) -> bool:
    # aiohttp's own test for hosts it connects to without resolving them.
    return ":" in host or host.replace(".", "").isdigit()


def check_url(url: URL, cli) -> None:
    """Scheme and, for an IP-literal host, the address (names are checked
    by CheckingResolver when the connector resolves them)."""
    if url.scheme not in ("http", "https"):
        raise Refused(f"scheme {url.scheme!r} is not fetched")
    host = url.raw_host
    if not host:
        raise Refused("no host")
    if _looks_like_ip(host):
        try:
            canonical = str(ipaddress.ip_address(host))
        except ValueError:
            raise Refused(f"{host!r} is not a canonical IP address") from None
        if not address_allowed(canonical, cli):
            raise Refused(f"{host} is not allowed (--allow-private-image-hosts)")


class _Budget:
    """Bytes all the images of one request may still take."""

    def __init__(self, total: Optional[int]):
        self.left = total

    def take(self, n: int) -> None:
        if self.left is None:
            return
        self.left -= n
        if self.left < 0:
            raise _Failed("the remote images together are larger than "
                          "--max-request-bytes")


async def _fetch(session: aiohttp.ClientSession, url_text: str, cli,
                 budget: _Budget) -> Tuple[str, bytes]:
    """(mime, bytes) of one image, following at most MAX_REDIRECTS."""
    limit = cli.max_image_bytes
    url = URL(url_text)
    for _ in range(MAX_REDIRECTS + 1):
        check_url(url, cli)
        async with session.get(url, allow_redirects=False) as r:
            if r.status in REDIRECT_STATUSES:
                location = r.headers.get("Location")
                if not location:
                    raise _Failed(f"{url} answered {r.status} without a Location")
                url = r.url.join(URL(location)).with_fragment(None)
                continue
            if r.status != 200:
                raise _Failed(f"{url} answered {r.status}")
            if limit is not None and (r.content_length or 0) > limit:
                raise _Failed(f"{url} is {r.content_length} bytes, more than "
                              f"{limit} (--max-image-bytes)")
            data = bytearray()
            async for chunk in r.content.iter_any():
                budget.take(len(chunk))
                data += chunk
                if limit is not None and len(data) > limit:
                    raise _Failed(f"{url} is more than {limit} bytes (--max-image-bytes)")
            mime = r.content_type if _MIME.match(r.content_type or "") else (
                "application/octet-stream")
            return mime, bytes(data)
    raise _Failed(f"more than {MAX_REDIRECTS} redirects (last: {url})")


async def _fetch_checked(session, url_text: str, cli, budget: _Budget) -> dict:
    """The data-URL part for one remote image, checked like a sent one."""
    mime, data = await _fetch(session, url_text, cli, budget)
    # Encoding and checking take ~3 ms a MB: not on the event loop.
    return await asyncio.get_running_loop().run_in_executor(
        None, _checked_part, url_text, mime, data, cli)


def _checked_part(url_text: str, mime: str, data: bytes, cli) -> dict:
    part = {"type": "image_url", "image_url": {
        "url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}
    try:
        _validate_images({"messages": [{"role": "user", "content": [part]}]}, cli)
    except RequestError as e:
        raise _Failed(f"{url_text}: {e}") from e
    return part


async def inline_remote_images(messages, cli, *,
                               resolver: Optional[AbstractResolver] = None) -> None:
    """Replace each http(s) image part of a validated chat request's messages
    by a data-URL part, or raise `fetch_error` for the first image that could
    not be used."""
    if not isinstance(messages, list) or not cli.allow_remote_images:
        return
    remote: List[Tuple[int, dict]] = [
        (i, part) for i, part in enumerate(image_parts(messages)) if is_remote(image_url(part))
    ]
    if not remote:
        return
    deadline = cli.remote_image_timeout
    checking = CheckingResolver(resolver or make_resolver(),
                                lambda address: address_allowed(address, cli))
    connector = aiohttp.TCPConnector(resolver=checking, use_dns_cache=False)
    budget = _Budget(cli.max_request_bytes)
    tasks = {}
    try:
        async with aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=deadline),
            trust_env=False,
        ) as session:
            try:
                for i, part in remote:
                    task = asyncio.create_task(
                        _fetch_checked(session, image_url(part), cli, budget))
                    tasks[task] = (i, part)
                done, pending = await asyncio.wait(
                    tasks, timeout=deadline, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.wait(tasks)
    finally:
        await checking.close()

    errors, unfinished = [], []
    for task, (i, part) in tasks.items():
        error = None if task.cancelled() else task.exception()
        if task not in done:
            unfinished.append(i)
            reason = (f"not fetched within --remote-image-timeout ({deadline:g} s), "
                      "or stopped when another image failed")
        elif error is not None:
            errors.append(i)
            reason = str(error) if isinstance(error, (_Failed, Refused)) else repr(error)
        else:
            continue
        log.warning("Remote image %d (%s) not used: %s", i, image_url(part), reason)
    if errors or unfinished:
        # The first image that failed; without one, the first that timed out.
        raise fetch_error(min(errors or unfinished))
    for task, (i, part) in tasks.items():
        fetched = task.result()
        part.clear()
        part.update(fetched)
    # Each image was checked alone; the request's limits on all its images
    # together (--max-request-image-pixels) hold for fetched ones too.
    await asyncio.get_running_loop().run_in_executor(
        None, _validate_images, {"messages": messages}, cli)
