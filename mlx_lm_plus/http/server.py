"""HTTP layer: aiohttp handlers with mlx_lm.server 0.32.2's routes and shapes.

The event loop never touches MLX. A completion is submitted to the engine
with an `AsyncChannel`; the generation thread hands events over with
`call_soon_threadsafe` and the handler awaits them. Disconnects cancel the
channel, and the engine drops the request at its next step.

`Server` is the routes, the API key and the admin guard, health, models,
stats and the cache; its parts, each a file: `Replies` (replies.py: JSON,
errors, streams), `Intake` (intake.py: a request's body, parse, images,
constraint and plan) and `Completions` (completion.py: the one completion
handler every wire protocol goes through).
"""

import asyncio
import hmac
import ipaddress
import logging
import time
from pathlib import Path
from typing import List, Optional

from aiohttp import web

from mlx_lm_plus.errors import EngineUnavailable
from mlx_lm_plus.http.completion import Completions
from mlx_lm_plus.http.embeddings import Embeddings
from mlx_lm_plus.http.connections import HEAD_SECONDS, ConnectionLimit, default_max_open
from mlx_lm_plus.http.intake import LARGE_LANE_HELD, Intake
from mlx_lm_plus.http.metrics import Metrics, cache_entries
from mlx_lm_plus.http.replies import ADMIN_PATHS, OPEN_STREAM, Replies
from mlx_lm_plus.planning.lanes import Lane
from mlx_lm_plus.protocols.base import WireProtocol
from mlx_lm_plus.protocols.chat import ChatCompletionsProtocol
from mlx_lm_plus.protocols.embeddings import EMBEDDINGS_PATHS, RERANK_PATHS

DASHBOARD = Path(__file__).with_name("dashboard.html")
# How the app is served (app.serve, and the tests' servers): request bodies
# are read as sent, never decompressed, as upstream's http.server did; a
# compressed one gets a 415 (Server._read_body) instead of a bomb, a parser's
# text 400, or a half-sent stream that never ends.
# A connection gets connections.HEAD_SECONDS for a request's head (aiohttp's
# keepalive_timeout, 3,630 s by default in an AppRunner).
RUNNER_OPTIONS = {"auto_decompress": False, "keepalive_timeout": HEAD_SECONDS}


class Server(Replies, Intake, Completions, Embeddings):
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
        # Many or long embedding inputs are tokenized in a lane of their own.
        self._embedding_lane = Lane("embedding inputs", LARGE_LANE_HELD)
        self._planning_timeout = cli_args.planning_timeout
        # Wire protocols, by the paths they serve: chat and text completions
        # always (upstream's), the others as app.build registers them.
        self.protocols: List[WireProtocol] = [ChatCompletionsProtocol(system_fingerprint)]
        # Open connections, and room for new ones (connections.py).
        self.connections = ConnectionLimit(default_max_open())

    def add_protocol(self, protocol: WireProtocol) -> None:
        self.protocols.append(protocol)

    def protocol_for(self, path: str) -> Optional[WireProtocol]:
        return next((p for p in self.protocols if p.serves(path)), None)

    @property
    def max_in_flight(self) -> int:
        """Requests the server holds at once: a full batch plus the queue."""
        queued = self.cli_args.max_queued_requests
        if queued is None:
            return 1 << 62
        return self.cli_args.decode_concurrency + queued

    # -- routing --

    def authorized(self, request: web.Request) -> bool:
        key = self.cli_args.api_key
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
        if request.path in ADMIN_PATHS and not self.cli_args.api_key:
            why = self.foreign_caller(request)
            if why is not None:
                return self.error(
                    request, f"{request.path} refuses {why}: call it from this "
                    "server's own pages or a non-browser client, by address or "
                    "localhost (or start the server with --api-key and send the key)", 403)
        if request.method == "POST" and request.path in EMBEDDINGS_PATHS + RERANK_PATHS:
            return await self.handle_embeddings(
                request, "embed" if request.path in EMBEDDINGS_PATHS else "rerank")
        protocol = self.protocol_for(request.path)
        if protocol is not None and request.method == "POST" and request.path in protocol.paths:
            return await self.handle_completion(request, protocol)
        if protocol is not None and protocol.prefix:
            # (Every path under its prefix is the protocol's, whatever the method.)
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
            return self.not_found(request)
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
                # --prompt-lookup-tokens: proposed, kept, the steps that checked.
                "prompt_lookup": getattr(engine, "prompt_lookup", None),
                "draft_model": getattr(engine, "draft_model", None),
                # /v1/embeddings and /v1/rerank: forward passes and the inputs they ran.
                "embeddings": getattr(engine, "embedding_stats", None),
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
                   "owned_by": "mlx_lm_plus", "loaded": m["loaded"], "pinned": m["pinned"],
                   "task": m["task"]}
                  for i, m in enumerate(self.engine.models())
                  if i < served or self.cli_args.allow_model_loading]
        if self.cli_args.allow_model_loading:
            # (Upstream's path filter applies to these only.)
            listed = {m["id"] for m in models}
            models += [m for m in _hub_cache_models(created)
                       if m["id"] not in listed and filter_id in (None, m["id"])]
        return models


def make_app(server: Server) -> web.Application:
    limit = server.cli_args.max_request_bytes or 1024**3
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
