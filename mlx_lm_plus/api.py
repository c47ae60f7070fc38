"""HTTP layer: aiohttp handlers with mlx_lm.server 0.32.2's routes and shapes.

The event loop never touches MLX. A completion is submitted to the engine
with an `AsyncChannel`; the generation thread hands events over with
`call_soon_threadsafe` and the handler awaits them. Disconnects cancel the
channel, and the engine drops the request at its next step.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from pathlib import Path

from aiohttp import web

from .engine import Channel, EngineUnavailable, PromptError
from .responses import CompletionAssembler, ResponseBuilder
from .validation import RequestError, parse_request

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")


class AsyncChannel(Channel):
    """Thread-safe hand-off from the generation thread to one handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item):
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            # The loop is closed: the server is shutting down.
            self.cancel()

    async def get(self):
        return await self._queue.get()


class Server:
    """The handlers, with the engine and the settings they need."""

    def __init__(self, cli_args, engine, model_provider, system_fingerprint: str):
        self.cli_args = cli_args
        self.engine = engine
        self.model_provider = model_provider
        self.system_fingerprint = system_fingerprint
        # Completions accepted and not yet answered (the event loop's own count).
        self.in_flight = 0

    @property
    def max_in_flight(self) -> int:
        """Requests the server holds at once: a full batch plus the queue."""
        queued = getattr(self.cli_args, "max_queued_requests", None)
        if queued is None:
            return 1 << 62
        return self.cli_args.decode_concurrency + queued

    # -- headers --

    def cors_headers(self, request: web.Request) -> dict:
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
        return web.Response(
            body=json.dumps(obj).encode(),
            status=status,
            content_type="application/json",
            headers=self.cors_headers(request),
        )

    def error(self, request, message: str, status: int = 400) -> web.Response:
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
        if not key or request.path == "/health":
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
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
        if request.method == "GET":
            if request.path.startswith("/v1/models"):
                return await self.handle_models(request)
            if request.path == "/health":
                return self.handle_health(request)
            if request.path == "/v1/cache/stats":
                return self.json_response(request, self.engine.store.snapshot())
            if request.path == "/v1/stats":
                return self.json_response(request, self.stats())
            return self.not_found(request)
        if request.method == "DELETE" and request.path == "/v1/cache":
            return self.json_response(request, self.engine.clear_cache())
        if request.method == "POST":
            if request.path not in COMPLETION_PATHS:
                return self.not_found(request)
            return await self.handle_completion(request)
        return self.error(request, f"Unsupported method ({request.method!r})", 501)

    def handle_health(self, request):
        if self.engine.is_healthy:
            return self.json_response(request, {"status": "ok"})
        return self.json_response(
            request,
            {"status": "unavailable", "reason": self.engine.unhealthy_reason},
            503,
        )

    def stats(self) -> dict:
        engine = self.engine
        return {
            "engine": {
                "healthy": engine.is_healthy,
                "unhealthy_reason": engine.unhealthy_reason,
                "restarts": engine.restarts,
                "active_requests": engine.active_requests,
                "queued_requests": engine.requests.qsize(),
            },
            "http": {"in_flight": self.in_flight, "max_in_flight": self.max_in_flight},
            "memory": engine.memory(),
            "cache": engine.store.snapshot(),
        }

    async def handle_models(self, request):
        loop = asyncio.get_running_loop()
        models = await loop.run_in_executor(None, self.list_models, request.path)
        return self.json_response(request, {"object": "list", "data": models})

    def list_models(self, path: str):
        """Downloaded MLX models in the Hugging Face cache, plus --model."""
        created = int(time.time())
        parts = path.split("/")
        filter_repo_id = "/".join(parts[3:]) if len(parts) > 3 else None
        needed = {"config.json", "model.safetensors.index.json", "tokenizer_config.json"}
        models = []
        try:
            from huggingface_hub import scan_cache_dir

            repos = scan_cache_dir().repos
        except Exception:
            # Upstream fails mid-response when there is no cache directory.
            repos = []
        for repo in repos:
            if repo.repo_type != "model" or "main" not in repo.refs:
                continue
            if filter_repo_id is not None and repo.repo_id != filter_repo_id:
                continue
            names = {f.file_path.name for f in repo.refs["main"].files}
            if needed <= names:
                models.append({"id": repo.repo_id, "object": "model", "created": created})
        if self.cli_args.model:
            model_path = Path(self.cli_args.model)
            if model_path.exists():
                models.append(
                    {"id": str(model_path.resolve()), "object": "model", "created": created}
                )
        return models

    # -- completions --

    async def _read_body(self, request):
        if request.headers.get("Content-Length") is None:
            raise RequestError("Content-Length header is required", 411)
        limit = getattr(self.cli_args, "max_request_bytes", None)
        too_large = RequestError(
            f"Request body is larger than {limit} bytes (--max-request-bytes)", 413
        )
        if limit is not None and (request.content_length or 0) > limit:
            raise too_large
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        try:
            text = raw.decode()
        except UnicodeDecodeError as e:
            raise RequestError(f"Request body is not valid UTF-8: {e}") from e
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(f"Invalid JSON in request body: {e}") from e

    def _vocab_size(self):
        tokenizer = self.model_provider.tokenizer
        model = self.model_provider.model
        sizes = []
        if model is not None and hasattr(model, "args"):
            sizes.append(getattr(model.args, "vocab_size", None))
        if tokenizer is not None:
            sizes.append(len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else None)
        sizes = [s for s in sizes if isinstance(s, int)]
        return max(sizes) if sizes else None

    async def handle_completion(self, request: web.Request):
        if not self.engine.is_healthy:
            return self.unavailable(
                request, f"Generation engine unavailable: {self.engine.unhealthy_reason}"
            )
        if self.in_flight >= self.max_in_flight:
            return self.unavailable(
                request,
                f"Server busy: {self.in_flight} requests in flight "
                "(--decode-concurrency + --max-queued-requests)",
            )
        self.in_flight += 1
        try:
            return await self._handle_completion(request)
        finally:
            self.in_flight -= 1

    async def _handle_completion(self, request: web.Request):
        try:
            body = await self._read_body(request)
            parsed = parse_request(request.path, body, self.cli_args, self._vocab_size())
        except RequestError as e:
            return self.error(request, str(e), e.status)

        if not self.model_provider.is_served(parsed.args.model):
            desc = parsed.args.model
            return self.error(
                request,
                f"Model not served here: model={desc.model!r}, adapters={desc.adapter!r}, "
                f"draft_model={desc.draft!r}. This server serves {self.cli_args.model!r} "
                "(start it with --allow-model-loading to load others).",
                404,
            )

        if request.path == "/v1/completions":
            request_id, object_type = f"cmpl-{uuid.uuid4()}", "text_completion"
        else:
            request_id = f"chatcmpl-{uuid.uuid4()}"
            object_type = "chat.completion.chunk" if parsed.stream else "chat.completion"
        builder = ResponseBuilder(
            request_id=request_id,
            object_type=object_type,
            model=parsed.requested_model,
            created=int(time.time()),
            system_fingerprint=self.system_fingerprint,
            stream=parsed.stream,
        )

        channel = AsyncChannel(asyncio.get_running_loop())
        try:
            self.engine.submit(channel, parsed.request, parsed.args)
        except EngineUnavailable as e:
            return self.unavailable(request, str(e))

        try:
            first = await channel.get()
            if isinstance(first, EngineUnavailable):
                return self.unavailable(request, str(first))
            if isinstance(first, Exception):
                return self.error(request, str(first), _status_of(first))
            ctx = first
            assembler = CompletionAssembler(
                ctx,
                parsed.request.tools,
                parsed.stream,
                parsed.args.logprobs,
                parsed.args.top_logprobs,
            )
            if parsed.stream:
                return await self._stream(request, channel, ctx, assembler, builder, parsed)
            return await self._complete(request, channel, ctx, assembler, builder)
        finally:
            # Whatever happened (done, error, disconnect), the engine may stop.
            channel.cancel()

    async def _complete(self, request, channel, ctx, assembler, builder):
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

    async def _stream(self, request, channel, ctx, assembler, builder, parsed):
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **self.cors_headers(request),
            },
        )
        await response.prepare(request)

        async def send(obj):
            await response.write(f"data: {json.dumps(obj)}\n\n".encode())

        while True:
            item = await channel.get()
            if item is None:
                break
            if isinstance(item, Exception):
                # Headers are gone: report in the stream, then end it.
                logging.error(f"Generation failed mid-stream: {item}")
                await send({"error": str(item)})
                await response.write(b"data: [DONE]\n\n")
                return response
            if isinstance(item, tuple):
                done, total = item
                await response.write(f": keepalive {done}/{total}\n\n".encode())
                continue
            if assembler.add(item):
                text, tool_calls, reasoning = assembler.take_delta()
                await send(builder.response(text, None, tool_calls=tool_calls,
                                            reasoning_text=reasoning))

        assembler.finish()
        text, tool_calls, reasoning = assembler.take_delta()
        await send(builder.response(text, assembler.finish_reason,
                                    tool_calls=tool_calls, reasoning_text=reasoning))
        options = parsed.stream_options
        if options is not None and options.get("include_usage"):
            await send(
                builder.usage_response(
                    len(ctx.prompt), len(assembler.tokens), ctx.prompt_cache_count
                )
            )
        await response.write(b"data: [DONE]\n\n")
        return response


def _status_of(error: Exception) -> int:
    if isinstance(error, PromptError):
        return 400
    # Upstream answers 404 for anything raised before generation starts,
    # mostly a model that could not be loaded (ModelLoadError).
    return 404


def make_app(server: Server) -> web.Application:
    limit = getattr(server.cli_args, "max_request_bytes", None) or 1024**3
    app = web.Application(client_max_size=limit)
    app.router.add_route("*", "/{tail:.*}", server.dispatch)
    return app
