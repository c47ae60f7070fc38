"""The cost of metrics on decode speed under a burst: the same server with
metrics on and with --disable-metrics, run alternately (A B A B ...).

    python -m benchmarks.metrics_overhead --model-kind qwen3 --rounds 5

Each round starts a fresh server, warms it up, then sends a burst of
concurrent streaming requests (different prompts, same lengths) and takes
the aggregate output tokens per second over the burst. Prints the medians
and the ratio on/off (goal: at least 0.99).

On a shared 2-core machine the rounds scatter by +-20%, far more than what
is measured, so the benchmark also accounts for the work directly: it times
what metrics add (one `Metrics.observe` per request, with its log line; one
`Metrics.sample` per second; one comparison per streamed token) and divides
by the burst's duration. That figure does not drift with the machine.
"""

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp


async def burst(url: str, clients: int, max_tokens: int, salt: int) -> float:
    """Aggregate streamed output tokens per second of `clients` concurrent requests."""
    async def one(session, i):
        body = {"messages": [{"role": "user", "content": f"Story {salt}-{i} about a ship."}],
                "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
        n = 0
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {") and b'"content": "' in line:
                    n += 1
        return n

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await one(session, -1)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(session, i) for i in range(clients)))
        return sum(counts) / (time.perf_counter() - start)


def accounted_overhead(tokens_per_s: float, clients: int, max_tokens: int) -> dict:
    """Share of a burst's time spent in metrics work, from timed pieces."""
    import logging
    import queue
    import timeit
    from types import SimpleNamespace

    from mlx_lm_plus.cache.store import PromptStore
    from mlx_lm_plus.http.metrics import Metrics, RequestRecord

    log = tempfile.NamedTemporaryFile(suffix=".log", delete=False)
    logging.basicConfig(filename=log.name, level=logging.INFO, force=True)
    store = PromptStore(max_bytes=1 << 30)
    engine = SimpleNamespace(
        store=store, requests=queue.Queue(), active_requests=0, restarts=0,
        is_healthy=True, vision_stats=lambda: None,
        memory=lambda: {"mlx_active_bytes": 0, "mlx_cache_bytes": 0,
                                         "mlx_peak_bytes": 0})
    metrics = Metrics(engine)
    record = RequestRecord(id="chatcmpl-x", endpoint="/v1/chat/completions", model="m",
                           status=200, started=time.time(), prompt_tokens=40,
                           cached_tokens=8, generated_tokens=max_tokens,
                           finish_reason="length", ttft=0.05, prefill_seconds=0.04,
                           decode_seconds=0.5, total_seconds=0.55)
    n = 5000
    observe = timeit.timeit(lambda: metrics.observe(record), number=n) / n
    sample = timeit.timeit(metrics.sample, number=n) / n
    first = None
    check = timeit.timeit("first is None", globals={"first": first}, number=10**6) / 10**6
    burst_seconds = clients * max_tokens / tokens_per_s
    work = (clients * observe) + (burst_seconds * sample) + (clients * max_tokens * check)
    logging.shutdown()
    return {
        "observe_us": round(observe * 1e6, 1), "sample_us": round(sample * 1e6, 1),
        "per_token_check_ns": round(check * 1e9, 1),
        "burst_seconds": round(burst_seconds, 3),
        "metrics_work_share_of_burst": round(work / burst_seconds, 6),
    }


def main(argv=None):
    from benchmarks.harness import ab_parser, alternate, fixture_or_model
    from compat.launch import OURS

    parser = ab_parser(__doc__.split("\n")[0], "qwen3", rounds=5)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="mlx_lm_plus-metrics-"))
    model = fixture_or_model(args, work)
    runs = alternate(
        {"on": (OURS, []), "off": (OURS, ["--disable-metrics"])}, model, work, args.rounds,
        lambda server, round_: asyncio.run(
            burst(server.url, args.clients, args.max_tokens, round_)),
        lambda tps: f"metrics, {tps:8.1f} tok/s")
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    result = {
        "model": model, "clients": args.clients, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "median_tps_metrics_on": round(on, 1),
        "median_tps_metrics_off": round(off, 1), "ratio_on_over_off": round(on / off, 4),
        "runs": runs,
    }
    print(f"median output tok/s: metrics on {on:.1f}, off {off:.1f}, "
          f"ratio {on / off:.4f} (overhead {100 * (1 - on / off):+.2f}%)")
    result["accounted"] = accounted_overhead(off, args.clients, args.max_tokens)
    a = result["accounted"]
    print(f"accounted: observe {a['observe_us']} us/request, sample {a['sample_us']} us/s, "
          f"{a['per_token_check_ns']} ns/token -> "
          f"{100 * a['metrics_work_share_of_burst']:.3f}% of the burst's time")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
