"""Embeddings per second: /v1/embeddings one input at a time, 32 inputs in one
request, 32 concurrent requests, and a bare loop with no server.

    python -m benchmarks.embeddings                         # the bert_embed fixture
    python -m benchmarks.embeddings --kind qwen3_embed      # the decoder fixture
    python -m benchmarks.embeddings --model PATH --task embed --rounds 3
        (PATH a chat model, e.g. the demo model's folder,
         mlx_lm_plus.models.demo.demo_model_path(): served as a last-token
         embedder because its --models-config entry says "task": "embed")
    python -m benchmarks.embeddings --check-upstream --json out.json

Our server is started once, with a --models-config naming the model "embed".
The workloads, each on the same 32 distinct sentences of --words
(10-60) words, deterministic:
  one at a time   32 requests of one input each, one after the other (one
                  keep-alive connection)
  batch 32        one request with the 32 inputs
  concurrent 32   32 requests of one input each, sent together (32 threads,
                  each on its own connection, released by a barrier)
  bare, one       no server, in this process: each input tokenized (the
                  server's own plan_embeddings) and run alone through
                  Embedder.hidden + Embedder.pooling, to numpy
  bare, batch 32  the same, the 32 inputs as one right-padded forward pass
The bare loop loads the model as the server does (embedders.load_embedder,
then cpu.weights_for_cpu: quantized or half weights made float32 where MLX
runs on a CPU with a fast BLAS, unless --keep-quantized, which both sides
then get) and calls the Embedder directly, not the engine's
EmbeddingRunner: its figures are the model's alone, with no HTTP, JSON,
threads or scheduling. The server's log says whether it converted its
weights; both are printed (a float32 model and a quantized one give other
vectors, by ~1e-3, and other speeds). (The server splits
a batch into forward passes of at most --prefill-step-size padded tokens,
2,048 by default; the bare batch is one pass whatever its size.)

Each round runs every workload in turn, in an order that alternates
(forward, then reversed: A B, B A) because timings on a shared machine
drift; a workload runs again until it has taken --min-seconds (0.5) in that
round, and its round's figure is the mean of those runs. The figures are
medians over --rounds, after an untimed warm-up.
Every answer is checked: a vector for each input, of the model's width,
within 1e-3 of the bare loop's one-at-a-time vector of the same input.

BLAS: this process loads the fast BLAS (mlx_lm_plus/models/cpu.py) before it
imports MLX, as the server does, and passes its choice to the server
(MLX_LM_PLUS_BLAS: the library's path, or "bundled"), so both sides multiply
on the same BLAS; the server's log line saying which is read back and
printed beside this process's. MLX_LM_PLUS_BLAS=bundled runs both on
mlx[cpu]'s reference BLAS.

Upstream: mlx_lm.server 0.32.2 has no /v1/embeddings (its do_POST knows
/v1/completions, /v1/chat/completions and /chat/completions, and answers
404 "Not Found" to any other path), so there is no upstream column.
--check-upstream starts it once and shows the 404.
"""

from mlx_lm_plus.models import cpu

cpu.preload_fast_blas()  # before anything imports MLX (see the module doc)

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.harness import median  # noqa: E402
from compat.launch import OURS, UPSTREAM, ServerProcess  # noqa: E402

NAME = "embed"  # the model's name in the server's --models-config
INPUTS = 32  # sentences, each workload (the batch of 32)
SERVER_WORKLOADS = ("one at a time", "batch 32", "concurrent 32")
BARE_WORKLOADS = ("bare, one", "bare, batch 32")
WORKLOADS = SERVER_WORKLOADS + BARE_WORKLOADS
# The bar of the issue: 32 inputs batched (in one request, or 32 requests at
# once) embed at least 3x as fast as one at a time on the same server.
BAR = 3.0
# An answer further than this from the bare loop's vector of the same input
# is wrong (batching and padding change the last bits only).
TOLERANCE = 1e-3

