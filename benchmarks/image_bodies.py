"""A running stream's largest gap while large image bodies arrive: ours and
upstream, alternately (A B A B ...).

    python -m benchmarks.image_bodies --rounds 3

Each round starts a fresh server on a text fixture, starts one greedy
stream, and once it is going posts `--bodies` request bodies, one after
another, of `--images` noise PNGs of `--image-mb` MB each as data URLs
(agents resend every screenshot of a conversation each turn: bodies of
100 MB are theirs). What is measured is what reading them costs the
stream, not their prefill:

  --mode parse (both servers): each body has a bad `temperature`, so each
    server parses it and refuses it in its HTTP handler (a valid image
    request to this text model would wait, on upstream, until the stream
    ends: its image requests are served one at a time);
  --mode check (ours only): valid bodies; the model takes no images, so
    each is parsed, its images checked, then refused.

Printed per server (medians over rounds): the stream's largest gap between
tokens while the bodies came, its median gap before them, and the largest
/health latency meanwhile.
"""

import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp


def image_body(images: int, image_mb: float, refused: bool) -> bytes:
    import numpy as np
    from PIL import Image

    side = int((image_mb * 1e6 / 3) ** 0.5)
    noise = np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(noise).save(out, format="PNG", compress_level=0)
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}] * images
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What are these?"}, *parts]}], "max_tokens": 2}
    if refused:
        body["temperature"] = "hot"
    return json.dumps(body).encode()


POSTER = """
import json, sys, urllib.error, urllib.request
url, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
body, statuses = open(path, "rb").read(), []
for _ in range(n):
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            statuses.append(r.status)
    except urllib.error.HTTPError as e:
        statuses.append(e.code)
print(json.dumps(statuses))
"""


async def measure(url: str, body: bytes, bodies: int) -> dict:
    arrivals, window, statuses, health = [], [], [], []
    posting_done = asyncio.Event()

    async def stream(session):
        request = {"messages": [{"role": "user", "content": "Tell a long story about a ship."}],
                   "max_tokens": 4000, "stream": True, "temperature": 0.0}
        async with session.post(url + "/v1/chat/completions", json=request) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.perf_counter())
                if posting_done.is_set():
                    break

    async def post(session):
        # From another process: sending 100 MB from this one would stall
        # the stream's reader here, whichever server it reads.
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            f.write(body)
            f.flush()
            while len(arrivals) < 20:
                await asyncio.sleep(0.01)
            window.append(time.perf_counter())
            poster = await asyncio.create_subprocess_exec(
                sys.executable, "-c", POSTER, url, f.name, str(bodies),
                stdout=asyncio.subprocess.PIPE)
            out, _ = await poster.communicate()
        statuses.extend(json.loads(out))
        window.append(time.perf_counter())
        posting_done.set()

    async def probe(session):
        while not posting_done.is_set():
            start = time.perf_counter()
            async with session.get(url + "/health") as r:
                await r.read()
            if window:
                health.append(time.perf_counter() - start)
            await asyncio.sleep(0.005)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(stream(session), post(session), probe(session))
    start, end = window
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    before = [g for g, t in zip(gaps, arrivals[1:]) if t < start]
    during = [g for g, t in zip(gaps, arrivals[1:]) if start <= t <= end]
    return {"max_gap_ms": 1000 * max(during, default=end - start),
            "median_gap_before_ms": 1000 * statistics.median(before),
            "max_health_ms": 1000 * max(health, default=0.0),
            "tokens_during": len(during), "statuses": sorted(set(statuses))}


def main(argv=None):
    from benchmarks.harness import ab_parser, alternate, fixture_or_model
    from compat.launch import OURS, UPSTREAM

    parser = ab_parser(__doc__.split("\n")[0], "qwen3", rounds=3)
    parser.add_argument("--bodies", type=int, default=3)
    parser.add_argument("--images", type=int, default=10)
    parser.add_argument("--image-mb", type=float, default=8.7, help="raw PNG MB per image")
    parser.add_argument("--mode", choices=("parse", "check"), default="parse")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="mlx_lm_plus-image-bodies-"))
    model = fixture_or_model(args, work)
    body = image_body(args.images, args.image_mb, refused=args.mode == "parse")
    print(f"body: {len(body) / 1e6:.1f} MB, {args.images} images", flush=True)
    # (Ours refuses such bodies by default: 128 MiB a body, 20 MiB an image.)
    ours = ["--max-request-bytes", str(len(body) + (1 << 20)),
            "--max-image-bytes", str(len(body))]
    servers = {"ours": (OURS, ours), "upstream": (UPSTREAM, [])}
    if args.mode == "check":
        del servers["upstream"]
    runs = alternate(
        servers, model, work, args.rounds,
        lambda server, _: asyncio.run(measure(server.url, body, args.bodies)),
        lambda f: (f"largest gap {f['max_gap_ms']:7.1f} ms (median before "
                   f"{f['median_gap_before_ms']:.1f} ms, {f['tokens_during']} tokens "
                   f"meanwhile), /health at most {f['max_health_ms']:.1f} ms, statuses "
                   f"{f['statuses']}"))
    result = {"model": model, "mode": args.mode, "body_mb": round(len(body) / 1e6, 1),
              "runs": runs}
    for name, rows in runs.items():
        result[name] = {key: round(statistics.median(r[key] for r in rows), 1)
                        for key in ("max_gap_ms", "median_gap_before_ms", "max_health_ms")}
        m = result[name]
        print(f"{name:>8} medians: largest gap {m['max_gap_ms']} ms, median gap before "
              f"{m['median_gap_before_ms']} ms, largest /health {m['max_health_ms']} ms")
    if "upstream" in result:
        ratio = result["ours"]["max_gap_ms"] / result["upstream"]["max_gap_ms"]
        result["largest_gap_ours_over_upstream"] = round(ratio, 3)
        print(f"largest gap, ours / upstream: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
