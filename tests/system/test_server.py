"""End-to-end behaviour of mlx_lm_plus.server on a tiny fixture model."""

import asyncio
import json

import aiohttp
import pytest

from compat.launch import OURS, ServerProcess, parse_sse
from testkit.engine_harness import SEQUENTIAL

SYSTEM = "You are a helpful assistant. Answer briefly and clearly."


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    model = fixture_path("qwen3")
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with ServerProcess(OURS, ["--model", str(model), "--max-tokens", "24"], log=log) as s:
        yield s


def chat(server, messages, **kw):
    return server.post("/v1/chat/completions", {"messages": messages, **kw})


def user(text):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def test_health_models_options_404(server):
    assert server.get("/health") == (200, {"status": "ok"})
    status, models = server.get("/v1/models")
    assert status == 200 and models["object"] == "list"
    assert any(m["id"].endswith("qwen3") and m["object"] == "model" for m in models["data"])
    status, headers, body = server.request("OPTIONS", "/v1/chat/completions")
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "*"
    assert headers["Access-Control-Allow-Methods"] == "*"
    assert headers["Access-Control-Allow-Headers"] == "*"
    assert server.request("GET", "/nope")[0] == 404
    status, _, body = server.request("POST", "/v1/nope", {"x": 1})
    assert (status, body) == (404, b"Not Found")


def test_chat_completion_shape(server):
    status, r = chat(server, user("Tell me about the weather today."))
    assert status == 200, r
    assert r["id"].startswith("chatcmpl-")
    assert r["object"] == "chat.completion"
    assert r["model"] == "default_model"
    assert isinstance(r["created"], int) and r["system_fingerprint"]
    (choice,) = r["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    u = r["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 0 < u["completion_tokens"] <= 24
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"]


def test_max_tokens_gives_length(server):
    status, r = chat(server, user("Count to ten."), max_tokens=5)
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 5
    status, r2 = chat(server, user("Count to ten."), max_completion_tokens=3, max_tokens=9)
    assert r2["usage"]["completion_tokens"] == 3


def test_text_completion(server):
    status, r = server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6})
    assert status == 200, r
    assert r["id"].startswith("cmpl-") and r["object"] == "text_completion"
    assert isinstance(r["choices"][0]["text"], str)
    assert r["usage"]["completion_tokens"] == 6


