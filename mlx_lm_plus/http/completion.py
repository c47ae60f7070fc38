"""The completion handler: one for every wire protocol (protocols/).

A request is taken in (intake.py), handed to the engine with an
`AsyncChannel`, and its events drained by one loop (`_drain`) into its
protocol's Exchange, which writes the frames or the body. Keepalives, the
first-token stamp, mid-stream errors and the one-write-per-arrival
batching are here, once, for all of them.
"""

import asyncio
import logging
import time
import uuid
from typing import Optional

from aiohttp import web

from mlx_lm_plus.errors import EngineUnavailable, InternalError, PromptError
from mlx_lm_plus.http.channel import IDLE, AsyncChannel
from mlx_lm_plus.http.intake import inline_remote_images
from mlx_lm_plus.http.replies import OPEN_STREAM, _keepalive, _write_all
from mlx_lm_plus.http.tracker import _Tracker
from mlx_lm_plus.planning.lanes import LaneBusy
from mlx_lm_plus.protocols.base import Completion, WireProtocol
from mlx_lm_plus.protocols.validation import RequestError

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


class Completions:
    """The Server's completion handling. (A part of `Server`: it uses its
    counters, engine, metrics, lanes, Intake and Replies.)"""

    async def handle_completion(self, request: web.Request, protocol: WireProtocol):
        return await self.take_in(request, lambda body, track: self._handle_completion(
            request, body, track, protocol))

    async def take_in(self, request: web.Request, handle):
        """A request's way in for every endpoint that runs the engine: the
        engine's health, the bound on requests in flight, its body read and
        counted; then `await handle(body, track)` gives its response. Its
        record goes to the metrics at the end, whatever happened."""
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
                        response = await handle(body, track)
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

    def not_served(self, request, desc):
        """The 404 of a model (ModelDescription) this server doesn't serve."""
        served = ", ".join(repr(e.name) for e in self.model_provider.served)
        return self.error(
            request,
            f"Model not served here: model={desc.model!r}, adapters={desc.adapter!r}, "
            f"draft_model={desc.draft!r}. This server serves {served} (GET /v1/models "
            "lists them; start it with --allow-model-loading to load others).",
            404,
        )

    def _busy(self, request):
        return self.unavailable(request, f"Server busy: {self.in_flight} requests in flight "
                                         "(--decode-concurrency + --max-queued-requests)")

    async def _handle_completion(self, request: web.Request, body, track: _Tracker,
                                 protocol: WireProtocol):
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
            return self.not_served(request, parsed.args.model)
        try:
            if self.cli_args.allow_remote_images:
                # Only once the whole request validated.
                await inline_remote_images(parsed.request, self.cli_args)
            await self._decode_images(parsed.request, parsed.args.model)
            await self._constrain(parsed.request, parsed.args.model, track.body_bytes)
            planned = await self._plan(parsed, track.body_bytes)
        except RequestError as e:
            return self.error(request, str(e), e.status)
        except (EngineUnavailable, LaneBusy) as e:
            return self.unavailable(request, str(e))

        track.messages = parsed.request.messages  # (a cache miss's message, at the end)
        track.miss_text = self.cli_args.cache_miss_text
        exchange = track.exchange = protocol.exchange(parsed, f"{uuid.uuid4().hex}")
        track.record.id = exchange.id

        if parsed.request.count_only:
            counted = await self._count(request, parsed, exchange)
            if counted is not None:
                return counted

        channel = AsyncChannel(asyncio.get_running_loop())
        self._arrived(track)
        try:
            self.engine.submit(channel, parsed.request, parsed.args, planned)
        except EngineUnavailable as e:
            return self.unavailable(request, str(e))
        # The plan is the engine's now: held here too, an image request's
        # pixels would stay in memory until its answer ends.
        del planned

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
            return await self._drain(request, channel, first, parsed, exchange, track, opened)
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

    async def _drain(self, request, channel, ctx, parsed, exchange, track, opened):
        """The engine's events for one accepted request, written by its
        protocol's Exchange (base.py): a stream's frames as they come (those
        that arrived together in one write), or the JSON body at the end."""
        assembler = exchange.assembler(ctx, parsed)
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
                frames = exchange.start(len(ctx.prompt), ctx.prompt_cache_count or 0)
                if frames:
                    await response.write(frames)
            while True:
                if not channel.ready():
                    await _write_all(response, pending)
                item = await channel.get()
                if item is None:
                    break
                if item is IDLE or isinstance(item, tuple):
                    if response is None:
                        continue
                    if isinstance(item, tuple):  # prefill progress
                        pending.append(_keepalive(item))
                        if exchange.comments_keep_alive:
                            pulse.beat()
                            continue
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
                    # (A token that writes nothing, inside a tool call, is
                    # silence to the client: no beat.)
                    if response is not None and frames:
                        pending.append(frames)
                        pulse.beat()
            assembler.finish()
            frames = exchange.last_delta(*assembler.take_delta())
            completion = Completion(
                finish_reason=assembler.finish_reason,
                stop_sequence=_stop_sequence(ctx, assembler),
                prompt_tokens=len(ctx.prompt),
                completion_tokens=len(assembler.tokens),
                cached_tokens=ctx.prompt_cache_count or 0,
            )
            if response is None:
                answer = exchange.body(completion)
            else:
                # (With the frames that came with the end: one write.)
                pending.append(frames + exchange.finish(completion))
            if exchange.keeps_answer:  # (it writes JSON: not on the loop)
                await asyncio.get_running_loop().run_in_executor(None, exchange.save)
            if response is None:
                return self.json_response(request, answer)
            await _write_all(response, pending)
            return response
        except Exception:
            # (handle_completion ends an open stream, dispatch answers the rest)
            await _write_all(response, pending)  # what came before still goes out
            raise

    async def _end_stream(self, response, track, message: str, status: int):
        """End an open stream with an error, in its protocol's way (its
        Exchange's stream_error). Returns the response."""
        logging.error(f"Generation failed mid-stream: {message}")
        track.error = message
        try:
            frames = track.exchange.stream_error(message, status)
        except Exception:  # (the stream just ends)
            logging.exception("Could not write a stream's error event")
            frames = b""
        if frames:
            await response.write(frames)
        return response


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
