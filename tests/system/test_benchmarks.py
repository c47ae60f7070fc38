"""The benchmark harness, short form, against upstream on the hybrid fixture:
every workload runs on both servers and prints its figures (timings are not
asserted: they drift on shared machines). Counts and correctness are."""

import json

import pytest

from benchmarks.__main__ import main
from benchmarks.workloads import VISION_WORKLOADS, WORKLOADS

TEXT_WORKLOADS = [w for w in WORKLOADS if w not in VISION_WORKLOADS]


def test_every_workload_runs_against_upstream(fixture_path, tmp_path, capsys):
    out = tmp_path / "figures.json"
    report = main(["run", "--all", "--smoke", "--rounds", "1",
                   "--model", str(fixture_path("qwen3_5")), "--json", str(out)])
    printed = capsys.readouterr().out
    # (The vision workload runs only on a model with vision: below.)
    assert list(json.loads(out.read_text())["workloads"]) == TEXT_WORKLOADS
    for name in TEXT_WORKLOADS:
        assert f"## {name}" in printed
        medians = report["workloads"][name]["median"]
        for server in ("ours", "upstream"):
            figures = medians[server]
            # Upstream has no generation-thread counters, and its streams
            # may not overlap (no window for the decode rate of a batch).
            theirs_only = ("gen. thread", "decode") if server == "upstream" else ()
            assert figures and all(v is not None for k, v in figures.items()
                                   if "cache bytes" not in k and "entries" not in k
                                   and "budget" not in k
                                   and not any(t in k for t in theirs_only)), (
                name, server, figures)
    ours = {n: report["workloads"][n]["median"]["ours"] for n in TEXT_WORKLOADS}
    upstream = {n: report["workloads"][n]["median"]["upstream"] for n in TEXT_WORKLOADS}
    # Batched replies equal the same requests sent alone, on both servers.
    assert ours["burst"]["replies differing from the request alone"] == 0
    assert upstream["burst"]["replies differing from the request alone"] == 0
    # The cache figures are counts, not timings: they hold in the short form.
    assert ours["seeded"]["recomputed/novel"] <= 1.1 < upstream["seeded"]["recomputed/novel"]
    assert ours["branch"]["recomputed/novel, branches only"] < \
        upstream["branch"]["recomputed/novel, branches only"]


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_5_vl"])
def test_vision_workload(fixture_path, capsys, kind):
    report = main(["run", "--workload", "vision", "--smoke", "--rounds", "1",
                   "--model", str(fixture_path(kind))])
    figures = report["workloads"]["vision"]["median"]
    ours, upstream = figures["ours"], figures["upstream"]
    # One image, sent again with every turn and with the new question:
    # through the vision tower once.
    assert ours["vision tower images"] == 1
    assert ours["ttft turn 2 / turn 1"] is not None
    assert ours["cached share, same picture new question"] > 0.5
    # mlx_lm.server 0.32.2 has no vision for these models: it refuses image parts.
    assert "Only 'text' content type is supported" in upstream["error"]
    assert "## vision" in capsys.readouterr().out


def test_the_minimal_server_streams_what_ours_does(fixture_path, tmp_path, capsys):
    """benchmarks.minimal_server, the floor of the overhead workload, really
    generates: its greedy streams equal ours token for token (text and
    count), alone and in a batch; the workload runs against it."""
    import asyncio
    import sys

    from benchmarks.harness import Client, session
    from compat.launch import OURS, ServerProcess

    model = str(fixture_path("qwen3_5"))
    minimal = [sys.executable, "-m", "benchmarks.minimal_server"]

    async def replies(url):
        client = Client(url, None, 24)
        async with session() as http:
            alone = await client.chat(http, [{"role": "user", "content": "Tell me a story."}],
                                      stream=True, record=False)
            together = await asyncio.gather(*(client.chat(
                http, [{"role": "user", "content": f"Story {i}, please."}], stream=True,
                record=False) for i in range(4)))
        return [(r.text, r.output_tokens) for r in (alone, *together)]

    with ServerProcess(minimal, ["--model", model], log=tmp_path / "minimal.log") as s:
        floor = asyncio.run(replies(s.url))
    with ServerProcess(OURS, ["--model", model], log=tmp_path / "ours.log") as s:
        want = asyncio.run(replies(s.url))
    assert floor == want and all(text and n for text, n in want)

    report = main(["run", "--workload", "overhead", "--smoke", "--rounds", "1",
                   "--model", model, "--against", " ".join(minimal)])
    theirs = report["workloads"]["overhead"]["median"]["theirs"]
    assert theirs["batch 4: decode tok/s"] > 0 and "error" not in theirs
    assert "## overhead" in capsys.readouterr().out


