"""What the server is doing: Prometheus metrics, /v1/stats and its time series.

Nothing here runs per token. The HTTP handler notes four times per request
(arrival, accepted by the engine, first token, end) and hands one
`RequestRecord` to `Metrics.observe` when the request ends; the cache, the
engine and MLX's memory are read when /metrics or /v1/stats is asked for
(collectors), not updated as they change. So the generation thread pays
nothing, and the event loop a few histogram observations per request.
"""

import json
import logging
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Any, Deque, Dict, List, Optional

from prometheus_client import CollectorRegistry, Counter as PromCounter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

PREFIX = "mlx_lm_plus"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SPEED_BUCKETS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000)
SHARE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
HISTORY = 1000  # requests kept for /v1/stats and the dashboard
SERIES_SECONDS = 300  # the time series: the last five minutes at 1 s


@dataclass
class RequestRecord:
    """One finished request, as the HTTP side saw it."""

    id: str
    endpoint: str
    model: str
    status: int
    started: float  # wall clock (time.time()) at arrival
    ended: float = 0.0  # wall clock at the end
    stream: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: Optional[str] = None  # stop, length, tool_calls, cancelled, error
    ttft: Optional[float] = None  # arrival to first token, seconds
    prefill_seconds: Optional[float] = None  # accepted to first token
    decode_seconds: Optional[float] = None  # first token to the last
    total_seconds: float = 0.0
    images: int = 0
    error: Optional[str] = None
    # The served model it ran on (its name in /v1/models), the `model` label:
    # never the name a client sent, which could be anything.
    served_model: str = ""
    # Why it reused fewer prompt tokens than the prompt cache shares with it
    # (Engine._explain_miss; None: it didn't).
    cache_miss: Optional[Dict[str, Any]] = None
    # --prompt-lookup-tokens: its proposals (speculation.summary; None: none).
    speculation: Optional[Dict[str, Any]] = None

    @property
    def computed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def prefill_tps(self) -> Optional[float]:
        if self.prefill_seconds and self.computed_tokens:
            return self.computed_tokens / self.prefill_seconds
        return None

    @property
    def tokens_per_step(self) -> Optional[float]:
        """Generated tokens per model step that wrote them, where prompt
        lookup proposed: each step writes one token and the proposals kept."""
        if not self.speculation:
            return None
        steps = self.generated_tokens - self.speculation["accepted"]
        return self.generated_tokens / steps if steps > 0 else None

    @property
    def decode_tps(self) -> Optional[float]:
        # The first token comes out of the prefill; the rest are decode steps.
        if self.decode_seconds and self.generated_tokens > 1:
            return (self.generated_tokens - 1) / self.decode_seconds
        return None

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        if self.id.startswith("resp_"):
            # A stored response's id is all it takes to read or continue it
            # (OpenAI's Responses API): /v1/stats shows its end only.
            d["id"] = "resp_..." + self.id[-6:]
        d.update(
            computed_tokens=self.computed_tokens,
            prefill_tps=_round(self.prefill_tps),
            decode_tps=_round(self.decode_tps),
        )
        if self.speculation:
            d["tokens_per_step"] = _round(self.tokens_per_step, 2)
        for k in ("ttft", "prefill_seconds", "decode_seconds", "total_seconds"):
            d[k] = _round(d[k], 4)
        return d


def _round(x, digits=1):
    return None if x is None else round(x, digits)


