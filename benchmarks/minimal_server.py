"""The least a streaming server on a BatchGenerator must do: the floor the
overhead workload compares a server with, over HTTP on the same machine.

    python -m benchmarks run --model-kind hybrid --workload overhead \\
        --against "python -m benchmarks.minimal_server"

A bare BatchGenerator loop in the benchmark's process has no HTTP, no
detokenizing and no client reading beside it. On a machine whose model step
runs on the CPU cores the client and the event loop also use, that work
comes out of the model's time, so no server reaches the bare loop there.
This server does only the part every streaming server does: it parses the
body, renders the chat template, runs one BatchGenerator on one thread,
detokenizes with mlx-lm's streaming detokenizer, hands each step's tokens
to the event loop in one call and writes OpenAI-shaped SSE chunks (usage at
the end). A real server does more per token (stop strings, tool-call and
reasoning parsing, disconnects) and per request (validation, a cache,
limits); this one has none of it, streams only and decodes greedily: not a
server to use, a measuring stick. A bad request or a failed step ends its
streams with an error event; flags other than its own are refused.
"""

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from pathlib import Path

from aiohttp import web


def build_app(model_path: str, prefill_step_size: int = 2048) -> web.Application:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model_path))
    incoming = queue.Queue()  # (prompt tokens, max_tokens, stream state)
    state = {}

    def generate():  # the generation thread, on its own stream as upstream's
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator

        def new_generator():
            return BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                                  prefill_step_size=prefill_step_size,
                                  stream=mx.default_stream(mx.default_device()))

        model, _ = load(model_path)
        generator = new_generator()
        state["ready"] = True
        detokenizers, streams = {}, {}
        while True:
            try:
                while True:  # everything that came; waiting only when idle
                    try:
                        tokens, max_tokens, stream = incoming.get(block=not streams)
                    except queue.Empty:
                        break
                    try:
                        (uid,) = generator.insert([tokens], max_tokens=[max_tokens])
                    except Exception as e:  # (this request's)
                        state["loop"].call_soon_threadsafe(deliver, [(stream, "", repr(e))])
                        continue
                    detokenizers[uid] = tokenizer.detokenizer  # (a fresh copy)
                    streams[uid] = stream
                gone = [uid for uid, stream in streams.items() if stream["gone"]]
                if gone:  # (clients that went away)
                    generator.remove(gone)
                    for uid in gone:
                        del detokenizers[uid], streams[uid]
                    if not streams:
                        continue
                _, responses = generator.next()
            except Exception as e:  # (a step's: every stream ends, the loop goes on)
                failed = [(stream, "", repr(e)) for stream in streams.values()]
                state["loop"].call_soon_threadsafe(deliver, failed)
                detokenizers, streams, generator = {}, {}, new_generator()
                continue
            out = []
            for r in responses:
                detokenizer = detokenizers[r.uid]
                if r.finish_reason != "stop":  # (a stop token is not text)
                    detokenizer.add_token(r.token)
                stream = streams[r.uid]
                stream["tokens"] += 1
                if r.finish_reason is not None:
                    detokenizer.finalize()
                    del detokenizers[r.uid], streams[r.uid]
                out.append((stream, detokenizer.last_segment, r.finish_reason))
            if out:  # one hand-off per step
                state["loop"].call_soon_threadsafe(deliver, out)

    def deliver(out):
        for stream, text, finish in out:
            stream["queue"].put_nowait((text, finish))

    async def chat(request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
            if not body.get("stream"):
                raise ValueError("streaming only")
            tokens = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
            max_tokens = int(body.get("max_tokens", 512))
        except Exception as e:
            return web.json_response({"error": repr(e)}, status=400)
        stream = {"queue": asyncio.Queue(), "tokens": 0, "gone": False}
        incoming.put((tokens, max_tokens, stream))
        try:
            return await write_stream(request, body, tokens, stream)
        finally:
            stream["gone"] = True  # (done, or its client went: its row leaves)

    async def write_stream(request, body, tokens, stream) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        # The chunks servers of this API send (mlx_lm.server's fields), so a
        # client reads as much as from them.
        head = ("data: " + json.dumps({
            "id": f"chatcmpl-{uuid.uuid4()}", "system_fingerprint": "fp_minimal",
            "object": "chat.completion.chunk", "model": body.get("model", "default_model"),
            "created": int(time.time())})[:-1] + ', "choices": [{"index": 0, ')
        text_head = (head + '"finish_reason": null, "delta": {"role": "assistant", '
                     '"content": ').encode()
        while True:
            text, finish = await stream["queue"].get()
            if text:
                await response.write(text_head + json.dumps(text).encode() + b"}}]}\n\n")
            if finish not in (None, "stop", "length"):  # an error's text
                await response.write(b"data: " + json.dumps({"error": finish}).encode()
                                     + b"\n\ndata: [DONE]\n\n")
                return response
            if finish is not None:
                break
        usage = {"prompt_tokens": len(tokens), "completion_tokens": stream["tokens"],
                 "total_tokens": len(tokens) + stream["tokens"]}
        await response.write(
            (head + f'"finish_reason": "{finish}", "delta": {{"role": "assistant"}}}}]}}\n\n'
             + "data: " + json.dumps({"choices": [], "usage": usage})
             + "\n\ndata: [DONE]\n\n").encode())
        return response

    async def health(_):
        ready = state.get("ready", False)
        return web.json_response({"status": "ok" if ready else "loading"},
                                 status=200 if ready else 503)

    async def started(_):
        state["loop"] = asyncio.get_running_loop()
        threading.Thread(target=generate, daemon=True).start()

    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.on_startup.append(started)
    return app


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.minimal_server")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    # (Any other flag is an error: a workload that sets one would compare
    # different settings.)
    args = p.parse_args(argv)
    web.run_app(build_app(args.model, args.prefill_step_size), host=args.host,
                port=args.port, print=None)


if __name__ == "__main__":
    main()
