"""HTTP layer: aiohttp handlers with mlx_lm.server 0.32.2's routes and shapes.

The event loop never touches MLX. A completion is submitted to the engine
with an `AsyncChannel`; the generation thread hands events over with
`call_soon_threadsafe` and the handler awaits them. Disconnects cancel the
channel, and the engine drops the request at its next step.
"""

import asyncio
import collections
import hmac
import ipaddress
import json
import logging
import time
import uuid
from pathlib import Path
from typing import List, Optional

from aiohttp import web
from mlx_lm.server import ModelDescription, _image_parts, _image_url

from mlx_lm_plus.http.bodies import BodyError, parse_body
from mlx_lm_plus.cache.store import READ_AHEAD_SECONDS
from mlx_lm_plus.http.connections import HEAD_SECONDS, ConnectionLimit, default_max_open
from mlx_lm_plus.planning.constraints import (
    ConstraintError,
    ConstraintUnavailable,
    ForcedToolCall,
    StrictToolCalls,
    compile_response_format,
    prepare,
)
from mlx_lm_plus.engine.channel import Channel
from mlx_lm_plus.errors import EngineUnavailable, InternalError, PromptError
from mlx_lm_plus.planning.lanes import Lane, LaneBusy
from mlx_lm_plus.logs import warn_once
from mlx_lm_plus.http.metrics import Metrics, RequestRecord, cache_entries
from mlx_lm_plus.protocols.assembler import CompletionAssembler, ResponseBuilder
from mlx_lm_plus.protocols.validation import RequestError, parse_request
from mlx_lm_plus.models.vision import decode_images
from mlx_lm_plus.protocols.base import Completion, WireProtocol

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
# Endpoints that change the server's state or show what other clients sent.
# They get no CORS headers and refuse cross-origin callers without the API
# key: otherwise any web page the operator opens could call them on localhost.
ADMIN_PATHS = ("/v1/cache", "/v1/cache/stats", "/v1/stats", "/metrics")
DASHBOARD = Path(__file__).with_name("dashboard.html")
# How the app is served (app.serve, and the tests' servers): request bodies
# are read as sent, never decompressed, as upstream's http.server did; a
# compressed one gets a 415 (Server._read_body) instead of a bomb, a parser's
# text 400, or a half-sent stream that never ends.
# A connection gets connections.HEAD_SECONDS for a request's head (aiohttp's
# keepalive_timeout, 3,630 s by default in an AppRunner).
RUNNER_OPTIONS = {"auto_decompress": False, "keepalive_timeout": HEAD_SECONDS}
# Bodies larger than this are decoded and parsed in an executor.
LARGE_BODY_BYTES = 256 << 10
# Bodies still coming are not counted in flight: a client that never sends
# its body must not hold a place a real request needs. What bounds them is
# the bytes actually received and held at once, until parsed (a stalled
# connection holds none), at most RECEIVING_BYTES or twice
# --max-request-bytes; and time, as Apache's mod_reqtimeout does: a body
# gets a 408 when no byte comes for BODY_IDLE_SECONDS, or when it is past
# BODY_IDLE_SECONDS plus a second per BODY_MIN_RATE bytes received (a slow
# upload that keeps that rate goes on; a trickle can't hold bytes for ever).
RECEIVING_BYTES = 1 << 30
BODY_IDLE_SECONDS = 60.0
BODY_MIN_RATE = 64 << 10
# Lanes (lanes.py): a request's prompt is planned in the large lane when its
# body (and a conversation it continues) is larger than LARGE_LANE_PLAN_BYTES
# (images, long conversations), its constraint compiled in the large one
# when the body is larger than LARGE_LANE_CONSTRAINT_BYTES (a schema can't
# be larger than its body), which holds at most LARGE_LANE_HELD requests
# and turns more away (large plans are bounded by the requests in flight).
LARGE_LANE_PLAN_BYTES = 1 << 20
LARGE_LANE_CONSTRAINT_BYTES = 64 << 10
LARGE_LANE_HELD = 16
# Where a request keeps its SSE response once the head is sent: from then
# on an error ends that stream, and no other response is written.
OPEN_STREAM = (web.RequestKey("mlx_lm_plus.open_stream", web.StreamResponse)
               if hasattr(web, "RequestKey") else "mlx_lm_plus.open_stream")


# What AsyncChannel.get returns when nothing came in time.
IDLE = object()

# A stream's heartbeat ticks this many times a KEEPALIVE_SECONDS: the longest
# silence is KEEPALIVE_SECONDS and one tick.
BEATS = 4

# A stream that has sent no frame for this long gets a keepalive (Anthropic:
# a ping event; chat completions and Responses: an SSE comment): clients give
# up on a silent stream (Claude Code resent a request whose prefill ran for
# minutes with a keepalive every ~150 s), and prefill progress alone comes
# once per prefill step, which takes minutes for a long prompt on a slow
# machine.
KEEPALIVE_SECONDS = 10.0


class _Pulse:
    """When a stream's next keepalive is due: KEEPALIVE_SECONDS after the
    last frame a client's idle timer counts (SSE comments don't count for
    clients whose parser drops them: Anthropic's SDKs)."""

    def __init__(self):
        self.last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= KEEPALIVE_SECONDS

    def beat(self) -> None:
        self.last = time.monotonic()


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