# Sentences from the fixtures' vocabulary (testkit.fixtures.WORDS): every
# word is one token for the fixtures' tokenizers (a word the BERT fixture
# doesn't know would be split into characters, and 60 of them would pass
# its context of 128 tokens), and ordinary English for a real tokenizer.
ADJECTIVES = ("good", "bad", "big", "small", "red", "blue", "green", "old", "new", "first",
              "last", "next", "short", "long", "quick")
NOUNS = ("cat", "dog", "bird", "fish", "horse", "river", "sea", "lake", "mountain", "village",
         "city", "road", "boat", "train", "morning", "evening", "night", "day", "week", "year",
         "story", "weather", "trip", "picnic", "bread", "fruit", "water", "people", "country",
         "capital", "question", "answer", "plan", "name")
PLACES = ("paris", "london", "tokyo", "rome", "berlin", "france", "japan", "italy")
PRONOUNS = ("you", "we", "they", "he", "she")
VERBS = ("tell", "write", "count", "name", "answer", "help", "plan", "describe", "explain",
         "list", "show")
PREPOSITIONS = ("in", "on", "at", "by", "for", "with", "from", "to")
NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
LINKS = ("and", "but", "or")


def _clause(rng: random.Random) -> List[str]:
    det = rng.choice(("the", "a"))
    shape = rng.randrange(4)
    if shape == 0:
        return [det, rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(("was", "is")),
                rng.choice(PREPOSITIONS), "the", rng.choice(NOUNS)]
    if shape == 1:
        return [rng.choice(PRONOUNS), rng.choice(VERBS), "the", rng.choice(NOUNS), "of",
                rng.choice(PLACES)]
    if shape == 2:
        return [rng.choice(NUMBERS), rng.choice(("hundred", "thousand")), "people",
                rng.choice(("were", "are")), "at", "the", rng.choice(ADJECTIVES),
                rng.choice(NOUNS)]
    return ["the", rng.choice(NOUNS), rng.choice(PREPOSITIONS), rng.choice(PLACES),
            rng.choice(("is", "was")), rng.choice(ADJECTIVES)]


def sentence(words: int, rng: random.Random) -> str:
    """A sentence of exactly `words` words: clauses joined by links."""
    out: List[str] = []
    while len(out) < words:
        if out:
            out[-1] += ","
            out.append(rng.choice(LINKS))
        out += _clause(rng)
    out = out[:words]
    if len(out) > 1 and out[-1] in LINKS:  # (cut after a link: "..., or.")
        out[-2], out[-1] = out[-2].rstrip(","), "again"
    out[-1] = out[-1].rstrip(",")
    text = " ".join(out)
    return text[0].upper() + text[1:] + "."


def parse_words(spec: str):
    """"LO-HI" or "N" -> (lo, hi)."""
    found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", spec)
    if not found:
        raise argparse.ArgumentTypeError(f"--words {spec!r}: N or LO-HI, e.g. 10-60")
    lo, hi = int(found.group(1)), int(found.group(2) or found.group(1))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"--words {spec!r}: 1 <= LO <= HI")
    return lo, hi


def sentences(n: int, lo: int, hi: int, seed: int = 0) -> List[str]:
    """`n` distinct sentences whose lengths spread evenly over lo..hi words
    (in a shuffled order), the same every run."""
    rng = random.Random(seed)
    lengths = [lo + round(i * (hi - lo) / max(1, n - 1)) for i in range(n)]
    rng.shuffle(lengths)
    out: List[str] = []
    for words in lengths:
        text = sentence(words, rng)
        while text in out:
            text = sentence(words, rng)
        out.append(text)
    return out


# -- the server side --

def _connection(url: str) -> http.client.HTTPConnection:
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=600)
    conn.connect()
    return conn