def test_streaming_sequence_matches_non_streaming(server):
    messages = user("Write a short story about a cat and a boat. " * 4)
    status, full = chat(server, messages, max_tokens=16)
    status, headers, body = server.request(
        "POST", "/v1/chat/completions",
        {"messages": messages, "max_tokens": 16, "stream": True,
         "stream_options": {"include_usage": True}},
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert headers["Cache-Control"] == "no-cache"
    events = parse_sse(body)
    comments = [e for k, e in events if k == "comment"]
    data = [e for k, e in events if k == "data"]
    assert comments and all(c.startswith("keepalive ") for c in comments)
    assert data[-1] == "[DONE]"
    usage, final, chunks = data[-2], data[-3], data[:-3]
    assert usage["choices"] == [] and usage["object"] == "chat.completion"
    assert usage["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    assert final["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["choices"][0]["finish_reason"] is None
        assert c["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(
        c["choices"][0]["delta"].get("content", "") for c in chunks + [final]
    )
    assert text == full["choices"][0]["message"]["content"]


def test_stream_without_usage_ends_with_done(server):
    status, _, body = server.request(
        "POST", "/v1/chat/completions",
        {"messages": user("hi"), "max_tokens": 4, "stream": True, "stream_options": {}},
    )
    data = [e for k, e in parse_sse(body) if k == "data"]
    assert data[-1] == "[DONE]"
    assert "usage" not in data[-2]


def test_logprobs_shapes(server):
    status, r = chat(server, user("Hello there"), max_tokens=4, logprobs=True)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(set(c) == {"id", "logprob"} for c in content)
    assert all(c["logprob"] <= 0 for c in content)
    status, r = chat(server, user("Hello there"), max_tokens=4, logprobs=True, top_logprobs=3)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for c in content:
        assert len(c["top_logprobs"]) == 3
        assert {"id", "token", "logprob"} <= set(c)
        # Greedy: the entry is the sampled token, the most likely one, first.
        top = c["top_logprobs"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert (c["id"], c["logprob"]) == (top[0]["id"], top[0]["logprob"])


def test_stop_word_truncates(server, fixture_path):
    """Stop words stop generation when their tokens are generated (as upstream)."""
    from mlx_lm import load

    tokenizer = load(str(fixture_path("qwen3")))[1]
    messages = user("Describe a mountain village in the morning.")
    _, r = chat(server, messages, max_tokens=24, logprobs=True)
    ids = [c["id"] for c in r["choices"][0]["logprobs"]["content"]]
    text = r["choices"][0]["message"]["content"]
    # Two generated tokens whose text encodes back to the same two tokens.
    for k in range(4, len(ids) - 2):
        stop = tokenizer.decode(ids[k:k + 2])
        if tokenizer.encode(stop, add_special_tokens=False) == ids[k:k + 2] and stop.strip():
            break
    else:
        pytest.fail(f"no usable stop word in {ids}")
    _, r2 = chat(server, messages, max_tokens=24, stop=[stop])
    assert r2["choices"][0]["finish_reason"] == "stop"
    assert r2["usage"]["completion_tokens"] <= k + 2
    text2 = r2["choices"][0]["message"]["content"] or ""
    assert stop not in text2 and text.startswith(text2)


def test_validation_errors_match_upstream(server):
    cases = [
        ({"messages": user("x"), "temperature": -1}, "temperature must be at least 0"),
        ({"messages": user("x"), "top_p": 2}, "top_p must be at most 1"),
        ({"messages": user("x"), "max_tokens": "a"}, "max_tokens must be of type int"),
        ({"messages": user("x"), "stream": "yes"}, "stream must be of type bool"),
        ({"messages": user("x"), "top_logprobs": 12}, "top_logprobs must be at most 11"),
        ({"messages": user("x"), "logit_bias": {"a": 1}}, "logit_bias must be a dict of int to float"),
        ({"messages": user("x"), "xtc_probability": 1}, "xtc_probability must be of type float"),
        ({"prompt": "x"}, "Request did not contain messages"),
    ]
    for body, message in cases:
        status, r = chat(server, **body) if "messages" in body else server.post(
            "/v1/chat/completions", body)
        assert (status, r) == (400, {"error": message}), body
    status, r = server.post("/v1/completions", {"messages": []})
    assert (status, r) == (400, {"error": "Request did not contain a prompt"})
    status, _, body = server.request("POST", "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and json.loads(body)["error"].startswith("Invalid JSON in request body:")
    status, _, body = server.request("POST", "/v1/chat/completions", raw=b"[1, 2]")
    assert (status, json.loads(body)) == (400, {"error": "Request should be a JSON dictionary"})
    assert server.get("/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("extra", [{"seed": 7}, SEQUENTIAL], ids=["seeded", "sequential"])
def test_greedy_is_greedy_seeded_or_on_the_sequential_path(server, extra):
    messages = user("What is a good name for a dog?")
    _, batched = chat(server, messages, max_tokens=12)
    _, other = chat(server, messages, max_tokens=12, **extra)
    assert other["choices"][0]["message"] == batched["choices"][0]["message"]


def test_second_turn_reports_cached_tokens(server):
    messages = user("Plan a trip to the sea with three stops and a picnic.")
    _, r1 = chat(server, messages, max_tokens=8)
    reply = r1["choices"][0]["message"]["content"]
    messages2 = messages + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And what should we eat?"},
    ]
    _, r2 = chat(server, messages2, max_tokens=8)
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert r1["usage"]["prompt_tokens"] <= cached < r2["usage"]["prompt_tokens"]


async def _stream_text(session, url, messages, max_tokens):
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        events = parse_sse(await resp.read())
    data = [e for k, e in events if k == "data" and e != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in data)


def test_concurrent_streams_equal_sequential(server):
    prompts = [user(("Story number %d about rivers. " % i) * (1 + 3 * i)) for i in range(8)]
    sequential = [chat(server, m, max_tokens=16)[1]["choices"][0]["message"]["content"]
                  for m in prompts]

    async def run_all():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                *(_stream_text(session, server.url, m, 16) for m in prompts)
            )

    concurrent = asyncio.run(run_all())
    assert concurrent == sequential


def _log_count(server, text):
    return server.log_tail(10**7).count(text)


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_removes_request_from_batch(server, stream):
    import socket
    import time

    before = _log_count(server, "cancelled request(s) from the batch")
    body = json.dumps({"messages": user("Tell me everything about the sea. " * 30),
                       "max_tokens": 100000, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(1.0)
    sock.close()
    for _ in range(100):
        if _log_count(server, "cancelled request(s) from the batch") > before:
            break
        time.sleep(0.1)
    assert _log_count(server, "cancelled request(s) from the batch") == before + 1
    # The server goes on serving.
    assert server.get("/health") == (200, {"status": "ok"})
    status, r = chat(server, user("hi"), max_tokens=3)
    assert status == 200 and r["usage"]["completion_tokens"] == 3


def test_unknown_model_is_404_and_leaves_the_model_loaded(server, fixture_path):
    # (As upstream, `adapters` only applies to a model other than the default.)
    for body in ({"model": "some/other-model"}, {"draft_model": "/tmp/nope"},
                 {"model": "some/other-model", "adapters": "/tmp/nope"}):
        status, r = chat(server, user("hi"), max_tokens=3, **body)
        assert status == 404 and "not served here" in r["error"], body
    # The names a client may use for the served model all work.
    for name in ("default_model", str(fixture_path("qwen3")),
                 str(fixture_path("qwen3").resolve())):
        status, r = chat(server, user("hi"), max_tokens=3, model=name)
        assert status == 200 and r["usage"]["completion_tokens"] == 3, name
    assert server.get("/health") == (200, {"status": "ok"})


def test_sigterm_exits_cleanly(fixture_path, tmp_path):
    import os
    import signal

    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))],
                       log=tmp_path / "s.log") as s:
        assert chat(s, user("hi"), max_tokens=2)[0] == 200
        os.killpg(s.proc.pid, signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0


def test_sigterm_finishes_short_requests_cuts_long_ones_and_exits_0(fixture_path, tmp_path):
    """Graceful shutdown: the listener closes at once, a request that ends
    within --shutdown-timeout ends normally, one that would not is ended
    there (a stream: an error event and [DONE], not a cut connection), and
    the process exits 0, soon after the timeout (aiohttp's own would wait
    it twice)."""
    import os
    import signal
    import socket
    import threading
    import time

    log = tmp_path / "server.log"
    s = ServerProcess(OURS, ["--model", str(fixture_path("qwen3")), "--shutdown-timeout", "5"],
                      log=log).start()
    try:
        results = {}

        def send(name, body):
            try:
                results[name] = s.request("POST", "/v1/chat/completions", body, timeout=60)
            except Exception as e:  # the long stream is cut mid-body
                results[name] = e

        long = threading.Thread(target=send, args=("long", {
            "messages": user("Go on forever."), "max_tokens": 10**6, "stream": True}))
        long.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            if s.get("/v1/stats")[1]["engine"]["active_requests"] == 1:
                break
            time.sleep(0.05)
        short = threading.Thread(target=send, args=("short", {
            "messages": user("Brief."), "max_tokens": 400}))
        short.start()
        while time.time() < deadline:
            if s.get("/v1/stats")[1]["engine"]["active_requests"] == 2:
                break
            time.sleep(0.01)
        import http.client

        pooled = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
        pooled.request("GET", "/health")
        assert pooled.getresponse().read() and pooled.sock is not None  # (kept alive)
        stopped_at = time.time()
        os.killpg(s.proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", s.port), timeout=2).close()
        # A new request on an open keep-alive connection is answered at once
        # (503), and the connection closes.
        pooled.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": user("Late."), "max_tokens": 2}), {"Content-Type": "application/json"})
        late = pooled.getresponse()
        assert late.status == 503 and b"server shutting down" in late.read()
        assert late.getheader("Connection", "").lower() == "close"
        assert s.proc.wait(30) == 0
        took = time.time() - stopped_at
        short.join(10)
        long.join(10)
        status, _, body = results["short"]
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 400
        # The long stream was ended after the bound, not before it.
        assert 5 <= took < 9, took
        status, _, body = results["long"]
        events = [line for line in body.decode().splitlines() if line.startswith("data: ")]
        assert status == 200 and events[-1] == "data: [DONE]", events[-3:]
        assert "server shutting down" in events[-2], events[-3:]
        text = s.log_tail(10**6)
        assert "2 request(s) in flight get up to 5 s to finish" in text
        assert "Server stopped" in text
    finally:
        s.stop()


def test_prompts_are_planned_before_the_generation_thread(server):
    """Once the model is loaded, a text request's template, tokenizing and
    boundaries are done on the planning thread: the generation thread plans
    none of them (it would stall every running stream meanwhile)."""
    assert chat(server, user("Warm up."), max_tokens=2)[0] == 200
    before = server.get("/v1/stats")[1]["engine"]
    for i in range(3):
        status, body = chat(server, user(f"Question {i}?"), max_tokens=2,
                            response_format={"type": "json_object"} if i == 2 else None)
        assert status == 200, body
    after = server.get("/v1/stats")[1]["engine"]
    assert after["admitted_requests"] == before["admitted_requests"] + 3
    assert after["planned_at_admission"] == before["planned_at_admission"]


def test_a_body_still_coming_at_shutdown_gets_a_503(fixture_path, tmp_path):
    """A body still being uploaded when --shutdown-timeout is over gets a
    503 "server shutting down" (the connection closes after it), not a
    connection cut with no answer; the process exits 0."""
    import os
    import signal
    import socket
    import time

    s = ServerProcess(OURS, ["--model", str(fixture_path("qwen3")), "--shutdown-timeout", "1"],
                      log=tmp_path / "server.log").start()
    try:
        upload = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        upload.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: 100000\r\n\r\n{")
        time.sleep(0.3)
        os.killpg(s.proc.pid, signal.SIGTERM)
        answer = b""
        deadline = time.time() + 15
        while time.time() < deadline:  # (a byte every 0.2 s: the drain waits for it)
            try:
                upload.sendall(b" ")
            except OSError:
                break
            upload.settimeout(0.2)
            try:
                chunk = upload.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
        upload.settimeout(5)
        try:
            while chunk := upload.recv(65536):
                answer += chunk
        except OSError:
            pass
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"server shutting down" in answer and b"Connection: close" in answer
        assert s.proc.wait(30) == 0
    finally:
        s.stop()