class Server:
    """The handlers, with the engine and the settings they need."""

    def __init__(self, cli_args, engine, model_provider, system_fingerprint: str,
                 metrics: Optional[Metrics] = None):
        self.cli_args = cli_args
        self.engine = engine
        self.model_provider = model_provider
        self.system_fingerprint = system_fingerprint
        # Completions accepted and not yet answered (the event loop's own
        # count), once their bodies are in; `reading`: those still coming.
        self.in_flight = 0
        self.reading = 0
        # Of those in flight, the ones not submitted to the engine yet (being
        # parsed and planned): the engine's first prefill step of a burst
        # waits a little for them (Engine.arrivals).
        self.arriving = 0
        self.receiving_bytes = 0  # (of bodies being read or parsed)
        self.body_progress_at = 0.0  # (loop time) when a body's bytes last came
        # Set at shutdown: new completions get 503 and their connections close.
        self.stopping = False
        self.metrics = metrics
        self._decoding = asyncio.Semaphore(2)
        # Prompts are planned (templates, tokenizing) and constraints
        # compiled (llguidance's grammar and matcher) in lanes of their own,
        # off the event loop and the generation thread; a large body's work
        # in a large lane, so that a flood of large schemas or prompts never
        # holds up the others (lanes.py).
        self._planner = Lane("planning")
        self._planner_large = Lane("planning large requests")
        self._counter = Lane("counting tokens")
        self._constraints = Lane("constraints")
        self._constraints_large = Lane("large constraints", LARGE_LANE_HELD)
        self._planning_timeout = getattr(cli_args, "planning_timeout", 60.0)
        # Wire protocols beyond chat completions, by the paths they serve.
        self.protocols: List[WireProtocol] = []
        # Open connections, and room for new ones (connections.py).
        self.connections = ConnectionLimit(default_max_open())

    def add_protocol(self, protocol: WireProtocol) -> None:
        self.protocols.append(protocol)

    def protocol_for(self, path: str) -> Optional[WireProtocol]:
        return next((p for p in self.protocols if p.serves(path)), None)

    @property
    def max_in_flight(self) -> int:
        """Requests the server holds at once: a full batch plus the queue."""
        queued = getattr(self.cli_args, "max_queued_requests", None)
        if queued is None:
            return 1 << 62
        return self.cli_args.decode_concurrency + queued

    # -- headers --

    def cors_headers(self, request: web.Request) -> dict:
        if request.path in ADMIN_PATHS:
            return {}
        allowed = self.cli_args.allowed_origins
        origin = request.headers.get("Origin")
        headers = {}
        if "*" in allowed:
            headers["Access-Control-Allow-Origin"] = "*"
        elif origin in allowed:
            headers["Access-Control-Allow-Origin"] = origin
            headers["Vary"] = "Origin"
        headers["Access-Control-Allow-Methods"] = "*"
        headers["Access-Control-Allow-Headers"] = "*"
        return headers

    def json_response(self, request, obj, status=200) -> web.Response:
        """`obj` as JSON (bytes: already JSON)."""
        return web.Response(
            body=obj if isinstance(obj, bytes) else json.dumps(obj).encode(),
            status=status,
            content_type="application/json",
            headers=self.cors_headers(request),
        )

    def error(self, request, message: str, status: int = 400) -> web.Response:
        protocol = self.protocol_for(request.path)
        if protocol is not None:
            return self.json_response(request, protocol.error_body(message, status), status)
        return self.json_response(request, {"error": message}, status)

    def unavailable(self, request, message: str, retry_after: int = 1) -> web.Response:
        response = self.error(request, message, 503)
        response.headers["Retry-After"] = str(retry_after)
        return response

    def not_found(self, request) -> web.Response:
        # Upstream answers a plain "Not Found" body with a JSON content type.
        return web.Response(
            body=b"Not Found",
            status=404,
            content_type="application/json",
            headers=self.cors_headers(request),
        )

    # -- routing --

    def authorized(self, request: web.Request) -> bool:
        key = getattr(self.cli_args, "api_key", None)
        # /dashboard is a static page with no data in it; what it shows comes
        # from /v1/stats, which the key guards (the page asks for the key).
        if not key or request.path in ("/health", "/dashboard"):
            return True
        # Anthropic's clients send the key as x-api-key; either header will do
        # (the scheme's case doesn't matter: RFC 7235).
        # (Header text is bytes decoded with surrogateescape: encoded back
        # the same way, odd bytes compare instead of raising.)
        def same(given, expected):
            return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                       expected.encode())

        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        return (same(request.headers.get("x-api-key", ""), key)
                or (scheme.lower() == "bearer" and same(given.strip(" "), key)))

    def foreign_caller(self, request: web.Request) -> Optional[str]:
        """Why an admin request may come from another site's page (None: it
        doesn't): a cross-origin browser request, or a Host header naming
        neither an address nor localhost nor --host (DNS rebinding: a
        foreign domain made to resolve to this machine)."""
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            return f"requests from another origin ({origin})"
        if request.headers.get("Sec-Fetch-Site") in ("cross-site", "same-site"):
            return "cross-site requests"
        host = (request.url.host or "").strip("[]").lower()
        try:
            ipaddress.ip_address(host)
            return None
        except ValueError:
            pass
        if host in ("localhost", str(self.cli_args.host).lower()):
            return None
        return f"requests for host {host!r}"

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        try:
            response = await self._dispatch(request)
            if self.stopping and not response.prepared:
                response.force_close()  # (keep-alive connections close as they answer)
            return response
        except (asyncio.CancelledError, ConnectionResetError, web.HTTPException):
            raise
        except Exception as e:
            # A bug, not the client's fault: a JSON 500, never aiohttp's
            # plain-text page or a dropped connection.
            logging.exception(f"Unhandled error on {request.method} {request.path}")
            stream = request.get(OPEN_STREAM)
            if stream is not None and stream.prepared:
                # Its head is sent: a new response would be written inside
                # its body. (handle_completion ended it in its protocol's
                # way where it could.)
                return stream
            return self.error(request, f"Internal server error: {type(e).__name__}: {e}", 500)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.method == "OPTIONS":
            # CORS preflights carry no credentials: always answered.
            return web.Response(
                status=204,
                content_type="application/json",
                headers=self.cors_headers(request),
            )
        if not self.authorized(request):
            response = self.error(request, "Invalid or missing API key", 401)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if request.path in ADMIN_PATHS and not getattr(self.cli_args, "api_key", None):
            why = self.foreign_caller(request)
            if why is not None:
                return self.error(
                    request, f"{request.path} refuses {why}: call it from this "
                    "server's own pages or a non-browser client, by address or "
                    "localhost (or start the server with --api-key and send the key)", 403)
        protocol = self.protocol_for(request.path)
        if protocol is not None:
            if request.method == "POST" and request.path in protocol.paths:
                return await self.handle_completion(request, protocol)
            answer = protocol.route(request.method, request.path)
            if answer is not None:
                return self.json_response(request, answer[1], answer[0])
            return self.error(request, f"Not found: {request.method} {request.path}", 404)
        if request.method == "GET":
            if request.path.startswith("/v1/models"):
                return await self.handle_models(request)
            if request.path == "/health":
                return self.handle_health(request)
            # The store's lock is the generation thread's too (an insert
            # holds it): snapshots are taken in an executor, never on the loop.
            loop = asyncio.get_running_loop()
            if request.path == "/v1/cache/stats":
                return self.json_response(
                    request, await loop.run_in_executor(None, self.engine.cache_snapshot))
            if request.path == "/v1/stats":
                cache = await loop.run_in_executor(None, self.cache_stats)
                return self.json_response(request, self.stats(request.query, cache))
            if request.path == "/metrics" and self.metrics is not None:
                # (Its collector reads the store, whose lock is the
                # generation thread's too.)
                return web.Response(
                    body=await loop.run_in_executor(None, self.metrics.exposition),
                    headers={"Content-Type": self.metrics.content_type,
                             **self.cors_headers(request)},
                )
            if request.path == "/dashboard":
                return web.Response(
                    body=DASHBOARD.read_bytes(),
                    content_type="text/html",
                    charset="utf-8",
                    headers=self.cors_headers(request),
                )
            return self.not_found(request)
        if request.method == "DELETE" and request.path == "/v1/cache":
            # Deleting the disk tier's files takes a while: not on the loop.
            loop = asyncio.get_running_loop()
            try:
                cleared = await loop.run_in_executor(None, self.engine.clear_cache)
            except EngineUnavailable as e:  # (under mx.distributed: the group is down)
                return self.error(request, str(e), 503)
            return self.json_response(request, cleared)
        if request.method == "POST":
            if request.path not in COMPLETION_PATHS:
                return self.not_found(request)
            return await self.handle_completion(request)
        return self.error(request, f"Unsupported method ({request.method!r})", 501)

    def handle_health(self, request):
        if self.stopping:
            return self.json_response(
                request, {"status": "unavailable", "reason": "server shutting down"}, 503)
        if self.engine.is_healthy:
            return self.json_response(request, {"status": "ok"})
        return self.json_response(
            request,
            {"status": "unavailable", "reason": self.engine.unhealthy_reason},
            503,
        )

    def cache_stats(self) -> dict:
        """The store's part of /v1/stats (off the loop: the store's lock is
        the generation thread's too)."""
        out = {"cache": self.engine.cache_snapshot()}
        if self.metrics is not None:
            out["entries"] = cache_entries(self.engine.store)
        return out

    def stats(self, query, cache) -> dict:
        """/v1/stats: engine, memory and cache now; with metrics on, the
        recent requests (`?since=T`: only those ended after T, `?limit=N`),
        the time series and the cache entries. `cache`: cache_stats()."""
        query = query or {}
        engine = self.engine
        stats = {
            "engine": {
                "healthy": engine.is_healthy,
                "unhealthy_reason": engine.unhealthy_reason,
                "restarts": engine.restarts,
                "active_requests": engine.active_requests,
                "queued_requests": engine.requests.qsize(),
                "vision": engine.vision_stats(),
                # The generation thread's time: in model steps, admitting
                # requests, and the rest (see Engine.thread_seconds).
                "thread_seconds": {k: round(v, 6) for k, v in
                                   getattr(engine, "thread_seconds", {}).items()},
                "admitted_requests": getattr(engine, "admitted", None),
                # Of them, planned on the generation thread: the model was
                # not loaded yet, another was named, or images.
                "planned_at_admission": getattr(engine, "planned_at_admission", None),
                "generated_tokens": getattr(engine, "tokens_out", None),
            },
            "http": {"in_flight": self.in_flight, "max_in_flight": self.max_in_flight,
                     "receiving_bodies": self.reading,
                     "receiving_bytes": self.receiving_bytes,
                     "connections": self.connections.open_connections(),
                     "max_connections": self.connections.max_open,
                     "connections_closed_for_room": self.connections.closed},
            "memory": engine.memory(),
            "models": engine.models(),
            "cache": cache["cache"],
        }
        if self.metrics is not None:
            try:
                limit = int(query.get("limit", 1000))
                since = float(query.get("since", 0))
            except ValueError:
                limit, since = 1000, 0.0
            stats.update(self.metrics.stats(limit=limit, since=since))
            stats["entries"] = cache["entries"]
        return stats

    async def handle_models(self, request):
        loop = asyncio.get_running_loop()
        models = await loop.run_in_executor(None, self.list_models, request.path)
        return self.json_response(request, {"object": "list", "data": models})

    def list_models(self, path: str):
        """What this server can serve: the served set (--model, --models-dir,
        --models-config), each saying whether it is loaded; with
        --allow-model-loading also the models loaded on request and, as
        upstream, the downloaded MLX models in the Hugging Face cache."""
        parts = path.split("/")
        filter_id = "/".join(parts[3:]) if len(parts) > 3 else None
        created = int(time.time())
        served = len(self.model_provider.served)
        models = [{"id": m["id"], "object": "model", "created": created,
                   "owned_by": "mlx_lm_plus", "loaded": m["loaded"], "pinned": m["pinned"]}
                  for i, m in enumerate(self.engine.models())
                  if i < served or self.cli_args.allow_model_loading]
        if self.cli_args.allow_model_loading:
            # (Upstream's path filter applies to these only.)
            listed = {m["id"] for m in models}
            models += [m for m in _hub_cache_models(created)
                       if m["id"] not in listed and filter_id in (None, m["id"])]
        return models

    # -- completions --

    async def _read_body(self, request):
        if request.headers.get("Content-Length") is None:
            raise RequestError("Content-Length header is required", 411)
        limit = getattr(self.cli_args, "max_request_bytes", None)
        if limit is not None and (request.content_length or 0) > limit:
            raise RequestError(
                f"Request body is larger than {limit} bytes (--max-request-bytes)", 413)
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # Bodies are not decompressed (aiohttp's auto_decompress is off, as
            # upstream's http.server never decoded them): a compressed body
            # would otherwise be a bomb, or hang a half-sent stream.
            raise RequestError(
                f"Content-Encoding {encoding!r} is not supported: send the body "
                "uncompressed", 415)
        raw = await self._receive(request, request.content_length or 0)
        try:
            # (~10 ms a MB; the nesting check walks bodies of many brackets)
            if len(raw) > LARGE_BODY_BYTES or raw.count(b"{") + raw.count(b"[") > 4096:
                return await asyncio.get_running_loop().run_in_executor(None, _parse_body, raw)
            return _parse_body(raw)
        finally:
            self.receiving_bytes -= len(raw)  # (held until parsed)

    async def _receive(self, request, length: int) -> bytearray:
        """The body's `length` bytes as they come, counted in
        receiving_bytes (503 past the bound; the caller releases them once
        parsed); 408 when too slow (BODY_IDLE_SECONDS, BODY_MIN_RATE)."""
        limit = getattr(self.cli_args, "max_request_bytes", None) or 0
        bound = max(RECEIVING_BYTES, 2 * limit)
        loop = asyncio.get_running_loop()
        start, raw = loop.time(), bytearray()
        # Set when the body is given up: to make room for a new connection,
        # or at shutdown (connections.py).
        given_up = self.connections.receiving(request)
        try:
            while len(raw) < length:
                deadline = start + BODY_IDLE_SECONDS + len(raw) / BODY_MIN_RATE
                wait = min(BODY_IDLE_SECONDS, deadline - loop.time())
                read = asyncio.ensure_future(
                    request.content.read(min(1 << 20, length - len(raw))))
                try:
                    if wait > 0:
                        await asyncio.wait((read, given_up), timeout=wait,
                                           return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not read.done():
                        read.cancel()  # (its bytes stay in the stream)
                    elif not read.cancelled():
                        read.exception()  # (retrieved: the handler may be cancelled with it)
                if given_up.done():
                    raise RequestError(f"{given_up.result()}: the request body was still "
                                       f"coming ({len(raw)} of {length} bytes)", 503)
                if not read.done() or read.cancelled():
                    raise RequestError(f"The request body came too slowly ({len(raw)} of "
                                       f"{length} bytes in {loop.time() - start:.0f} s)",
                                       408)
                chunk = read.result()
                if not chunk:
                    raise RequestError(f"The request body ended after {len(raw)} of "
                                       f"{length} bytes (Content-Length)", 400)
                raw += chunk
                self.receiving_bytes += len(chunk)
                self.body_progress_at = loop.time()
                if self.receiving_bytes > bound:
                    raise RequestError(f"Server busy: {self.receiving_bytes >> 20} MiB of "
                                       "request bodies being received", 503)
        except BaseException as e:  # (408, 503, 400 above; the client going away)
            self.receiving_bytes -= len(raw)
            if isinstance(e, (web.HTTPException, web.RequestPayloadError)):
                raise RequestError(f"Could not read the request body: {e}", 400) from e
            raise
        finally:
            self.connections.received(request)
        return raw

    def stop_receiving(self) -> None:
        """At shutdown, once --shutdown-timeout is over: bodies still coming
        are answered with a 503 (else the runner's cleanup would cut their
        connections with no answer)."""
        self.connections.give_up_bodies("server shutting down")

    async def _decode_images(self, req, model):
        """Decode, scale down and fingerprint a request's images in an
        executor: neither the event loop nor the generation thread spends
        its time on pixels (a 40-megapixel image takes about a second)."""
        if req.request_type != "chat":
            return
        urls = [_image_url(p) for p in _image_parts(req.messages)]
        if not urls:
            return
        loop = asyncio.get_running_loop()
        # (Off the loop: for a model not loaded yet, its config files are read.)
        if not await loop.run_in_executor(None, self.engine.serves_vision, model):
            return
        try:
            # Two requests' images decode at once: each holds its pixels
            # (up to --max-request-image-pixels) until the engine plans it.
            async with self._decoding:
                req.images = await loop.run_in_executor(
                    None, lambda: decode_images(urls, self.engine.image_max_pixels(model))
                )
        except Exception as e:
            raise RequestError(f"An image could not be decoded: {e}") from e

    async def _constrain(self, req, model, body_bytes: int):
        """Structured output, compiled for the loaded model's tokenizer and
        its matcher built before the request is queued (in a constraint
        lane: a schema of a large body in the large lane, so that small
        schemas never wait behind large ones): a schema llguidance can't
        take is a 400 here."""
        if not _may_constrain(req):
            return
        lane = self._constraints_large if body_bytes > LARGE_LANE_CONSTRAINT_BYTES \
            else self._constraints
        try:
            req.constraint = await self._in_lane(lane, self._compile_constraint, req, model)
        except ConstraintError as e:
            raise RequestError(str(e)) from e

    def _compile_constraint(self, req, model):
        """(In a constraint lane.) The request's constraint: a Prepared for
        the loaded model's tokenizer, else checked as far as it can be
        without one (the engine compiles it at admission). Raises
        ConstraintError."""
        choice = req.tool_choice
        key = self.model_provider.key_for(model)
        if choice == "required" or isinstance(choice, dict):
            name = choice["function"]["name"] if isinstance(choice, dict) else None
            constraint = ForcedToolCall(req.tools, name)
        elif req.response_format is not None and req.response_format.get("type") != "text":
            # (With strict tools too: the answer is held to the format, and
            # the model can't call a tool; see the README.)
            constraint = compile_response_format(req.response_format)
        elif choice != "none" and StrictToolCalls.wanted(req.tools) and not key[2]:
            # Best effort: a model or setup that can't hold calls to a schema
            # (another tool format, a draft model) serves the request as
            # upstream does; only a strict tool's broken schema is a 400.
            constraint = StrictToolCalls(req.tools)
        else:
            return None
        lm = self.model_provider.get(key)
        if constraint is None or lm is None:
            return constraint
        try:
            return prepare(constraint, lm.tokenizer)
        except ConstraintUnavailable as e:
            if not isinstance(constraint, StrictToolCalls):
                raise
            warn_once(f"strict tools served unconstrained: {e}")
            return None

    async def _in_lane(self, lane: Lane, fn, *args):
        """fn(*args) in `lane`, within --planning-timeout, given up if the
        engine goes down meanwhile."""
        return await lane.run(fn, *args, deadline=self._planning_timeout,
                              still_wanted=self._engine_down)

    def _engine_down(self) -> Optional[Exception]:
        """What a request waiting in a lane gives up with when the engine
        went down meanwhile (None: it is up)."""
        if self.engine.is_healthy:
            return None
        return EngineUnavailable(f"Generation engine unavailable: {self.engine.unhealthy_reason}")

    async def _plan(self, parsed, body_bytes: int):
        """Plan the prompt in a planning lane before the request is queued
        (a large body's in the large lane: images, long conversations), so
        the generation thread only looks it up (Engine.plan; None: the
        engine plans it at admission). A bad prompt is the client's 400;
        LaneBusy past --planning-timeout."""
        plan = getattr(self.engine, "plan", None)
        if plan is None or parsed.request.count_only:
            return
        size = body_bytes + parsed.carried_bytes
        lane = self._planner_large if size > LARGE_LANE_PLAN_BYTES else self._planner
        try:
            planned = parsed.request.planned = await self._in_lane(
                lane, plan, parsed.request, parsed.args)
        except PromptError as e:
            raise RequestError(str(e)) from e
        except (LaneBusy, EngineUnavailable):
            raise
        except Exception:  # the engine plans it again, and answers
            logging.exception("Planning a prompt failed")
            return
        if planned is not None and planned.on_disk:
            # Its disk entry read here, not on the generation thread; if
            # another request's handler is reading it, that read is waited
            # for (not cancelled if this client goes: others may wait too).
            loop = asyncio.get_running_loop()
            reading = await loop.run_in_executor(None, self.engine.read_ahead, planned)
            if reading is not None:
                await asyncio.wait({asyncio.wrap_future(reading)}, timeout=READ_AHEAD_SECONDS)

    def _vocab_size(self, name):
        """Model `name`'s vocabulary size for the top_k and logit_bias checks
        (from its config.json while it isn't loaded; None when unknown: the
        engine checks once it is loaded)."""
        desc = ModelDescription(name if isinstance(name, str) else "default_model",
                                "default_model", None)
        if not self.model_provider.is_served(desc):
            return None  # (a 404 follows: no file a client names is read)
        return self.model_provider.vocab_size(self.model_provider.key_for(desc))

    def _parse(self, path: str, body, protocol: Optional[WireProtocol]):
        """A completion body -> (ParsedRequest, whether its model is served,
        the model's metrics label); RequestError: the client's. Parsed with
        the defaults of the model it names (--models-config) and that
        model's vocabulary for logit_bias when it is loaded."""
        provider = self.model_provider
        name = body.get("model") if isinstance(body, dict) else None
        default = protocol is not None and (name is None or isinstance(name, str) and (
            not provider.is_served(ModelDescription(name, "default_model", None))))
        if default:
            # Agent clients name their own models (claude-..., gpt-...): a
            # name not served means the default model, and is echoed back.
            # (Any other type is the protocol's 400.)
            name = "default_model"
        cli = provider.defaults_for(name)
        parse = parse_request if protocol is None else protocol.parse
        parsed = parse(path, body, cli, self._vocab_size(name))
        if default:
            parsed.args.model = ModelDescription("default_model", "default_model", None)
        return (parsed, provider.is_served(parsed.args.model),
                provider.name_for(parsed.args.model))

    async def handle_completion(self, request: web.Request,
                                protocol: Optional[WireProtocol] = None):
        track = _Tracker(request.path)
        response = None
        try:
            if not self.engine.is_healthy:
                response = self.unavailable(
                    request, f"Generation engine unavailable: {self.engine.unhealthy_reason}"
                )
            elif self.stopping:
                response = self.unavailable(request, "server shutting down")
                response.force_close()
            elif self.in_flight >= self.max_in_flight:
                response = self._busy(request)
            else:
                # Its place is taken once its body is in: clients that open
                # requests and never send their bodies hold none (else a few
                # hundred of them would turn every real request away).
                self.reading += 1
                try:
                    body = await self._read_body(request)
                    track.body_bytes = request.content_length or 0
                except RequestError as e:
                    body, response = None, self.error(request, str(e), e.status)
                finally:
                    self.reading -= 1
                if response is None and self.in_flight >= self.max_in_flight:
                    response = self._busy(request)  # (others came in meanwhile)
                elif response is None:
                    self.in_flight += 1
                    self.arriving += 1
                    track.arriving = True
                    try:
                        response = await self._handle_completion(request, body, track,
                                                                 protocol)
                    except ConnectionResetError:
                        raise
                    except Exception as e:
                        stream = request.get(OPEN_STREAM)
                        if stream is None or not stream.prepared:
                            raise  # dispatch answers a 500 in the protocol's shape
                        # Whatever raised once the stream was open (a bug):
                        # the stream ends in its protocol's way, never with
                        # a second response written into it.
                        logging.exception("Unhandled error in a stream")
                        response = await self._end_stream(
                            stream, track, f"Internal server error: {type(e).__name__}: {e}",
                            500)
                    finally:
                        self.in_flight -= 1
                        self._arrived(track)
            return response
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels the handler).
            track.cancelled = True
            raise
        except ConnectionResetError:
            # The client went away while its body came (nothing to answer,
            # nothing to log: aiohttp would log a 500 with a traceback).
            track.cancelled = True
            response = web.Response(status=499)
            return response
        finally:
            if self.metrics is not None:
                self.metrics.observe(track.finish(response))

    def _arrived(self, track) -> None:
        """The request is submitted to the engine (or answered before)."""
        if track.arriving:
            track.arriving = False
            self.arriving -= 1

    def _busy(self, request):
        return self.unavailable(request, f"Server busy: {self.in_flight} requests in flight "
                                         "(--decode-concurrency + --max-queued-requests)")

    async def _handle_completion(self, request: web.Request, body, track: "_Tracker",
                                 protocol: Optional[WireProtocol] = None):
        provider = self.model_provider
        try:
            # In an executor: parsing checks each image's header by decoding
            # its base64 (~2 ms a MB; a Responses continuation brings the
            # stored conversation's images too), converts the agent
            # protocols' whole conversations, and looks the client's model
            # name up (on the filesystem too: a folder's path).
            parsed, served, label = await asyncio.get_running_loop().run_in_executor(
                None, self._parse, request.path, body, protocol)
        except RequestError as e:
            return self.error(request, str(e), e.status)
        track.record.model = parsed.requested_model
        track.record.served_model = label
        track.record.stream = parsed.stream
        if not served:
            desc = parsed.args.model
            served = ", ".join(repr(e.name) for e in provider.served)
            return self.error(
                request,
                f"Model not served here: model={desc.model!r}, adapters={desc.adapter!r}, "
                f"draft_model={desc.draft!r}. This server serves {served} (GET /v1/models "
                "lists them; start it with --allow-model-loading to load others).",
                404,
            )
        try:
            if getattr(self.cli_args, "allow_remote_images", False):
                # Only once the whole request validated.
                await inline_remote_images(parsed.request, self.cli_args)
            await self._decode_images(parsed.request, parsed.args.model)
            await self._constrain(parsed.request, parsed.args.model, track.body_bytes)
            await self._plan(parsed, track.body_bytes)
        except RequestError as e:
            return self.error(request, str(e), e.status)
        except (EngineUnavailable, LaneBusy) as e:
            return self.unavailable(request, str(e))

        track.messages = parsed.request.messages  # (a cache miss's message, at the end)
        track.miss_text = getattr(self.cli_args, "cache_miss_text", False)
        exchange = builder = None
        if protocol is not None:
            exchange = track.exchange = protocol.exchange(parsed, f"{uuid.uuid4().hex}")
            track.record.id = exchange.id
        else:
            if request.path == "/v1/completions":
                request_id, object_type = f"cmpl-{uuid.uuid4()}", "text_completion"
            else:
                request_id = f"chatcmpl-{uuid.uuid4()}"
                object_type = "chat.completion.chunk" if parsed.stream else "chat.completion"
            track.record.id = request_id
            builder = ResponseBuilder(
                request_id=request_id,
                object_type=object_type,
                model=parsed.requested_model,
                created=int(time.time()),
                system_fingerprint=self.system_fingerprint,
                stream=parsed.stream,
            )

        if parsed.request.count_only and exchange is not None:
            counted = await self._count(request, parsed, exchange)
            if counted is not None:
                return counted

        channel = AsyncChannel(asyncio.get_running_loop())
        self._arrived(track)
        try:
            self.engine.submit(channel, parsed.request, parsed.args)
        except EngineUnavailable as e:
            return self.unavailable(request, str(e))

        try:
            pulse = _Pulse()
            if parsed.stream:
                channel.beat_every(KEEPALIVE_SECONDS / BEATS)
            first = await channel.get()
            opened = None  # a stream opened before acceptance, for keepalives
            while isinstance(first, tuple) or first is IDLE:
                # Waiting in the queue, or progress before acceptance (images
                # through the vision tower): a stream gets keepalives, as
                # during prefill. (Comments only: a protocol's own events
                # come after its first frames.)
                if parsed.stream and (first is not IDLE or pulse.due()):
                    opened = opened or await self._open_stream(request)
                    await opened.write(_keepalive(first))
                    pulse.beat()
                first = await channel.get()
            if isinstance(first, Exception) and opened is not None:
                return await self._end_stream(opened, track, str(first), _status_of(first))
            if isinstance(first, EngineUnavailable):
                return self.unavailable(request, str(first))
            if isinstance(first, Exception):
                return self.error(request, str(first), _status_of(first))
            ctx = first
            if exchange is not None:
                return await self._exchange(request, channel, ctx, parsed, exchange, track,
                                            opened)
            assembler = CompletionAssembler(
                ctx,
                parsed.request.tools,
                parsed.stream,
                parsed.args.logprobs,
                parsed.args.top_logprobs,
                forced_tool=_forced_tool(parsed.request),
            )
            track.accepted(ctx, assembler)
            if parsed.stream:
                return await self._stream(request, channel, ctx, assembler, builder, parsed,
                                          track, opened)
            return await self._complete(request, channel, ctx, assembler, builder, track)
        finally:
            # Whatever happened (done, error, disconnect), the engine may stop.
            channel.cancel()

    async def _count(self, request, parsed, exchange):
        """count_tokens: the prompt is planned in an executor with the loaded
        model's tokenizer and image processor (rendering a long conversation
        takes seconds: never between batch steps). None: the engine counts
        it (the model isn't loaded yet, or images for one of mlx-lm's own
        vision models)."""
        count = getattr(self.engine, "count_prompt", None)
        if count is None:
            return None
        # (As planning, in a lane of its own: nothing that waits on a plan
        # waits on a count; the pixel arrays of images with the large plans.)
        lane = self._counter if parsed.request.images is None else self._planner_large
        try:
            n = await self._in_lane(lane, count, parsed.request, parsed.args)
        except PromptError as e:
            return self.error(request, str(e), 400)
        except (LaneBusy, EngineUnavailable) as e:
            return self.unavailable(request, str(e))
        if n is None:
            return None
        return self.json_response(request, exchange.count_body(n))

    async def _exchange(self, request, channel, ctx, parsed, exchange, track, opened):
        """A wire protocol's answer (wire.py): the same events as chat
        completions, written by the protocol's Exchange."""
        assembler = CompletionAssembler(ctx, parsed.request.tools, True, False, 0,
                                        forced_tool=_forced_tool(parsed.request))
        track.accepted(ctx, assembler)
        if parsed.request.count_only:
            while await channel.get() is not None:
                pass
            return self.json_response(request, exchange.count_body(len(ctx.prompt)))
        response = None
        if parsed.stream:
            response = opened or await self._open_stream(request)
        pending = []  # frames that arrived together go out in one write
        pulse = _Pulse()
        try:
            if response is not None:
                await response.write(
                    exchange.start(len(ctx.prompt), ctx.prompt_cache_count or 0))
            while True:
                if not channel.ready():
                    await _write_all(response, pending)
                item = await channel.get()
                if item is None:
                    break
                if item is IDLE or isinstance(item, tuple):
                    if response is not None:
                        if isinstance(item, tuple):
                            pending.append(_keepalive(item))
                        if pulse.due():
                            pending.append(exchange.keepalive())
                            pulse.beat()
                    continue
                if isinstance(item, Exception):
                    status = 503 if isinstance(item, EngineUnavailable) else 500
                    if response is None:
                        if status == 503:
                            return self.unavailable(request, str(item))
                        return self.error(request, str(item), status)
                    await _write_all(response, pending)
                    return await self._end_stream(response, track, str(item), status)
                if track.first is None:
                    track.first = time.perf_counter()
                if assembler.add(item):
                    frames = exchange.delta(*assembler.take_delta())
                    if response is not None and frames:
                        pending.append(frames)
                        pulse.beat()
            await _write_all(response, pending)
            assembler.finish()
            frames = exchange.delta(*assembler.take_delta())
            completion = Completion(
                finish_reason=assembler.finish_reason,
                stop_sequence=_stop_sequence(ctx, assembler),
                prompt_tokens=len(ctx.prompt),
                completion_tokens=len(assembler.tokens),
                cached_tokens=ctx.prompt_cache_count or 0,
            )
            answer = exchange.body(completion) if response is None else \
                frames + exchange.finish(completion)
            if exchange.keeps_answer:  # (it writes JSON: not on the loop)
                await asyncio.get_running_loop().run_in_executor(None, exchange.save)
            if response is None:
                return self.json_response(request, answer)
            await response.write(answer)
            return response
        except Exception:
            # (handle_completion ends an open stream, dispatch answers the rest)
            await _write_all(response, pending)  # what came before still goes out
            raise

    async def _complete(self, request, channel, ctx, assembler, builder, track):
        while True:
            item = await channel.get()
            if item is None:
                break
            if isinstance(item, EngineUnavailable):
                return self.unavailable(request, str(item))
            if isinstance(item, Exception):
                return self.error(request, str(item), 500)
            if isinstance(item, tuple):
                continue
            if track.first is None:
                track.first = time.perf_counter()
            assembler.add(item)
        assembler.finish()
        resp = builder.response(
            assembler.text,
            assembler.finish_reason,
            len(ctx.prompt),
            len(assembler.tokens),
            ctx.prompt_cache_count,
            token_logprobs=assembler.token_logprobs,
            top_tokens=assembler.top_tokens,
            tokens=assembler.tokens,
            reasoning_text=assembler.reasoning_text,
            tool_calls=assembler.format_tool_calls(assembler.tool_calls),
        )
        return self.json_response(request, resp)

    async def _end_stream(self, response, track, message: str, status: int):
        """End an open stream with an error, in its protocol's way (an
        Exchange's stream_error; chat completions: an error chunk and
        [DONE]). Returns the response."""
        logging.error(f"Generation failed mid-stream: {message}")
        track.error = message
        if track.exchange is None:
            frames = _sse({"error": message}) + b"data: [DONE]\n\n"
        else:
            try:
                frames = track.exchange.stream_error(message, status)
            except Exception:  # (the stream just ends)
                logging.exception("Could not write a stream's error event")
                frames = b""
        if frames:
            await response.write(frames)
        return response

    async def _open_stream(self, request) -> web.StreamResponse:
        response = _StreamResponse(
            request.transport,
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **self.cors_headers(request),
            },
        )
        await response.prepare(request)
        request[OPEN_STREAM] = response
        return response

    async def _stream(self, request, channel, ctx, assembler, builder, parsed, track,
                      response=None):
        """Chat completions' stream. (An exception here ends it in
        handle_completion, with an error chunk and [DONE].)"""
        response = response or await self._open_stream(request)
        # Events that arrived together (a step's, or while the socket was
        # busy) go out in one write.
        pending = []
        pulse = _Pulse()
        while True:
            if not channel.ready():
                await _write_all(response, pending)
            item = await channel.get()
            if item is None:
                break
            if isinstance(item, Exception):
                await _write_all(response, pending)
                return await self._end_stream(response, track, str(item), 500)
            if isinstance(item, tuple) or (item is IDLE and pulse.due()):
                pending.append(_keepalive(item))
                pulse.beat()
                continue
            if item is IDLE:
                continue
            if track.first is None:
                track.first = time.perf_counter()
            try:
                if assembler.add(item):
                    # (A token that writes nothing, inside a tool call, is
                    # silence to the client: no beat.)
                    pulse.beat()
                    text, tool_calls, reasoning = assembler.take_delta()
                    if text and not tool_calls and not reasoning:  # most tokens
                        pending.append(builder.text_chunk(text))
                    else:
                        pending.append(_sse(builder.response(
                            text, None, tool_calls=tool_calls, reasoning_text=reasoning)))
            except Exception:
                await _write_all(response, pending)  # what came before still goes out
                raise

        try:
            assembler.finish()
            text, tool_calls, reasoning = assembler.take_delta()
        except Exception:
            await _write_all(response, pending)  # what came before still goes out
            raise
        pending.append(_sse(builder.response(text, assembler.finish_reason,
                                             tool_calls=tool_calls, reasoning_text=reasoning)))
        options = parsed.stream_options
        if options is not None and options.get("include_usage"):
            pending.append(_sse(builder.usage_response(
                len(ctx.prompt), len(assembler.tokens), ctx.prompt_cache_count)))
        pending.append(b"data: [DONE]\n\n")
        await _write_all(response, pending)
        return response


