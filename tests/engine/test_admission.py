"""A long prompt admitted while another request decodes: its chunks are
smaller (engine.prefill_chunk) and the running stream takes a step between
every two of them, for a text prompt and for an image stretch alike; both
replies stay equal to each request run alone."""

import contextlib
import time

import pytest

from mlx_lm_plus.engine.segments import prefill_chunk
from testkit.engine_harness import SEQUENTIAL, EngineRunner
from tests.models.test_vision import image_part, noise, user

STEP = 64  # --prefill-step-size
CHUNK = prefill_chunk(STEP, True)


@contextlib.contextmanager
def model_calls(model, *methods, into=None):
    """Record (method, tokens in the call) for each call of `methods` on the
    model's class, in order (in `into`, if given)."""
    cls = type(model)
    calls = into if into is not None else []
    saved = {name: cls.__dict__.get(name) for name in methods}

    def recording(name, own):
        def call(self, inputs, *args, **kwargs):
            calls.append((name, inputs.shape[1]))
            return own(self, inputs, *args, **kwargs)
        return call

    for name in methods:
        setattr(cls, name, recording(name, getattr(cls, name)))
    try:
        yield calls
    finally:
        for name, own in saved.items():
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)


def a_stream(runner, tokens=400):
    """A request that decodes `tokens` tokens (one word forced: no early end)."""
    word = runner.loaded.tokenizer.encode(" the", add_special_tokens=False)[-1]
    return {"messages": [{"role": "user", "content": "Tell a very long story."}],
            "max_tokens": tokens, "logit_bias": {str(word): 100}}


def wait_for_tokens(channel, n):
    from mlx_lm.server import Response

    seen = []
    while sum(isinstance(i, Response) for i in seen) < n:
        seen.append(channel.items.get(timeout=120))
    return seen


def finish(channel, seen):
    """The tokens of a request whose first items were `seen`."""
    from mlx_lm.server import Response

    rest, _ = channel.result()
    return [i.token for i in seen if isinstance(i, Response)] + rest


def assert_interleaved(calls, prefill_name):
    """While the stream decodes (its one-token calls), every prompt chunk is
    at most CHUNK tokens and the stream steps between two chunks."""
    first = next(i for i, c in enumerate(calls) if c == ("__call__", 1))
    last = max(i for i, c in enumerate(calls) if c == ("__call__", 1))
    during = calls[first:last + 1]
    chunks = [n for name, n in during if name == prefill_name and n > 1]
    assert len(chunks) >= 4, during  # (the long prompt went in while it decoded)
    assert max(chunks) <= CHUNK, during
    for a, b in zip(during, during[1:]):
        assert not (a[0] == b[0] == prefill_name and a[1] > 1 and b[1] > 1), during


