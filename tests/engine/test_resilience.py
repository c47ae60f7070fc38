"""The engine survives a crash of its generation loop, and lets go of a
disconnected request within one generation step (issue 5)."""

import asyncio
import time

import pytest
from mlx_lm.server import Response

from mlx_lm_plus.engine import engine as engine_module
from mlx_lm_plus.http.server import make_app
from mlx_lm_plus.app import build
from mlx_lm_plus.errors import EngineUnavailable
from mlx_lm_plus.config import parse_args
from testkit.engine_harness import SEQUENTIAL, Collect, EngineRunner

LONG = " ".join(f"Paragraph {i} talks about rivers, boats and the weather." for i in range(40))


@pytest.fixture
def faulty_step(monkeypatch):
    """Make `_Batch.step` raise outside its own guard, once, when armed.

    That is an exception escaping the generation loop itself, the case the
    per-batch guard does not cover.
    """
    state = {"fail_at": None, "calls": 0}
    real_step = engine_module._Batch.step

    def step(self):
        state["calls"] += 1
        if state["fail_at"] is not None and state["calls"] >= state["fail_at"]:
            state["fail_at"] = None
            raise RuntimeError("injected fault")
        return real_step(self)

    monkeypatch.setattr(engine_module._Batch, "step", step)
    return state


def chat(text, **kw):
    return {"messages": [{"role": "user", "content": text}], **kw}


async def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_loop_crash_fails_held_requests_then_restarts(
    aiohttp_client, fixture_path, faulty_step
):
    cli = parse_args(["--model", str(fixture_path("qwen3")), "--max-tokens", "40"])
    engine, server = build(cli)
    engine.restart_delay = 2.0
    engine.start()
    try:
        client = await aiohttp_client(make_app(server))

        async def content(text):
            r = await client.post("/v1/chat/completions", json=chat(text))
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["message"]["content"]

        prompts = ["Tell me about rivers.", "What is a boat?"]
        before = [await content(p) for p in prompts]
        model = engine.model_provider.get(engine.model_provider.default_key).model

        # Three requests in the batch, mid-decode, when the loop raises.
        long = {"max_tokens": 5000}
        tasks = [
            asyncio.create_task(client.post("/v1/chat/completions", json=chat(prompts[0], **long))),
            asyncio.create_task(client.post("/v1/chat/completions", json=chat(prompts[1], **long))),
            asyncio.create_task(client.post(
                "/v1/chat/completions", json=chat("Stream it.", stream=True, **long))),
        ]
        await wait_for(lambda: engine.active_requests == 3)
        faulty_step["fail_at"] = faulty_step["calls"] + 3
        responses = [await t for t in tasks]

        for r in responses[:2]:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert "injected fault" in (await r.json())["error"]
        streamed = await responses[2].text()
        assert responses[2].status == 200
        assert "injected fault" in streamed and streamed.endswith("data: [DONE]\n\n")

        # While the loop restarts: /health says why, completions fail fast.
        r = await client.get("/health")
        health = await r.json()
        assert r.status == 503 and "injected fault" in health["reason"], health
        r = await client.post("/v1/chat/completions", json=chat(prompts[0]))
        assert r.status == 503 and r.headers["Retry-After"] == "1"

        async def healthy():
            return (await client.get("/health")).status == 200

        deadline = time.monotonic() + 20
        while not await healthy():
            assert time.monotonic() < deadline, "the engine did not come back"
            await asyncio.sleep(0.1)
        assert engine.restarts == 1
        assert engine.model_provider.get(engine.model_provider.default_key).model is model  # not reloaded
        assert [await content(p) for p in prompts] == before
        # And batching still works after the restart.
        again = await asyncio.gather(*(content(p) for p in prompts))
        assert list(again) == before
    finally:
        engine.stop_and_join(timeout=30)


def test_crash_loop_stays_down_and_says_so(fixture_path, faulty_step):
    runner = EngineRunner(fixture_path("qwen3"))
    runner.engine.max_restarts = 0
    try:
        faulty_step["fail_at"] = 1
        with pytest.raises(EngineUnavailable, match="injected fault"):
            runner.run(chat("hello"))
        deadline = time.monotonic() + 10
        while runner.engine._thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not runner.engine.is_healthy
        assert "not restarted: too many failures" in runner.engine.unhealthy_reason
        with pytest.raises(EngineUnavailable, match="not restarted"):
            runner.submit(chat("hello again"))
    finally:
        runner.close()