def _parse_body(raw: bytes):
    """A request body's JSON (RequestError 400 if it is not)."""
    try:
        return parse_body(raw)
    except BodyError as e:
        raise RequestError(str(e)) from e


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _keepalive(progress) -> bytes:
    """The SSE comment sent for (done, total) prefill progress, or for a
    stream that was silent for KEEPALIVE_SECONDS (IDLE)."""
    if progress is IDLE:
        return b": keepalive\n\n"
    return f": keepalive {progress[0]}/{progress[1]}\n\n".encode()


# A stream's write that waits this long for a client reading nothing gives
# up (and drops the connection): aiohttp has no write timeout.
WRITE_TIMEOUT = 60.0


class _StreamResponse(web.StreamResponse):
    """An SSE stream whose writes give up on a client that stops reading:
    its handler held its place in flight for good (clients with small
    receive windows that never read, one per place, turned every request
    away with 503s), as its request's memory."""

    def __init__(self, transport, **kw):
        super().__init__(**kw)
        self._transport = transport

    async def write(self, data) -> None:
        transport = self._transport
        if transport is None or not transport.get_write_buffer_size():
            # What the socket takes at once (the usual case, no timer):
            # aiohttp waits only once the transport's buffer is past its
            # high-water mark.
            return await super().write(data)
        try:
            await asyncio.wait_for(super().write(data), WRITE_TIMEOUT)
        except asyncio.TimeoutError:
            transport.abort()
            raise ConnectionResetError(
                f"the client read nothing for {WRITE_TIMEOUT:g} s") from None