def check_beside_a_stream(fixture_path, kind, b_body, min_prompt, prefill_name):
    """Admit `b_body` while a stream decodes: its chunks are small and
    interleaved with the stream's steps, and both replies are the ones each
    gets alone."""
    runner = EngineRunner(fixture_path(kind), argv=["--prefill-step-size", str(STEP)])
    alone = EngineRunner(fixture_path(kind), max_bytes=0)
    try:
        a_body = a_stream(runner)
        methods = dict.fromkeys(["__call__", prefill_name])
        engine, beat = runner.engine, runner.engine._beat
        with model_calls(runner.loaded.model, *methods) as calls:
            # (The watchdog's beats too: an image chunk runs under its own.)
            engine._beat = lambda what, *rest: (calls.append(("beat", what)), beat(what, *rest))
            a = runner.submit(a_body)
            seen = wait_for_tokens(a, 5)
            b_tokens, b_prompt, _ = runner.run(b_body)
            a_tokens = finish(a, seen)
        engine._beat = beat
        assert b_prompt > min_prompt
        assert_interleaved([c for c in calls if c[0] != "beat"], prefill_name)
        if prefill_name == "prefill_chunk":
            # Each image chunk runs under its own beat, after the batch
            # steps between chunks (a stuck chunk is named as one).
            last_beat = None
            for name, what in calls:
                if name == "beat":
                    last_beat = what
                elif name == prefill_name and what > 1:
                    assert last_beat == "a prefill chunk", calls
            assert ("beat", "a batch step") in calls
        assert a_tokens == alone.run(a_body)[0]
        assert b_tokens == alone.run(b_body)[0]
    finally:
        runner.close()
        alone.close()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_long_prompt_goes_in_small_chunks_between_decode_steps(fixture_path, kind):
    b_body = {"messages": [{"role": "user", "content": "A long question. " + " ".join(
        f"Item {i} is blue and item {i + 1} is red." for i in range(60))}], "max_tokens": 6}
    check_beside_a_stream(fixture_path, kind, b_body, 8 * CHUNK, "__call__")


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_5_vl"])
def test_an_image_stretch_goes_in_small_chunks_between_decode_steps(fixture_path, kind):
    pictures = [image_part(noise(seed, size=(336, 336))) for seed in (7, 8, 9)]
    b_body = {"messages": [user(*pictures, "What are these?")], "max_tokens": 6}
    check_beside_a_stream(fixture_path, kind, b_body, 4 * CHUNK, "prefill_chunk")


def test_prefill_chunk():
    assert prefill_chunk(2048, False) == 2048
    assert prefill_chunk(2048, True) == 512
    assert prefill_chunk(64, True) == 32  # (never below DECODING_CHUNK_MIN)
    assert prefill_chunk(8, True) == 8  # (nor above the step itself)


def test_a_finished_prompt_gets_its_first_token_before_another_prompts_chunk(fixture_path):
    """A short request admitted beside a long one: once its prompt is in, the
    step that computes its first token and the one that hands it out run
    no chunk of the long prompt, so the token doesn't wait for one."""
    from mlx_lm.server import Response

    from testkit.engine_harness import Collect

    events = []

    class Short(Collect):
        def put(self, item):
            if isinstance(item, Response) and "first token" not in events:
                events.append("first token")
            super().put(item)

    runner = EngineRunner(fixture_path("qwen3"), argv=["--prefill-step-size", str(STEP)])
    alone = EngineRunner(fixture_path("qwen3"), max_bytes=0)
    try:
        short = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
        long = {"messages": [{"role": "user", "content": " ".join(
            f"Item {i} is blue." for i in range(120))}], "max_tokens": 4}
        runner.run({**short, "max_tokens": 1})  # (compiled shapes; then a fresh store)
        runner.engine.store.clear()
        from mlx_lm_plus.protocols.validation import parse_request

        with model_calls(runner.loaded.model, "__call__", into=events):
            a = Short()
            parsed = parse_request("/v1/chat/completions", short, runner.args)
            runner.engine.submit(a, parsed.request, parsed.args)
            b = runner.submit(long)
            a_tokens, _ = a.result()
            b_tokens, _ = b.result()
        first = events.index("first token")
        chunks = [e for e in events[:first] if e[0] == "__call__" and e[1] > 1]
        # Its own prompt (beside the long one's first chunk, or alone).
        assert len(chunks) == 1, events[:first + 1]
        assert sum(1 for e in events if e[0] == "__call__" and e[1] > 1) > 3  # (the long one)
        assert a_tokens == alone.run(short)[0] and b_tokens == alone.run(long)[0]
    finally:
        runner.close()
        alone.close()


def test_requests_diverging_together_store_their_divergence_checkpoint_once(fixture_path):
    """Requests that arrive together and leave the store's paths at the same
    point: one of them stores the checkpoint there; each reply is the one it
    gets alone."""
    runner = EngineRunner(fixture_path("qwen3_5"))
    alone = EngineRunner(fixture_path("qwen3_5"), max_bytes=0)
    try:
        system = {"role": "system", "content": "You answer in one line about the river trip."}

        def body(i):
            return {"messages": [system, {"role": "user", "content":
                    f"Please tell me, in a few words, what happens on day {i} of the trip."}],
                    "max_tokens": 4}

        runner.run(body(9))  # the store's path: the divergence is at the day's number
        before = runner.engine.store.stats["insert_checkpoint"]
        replies = runner.run_all([body(i) for i in range(4)])
        assert runner.engine.store.stats["insert_checkpoint"] - before == 1
        assert replies == [alone.run(body(i))[0] for i in range(4)]
    finally:
        runner.close()
        alone.close()


