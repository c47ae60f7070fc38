"""The pieces every workload uses: a streaming client that records what each
request cost, servers run alternately (A B A B), medians and ratios.

A request's row: prompt tokens and cached tokens (the server's own
`usage`, asked for with stream_options.include_usage), novel tokens (the
prompt minus its longest common prefix with any earlier request's prompt
and reply: what no cache could have held), time to first token, total time
and output tokens.
"""

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import aiohttp

from mlx_lm_plus.planning.checkpoints import common_prefix


def add_model_args(parser, default_kind: str) -> None:
    parser.add_argument("--model", help="a model folder (default: a tiny fixture model)")
    parser.add_argument("--model-kind", default=default_kind,
                        help="fixture kind (testkit/fixtures.py) when no --model")


def ab_parser(description: str, default_kind: str, rounds: int):
    """The arguments every A/B benchmark takes: the model, --rounds, --json."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    add_model_args(parser, default_kind)
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds of A and B each")
    parser.add_argument("--json", help="write the figures to this file")
    return parser


def fixture_or_model(args, work, kind: Optional[str] = None) -> str:
    """--model, or the fixture of `kind` (default: --model-kind), built in
    $MLX_LM_PLUS_FIXTURES (the tests' folder: built once) or under `work`."""
    if args.model:
        return args.model
    from testkit.fixtures import VISION_KINDS, build_fixture, build_vision_fixture

    kind = kind or args.model_kind
    build = build_vision_fixture if kind in VISION_KINDS else build_fixture
    return str(build(kind, Path(os.environ.get("MLX_LM_PLUS_FIXTURES") or work)))


@dataclass
class Row:
    prompt: Optional[int]
    cached: int
    novel: Optional[int]
    ttft: Optional[float]  # streamed requests only
    total: float
    # Streamed: when the last text arrived (decode rate: tokens after the
    # first over last - ttft), and when each text chunk did (perf_counter).
    last: Optional[float]
    output_tokens: Optional[int]
    text: str
    arrivals: List[float] = field(default_factory=list)


async def stream_events(response):
    """The JSON events of a chat-completions SSE response, in order (an
    error event raises)."""
    async for line in response.content:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"])
        yield event


def delta_text(choice: dict) -> str:
    """The text a streamed choice carries: content and reasoning."""
    delta = choice.get("delta", {})
    return (delta.get("content") or "") + (delta.get("reasoning") or "")


@dataclass
class Streamed:
    """One streamed chat completion: when each piece of text arrived
    (perf_counter), the usage event, the finish reason, the text."""
    sent: float
    arrivals: List[float]
    usage: Optional[Dict[str, Any]]
    finish: Optional[str]
    text: str


async def stream_chat(http: aiohttp.ClientSession, url: str, body: dict) -> Streamed:
    """POST a streamed chat completion and read it to its end (a non-200
    answer raises)."""
    sent = time.perf_counter()
    arrivals, parts, usage, finish = [], [], None, None
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for event in stream_events(r):
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = delta_text(choice)
                if piece:
                    arrivals.append(time.perf_counter())
                    parts.append(piece)
                finish = choice.get("finish_reason") or finish
    return Streamed(sent, arrivals, usage, finish, "".join(parts))


@dataclass
class Client:
    """Streams chat completions from one server and keeps a Row for each."""

    url: str
    tokenizer: Any
    max_tokens: int
    seen: List[List[int]] = field(default_factory=list)
    _rows: List[Row] = field(default_factory=list)
    # Rows whose novel-token count is still to work out: tokenizing and
    # comparing with every earlier request takes milliseconds of this event
    # loop's time, which would delay the timestamps of concurrent requests.
    _unsettled: List[tuple] = field(default_factory=list)

    @property
    def rows(self) -> List[Row]:
        for row, messages, ids in self._unsettled:  # in the order they ended
            prompt_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            reusable = max((common_prefix(prompt_ids, s) for s in self.seen), default=0)
            if ids is None:  # streamed: the reply re-tokenized, an approximation
                ids = self.tokenizer.encode(row.text, add_special_tokens=False)
            self.seen.append(prompt_ids + ids)
            row.novel = len(prompt_ids) - reusable
            row.prompt = row.prompt if row.prompt is not None else len(prompt_ids)
            row.output_tokens = (row.output_tokens if row.output_tokens is not None
                                 else len(ids))
        self._unsettled.clear()
        return self._rows

    async def chat(self, session, messages, extra=None, record=True, stream=False) -> Row:
        """One request. Non-streaming (the default) asks for logprobs, whose
        ids are the exact generated tokens the novel-token count needs
        (streams carry no ids, and re-tokenizing a random model's text does
        not give its tokens back); streaming gives the time to first token."""
        body = {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0.0,
                **(extra or {})}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        else:
            body.update(logprobs=True)
        start = time.perf_counter()
        first, last, parts, usage, ids, arrivals = None, None, [], None, None, []
        async with session.post(self.url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {await r.text()}")
            if not stream:
                reply = await r.json()
                usage = reply["usage"]
                message = reply["choices"][0]["message"]
                parts = [message.get("content") or ""]
                ids = [c["id"] for c in reply["choices"][0]["logprobs"]["content"]]
            else:
                async for event in stream_events(r):
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices", []):
                        piece = delta_text(choice)
                        if piece:
                            arrivals.append(time.perf_counter())
                            last = arrivals[-1] - start
                            if first is None:
                                first = last
                            parts.append(piece)
        total = time.perf_counter() - start
        text = "".join(parts)
        row = Row(
            prompt=usage["prompt_tokens"] if usage else None,
            cached=(usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0),
            novel=None,  # settled when `rows` is read
            ttft=first,
            total=total,
            last=last,
            arrivals=arrivals,
            output_tokens=usage["completion_tokens"] if usage else None,
            text=text,
        )
        # (A copy: conversations grow after the request.)
        self._unsettled.append((row, list(messages), ids))
        if record:
            self._rows.append(row)
        return row


def print_figures(figures: Dict[str, Any], json_path: Optional[str] = None) -> None:
    """One figure a line, names aligned; all of them as JSON to `json_path`."""
    width = max((len(k) for k in figures), default=0)
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=1))