class _LiveCollector:
    """Figures read at scrape time from the engine, the store and MLX."""

    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        engine = m.engine
        cache = engine.store.snapshot()
        single = [  # (family, name, help, value)
            (GaugeMetricFamily, "cache_bytes", "Bytes held by the prompt cache", cache["bytes"]),
            (GaugeMetricFamily, "cache_budget_bytes", "Byte budget of the prompt cache",
             cache["budget_bytes"]),
            (GaugeMetricFamily, "cache_entries", "Prompt cache entries", cache["entries"]),
            (GaugeMetricFamily, "cache_tokens", "Tokens covered by prompt cache entries",
             cache["cached_tokens"]),
            (CounterMetricFamily, "cache_evictions", "Prompt cache entries evicted",
             cache["evictions"]),
            (CounterMetricFamily, "cache_evicted_bytes", "Bytes freed by prompt cache evictions",
             cache["evicted_bytes"]),
            (CounterMetricFamily, "cache_expired", "Prompt cache entries expired (TTL)",
             cache["expired"]),
            (CounterMetricFamily, "engine_restarts",
             "Restarts of the generation loop after a crash", engine.restarts),
            (GaugeMetricFamily, "engine_healthy", "1 while the generation loop serves",
             1 if engine.is_healthy else 0),
            (GaugeMetricFamily, "requests_in_flight",
             "Completion requests accepted and not answered", m.in_flight()),
            (GaugeMetricFamily, "requests_queued", "Requests waiting for the generation thread",
             engine.requests.qsize()),
            (GaugeMetricFamily, "requests_active",
             "Requests in the batch or being served sequentially", engine.active_requests),
        ]
        for source, what in (("prompt_lookup", "prompt lookup (--prompt-lookup-tokens)"),
                             ("draft_model", "a draft model (--draft-model)")):
            figures = getattr(engine, source, None)
            if figures is not None:
                single += [
                    (CounterMetricFamily, f"{source}_proposed_tokens",
                     f"Tokens proposed by {what}, finished requests",
                     figures["proposed_tokens"]),
                    (CounterMetricFamily, f"{source}_accepted_tokens",
                     "Proposed tokens the model kept", figures["accepted_tokens"]),
                    (CounterMetricFamily, f"{source}_verify_steps",
                     "Batch steps that checked a request's proposals", figures["verify_steps"]),
                ]
                if "cache_bytes" in figures:
                    single.append((GaugeMetricFamily, f"{source}_cache_bytes",
                                   "Bytes of the draft models' own prompt caches",
                                   figures["cache_bytes"]))
        if m.connections is not None:
            single += [
                (GaugeMetricFamily, "http_connections", "Open HTTP connections",
                 m.connections.open_connections()),
                (CounterMetricFamily, "http_connections_closed_for_room",
                 "Connections closed, or request bodies given up (a 503), to let a new "
                 "connection in",
                 m.connections.closed),
            ]
        for family, name, doc, value in single:
            f = family(f"{PREFIX}_{name}", doc)
            f.add_metric([], value)
            yield f
        disk = cache.get("disk")
        if disk is not None:  # --prompt-cache-dir
            for family, name, doc, key in (
                    (CounterMetricFamily, "cache_disk_writes", "Prompt cache files written",
                     "writes"),
                    (CounterMetricFamily, "cache_disk_write_errors",
                     "Prompt cache file writes that failed (a full disk pauses writing)",
                     "write_errors"),
                    (CounterMetricFamily, "cache_disk_dropped_writes",
                     "Prompt cache entries not written (queue full, writing paused)",
                     "dropped_writes"),
                    (CounterMetricFamily, "cache_disk_corrupt",
                     "Prompt cache files found unreadable and deleted", "corrupt"),
                    (CounterMetricFamily, "cache_disk_read_errors",
                     "Prompt cache file reads that failed for the moment (memory, "
                     "file descriptors, I/O); the file is kept", "read_errors"),
                    (CounterMetricFamily, "cache_disk_evictions",
                     "Prompt cache files evicted for --prompt-cache-disk-bytes", "evictions"),
                    (GaugeMetricFamily, "cache_disk_budget_bytes",
                     "Byte budget of the prompt cache on disk, per model", "max_bytes"),
                    (GaugeMetricFamily, "cache_disk_queued_bytes",
                     "Bytes of evicted entries waiting to be written", "queued_bytes")):
                f = family(f"{PREFIX}_{name}", doc)
                f.add_metric([], disk[key])
                yield f
        lookups = dict(cache["hits"], miss=cache["misses"])
        results = ("exact", "prefix", "checkpoint", "trimmed", "miss")
        if disk is not None:
            results += ("disk",)
        tiers = {"memory": cache["memory"]}
        if disk is not None:
            tiers["disk"] = disk
        labelled = [  # (family, name, help, label, {label value: value})
            (CounterMetricFamily, "cache_lookups", "Prompt cache lookups by result", "result",
             {k: lookups.get(k, 0) for k in results}),
            (GaugeMetricFamily, "cache_tier_bytes", "Bytes held by each prompt cache tier",
             "tier", {k: t["bytes"] for k, t in tiers.items()}),
            (GaugeMetricFamily, "cache_tier_tokens",
             "Tokens covered by each prompt cache tier's entries", "tier",
             {k: t["tokens"] for k, t in tiers.items()}),
            (GaugeMetricFamily, "cache_tier_entries", "Entries of each prompt cache tier",
             "tier", {k: t["entries"] for k, t in tiers.items()}),
            (CounterMetricFamily, "cache_tier_hits", "Prompt cache hits served by each tier",
             "tier", {k: cache["hits_by_tier"][k] for k in tiers}),
            (GaugeMetricFamily, "cache_tier_bytes_per_token",
             "Bytes per cached token in each prompt cache tier", "tier",
             {k: t["bytes_per_token"] or 0 for k, t in tiers.items()}),
        ]
        vision = engine.vision_stats()
        if vision is not None:
            labelled.append((CounterMetricFamily, "vision_images",
                             "Images of requests by how they were served", "source",
                             {"vision_tower": vision["images_encoded"],
                              "cache": vision["images_from_cache"]}))
        memory = engine.memory()
        labelled.append((GaugeMetricFamily, "mlx_memory_bytes", "MLX allocator memory", "kind",
                         {k: memory[f"mlx_{k}_bytes"] for k in ("active", "cache", "peak")}))
        models = engine.models()
        # A model's own figures once, under its first id (presets of one
        # folder share them).
        first = {}
        for m in models:
            first.setdefault(m["path"], m)
        own = [m for m in first.values() if m["loaded"]]
        labelled += [
            (GaugeMetricFamily, "model_loaded", "1 for each model of the served set that is "
             "loaded, 0 for the others", "model",
             {m["id"]: int(m["loaded"]) for m in models}),
            (GaugeMetricFamily, "model_weights_bytes", "Bytes of a loaded model's weights",
             "model", {m["id"]: m["weights_bytes"] for m in own}),
            (GaugeMetricFamily, "model_idle_seconds", "Seconds since a loaded model last "
             "ran a request (0 while one runs)", "model",
             {m["id"]: m["idle_seconds"] for m in own}),
            (GaugeMetricFamily, "model_active_requests", "Requests running on a loaded model",
             "model", {m["id"]: m["active_requests"] for m in own}),
        ]
        provider = engine.model_provider
        for name, doc, value in (("model_loads", "Models loaded since the start",
                                  provider.loads),
                                 ("model_unloads", "Models unloaded (idle, TTL, for room)",
                                  provider.unloads)):
            f = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            f.add_metric([], value)
            yield f
        for family, name, doc, label, values in labelled:
            f = family(f"{PREFIX}_{name}", doc, labels=[label])
            for key, value in values.items():
                f.add_metric([key], value)
            yield f