def test_requests_cached_whole_cannot_hold_a_long_prompt_back(fixture_path):
    """Each request whose prompt is cached whole asks for the two steps
    without a prompt chunk that hand its first token out; when they keep
    coming, at most FIRST_TOKEN_STEPS such steps run in a row, then a
    chunk (a long prompt still goes in)."""
    import mlx.core as mx

    from mlx_lm_plus.engine.batch import FIRST_TOKEN_STEPS, _Batch

    runner = EngineRunner(fixture_path("qwen3"), argv=["--prefill-step-size", str(STEP)])
    try:
        batch = _Batch(runner.engine, runner.loaded, mx.default_stream(mx.default_device()))
        batch.close()
        sizes = []

        class Generator:
            prefill_step_size = None

            def next(self):
                sizes.append(self.prefill_step_size)
                return [], []

        batch.generator = Generator()
        for _ in range(12):
            batch._decode_only = 2  # (one more such request came in)
            batch._step()
        runs, run = [], 0
        for size in sizes:
            run = run + 1 if size == 0 else 0
            runs.append(run)
        assert max(runs) == FIRST_TOKEN_STEPS and sizes.count(STEP) >= 12 // 3, sizes
    finally:
        runner.close()


def words_body(words, topic, max_tokens=4, **extra):
    """A chat request of `words` short sentences about `topic`."""
    return {"messages": [{"role": "user", "content": " ".join(
        f"{topic} word {i}." for i in range(words))}], "max_tokens": max_tokens, **extra}


def submit_planned(runner, body, channel):
    """Submit `body` planned ahead, as the HTTP layer does; returns `channel`."""
    from mlx_lm_plus.protocols.validation import parse_request

    parsed = parse_request("/v1/chat/completions", body, runner.args)
    planned = runner.engine.plan(parsed.request, parsed.args)
    runner.engine.submit(channel, parsed.request, parsed.args, planned)
    return channel


def test_requests_that_arrive_together_go_shortest_work_first(fixture_path):
    """Requests waiting together (they came during one step) are admitted
    shortest work first, the work being the prompt's tokens past what the
    store holds: a long prompt the store holds goes before a short new one.
    Each reply is the one it gets alone."""
    import threading

    from mlx_lm_plus.engine import engine as engine_module
    from testkit.engine_harness import Collect

    bodies = {"long": words_body(60, "Apple"), "medium": words_body(30, "Pear"),
              "short": words_body(8, "Plum"), "held": words_body(90, "Fig")}
    runner = EngineRunner(fixture_path("qwen3"))
    alone = EngineRunner(fixture_path("qwen3"), max_bytes=0)
    admitted, insert = [], engine_module._Batch.insert
    try:
        runner.run(bodies["held"])  # (the store holds it: little work left)
        stream = runner.submit(a_stream(runner, 200))  # (the engine steps meanwhile)
        wait_for_tokens(stream, 2)
        step, gate, held = runner.engine._step_batches, threading.Event(), threading.Event()

        def gated():
            held.set()
            gate.wait(60)
            step()

        names = {}

        def recording(self, a):
            admitted.append(names.get(id(a.channel)))
            return insert(self, a)

        engine_module._Batch.insert = recording
        runner.engine._step_batches = gated
        assert held.wait(60)
        channels = {}
        for name in ("long", "medium", "short", "held"):  # (arrival order)
            channels[name] = Collect()
            names[id(channels[name])] = name
            submit_planned(runner, bodies[name], channels[name])
        runner.engine._step_batches = step
        gate.set()
        replies = {name: c.result()[0] for name, c in channels.items()}
        assert admitted == ["held", "short", "medium", "long"]
        assert replies == {name: alone.run(b)[0] for name, b in bodies.items()}
        finish(stream, [])
    finally:
        engine_module._Batch.insert = insert
        runner.close()
        alone.close()


