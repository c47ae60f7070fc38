"""Run the engine in-process (no HTTP), for cache and batching tests."""

import copy
import queue
import time
from types import SimpleNamespace

from mlx_lm.server import Response

from mlx_lm_plus.cache.store import PromptStore
from mlx_lm_plus.engine.channel import Channel
from mlx_lm_plus.engine.engine import Engine
from mlx_lm_plus.models.provider import ModelProvider
from mlx_lm_plus.config import parse_args
from mlx_lm_plus.http.intake import Intake, _may_constrain
from mlx_lm_plus.protocols.validation import parse_request


# What sends a request to the sequential path today (a seed with XTC,
# whose draw upstream makes from the global random state). Greedy unless the
# body says otherwise: XTC only acts when sampling. Tests of the sequential
# path send this; EngineRunner.sequential counts what really went there, and
# tests/engine/test_seeds.py fails if this stops going there.
SEQUENTIAL = {"seed": 1, "xtc_probability": 0.5, "xtc_threshold": 0.1}


class Collect(Channel):
    def __init__(self):
        self.items = queue.Queue()

    def put(self, item):
        self.items.put(item)

    def cancel_and_drain(self, timeout=30) -> list:
        """The client goes: wait until the engine has let the request go, and
        return what it put after."""
        self.cancel()
        deadline = time.monotonic() + timeout
        while self.removed_at is None:
            assert time.monotonic() < deadline, "the request was not stopped"
            time.sleep(0.01)
        rest = []
        while not self.items.empty():
            rest.append(self.items.get())
        return rest

    def result(self, timeout=120):
        """(tokens, ctx) once the request is done; raises its error."""
        tokens, ctx = [], None
        while True:
            item = self.items.get(timeout=timeout)
            if item is None:
                return tokens, ctx
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Response):
                tokens.append(item.token)
            elif not isinstance(item, tuple):
                ctx = item


class EngineRunner:
    def __init__(self, model_path, *, max_bytes=1 << 30, max_sequences=None, argv=(),
                 as_a_rank=False):
        self.args = parse_args(["--model", str(model_path), *argv])
        self.provider = ModelProvider(self.args)
        self.store = PromptStore(max_bytes=max_bytes, max_sequences=max_sequences,
                                 share_kv=self.args.kv_bits is None)
        self.engine = Engine(self.provider, self.store)
        self.exits = []  # the statuses the engine exited the process with
        self.engine.exit_process = self.exits.append
        self.sequential = 0  # requests the sequential path served
        serve = self.engine.sequential.serve

        def counted(*a, **kw):
            self.sequential += 1
            return serve(*a, **kw)

        self.engine.sequential.serve = counted
        if as_a_rank:
            # The engine's mx.distributed paths, on a group of one (its
            # collectives are then the values themselves).
            self.engine._is_distributed = True
        self.engine.start()

    @property
    def loaded(self):
        """The default model once the generation thread has loaded it."""
        deadline = time.monotonic() + 120
        while (lm := self.provider.get(self.provider.default_key)) is None:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.01)
        return lm

    def submit(self, body, path="/v1/chat/completions"):
        # A copy, as a request parsed from its JSON: planning converts the
        # messages in place, and tests send the same ones again.
        body = copy.deepcopy(body)
        parsed = parse_request(path, {"max_tokens": 10, **body}, self.args)
        # Structured output compiled as the HTTP intake compiles it (in a
        # constraint lane there): a response_format or a forced tool is a
        # real grammar here too.
        if _may_constrain(parsed.request):
            parsed.request.constraint = Intake._compile_constraint(
                SimpleNamespace(model_provider=self.provider), parsed.request, parsed.args.model)
        channel = Collect()
        self.engine.submit(channel, parsed.request, parsed.args)
        return channel

    def run(self, body, **kw):
        """(generated tokens, prompt tokens, cached tokens) of one request."""
        tokens, ctx = self.submit(body, **kw).result()
        return tokens, len(ctx.prompt), ctx.prompt_cache_count

    def run_all(self, bodies):
        channels = [self.submit(b) for b in bodies]
        return [c.result()[0] for c in channels]

    def close(self):
        self.engine.stop_and_join(timeout=30)