async def _write_all(response, pending: List[bytes]) -> None:
    """Write the frames gathered so far (those that arrived together) as one
    write, and forget them."""
    if pending:
        await response.write(b"".join(pending))
        pending.clear()


async def inline_remote_images(req, cli_args) -> None:
    """--allow-remote-images: replace the http(s) image parts of a validated
    chat request by data URLs, fetched within one deadline and byte budget
    from allowed addresses only (see remote_images.py; upstream fetches any
    URL, unbounded, on its handler thread)."""
    from mlx_lm_plus.http.remote_images import inline_remote_images as fetch_and_inline

    if req.request_type == "chat":
        await fetch_and_inline(req.messages, cli_args)


class _Tracker:
    """Stamps and counts of one completion request, for the metrics.

    Set at arrival, when the engine accepts it, at its first token and at the
    end: nothing per token but one comparison.
    """

    def __init__(self, endpoint: str):
        self.record = RequestRecord(
            id="", endpoint=endpoint, model="", status=0, started=time.time()
        )
        self.start = time.perf_counter()
        self.accepted_at = self.first = None
        self.ctx = self.assembler = None
        self.cancelled = False
        self.error = None
        self.exchange = None  # the protocol's Exchange (None: chat completions)
        self.body_bytes = 0  # the request body's size (which lanes it takes)
        self.arriving = False  # counted in Server.arriving
        self.messages = None  # the request's chat messages (None: a text prompt)
        self.miss_text = False  # --cache-miss-text

    def accepted(self, ctx, assembler):
        self.accepted_at = time.perf_counter()
        self.ctx, self.assembler = ctx, assembler

    def finish(self, response) -> RequestRecord:
        end = time.perf_counter()
        r = self.record
        r.ended = time.time()
        r.total_seconds = end - self.start
        if self.ctx is not None:
            r.prompt_tokens = len(self.ctx.prompt)
            r.cached_tokens = self.ctx.prompt_cache_count or 0
            r.images = getattr(self.ctx, "images", 0)
            r.cache_miss = _with_message(getattr(self.ctx, "cache_miss", None), self.messages,
                                         self.miss_text)
        if self.assembler is not None:
            r.generated_tokens = len(self.assembler.tokens)
        if self.first is not None:
            r.ttft = self.first - self.start
            r.prefill_seconds = self.first - self.accepted_at
            r.decode_seconds = end - self.first
        if self.cancelled:
            r.status, r.finish_reason = 499, "cancelled"  # nginx's "client closed request"
        else:
            r.status = response.status if response is not None else 500
            if self.error is not None:
                r.finish_reason, r.error = "error", self.error
            elif r.status == 200 and self.assembler is not None:
                r.finish_reason = self.assembler.finish_reason
            elif r.status != 200:
                r.finish_reason = "error"
        return r