def test_a_long_request_is_not_passed_by_later_arrivals(fixture_path):
    """Only requests that arrived together are reordered: on the sequential
    path, where the queue isn't emptied every step, a
    long request waiting behind a running one is passed by the short one
    that came with it, never by those that come later, one per generation."""
    from mlx_lm.server import Response

    from testkit.engine_harness import Collect

    firsts = []

    class Named(Collect):
        def __init__(self, name):
            super().__init__()
            self.name, self.started = name, False

        def put(self, item):
            if isinstance(item, Response) and not self.started:
                self.started = True
                firsts.append(self.name)
            super().put(item)

    def body(words, topic, n):
        return words_body(words, topic, n, **SEQUENTIAL)

    runner = EngineRunner(fixture_path("qwen3"))
    try:
        runner.loaded

        def submit(name, b):
            return submit_planned(runner, b, Named(name))

        def started(channel):
            deadline = time.monotonic() + 60
            while not channel.started:
                assert time.monotonic() < deadline, \
                    f"{channel.name} did not start: {list(channel.items.queue)}"
                time.sleep(0.001)

        short = submit("s0", body(5, "Plum", 60))
        started(short)
        long = submit("long", body(80, "Apple", 4))
        short = submit("s1", body(5, "Plum", 60))
        for i in range(2, 5):  # each arrives while the one before it generates
            started(short)
            short = submit(f"s{i}", body(5, "Plum", 60))
        long.result()
        short.result()
        assert firsts.index("long") < firsts.index("s2"), firsts
    finally:
        runner.close()


def _wave_steps(fixture_path, monkeypatch, arriving: bool, gap: float):
    """Submit A, then B `gap` seconds later, the HTTP side saying (or not)
    that a request is still on its way while A is admitted: the batch steps
    that ran between A's admission and B's."""
    import threading
    import time

    from mlx_lm_plus.engine import engine as engine_module
    from testkit.engine_harness import EngineRunner

    runner = EngineRunner(fixture_path("qwen3_5"))
    events = []
    insert, step = engine_module._Batch.insert, engine_module._Batch.step

    def recording_insert(self, admission):
        events.append("insert")
        return insert(self, admission)

    def recording_step(self):
        worked = step(self)
        if worked:
            events.append("step")
        return worked

    monkeypatch.setattr(engine_module._Batch, "insert", recording_insert)
    monkeypatch.setattr(engine_module._Batch, "step", recording_step)
    try:
        runner.loaded
        runner.run({"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2})
        coming = [1 if arriving else 0]
        runner.engine.arrivals = lambda: coming[0]
        events.clear()
        first = runner.submit({"messages": [{"role": "user", "content": "first of two"}]})
        time.sleep(gap)
        second = runner.submit({"messages": [{"role": "user", "content": "second of two"}]})
        coming[0] = 0
        first.result(), second.result()
        threading.Event().wait(0.01)
        a, b = [i for i, e in enumerate(events) if e == "insert"][:2]
        return events[a:b].count("step")
    finally:
        runner.close()


def test_requests_sent_together_share_one_prefill_wave(fixture_path, monkeypatch):
    """Found in review: the first of a burst was admitted alone and the rest
    waited for its prefill. While the HTTP side is still planning requests
    (Engine.arrivals), the wave's first step waits for them, briefly; with
    none on their way it doesn't (the control: there a step runs between
    the two admissions, so the check can fail)."""
    assert _wave_steps(fixture_path, monkeypatch, arriving=True, gap=0.003) == 0
    assert _wave_steps(fixture_path, monkeypatch, arriving=False, gap=0.03) >= 1