def alternate(servers: Dict[str, tuple], model: str, work: Path, rounds: int,
              measure, describe) -> Dict[str, List[Any]]:
    """Each round, each server in turn (A B A B ...), started fresh on
    `model`: servers is {name: (launch command, extra arguments)};
    `measure(server, round_index)` gives a round's figures, printed as
    `describe(figures)`. Returns {name: [figures of each round]}."""
    from compat.launch import ServerProcess

    runs = {name: [] for name in servers}
    for round_ in range(rounds):
        for name, (command, extra) in servers.items():
            with ServerProcess(command, ["--model", model, *extra],
                               log=work / f"{name}.log") as server:
                figures = measure(server, round_)
            runs[name].append(figures)
            print(f"round {round_ + 1} {name:>8}: {describe(figures)}", flush=True)
    return runs


def session(timeout: float = 1800) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout),
        connector=aiohttp.TCPConnector(limit=0),
    )


def window_rate(arrivals: List[List[float]], tokens: List[int]) -> Optional[float]:
    """Decode tok/s of concurrent streams while all of them decode: the tokens
    that arrived between the last stream's first token and the first
    stream's last, over that time (a stream's `arrivals` are when its
    tokens, or its text chunks, came; `tokens` its token count). One stream:
    its tokens after the first over its first-to-last time."""
    pairs = [(a, n) for a, n in zip(arrivals, tokens) if len(a) > 1]
    if not pairs:
        return None
    arrivals, tokens = [a for a, _ in pairs], [n for _, n in pairs]
    start, end = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    if end <= start:
        return None
    per_arrival = [n / len(a) for a, n in zip(arrivals, tokens)]
    inside = sum(sum(start < t <= end for t in a) * k for a, k in zip(arrivals, per_arrival))
    return inside / (end - start)


def reuse_ratio(rows: List[Row]) -> Optional[float]:
    """Prompt tokens recomputed per novel prompt token (ideal 1.0)."""
    novel = sum(r.novel for r in rows)
    if not novel:
        return None
    return round(sum(r.prompt - r.cached for r in rows) / novel, 3)


def median(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values: List[float], q: float) -> Optional[float]:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def get_json(http: aiohttp.ClientSession, url: str, path: str) -> Optional[Dict[str, Any]]:
    """GET a JSON endpoint (None where the server has no such endpoint)."""
    try:
        async with http.get(url + path) as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None