# Characters of a conversation searched for a cache miss's message, at
# most (the search runs on the event loop, at a request's end).
MISS_SEARCH_CHARS = 1 << 20
# What a departure in a message of each role most often is.
MISS_HINTS = {
    "system": "the system prompt changed since it was cached (a date, a session id?)",
    "assistant": "a reply came back other than as the model wrote it (re-rendered, "
                 "its reasoning dropped, or edited)",
    "user": "an earlier user message changed",
    "tool": "an earlier tool result changed",
}


# A cache miss's text (Engine._explain_miss): kept with --cache-miss-text only.
MISS_TEXT = ("before", "prompt", "stored")


def _with_message(miss, messages, keep_text: bool = False):
    """A cache miss (Engine._explain_miss) with the message whose text holds
    the prompt's side of the departure: its index in the conversation as
    chat messages (a system message first) and role, searched from the last
    message back, within MISS_SEARCH_CHARS (None where the departure lies in
    the template's own text, such as role markers or tool definitions, or
    farther than the search goes). Its text (MISS_TEXT: the request's and a
    stored prompt's, maybe another client's) only if `keep_text`."""
    if not miss:
        return miss
    miss = dict(miss)
    if miss.get("prompt") and messages:
        miss["message"] = None
        # The excerpt's start, shorter and shorter: it may run on into the
        # template's text (the end of a message, the next role's marker).
        text = miss["prompt"].strip()
        for n in (24, 12, 6):
            if len(text) >= min(n, 4) and _find_message(miss, messages, text[:n]):
                break
    if not keep_text:
        for key in MISS_TEXT:
            miss.pop(key, None)
    return miss


