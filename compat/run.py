"""Record the corpus against servers and report every difference.

    python -m compat.run --model PATH            # upstream vs ours on PATH
    python -m compat.run --model PATH --kind qwen3_5   # build a fixture first
    python -m compat.run --base-url URL --out a.json   # just record one server

A record keeps what a client can rely on: status, the headers that matter
(content type, CORS, cache control), the JSON body with volatile values masked
(ids, timestamps, fingerprints, cached token counts, tool call ids) and floats
rounded, and for SSE the sequence of events (keepalive comments collapsed).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from .corpus import EXCEPTIONS, Case, cases
from .launch import OURS, UPSTREAM, ServerProcess, parse_sse

HEADERS = (
    "content-type",
    "access-control-allow-origin",
    "access-control-allow-methods",
    "access-control-allow-headers",
    "vary",
    "cache-control",
)
MASKED = {"id", "created", "system_fingerprint", "cached_tokens"}


def _mask(obj: Any, key: str = "") -> Any:
    if isinstance(obj, dict):
        return {k: _mask(v, k) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_mask(v, key) for v in obj]
    if key in MASKED:
        return f"<{type(obj).__name__}>"
    if key == "model" and isinstance(obj, str) and obj.startswith("/"):
        return "<path>"
    if isinstance(obj, float):
        return round(obj, 3)
    return obj


def _body(data: bytes, content_type: str):
    if content_type.startswith("text/event-stream"):
        events, last = [], None
        for kind, payload in parse_sse(data):
            if kind == "comment":
                # The number and counts of keepalives depend on cache hits.
                if last != "keepalive":
                    events.append("keepalive")
                last = "keepalive"
                continue
            last = "data"
            events.append(payload if payload == "[DONE]" else _mask(payload))
        return {"sse": events}
    try:
        return {"json": _mask(json.loads(data))}
    except ValueError:
        return {"text": data.decode(errors="replace")}


def record_case(server: ServerProcess, case: Case) -> Dict[str, Any]:
    for body in case.setup:
        server.request("POST", case.path, body=body)
    try:
        status, headers, data = server.request(
            case.method, case.path, body=case.body, raw=case.raw, headers=case.headers
        )
    except (ConnectionError, OSError) as e:
        # http.client's RemoteDisconnected and friends: no answer at all.
        return {"status": None, "closed": type(e).__name__}
    lower = {k.lower(): v for k, v in headers.items()}
    return {
        "status": status,
        "headers": {h: lower[h] for h in HEADERS if h in lower},
        **_body(data, lower.get("content-type", "")),
    }


def record(server: ServerProcess, corpus: List[Case]) -> Dict[str, Any]:
    return {case.name: record_case(server, case) for case in corpus}


def diff(a: Any, b: Any, path: str = "") -> List[str]:
    """Human-readable differences between two records."""
    if type(a) is not type(b):
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'ours' if k in b else 'upstream'}")
            else:
                out.extend(diff(a[k], b[k], f"{path}.{k}"))
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare(upstream: Dict[str, Any], ours: Dict[str, Any]):
    """(unexplained, explained) differences, each {case: [lines]}."""
    unexplained, explained = {}, {}
    for name in upstream:
        d = diff(upstream[name], ours[name])
        if d:
            (explained if name in EXCEPTIONS else unexplained)[name] = d
    return unexplained, explained


def run_side_by_side(model: str, log_dir: Path, extra_args=()) -> Dict[str, Any]:
    corpus = cases()
    results = {}
    # Upstream's /v1/models fails mid-response when the Hugging Face cache
    # directory does not exist (a fresh machine): give both an empty one.
    hf_cache = log_dir / "hf-cache"
    hf_cache.mkdir(parents=True, exist_ok=True)
    env = {"HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    for label, command in (("upstream", UPSTREAM), ("ours", OURS)):
        with ServerProcess(command, ["--model", model, *extra_args],
                           log=log_dir / f"{label}.log", env=env) as server:
            results[label] = record(server, corpus)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder served by both servers")
    p.add_argument("--kind", help="build this fixture kind (testkit/fixtures.py) and use it")
    p.add_argument("--base-url", help="record a running server instead")
    p.add_argument("--out", help="write the records as JSON here")
    args = p.parse_args(argv)

    if args.base_url:
        class Remote(ServerProcess):
            def __init__(self, url):
                self.url = url
        recs = record(Remote(args.base_url.rstrip("/")), cases())
        Path(args.out or "compat-record.json").write_text(json.dumps(recs, indent=1))
        return 0

    work = Path(tempfile.mkdtemp(prefix="compat-"))
    model = args.model
    if args.kind:
        from testkit.fixtures import build_fixture

        model = str(build_fixture(args.kind, work / "fixtures"))
    if not model:
        p.error("--model or --kind is required")
    results = run_side_by_side(model, work)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    unexplained, explained = compare(results["upstream"], results["ours"])
    print(f"compat: {len(results['ours'])} cases, {len(unexplained)} unexplained "
          f"differences, {len(explained)} documented exceptions (logs in {work})")
    for name, lines in explained.items():
        print(f"  documented  {name}: {EXCEPTIONS[name]}")
    for name, lines in unexplained.items():
        print(f"  DIFFERENT   {name}:")
        for line in lines[:10]:
            print(f"      {line}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
