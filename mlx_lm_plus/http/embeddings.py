"""/v1/embeddings and /v1/rerank: the same way in as completions
(`take_in`: the engine's health, the bound on requests in flight, the body,
the metrics), a plan made in a planning lane, the engine's embedding runner,
one JSON answer.

Parsing, the model lookup (a folder's path reads the filesystem) and
writing the answer (2,048 vectors of floats is seconds of JSON) run in an
executor, never on the event loop.
"""

import asyncio
import json
import uuid

from aiohttp import web
from mlx_lm.server import ModelDescription

from mlx_lm_plus.errors import EngineUnavailable, PromptError
from mlx_lm_plus.http.channel import IDLE, AsyncChannel
from mlx_lm_plus.http.completion import _status_of
from mlx_lm_plus.planning.embedding import (
    EmbeddingArgs, PlanFirst, RerankRequest, plan_embedding_request,
)
from mlx_lm_plus.planning.lanes import LaneBusy
from mlx_lm_plus.protocols.embeddings import (
    embeddings_body, encode, parse_embeddings, parse_rerank, rerank_body,
)
from mlx_lm_plus.protocols.validation import RequestError

# Bodies larger than this are tokenized in the large planning lane: 2,048
# inputs take a while, and chat plans must not queue behind them.
LARGE_LANE_BYTES = 64 << 10
SERVES = {"embed": "an embedding model (/v1/embeddings)",
          "rerank": "a reranking model (/v1/rerank)",
          "generate": "a generation model (chat and text completions)"}


class Embeddings:
    """The Server's embedding endpoints. (A part of `Server`: it uses its
    take_in, replies, lanes, engine and model provider.)"""

    async def handle_embeddings(self, request: web.Request, task: str):
        return await self.take_in(
            request, lambda body, track: self._embed(request, body, track, task))

    def _parse_embedding(self, body, task: str):
        """(the request, its model's ModelDescription, whether it is
        served, its metrics label, what that model serves)."""
        parsed = parse_rerank(body) if task == "rerank" else parse_embeddings(body)
        provider = self.model_provider
        desc = ModelDescription(parsed.model, None, None)
        served = provider.is_served(desc)
        serves = provider.task(provider.key_for(desc)) if served else None
        return parsed, desc, served, provider.name_for(desc), serves

    async def _embed(self, request: web.Request, body, track, task: str):
        loop = asyncio.get_running_loop()
        try:
            parsed, desc, served, label, serves = await loop.run_in_executor(
                None, self._parse_embedding, body, task)
        except RequestError as e:
            return self.error(request, str(e), e.status)
        track.record.model, track.record.served_model = parsed.model, label
        track.record.id = f"{task}-{uuid.uuid4().hex}"
        if not served:
            return self.not_served(request, desc)
        if serves != task:
            return self.error(request, f"Model {label!r} is {SERVES[serves]}: {request.path} "
                                       f"needs {SERVES[task]} (GET /v1/models says what each "
                                       "model serves: its `task`)")
        if self.model_provider.is_distributed:
            return self.error(request, f"{request.path} is not served under mx.distributed")
        args = EmbeddingArgs(desc)
        # (A rerank's query is tokenized once for each document.)
        work = track.body_bytes + (len(parsed.query) * len(parsed.documents)
                                   if isinstance(parsed, RerankRequest) else 0)
        lane = self._embedding_lane if work > LARGE_LANE_BYTES else self._planner
        # Planned in a lane with the loaded model's tokenizer. A request for
        # a model not loaded yet goes to the engine unplanned, which loads
        # the model and hands it back (PlanFirst, with the model): it is
        # planned here with it and sent again, so no tokenizing is done on
        # the generation thread.
        try:
            planned = await self._in_lane(lane, self.engine.plan_embedding, parsed, args)
            item = await self._submit_embedding(track, parsed, args, planned)
            if isinstance(item, PlanFirst):
                planned = await self._in_lane(lane, plan_embedding_request, item.lm, parsed)
                item = None  # (the model let go before waiting: an unload frees it)
                item = await self._submit_embedding(track, parsed, args, planned)
        except PromptError as e:
            return self.error(request, str(e), 400)
        except (EngineUnavailable, LaneBusy) as e:
            return self.unavailable(request, str(e))
        del planned  # (the engine's now)
        if isinstance(item, PlanFirst):  # (a plan for its model: never twice)
            return self.unavailable(request, f"Model {label!r} could not be planned for")
        if isinstance(item, EngineUnavailable):
            return self.unavailable(request, str(item))
        if isinstance(item, Exception):
            track.error = str(item)
            return self.error(request, str(item), _status_of(item))
        track.record.prompt_tokens = item.prompt_tokens
        answer = await loop.run_in_executor(None, _answer, parsed, label, item)
        return self.json_response(request, answer)

    async def _submit_embedding(self, track, parsed, args, planned):
        """Submit to the engine and wait for its answer (the client's going
        cancels the wait, and the engine drops the request)."""
        channel = AsyncChannel(asyncio.get_running_loop())
        self._arrived(track)
        self.engine.submit(channel, parsed, args, planned)
        try:
            item = await channel.get()
            while item is IDLE or isinstance(item, tuple):  # (queued; its model loading)
                item = await channel.get()
            return item
        finally:
            channel.cancel()  # (gone: the engine drops it; else it is done with it)


def _answer(parsed, label: str, output) -> bytes:
    """The JSON answer, off the event loop."""
    if isinstance(parsed, RerankRequest):
        body = rerank_body(parsed, label, output.values, output.prompt_tokens)
        return json.dumps(body, allow_nan=False).encode()
    return encode(embeddings_body(parsed, label, output.values, output.normalized,
                                  output.prompt_tokens))
