"""An error after a stream's head was sent ends that stream in its
protocol's way (chat completions: an error chunk and [DONE]; Messages: an
`error` event; Responses: `response.failed`), after what was already
generated, and never writes a second HTTP response into it; without a
stream it is a 500 in the protocol's shape. Found in review: a
RecursionError building response.created wrote `HTTP/1.1 500` inside the
chunked 200 body. tests/http/raising_server.py plants the failures."""

import json
import socket
import sys

import pytest

from compat.launch import ServerProcess, parse_sse

USER = [{"role": "user", "content": "hi"}]
CASES = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 7}),
    "text": ("/v1/completions", {"prompt": "hi", "max_tokens": 7}),
    "messages": ("/v1/messages", {"model": "m", "messages": USER, "max_tokens": 7}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 7}),
    "responses at start": ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 3,
                                             "instructions": "explode at start"}),
}


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("guard") / "server.log"
    command = [sys.executable, "-m", "tests.http.raising_server"]
    with ServerProcess(command, ["--model", str(fixture_path("qwen3"))], log=log) as s:
        yield s


def raw_exchange(server, path, body) -> bytes:
    """The whole byte stream of one request on its own connection (what
    came after the first response included)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, body = out + rest[:n], rest[n + 2:]
    raise AssertionError("the chunked body did not end")


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_error_in_an_open_stream_ends_it_in_its_protocols_way(server, case):
    path, body = CASES[case]
    raw = raw_exchange(server, path, {**body, "stream": True})
    assert raw.count(b"HTTP/1.1 ") == 1, raw[-400:]
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    events = dechunk(chunked).decode()
    assert "planted failure" in events
    if path.startswith("/v1/chat") or path == "/v1/completions":
        assert events.rstrip().endswith("data: [DONE]")
        data = [e for k, e in parse_sse(events.encode()) if k == "data" and e != "[DONE]"]
        assert "error" in data[-1] and len(data) > 1  # (the tokens before went out)
    elif path == "/v1/messages":
        assert events.rstrip().split("\n\n")[-1].startswith("event: error")
        assert "event: content_block_delta" in events
    else:
        last = events.rstrip().split("\n\n")[-1]
        assert last.startswith("event: response.failed"), last
        assert "planted failure" in last
    assert server.get("/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("case", sorted(set(CASES) - {"responses at start"}))
def test_without_a_stream_it_is_a_500_in_the_protocols_shape(server, case):
    path, body = CASES[case]
    status, answer = server.post(path, body)
    assert status == 500 and "planted failure" in json.dumps(answer)
    if path == "/v1/messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "api_error"
    elif path == "/v1/responses":
        assert answer["error"]["type"] == "server_error"
    else:
        assert isinstance(answer["error"], str)
    assert server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2})[0] == 200