def test_image_bodies_benchmark(fixture_path, capsys):
    """benchmarks/image_bodies.py, short: both servers refuse the bodies it
    posts after parsing them (a 400 each), with a stream running."""
    from benchmarks.image_bodies import main as image_bodies

    model = str(fixture_path("qwen3"))
    report = image_bodies(["--model", model, "--rounds", "1", "--bodies", "1",
                           "--images", "2", "--image-mb", "0.2"])
    for name in ("ours", "upstream"):
        (run,) = report["runs"][name]
        assert run["statuses"] == [400] and run["max_gap_ms"] > 0, run
    assert "largest gap, ours / upstream" in capsys.readouterr().out
    report = image_bodies(["--model", model, "--rounds", "1", "--bodies", "1",
                           "--images", "2", "--image-mb", "0.2", "--mode", "check"])
    assert list(report["runs"]) == ["ours"] and report["runs"]["ours"][0]["statuses"] == [400]


def test_slow_heads_benchmark(fixture_path):
    """benchmarks/slow_heads.py, short: with a few connections held, each
    server answers /health and keeps them (the lockout takes ~2,000)."""
    from benchmarks.slow_heads import main as slow_heads

    runs = slow_heads(["--model", str(fixture_path("qwen3")), "--connections", "20",
                       "--probes", "1"])
    for name in ("ours", "upstream"):
        (run,) = runs[name]
        assert run == {"opened": 20, "answered": 1, "probes": 1, "median_ms": run["median_ms"],
                       "held_still_open": 20}, (name, run)


def test_embeddings_benchmark(fixture_path, tmp_path, capsys):
    """benchmarks/embeddings.py, short: one round on the bert_embed fixture
    (every answer checked against the bare loop's vectors; batching counted
    in forward passes, timings not asserted), upstream's 404, and a chat
    model served as an embedder through its models-config `task`."""
    from benchmarks.embeddings import WORKLOADS
    from benchmarks.embeddings import main as embeddings

    out = tmp_path / "embeddings.json"
    report = embeddings(["--model", str(fixture_path("bert_embed")), "--rounds", "1",
                         "--check-upstream", "--json", str(out)])
    printed = capsys.readouterr().out
    summary = report["summary"]
    for name in WORKLOADS:
        assert summary[name]["inputs_per_s"] > 0 and summary[name]["max_abs_diff"] < 1e-3
        assert f"| {name} |" in printed
    assert summary["one at a time"]["forward_passes"] == 32
    # (32 inputs, ~2,200 padded tokens: two passes of --prefill-step-size 2,048)
    assert summary["batch 32"]["forward_passes"] <= 2
    assert summary["concurrent 32"]["forward_passes"] < 32
    assert report["blas"]["same"] and report["weights"]["same"]
    # mlx-lm can't load BERT: upstream is asked on the demo model, and has no route.
    assert report["upstream"]["status"] == 404 and not report["upstream"]["loads"]
    assert "batch 32 / one at a time:" in printed and "no /v1/embeddings" in printed
    assert json.loads(out.read_text())["summary"]["ratios"]["batch 32 / one at a time"] > 0

    report = embeddings(["--model", str(fixture_path("qwen3")), "--task", "embed",
                         "--rounds", "1", "--words", "5-20"])
    assert report["summary"]["batch 32"]["forward_passes"] == 1  # (under 2,048 tokens)
    assert report["upstream"] is None and report["width"] == 64


