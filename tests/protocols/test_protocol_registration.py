"""A wire protocol is one module and one registration line: a tiny one,
written here (POST /v1/echo-completions answers the generated text as
{"text": ...}), registered on the app `app.build` makes, and served by the
real engine on the qwen3 fixture through the same completion handler as
every other protocol: parse, limits, engine, drain, errors in its shape."""

import json

from mlx_lm_plus.app import build
from mlx_lm_plus.http.server import make_app
from mlx_lm_plus.protocols.base import Exchange, WireProtocol
from mlx_lm_plus.protocols.validation import parse_request
from mlx_lm_plus.config import parse_args
from tests.http.test_api import served

ECHO = "/v1/echo-completions"


def data(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


# -- the protocol: what a module of protocols/ would hold --


class EchoProtocol(WireProtocol):
    paths = (ECHO,)

    def parse(self, path, body, cli, vocab_size):
        # (Its body is a text completion's: {"prompt", "max_tokens", "stream", ...}.)
        return parse_request("/v1/completions", body, cli, vocab_size)

    def error_body(self, message, status):
        return {"echo_error": message, "status": status}

    def exchange(self, parsed, request_id):
        return EchoExchange(f"echo-{request_id}", parsed.stream)


class EchoExchange(Exchange):
    def __init__(self, echo_id: str, stream: bool):
        self.id = echo_id
        self.stream = stream
        self.text = ""

    def delta(self, text, tool_calls, reasoning):
        self.text += text
        return data({"text": text}) if self.stream and text else b""

    def finish(self, completion):
        return data({"end": completion.finish_reason})

    def body(self, completion):
        return {"text": self.text}

    def stream_error(self, message, status):
        return data({"echo_error": message})


# -- served --


async def test_a_protocol_registered_in_one_line_is_served(aiohttp_client, fixture_path):
    engine, server = build(parse_args(["--model", str(fixture_path("qwen3"))]))
    server.add_protocol(EchoProtocol())  # the one line app.build would hold
    engine.start()
    try:
        client = await served(aiohttp_client, make_app(server))
        body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200
        expected = (await r.json())["choices"][0]["text"]
        assert expected

        r = await client.post(ECHO, json=body)
        assert (r.status, await r.json()) == (200, {"text": expected})

        r = await client.post(ECHO, json={**body, "stream": True})
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        events = [json.loads(line[len("data: "):]) for line in (await r.text()).split("\n")
                  if line.startswith("data: ")]
        assert events[-1] == {"end": "length"}
        assert "".join(e["text"] for e in events[:-1]) == expected

        # Its errors take its shape; a model it doesn't serve is a 404
        # (names_own_models is off); other methods get the server's answers.
        r = await client.post(ECHO, json={"prompt": 5})
        assert (r.status, await r.json()) == (
            400, {"echo_error": "prompt must be of type str", "status": 400})
        r = await client.post(ECHO, json={**body, "model": "someone/else"})
        assert r.status == 404 and "Model not served here" in (await r.json())["echo_error"]
        r = await client.get(ECHO)
        assert (r.status, await r.read()) == (404, b"Not Found")
    finally:
        engine.stop_and_join(timeout=30)