def _find_message(miss, messages, needle) -> bool:
    budget = MISS_SEARCH_CHARS
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i] if isinstance(messages[i], dict) else {}
        content = message.get("content")
        texts = [content] if isinstance(content, str) else [
            p.get("text") for p in content or () if isinstance(p, dict)
            and isinstance(p.get("text"), str)] if isinstance(content, list) else []
        texts += [message.get("reasoning_content") or "", message.get("reasoning") or ""]
        for text in texts:
            if not isinstance(text, str):
                continue
            budget -= len(text)
            if budget < 0:
                return False
            if needle in text:
                miss["message"] = {"index": i, "role": message.get("role")}
                hint = MISS_HINTS.get(message.get("role"))
                if hint:
                    miss["hint"] = hint
                return True
    return False


def _forced_tool(req) -> Optional[str]:
    """The function tool_choice names, if it names one."""
    choice = req.tool_choice
    return choice["function"]["name"] if isinstance(choice, dict) else None


def _may_constrain(req) -> bool:
    """Whether a request asks for anything a constraint lane may compile
    (cheap: no schema is looked at)."""
    choice = req.tool_choice
    return (choice == "required" or isinstance(choice, dict)
            or (req.response_format is not None and req.response_format.get("type") != "text")
            or (choice != "none" and StrictToolCalls.wanted(req.tools)))


