"""What the handlers write: JSON answers and errors in the shape of the
protocol a path belongs to, CORS headers, and SSE streams whose writes give
up on a client that stops reading.
"""

import asyncio
import json
from typing import List

from aiohttp import web

from mlx_lm_plus.http.channel import IDLE

# Endpoints that change the server's state or show what other clients sent.
# They get no CORS headers and refuse cross-origin callers without the API
# key: otherwise any web page the operator opens could call them on localhost.
ADMIN_PATHS = ("/v1/cache", "/v1/cache/stats", "/v1/stats", "/metrics")
# Where a request keeps its SSE response once the head is sent: from then
# on an error ends that stream, and no other response is written.
OPEN_STREAM = (web.RequestKey("mlx_lm_plus.open_stream", web.StreamResponse)
               if hasattr(web, "RequestKey") else "mlx_lm_plus.open_stream")
# A stream's write that waits this long for a client reading nothing gives
# up (and drops the connection): aiohttp has no write timeout.
WRITE_TIMEOUT = 60.0


class Replies:
    """The Server's answers. (A part of `Server`: it uses its `cli_args`
    and `protocol_for`.)"""

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


def _keepalive(progress) -> bytes:
    """The SSE comment sent for (done, total) prefill progress, or for a
    stream that was silent for KEEPALIVE_SECONDS (IDLE)."""
    if progress is IDLE:
        return b": keepalive\n\n"
    return f": keepalive {progress[0]}/{progress[1]}\n\n".encode()


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