def _post(conn: http.client.HTTPConnection, body: dict):
    """(status, parsed answer) of one POST /v1/embeddings on a kept-alive
    connection."""
    conn.request("POST", "/v1/embeddings", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode(errors="replace")[:200]


def _vectors(status, answer, count: int) -> List[np.ndarray]:
    """An answer's vectors in input order (a failed request raises: the
    benchmark stops on a server error rather than time it)."""
    if status != 200:
        raise RuntimeError(f"/v1/embeddings answered {status}: {str(answer)[:300]}")
    data = sorted(answer["data"], key=lambda d: d["index"])
    if len(data) != count:
        raise RuntimeError(f"/v1/embeddings answered {len(data)} vectors for {count} inputs")
    return [np.array(d["embedding"], dtype=np.float32) for d in data]


def run_server_workload(url: str, name: str, texts: List[str]):
    """(seconds, vectors in input order, prompt tokens) of one server workload."""
    n = len(texts)
    if name == "one at a time":
        conn = _connection(url)
        try:
            out, tokens = [], 0
            start = time.perf_counter()
            for text in texts:
                status, answer = _post(conn, {"model": NAME, "input": [text]})
                out += _vectors(status, answer, 1)
                tokens += answer["usage"]["prompt_tokens"]
            return time.perf_counter() - start, out, tokens
        finally:
            conn.close()
    if name == "batch 32":
        conn = _connection(url)
        try:
            start = time.perf_counter()
            status, answer = _post(conn, {"model": NAME, "input": texts})
            out = _vectors(status, answer, n)
            return time.perf_counter() - start, out, answer["usage"]["prompt_tokens"]
        finally:
            conn.close()
    assert name == "concurrent 32", name
    conns = [_connection(url) for _ in texts]
    barrier = threading.Barrier(n + 1)
    started: List[Optional[float]] = [None] * n
    ended: List[Optional[float]] = [None] * n
    answers: List[Any] = [None] * n

    def send(i):
        barrier.wait()
        started[i] = time.perf_counter()
        try:
            answers[i] = _post(conns[i], {"model": NAME, "input": [texts[i]]})
        except Exception as e:  # (said below, after every thread is done)
            answers[i] = (None, repr(e))
        ended[i] = time.perf_counter()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        barrier.wait()  # (all threads started and connected: go)
        for t in threads:
            t.join()
    finally:
        for conn in conns:
            conn.close()
    out, tokens = [], 0
    for status, answer in answers:
        out += _vectors(status, answer, 1)
        tokens += answer["usage"]["prompt_tokens"]
    return max(ended) - min(started), out, tokens


def engine_embedding_stats(url: str) -> Optional[Dict[str, int]]:
    conn = _connection(url)
    try:
        conn.request("GET", "/v1/stats")
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            return None
        return json.loads(data)["engine"].get("embeddings")
    finally:
        conn.close()


def server_blas(log: Path) -> str:
    """What the server's log says of its BLAS (app.py's log_blas)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "unknown (no log)"
    found = re.search(r"CPU matmuls on (.*)", text)
    return found.group(1).strip() if found else "unknown (the log does not say)"


def server_weights(log: Path) -> Optional[str]:
    """What the server's log says it did with the weights: "+N MB" where it
    made them float32 (provider.py), None where it kept them as stored."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"weights as float32 for the CPU's BLAS \(([^;)]+)", text)
    return found.group(1) if found else None


# -- the bare loop --

class BareLoop:
    """The model in this process, loaded as the server loads it
    (embedders.load_embedder), called directly: Embedder.hidden and
    Embedder.pooling, the input tokenized by the server's plan_embeddings."""

    def __init__(self, model: str, task: str, keep_quantized: bool = False):
        import mlx.core as mx
        import mlx.nn as nn
        from mlx.utils import tree_flatten

        from mlx_lm_plus import patches
        from mlx_lm_plus.models.embedders import load_embedder
        from mlx_lm_plus.models.folders import _mlx_lm_has

        self.mx = mx
        patches.apply_all()  # (as the engine does at start: ModernBERT's GELU and masks)
        self.embedder, _ = load_embedder(model, task, _mlx_lm_has)
        quantized = [m for _, m in self.embedder.model.named_modules()
                     if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
        stored = (f"{quantized[0].bits}-bit quantized" if quantized else
                  "/".join(sorted({str(v.dtype).replace("mlx.core.", "") for _, v in
                                   tree_flatten(self.embedder.model.parameters())})))
        # (as provider.LoadedModel does for every model it loads; None:
        # kept as stored: float32 already, --keep-quantized, or no fast BLAS)
        self.grown = cpu.weights_for_cpu(self.embedder.model, keep_quantized)
        mx.eval([v for _, v in tree_flatten(self.embedder.model.parameters())])
        self.weights = (f"float32 (stored {stored}, converted at load, "
                        f"{self.grown / 1e6:+.0f} MB)" if self.grown is not None
                        else f"{stored}, as stored")

    def _plan(self, texts: List[str]):
        from mlx_lm_plus.planning.embedding import EmbeddingsRequest, plan_embeddings

        return plan_embeddings(self.embedder, None, EmbeddingsRequest(NAME, tuple(texts)))

    def _forward(self, inputs, starts) -> np.ndarray:
        mx = self.mx
        longest = max(len(ids) for ids in inputs)
        tokens = np.zeros((len(inputs), longest), dtype=np.int32)
        for row, ids in enumerate(inputs):
            tokens[row, :len(ids)] = ids
        lengths = mx.array([len(ids) for ids in inputs])
        hidden = self.embedder.hidden(mx.array(tokens), lengths)
        out = self.embedder.pooling(hidden, lengths, mx.array(list(starts)))
        mx.eval(out)
        return np.array(out, dtype=np.float32)

    def run(self, name: str, texts: List[str]):
        """(seconds, vectors in input order, prompt tokens)."""
        start = time.perf_counter()
        if name == "bare, one":
            out, tokens = [], 0
            for text in texts:
                plan = self._plan([text])
                out.append(self._forward(plan.inputs, plan.starts)[0])
                tokens += plan.prompt_tokens
        else:
            plan = self._plan(texts)
            out = list(self._forward(plan.inputs, plan.starts))
            tokens = plan.prompt_tokens
        return time.perf_counter() - start, out, tokens

    def padded_tokens(self, texts: List[str]) -> int:
        plan = self._plan(texts)
        return len(plan.inputs) * max(len(ids) for ids in plan.inputs)


# -- upstream --

def check_upstream(model: str, work: Path, texts: List[str]) -> Dict[str, Any]:
    """Start mlx_lm.server once and POST /v1/embeddings to it: its status and
    body. It is started on `model` where mlx-lm has its model type, else on
    the demo model (upstream can't load a BERT folder at all: its generation
    thread dies and /health answers 503; the 404 comes before any model is
    looked at anyway)."""
    from mlx_lm_plus.models.demo import demo_model_path
    from mlx_lm_plus.models.folders import _mlx_lm_has

    out: Dict[str, Any] = {"model": model, "loads": bool(_mlx_lm_has(model))}
    if not out["loads"]:
        config = json.loads((Path(model) / "config.json").read_text())
        out["why_not"] = f"mlx-lm has no model type {config.get('model_type')!r}"
        out["model"] = str(demo_model_path())
    try:
        with ServerProcess(UPSTREAM, ["--model", out["model"]], log=work / "upstream.log",
                           startup_timeout=120) as server:
            status, _, data = server.request(
                "POST", "/v1/embeddings", {"model": out["model"], "input": texts[:2]})
        out.update(status=status, body=data.decode(errors="replace")[:80])
    except (RuntimeError, TimeoutError, OSError) as e:
        out.update(status=None, error=str(e).splitlines()[0][:200])
    return out


# -- figures --

def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _rate(x) -> str:
    """inputs/s, to 3 figures or more (a real model on a CPU: under 1/s)."""
    return "-" if x is None else format(x, ".1f" if x >= 100 else ".2f" if x >= 1 else ".3f")


def summarize(runs: Dict[str, List[dict]], n: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name in WORKLOADS:
        rows = runs[name]
        seconds = median([r["seconds"] for r in rows])
        out[name] = {
            "inputs_per_s": n / seconds if seconds else None,
            "seconds": seconds,
            "forward_passes": median([r["passes"] for r in rows if r.get("passes") is not None]),
            "prompt_tokens": rows[0]["tokens"],
            "max_abs_diff": max(r["max_abs_diff"] for r in rows),
            "rounds_seconds": [r["seconds"] for r in rows],
            "runs_per_round": [r["runs"] for r in rows],
        }

    def ratio(a, b):
        x, y = out[a]["inputs_per_s"], out[b]["inputs_per_s"]
        return x / y if x and y else None

    out["ratios"] = {
        "batch 32 / one at a time": ratio("batch 32", "one at a time"),
        "concurrent 32 / one at a time": ratio("concurrent 32", "one at a time"),
        "server / bare, one at a time": ratio("one at a time", "bare, one"),
        "server / bare, batch 32": ratio("batch 32", "bare, batch 32"),
        "concurrent 32 / bare, batch 32": ratio("concurrent 32", "bare, batch 32"),
        "bare, batch 32 / bare, one": ratio("bare, batch 32", "bare, one"),
    }
    return out


def print_report(report: Dict[str, Any]) -> None:
    s = report["summary"]
    n = report["inputs"]
    print()
    print(f"model: {report['model']} ({report['model_desc']})")
    print(f"inputs: {n} sentences of {report['words'][0]}-{report['words'][1]} words, "
          f"{s['batch 32']['prompt_tokens']} tokens in all "
          f"({report['padded_tokens']} padded as one batch); rounds {report['rounds']} "
          f"(order alternating), medians; {report['machine']}")
    blas = report["blas"]
    print(f"BLAS: this process (bare loop): {blas['bare']}; server: {blas['server']}"
          + ("" if blas["same"] else "  ** NOT THE SAME BLAS **"))
    weights = report["weights"]
    print(f"weights: bare loop: {weights['bare']}; server: {weights['server']}"
          + ("" if weights["same"] else "  ** NOT THE SAME WEIGHTS **"))
    print()
    print("| workload | inputs/s | s per 32 inputs | forward passes | max abs diff vs bare one |")
    print("|---|---:|---:|---:|---:|")
    for name in WORKLOADS:
        w = s[name]
        passes = w["forward_passes"] if name in SERVER_WORKLOADS else (
            n if name == "bare, one" else 1)
        passes = _fmt(passes, ".0f" if passes is None or passes == int(passes) else ".1f")
        print(f"| {name} | {_rate(w['inputs_per_s'])} | {_fmt(w['seconds'], '.4g')} | "
              f"{passes} | {w['max_abs_diff']:.1e} |")
    print()
    r = s["ratios"]
    for key in ("batch 32 / one at a time", "concurrent 32 / one at a time"):
        met = "met" if r[key] is not None and r[key] >= BAR else "NOT met"
        print(f"{key + ':':<34} {_fmt(r[key], '.2f')}x   (bar >= {BAR:.0f}x: {met})")
    for key in ("server / bare, one at a time", "server / bare, batch 32",
                "concurrent 32 / bare, batch 32", "bare, batch 32 / bare, one"):
        print(f"{key + ':':<34} {_fmt(r[key], '.2f')}x")
    print()
    upstream = report["upstream"]
    print("upstream mlx_lm.server 0.32.2: no /v1/embeddings (its do_POST serves only "
          "/v1/completions, /v1/chat/completions, /chat/completions; any other path: 404 "
          "\"Not Found\"): no upstream column.")
    if upstream is None:
        print("  (not started: --check-upstream starts it once to show the 404)")
    elif upstream.get("status") is None:
        print(f"  checked: it did not start: {upstream.get('error')}")
    else:
        note = ("" if upstream["loads"] else
                f" (not on this model: {upstream['why_not']}; upstream can't load it)")
        print(f"  checked: POST /v1/embeddings to mlx_lm.server --model {upstream['model']}: "
              f"{upstream['status']} {upstream['body']!r}{note}")


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embeddings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="bert_embed",
                   help="embedding fixture kind (testkit/embedding_fixtures.py: bert_embed, "
                        "qwen3_embed, bert_cls, xlmr_embed, modernbert_embed) when no --model")
    p.add_argument("--model", help="a model folder instead of a fixture")
    p.add_argument("--task", choices=("embed",),
                   help='the models-config entry\'s "task" (embed: serve a chat model as a '
                        "last-token embedder); default: what the folder says")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--words", type=parse_words, default=(10, 60),
                   help="words a sentence: LO-HI (spread evenly) or N (default 10-60)")
    p.add_argument("--min-seconds", type=float, default=0.5,
                   help="each round, each workload runs again until it has taken this long "
                        "(its figure: the mean of those runs; one run of 32 inputs of a tiny "
                        "model is tens of milliseconds, too short to time once)")
    p.add_argument("--keep-quantized", action="store_true",
                   help="keep the weights as stored on both sides (the server's "
                        "--keep-quantized; default: float32 where the CPU has a fast BLAS)")
    p.add_argument("--check-upstream", action="store_true",
                   help="start mlx_lm.server once and show its answer to /v1/embeddings")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    if args.model:
        model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
        model_desc = f"--model{' --task ' + args.task if args.task else ''}"
    else:
        from testkit.embedding_fixtures import build_embedding_fixture

        root = Path(os.environ.get("MLX_LM_PLUS_FIXTURES") or work / "fixtures")
        model = str(build_embedding_fixture(args.kind, root))
        model_desc = f"fixture {args.kind}"
    texts = sentences(INPUTS, *args.words)

    # The same BLAS on both sides: this process's (cpu.py's choice, made at
    # import), handed to the server.
    bare_blas = cpu.FAST_BLAS or "bundled"
    import mlx.core as mx

    rate = cpu.gflops() if sys.platform == "linux" and cpu.on_cpu() else None
    cpu.RATE = rate  # (weights_for_cpu's test, as the server's log_blas sets it)
    blas_line = (f"{cpu.FAST_BLAS}" if cpu.FAST_BLAS
                 else f"the reference BLAS bundled with mlx[cpu] ({cpu.WHY_NOT})")
    if rate is not None:
        blas_line += f": {rate:.0f} GFLOP/s (fp32)"

    entry: Dict[str, Any] = {"name": NAME, "path": model}
    if args.task:
        entry["task"] = args.task
    config = work / "models.json"
    config.write_text(json.dumps({"models": [entry]}))
    log = work / "server.log"
    # (The bare loop's model loads first: the server's weights are not in
    # this process's memory while it loads.)
    bare = BareLoop(model, args.task or "embed", args.keep_quantized)
    server_args = ["--models-config", str(config)] + (
        ["--keep-quantized"] if args.keep_quantized else [])

    def weights_now() -> str:
        grown = server_weights(log)
        return (f"float32, converted at load ({grown})" if grown
                else "as stored (no conversion in its log)")
    runs: Dict[str, List[dict]] = {name: [] for name in WORKLOADS}
    print(f"model: {model}; server log: {log}", flush=True)
    with ServerProcess(OURS, server_args, log=log,
                       env={"MLX_LM_PLUS_BLAS": cpu.FAST_BLAS or "bundled"}) as server:
        reference = None

        def one(name, min_seconds=0.0, count=INPUTS):
            """A workload on the first `count` inputs, run until it has taken
            `min_seconds` (once at least): seconds per run, forward passes
            per run (the server's /v1/stats, read outside the timing), its
            vectors checked."""
            seconds, runs_done, passes, diff = 0.0, 0, 0, 0.0
            while runs_done == 0 or seconds < min_seconds:
                before = engine_embedding_stats(server.url) if name in SERVER_WORKLOADS else None
                if name in SERVER_WORKLOADS:
                    took, vectors, tokens = run_server_workload(server.url, name,
                                                                texts[:count])
                else:
                    took, vectors, tokens = bare.run(name, texts[:count])
                after = engine_embedding_stats(server.url) if name in SERVER_WORKLOADS else None
                seconds += took
                runs_done += 1
                passes = (passes + after["batches"] - before["batches"]) if before and after \
                    else None
                if reference is not None:
                    bad = [i for i, v in enumerate(vectors) if v.shape != reference[i].shape]
                    if bad:
                        raise RuntimeError(f"{name}: vectors of the wrong width for inputs {bad}")
                    diff = max([diff] + [float(np.abs(v - w).max())
                                         for v, w in zip(vectors, reference)])
                    if diff > TOLERANCE:
                        raise RuntimeError(
                            f"{name}: a vector differs from the bare loop's by {diff:.2e} "
                            f"(more than {TOLERANCE}; weights: bare loop {bare.weights}, "
                            f"server {weights_now()})")
            return {"seconds": seconds / runs_done, "runs": runs_done, "tokens": tokens,
                    "passes": None if passes is None else passes / runs_done,
                    "max_abs_diff": diff, "vectors": vectors}

        # Warm-up (untimed): the bare loop's one-at-a-time vectors, the
        # reference every answer is checked against, then each workload on
        # 4 inputs (the server loads the model; first calls allocate).
        reference = one("bare, one")["vectors"]
        if min(float(np.abs(a - b).max()) for i, a in enumerate(reference)
               for b in reference[i + 1:]) < 1e-6:
            raise RuntimeError("two inputs have the same vector: the model is flat")
        width = reference[0].shape[0]
        for name in WORKLOADS:
            one(name, count=4)
        for round_ in range(args.rounds):
            order = WORKLOADS if round_ % 2 == 0 else WORKLOADS[::-1]
            line = []
            for name in order:
                row = one(name, args.min_seconds)
                del row["vectors"]
                runs[name].append(row)
                line.append(f"{name}: {_rate(len(texts) / row['seconds'])}/s")
            print(f"round {round_ + 1}: " + ", ".join(line), flush=True)
    server_blas_line = server_blas(log)
    server_grown = server_weights(log)

    report: Dict[str, Any] = {
        "command": "python -m benchmarks.embeddings " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "model": model, "model_desc": model_desc, "task": args.task,
        "width": width, "inputs": len(texts), "words": list(args.words),
        "rounds": args.rounds, "texts": texts,
        "padded_tokens": bare.padded_tokens(texts),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
                   f"mlx {mx.__version__}",
        "blas": {"bare": blas_line, "server": server_blas_line, "env": bare_blas,
                 # (the server's log names the library, or "the reference BLAS bundled")
                 "same": server_blas_line.startswith(cpu.FAST_BLAS) if cpu.FAST_BLAS
                 else "bundled" in server_blas_line},
        "weights": {"bare": bare.weights, "server": weights_now(),
                    "same": (bare.grown is None) == (server_grown is None)},
        "bare_loop": "embedders.load_embedder (+ cpu.weights_for_cpu) + Embedder.hidden + "
                     "Embedder.pooling, tokenized by planning.embedding.plan_embeddings",
        "runs": runs,
        "summary": summarize(runs, len(texts)),
        "upstream": check_upstream(model, work, texts) if args.check_upstream else None,
    }
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"\nfigures written to {args.json}")
    return report


if __name__ == "__main__":
    main()