class Watch(Collect):
    """Collects a request's events, and when it was cancelled and removed,
    in generation steps of the engine."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.events = []  # (time, item)
        self.cancel_step = self.removed_step = None

    def put(self, item):
        self.events.append((time.monotonic(), item))
        super().put(item)

    def cancel_now(self):
        self.cancel_step = self.engine.steps
        self.cancel()

    def removed(self):
        self.removed_step = self.engine.steps
        super().removed()


@pytest.fixture(scope="module")
def slow_prefill_runner(fixture_path):
    # Small prefill chunks, so a long prompt takes many steps to prefill.
    runner = EngineRunner(fixture_path("qwen3"), argv=["--prefill-step-size", "16"])
    yield runner
    runner.close()


@pytest.mark.parametrize("path", ["batched", "sequential"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_disconnect_leaves_within_one_step(slow_prefill_runner, path, phase):
    runner = slow_prefill_runner
    engine = runner.engine
    body = chat(LONG + f" ({path}, {phase})", max_tokens=5000)
    if path == "sequential":
        body.update(SEQUENTIAL)
    parsed_channel = Watch(engine)
    from mlx_lm_plus.protocols.validation import parse_request

    parsed = parse_request("/v1/chat/completions", body, runner.args)
    engine.submit(parsed_channel, parsed.request, parsed.args)

    def wanted(item):
        if phase == "prefill":
            return isinstance(item, tuple)  # the first prefill progress report
        return isinstance(item, Response)

    deadline = time.monotonic() + 60
    seen = 0
    while seen < (1 if phase == "prefill" else 3):
        item = parsed_channel.items.get(timeout=max(0.1, deadline - time.monotonic()))
        assert not isinstance(item, Exception), item
        seen += wanted(item)
    parsed_channel.cancel_now()
    cancelled_at = parsed_channel.cancelled_at

    while parsed_channel.removed_at is None:
        assert time.monotonic() < deadline, "the request was never removed"
        time.sleep(0.005)
    after = [item for t, item in parsed_channel.events if t > cancelled_at]
    tokens_after = sum(isinstance(i, Response) for i in after)
    progress_after = sum(isinstance(i, tuple) for i in after)
    waited_ms = (parsed_channel.removed_at - cancelled_at) * 1000
    print(f"{path} {phase}: removed {waited_ms:.1f} ms after the cancel, "
          f"{parsed_channel.removed_step - parsed_channel.cancel_step} step(s), "
          f"{tokens_after} token(s) and {progress_after} prefill report(s) after it")
    assert parsed_channel.removed_step - parsed_channel.cancel_step <= 1
    assert tokens_after <= 1
    if phase == "prefill":
        assert tokens_after == 0 and progress_after <= 1
    assert engine.active_requests == 0 or _settles(engine)
    # The engine goes on: a new request is served in full.
    tokens, prompt, cached = runner.run(chat("Short one.", max_tokens=8))
    assert len(tokens) == 8


def _settles(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while engine.active_requests:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_disconnect_in_decode_keeps_the_work_in_the_cache(fixture_path):
    from tests.cache.test_cache_exactness import assert_store_invariant

    runner = EngineRunner(fixture_path("qwen3"))
    try:
        body = chat(LONG, max_tokens=5000)
        channel = runner.submit(body)
        got = 0
        while got < 20:
            item = channel.items.get(timeout=60)
            got += isinstance(item, Response)
        before = [(e.kind, len(e.key)) for e in runner.store.entries()]
        channel.cancel()
        while channel.removed_at is None:
            time.sleep(0.005)
        assert _settles(runner.engine)
        # Before: only the prompt (as the checkpoint before its last token).
        # After: the prompt and the 20+ tokens generated before the disconnect.
        (entry,) = runner.store.entries()
        prompt_len = before[0][1] + 1
        assert before == [("prompt", prompt_len - 1)]
        assert entry.kind == "generated" and len(entry.key) >= prompt_len + 20
        assert_store_invariant(runner)
    finally:
        runner.close()