FAKE_SERVER = '''
import argparse, http.server, json
parser = argparse.ArgumentParser()
for flag in ("--model", "--host", "--port"):
    parser.add_argument(flag)
args = parser.parse_args()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"file": __file__}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.HTTPServer((args.host, int(args.port)), Health).serve_forever()
'''


def test_against_tree_runs_that_checkouts_server(tmp_path):
    """--against-tree's side is the other checkout's code: `python -m` run in
    this folder would import this folder's mlx_lm_plus whatever PYTHONPATH
    says (an A/B of a change against its parent was the change against
    itself)."""
    import urllib.request

    from benchmarks.__main__ import Launch
    from compat.launch import OURS

    tree = tmp_path / "other"
    (tree / "mlx_lm_plus").mkdir(parents=True)
    (tree / "mlx_lm_plus" / "__init__.py").write_text("")
    (tree / "mlx_lm_plus" / "server.py").write_text(FAKE_SERVER)
    with Launch(OURS, tree).server(["--model", "unused"], log=tmp_path / "log") as s:
        with urllib.request.urlopen(s.url + "/health", timeout=10) as r:
            assert json.loads(r.read())["file"] == str(tree / "mlx_lm_plus" / "server.py")
    with pytest.raises(SystemExit):
        main(["run", "--workload", "multiturn", "--against-tree", str(tmp_path / "none")])


def test_a_model_folder_given_relative_reaches_servers_absolute(fixture_path, tmp_path,
                                                                 monkeypatch):
    """A server run in another checkout (--against-tree) would look for a
    relative --model there; a name that is no folder here (a hub id) is
    passed as it is."""
    import argparse

    from benchmarks.__main__ import resolve_model

    monkeypatch.chdir(fixture_path("qwen3").parent)
    args = argparse.Namespace(model="qwen3", model_kind="hybrid")
    assert resolve_model(args, tmp_path) == str(fixture_path("qwen3").resolve())
    args = argparse.Namespace(model="org/not-a-folder-here", model_kind="hybrid")
    assert resolve_model(args, tmp_path) == "org/not-a-folder-here"


def test_cpu_profile_accounts_for_the_pass(fixture_path, capsys):
    """benchmarks.cpu_profile times each kind of op: on a fixture every kind
    the model has gets time, none more than the timed pass, and the kinds
    with the rest add up to it."""
    from benchmarks import cpu_profile

    result = cpu_profile.main(["--model", str(fixture_path("qwen3")), "--prompt", "24",
                               "--steps", "3", "--repeats", "1"])
    for phase in ("prefill", "decode"):
        r = result[phase]
        kinds = r["kinds"]
        for kind in cpu_profile.KINDS[:6]:  # (projections, MLP, LM head, attention, RoPE, norms)
            assert kinds[kind] > 0, (phase, kind)
        assert sum(kinds.values()) >= r["timed"] * 0.999 and r["real"] > 0
        assert all(0 <= s <= r["timed"] for s in kinds.values())
    assert result["decode"]["kinds"]["argmax (greedy pick)"] > 0
    # The decode step's graph, counted: one op a projection (qwen3: 2 layers).
    ops = result["decode_ops"]
    assert sum(ops.values()) > 7 * 2 and ops.get("Softmax") == 2, ops
    out = capsys.readouterr().out
    assert "| attention (scores, softmax, values) |" in out
    assert "ops in a decode step's graph: " in out


def test_speculation_benchmark(fixture_path, capsys):
    """benchmarks.speculation, short: json_edit (structured output that
    repeats its prompt) and code_edit at 1 and 2 streams on the qwen3
    fixture; greedy, so the texts with and without prompt lookup agree."""
    from benchmarks import speculation

    figures = speculation.main(["--model", str(fixture_path("qwen3")), "--rounds", "1",
                                "--lines", "18", "--max-tokens", "24", "--concurrency", "2",
                                "--workloads", "json_edit,code_edit"])
    for case in ("json_edit@1", "json_edit@2", "code_edit@1", "code_edit@2"):
        assert figures[f"{case} same text"] is True, case
        assert figures[f"{case} plain tok/s"] and figures[f"{case} lookup tok/s"], case
        assert figures[f"{case} tokens/step"] >= 1.0
    assert "json_edit@2" in capsys.readouterr().out
