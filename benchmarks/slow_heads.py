"""Connections that send half a request head (a slowloris, or pools of
connections left open): does /health still answer? Ours and upstream,
alternately.

    python -m benchmarks.slow_heads --connections 2100

mlx-lm sets the process's file limit to 2,048 when imported, so past about
2,000 such connections a server that keeps them all can accept no more.
Another process opens `--connections` of them, each sending
`GET /health HTTP/1.1\\r\\nHost: x\\r\\n` and nothing else, and holds them;
then /health is asked `--probes` times, each on a new connection, with a
10 s timeout. Printed per server: the connections the attacker got open,
the probes answered and their median latency, and how many of the held
connections the server had closed by the end.
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HOLDER = r"""
import resource, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))
held = []
for _ in range(n):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        held.append(s)
    except OSError:
        break
print(len(held), flush=True)
sys.stdin.readline()  # (the probes are done)
open_ = 0
for s in held:
    s.setblocking(False)
    try:
        open_ += s.recv(1) != b""
    except BlockingIOError:
        open_ += 1
    except OSError:
        pass
print(open_, flush=True)
"""


def probe(url: str, probes: int):
    times = []
    for _ in range(probes):
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                r.read()
            times.append(time.perf_counter() - start)
        except OSError:
            pass
    return times


def measure(url: str, port: int, connections: int, probes: int):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), str(connections)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    opened = int(holder.stdout.readline())
    times = probe(url, probes)
    holder.stdin.write("done\n")
    holder.stdin.flush()
    still_open = int(holder.stdout.readline())
    holder.wait()
    return {"opened": opened, "answered": len(times), "probes": probes,
            "median_ms": round(1000 * statistics.median(times), 1) if times else None,
            "held_still_open": still_open}


def main(argv=None):
    from benchmarks.harness import ab_parser, alternate, fixture_or_model
    from compat.launch import OURS, UPSTREAM

    parser = ab_parser(__doc__.split("\n")[0], "qwen3", rounds=1)
    parser.add_argument("--connections", type=int, default=2100)
    parser.add_argument("--probes", type=int, default=3)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="mlx_lm_plus-slow-heads-"))
    model = fixture_or_model(args, work)
    runs = alternate(
        {"ours": (OURS, []), "upstream": (UPSTREAM, [])}, model, work, args.rounds,
        lambda server, _: measure(server.url, server.port, args.connections, args.probes),
        lambda f: (f"{f['opened']} connections held, /health answered "
                   f"{f['answered']}/{f['probes']} (median {f['median_ms']} ms), "
                   f"{f['held_still_open']} of the held still open"))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "runs": runs}, indent=2))
    return runs


if __name__ == "__main__":
    main()