def _stop_sequence(ctx, assembler) -> Optional[str]:
    """The stop word that ended a generation: its tokens end the output
    (the engine put each stop word's tokens on the context)."""
    if assembler.finish_reason != "stop":
        return None
    tokens = assembler.tokens
    for word, ids in getattr(ctx, "stop_word_tokens", ()):
        if ids and len(tokens) >= len(ids) and tuple(tokens[-len(ids):]) == ids:
            return word
    return None


def _status_of(error: Exception) -> int:
    if isinstance(error, PromptError):
        return 400
    if isinstance(error, InternalError):
        return 500
    # Upstream answers 404 for anything raised before generation starts,
    # mostly a model that could not be loaded (ModelLoadError).
    return 404


def make_app(server: Server) -> web.Application:
    limit = getattr(server.cli_args, "max_request_bytes", None) or 1024**3
    app = web.Application(client_max_size=limit,
                          middlewares=[server.connections.middleware])
    # Every path, newlines included (`.` stops at one: /v1/models/%0A would
    # get aiohttp's own text 404).
    app.router.add_route("*", r"/{tail:[\s\S]*}", server.dispatch)
    if server.metrics is not None:
        app.cleanup_ctx.append(_sample_every_second(server.metrics))
    return app


def _sample_every_second(metrics: Metrics):
    async def sampler(app):
        async def loop():
            running = asyncio.get_running_loop()
            while True:
                try:
                    # The store's snapshot off the loop (its lock is the
                    # generation thread's too); the point is added on it.
                    cache = await running.run_in_executor(None, metrics.engine.cache_snapshot)
                    metrics.sample(cache)
                except Exception:
                    logging.exception("Metrics sample failed")
                await asyncio.sleep(1.0)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    return sampler


def _hub_cache_models(created: int):
    """Downloaded MLX models in the Hugging Face cache (upstream's listing)."""
    needed = {"config.json", "model.safetensors.index.json", "tokenizer_config.json"}
    try:
        from huggingface_hub import scan_cache_dir

        repos = scan_cache_dir().repos
    except Exception:
        # Upstream fails mid-response when there is no cache directory.
        return []
    models = []
    for repo in repos:
        if repo.repo_type != "model" or "main" not in repo.refs:
            continue
        names = {f.file_path.name for f in repo.refs["main"].files}
        if needed <= names:
            models.append({"id": repo.repo_id, "object": "model", "created": created})
    return models
