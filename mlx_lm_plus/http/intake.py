"""A completion request's way in, before the engine gets it: its body read
(bounded in bytes held and in time) and parsed, the protocol's parse, its
remote images fetched and its images decoded, its constraint compiled and
its prompt planned, each off the event loop, in lanes (planning/lanes.py).
"""

import asyncio
import logging
from typing import Optional

from aiohttp import web
from mlx_lm.server import ModelDescription

from mlx_lm_plus.cache.store import READ_AHEAD_SECONDS
from mlx_lm_plus.errors import EngineUnavailable, PromptError
from mlx_lm_plus.http.bodies import BodyError, parse_body
from mlx_lm_plus.logs import warn_once
from mlx_lm_plus.models.images import decode_images
from mlx_lm_plus.planning.grammars import (
    ConstraintError,
    ConstraintUnavailable,
    ForcedToolCall,
    StrictToolCalls,
    compile_response_format,
    prepare,
)
from mlx_lm_plus.planning.lanes import Lane, LaneBusy
from mlx_lm_plus.protocols.base import WireProtocol
from mlx_lm_plus.protocols.validation import RequestError
from mlx_lm_plus.upstream import image_parts, image_url

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


class Intake:
    """The Server's intake. (A part of `Server`: it uses its `cli_args`,
    `engine`, `model_provider`, `connections`, body counters and lanes.)"""

    async def _read_body(self, request):
        if request.headers.get("Content-Length") is None:
            raise RequestError("Content-Length header is required", 411)
        limit = self.cli_args.max_request_bytes
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
        limit = self.cli_args.max_request_bytes or 0
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
        urls = [image_url(p) for p in image_parts(req.messages)]
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
        the generation thread only looks it up. Returns the plan, to be
        submitted beside the request (Engine.plan; None: the engine plans
        it at admission). A bad prompt is the client's 400; LaneBusy past
        --planning-timeout."""
        plan = getattr(self.engine, "plan", None)
        if plan is None or parsed.request.count_only:
            return None
        size = body_bytes + parsed.carried_bytes
        lane = self._planner_large if size > LARGE_LANE_PLAN_BYTES else self._planner
        try:
            planned = await self._in_lane(lane, plan, parsed.request, parsed.args)
        except PromptError as e:
            raise RequestError(str(e)) from e
        except (LaneBusy, EngineUnavailable):
            raise
        except Exception:  # the engine plans it again, and answers
            logging.exception("Planning a prompt failed")
            return None
        if planned is not None and planned.on_disk:
            # Its disk entry read here, not on the generation thread; if
            # another request's handler is reading it, that read is waited
            # for (not cancelled if this client goes: others may wait too).
            loop = asyncio.get_running_loop()
            reading = await loop.run_in_executor(None, self.engine.read_ahead, planned)
            if reading is not None:
                await asyncio.wait({asyncio.wrap_future(reading)}, timeout=READ_AHEAD_SECONDS)
        return planned

    def _vocab_size(self, name):
        """Model `name`'s vocabulary size for the top_k and logit_bias checks
        (from its config.json while it isn't loaded; None when unknown: the
        engine checks once it is loaded)."""
        desc = ModelDescription(name if isinstance(name, str) else "default_model",
                                "default_model", None)
        if not self.model_provider.is_served(desc):
            return None  # (a 404 follows: no file a client names is read)
        return self.model_provider.vocab_size(self.model_provider.key_for(desc))

    def _parse(self, path: str, body, protocol: WireProtocol):
        """A completion body -> (ParsedRequest, whether its model is served,
        the model's metrics label); RequestError: the client's. Parsed with
        the defaults of the model it names (--models-config) and that
        model's vocabulary for logit_bias when it is loaded."""
        provider = self.model_provider
        name = body.get("model") if isinstance(body, dict) else None
        default = protocol.names_own_models and (name is None or isinstance(name, str) and (
            not provider.is_served(ModelDescription(name, "default_model", None))))
        if default:
            # Agent clients name their own models (claude-..., gpt-...): a
            # name not served means the default model, and is echoed back.
            # (Any other type is the protocol's 400.)
            name = "default_model"
        cli = provider.defaults_for(name)
        parsed = protocol.parse(path, body, cli, self._vocab_size(name))
        if default:
            parsed.args.model = ModelDescription("default_model", "default_model", None)
        served = provider.is_served(parsed.args.model)
        if served:
            task = provider.task(provider.key_for(parsed.args.model))
            if task != "generate":
                raise RequestError(
                    f"Model {provider.name_for(parsed.args.model)!r} is "
                    f"{'an embedding' if task == 'embed' else 'a reranking'} model: it "
                    f"serves /v1/{'embeddings' if task == 'embed' else 'rerank'}, not {path}")
        return parsed, served, provider.name_for(parsed.args.model)


def _parse_body(raw: bytes):
    """A request body's JSON (RequestError 400 if it is not)."""
    try:
        return parse_body(raw)
    except BodyError as e:
        raise RequestError(str(e)) from e


async def inline_remote_images(req, cli_args) -> None:
    """--allow-remote-images: replace the http(s) image parts of a validated
    chat request by data URLs, fetched within one deadline and byte budget
    from allowed addresses only (see remote_images.py; upstream fetches any
    URL, unbounded, on its handler thread)."""
    from mlx_lm_plus.http.remote_images import inline_remote_images as fetch_and_inline

    if req.request_type == "chat":
        await fetch_and_inline(req.messages, cli_args)


def _may_constrain(req) -> bool:
    """Whether a request asks for anything a constraint lane may compile
    (cheap: no schema is looked at)."""
    choice = req.tool_choice
    return (choice == "required" or isinstance(choice, dict)
            or (req.response_format is not None and req.response_format.get("type") != "text")
            or (choice != "none" and StrictToolCalls.wanted(req.tools)))