class Metrics:
    """The server's metrics registry, recent requests and time series."""

    def __init__(self, engine, in_flight=lambda: 0, clock=time.time, connections=None):
        self.engine = engine
        self.in_flight = in_flight
        self.connections = connections  # (a ConnectionLimit)
        self._clock = clock
        self.registry = CollectorRegistry()
        r = self.registry
        def counter(name, doc, labels=()):
            return PromCounter(f"{PREFIX}_{name}", doc, labels, registry=r)

        def histogram(name, doc, buckets):
            return Histogram(f"{PREFIX}_{name}", doc, buckets=buckets, registry=r)

        self.requests = counter(
            "requests", "Completion requests by endpoint and status", ["endpoint", "status"])
        self.finish_reasons = counter(
            "finish_reasons", "Why requests ended (cancelled: the client went away)", ["reason"])
        self.disconnects = counter(
            "disconnects", "Clients that went away before their answer ended")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of served requests")
        self.cached_tokens = counter(
            "prompt_tokens_cached", "Prompt tokens taken from the prompt cache")
        self.computed_tokens = counter(
            "prompt_tokens_computed", "Prompt tokens computed (prefilled)")
        self.generated_tokens = counter("generation_tokens", "Tokens generated")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.request_seconds = histogram(
            "request_duration_seconds", "Arrival to the end of the answer", LATENCY_BUCKETS)
        self.prefill_tps = histogram(
            "prefill_tokens_per_second",
            "Per request: prompt tokens computed over prefill time", SPEED_BUCKETS)
        self.decode_tps = histogram(
            "decode_tokens_per_second", "Per request: generated tokens per second",
            SPEED_BUCKETS)
        self.cache_match_tokens = histogram(
            "cache_match_tokens", "Per request: prompt tokens reused from the cache",
            (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144))
        self.cache_match_share = histogram(
            "cache_match_ratio", "Per request: share of the prompt reused", SHARE_BUCKETS)
        # Per served model (the `model` label: its name in /v1/models).
        self.model_requests = counter(
            "model_requests", "Completion requests by model and status", ["model", "status"])
        self.model_prompt_tokens = counter(
            "model_prompt_tokens", "Prompt tokens by model", ["model"])
        self.model_cached_tokens = counter(
            "model_prompt_tokens_cached", "Prompt tokens from the cache by model", ["model"])
        self.model_generated_tokens = counter(
            "model_generation_tokens", "Tokens generated by model", ["model"])
        self.model_ttft = Histogram(
            f"{PREFIX}_model_time_to_first_token_seconds", "Arrival to first token by model",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.vision_seconds = histogram(
            "vision_seconds", "Vision tower time per image request", LATENCY_BUCKETS)
        self.removal_seconds = histogram(
            "disconnect_removal_seconds", "Disconnect to the request leaving the engine",
            (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
        r.register(_LiveCollector(self))

        self.recent: Deque[RequestRecord] = deque(maxlen=HISTORY)
        self.series: Deque[Dict[str, Any]] = deque(maxlen=SERIES_SECONDS)
        self.totals = Counter()
        self._last_totals = Counter()

    # -- events --

    def observe(self, record: RequestRecord):
        """A request ended (answered, failed or cancelled)."""
        self.requests.labels(record.endpoint, str(record.status)).inc()
        model = record.served_model or "other"
        self.model_requests.labels(model, str(record.status)).inc()
        t = self.totals
        t["requests"] += 1
        t[f"status_{record.status}"] += 1
        if record.finish_reason:
            self.finish_reasons.labels(record.finish_reason).inc()
            t[f"finish_{record.finish_reason}"] += 1
        if record.finish_reason == "cancelled":
            self.disconnects.inc()
            t["disconnects"] += 1
        if record.status == 200 or record.finish_reason == "cancelled":
            # Served (or partly served): its tokens count.
            self.prompt_tokens.inc(record.prompt_tokens)
            self.cached_tokens.inc(record.cached_tokens)
            self.computed_tokens.inc(record.computed_tokens)
            self.generated_tokens.inc(record.generated_tokens)
            self.model_prompt_tokens.labels(model).inc(record.prompt_tokens)
            self.model_cached_tokens.labels(model).inc(record.cached_tokens)
            self.model_generated_tokens.labels(model).inc(record.generated_tokens)
            t["prompt_tokens"] += record.prompt_tokens
            t["cached_tokens"] += record.cached_tokens
            t["computed_tokens"] += record.computed_tokens
            t["generated_tokens"] += record.generated_tokens
            if record.prompt_tokens:
                self.cache_match_tokens.observe(record.cached_tokens)
                self.cache_match_share.observe(record.cached_tokens / record.prompt_tokens)
        if record.ttft is not None:
            self.ttft.observe(record.ttft)
            self.model_ttft.labels(model).observe(record.ttft)
        if record.prefill_tps is not None:
            self.prefill_tps.observe(record.prefill_tps)
        if record.decode_tps is not None:
            self.decode_tps.observe(record.decode_tps)
        self.request_seconds.observe(record.total_seconds)
        self.recent.append(record)
        logging.info("Request " + json.dumps(record.as_dict(), separators=(",", ":")))

    def sample(self, cache=None):
        """One point of the time series (called every second; `cache`: the
        store's snapshot, taken now if not given)."""
        memory = self.engine.memory()
        cache = cache if cache is not None else self.engine.store.snapshot()
        delta = self.totals - self._last_totals
        self._last_totals = Counter(self.totals)
        self.series.append({
            "t": round(self._clock(), 3),
            "in_flight": self.in_flight(),
            "queued": self.engine.requests.qsize(),
            "active": self.engine.active_requests,
            "cache_bytes": cache["bytes"],
            "cache_budget_bytes": cache["budget_bytes"],
            "mlx_active_bytes": memory["mlx_active_bytes"],
            "requests": delta["requests"],
            "generated_tokens": delta["generated_tokens"],
            "computed_tokens": delta["computed_tokens"],
            "cached_tokens": delta["cached_tokens"],
        })

    # -- reports --

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST

    def stats(self, limit: int = HISTORY, since: float = 0.0) -> Dict[str, Any]:
        recent = [r for r in self.recent if r.ended > since]
        recent = recent[-limit:] if limit > 0 else []
        return {
            "time": round(self._clock(), 3),
            "totals": dict(self.totals),
            "requests": [r.as_dict() for r in recent],
            "series": [p for p in self.series if p["t"] > since],
        }


def cache_entries(store, limit: int = 200) -> List[Dict[str, Any]]:
    """The store's entries for the dashboard's table, most recently used first."""
    now = store.now()
    rows = []
    for e in sorted(store.entries(), key=lambda e: -e.last_used)[:limit]:
        rows.append({
            "tokens": e.ntokens,
            "bytes": store.entry_bytes(e),
            "kind": e.kind,
            "hits": e.hits,
            "age_s": round(now - e.created, 1),
            "idle_s": round(now - e.last_used, 1),
            # Distinct image ids (negative tokens) in the key, counted on insert.
            "images": e.images,
        })
    return rows
