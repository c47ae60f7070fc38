"""Two hosts, simulated: network namespaces joined by a bridge, one rank of
the server in each over the ring backend (testkit/netns.py). The prompt cache,
batching and bad input hold as in one process; a rank killed or its link cut
ends the group within --distributed-timeout, every client answered."""

import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from compat.launch import OURS, ServerProcess
from testkit import netns
from testkit.engine_harness import SEQUENTIAL
from tests.models.test_vision import image_part, png, user

pytestmark = pytest.mark.skipif(netns.unavailable() is not None,
                                reason=str(netns.unavailable()))


@pytest.fixture(scope="module")
def hosts():
    with netns.Hosts(2) as h:
        yield h


def chat(server, messages, **extra):
    status, r = server.post("/v1/chat/completions",
                            {"messages": messages, "max_tokens": 8, **extra}, timeout=120)
    assert status == 200, r
    return (r["choices"][0]["message"]["content"],
            r["usage"]["prompt_tokens_details"]["cached_tokens"])


def workload(server):
    """Multi-turn, a branch (an earlier turn edited), a seeded request, bad
    input beside good, and concurrent requests: (text, cached tokens) of
    each sequential one, the texts of the concurrent ones."""
    out = []
    messages = [{"role": "system", "content": "You answer briefly. " * 4},
                {"role": "user", "content": "Tell me about the sea."}]
    for turn in range(3):
        text, cached = chat(server, messages)
        out.append((text, cached))
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"And then {turn}?"}]
    branch = messages[:4] + [{"role": "user", "content": "Something else, then."}]
    out.append(chat(server, branch))
    out.append(chat(server, messages[:2], seed=3, temperature=0.8))
    status, r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": -1})
    assert status == 400, r
    bodies = [[{"role": "user", "content": f"Question number {i} about rivers."}]
              for i in range(4)]
    texts = [None] * len(bodies)

    def one(i):
        texts[i] = chat(server, bodies[i])[0]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    out.append(texts)
    return out


# Rank 0 holds the last layers, as mlx-lm pipelines.
PIPELINE_SPLITS = {"qwen2": ["1-2", "0-0"], "qwen3_5": ["2-3", "0-1"],
                   "qwen3_5_split": ["1-1", "0-0"]}


@pytest.mark.parametrize("kind,extra", [
    ("qwen3", []), ("qwen3_5", []), ("qwen2", ["--pipeline"]), ("qwen3_5", ["--pipeline"]),
    ("qwen3_5_split", ["--pipeline"])])
def test_two_hosts_answer_as_one_process(hosts, fixture_path, tmp_path, kind, extra):
    """Tensor-parallel (as `mlx.launch` runs it by default) and pipelined, on
    an attention and the hybrid fixture; and a hybrid pipelined into a rank
    of attention alone (trimmable caches, no checkpoints of its own) and a
    rank of the recurrent layer alone, which must store alike. Clients that
    go mid-stream leave on every rank at the same step; DELETE /v1/cache
    clears every rank's store."""
    model = str(fixture_path(kind))
    sea = [{"role": "user", "content": "Tell me about the sea."}]
    with ServerProcess(OURS, ["--model", model, *extra], log=tmp_path / "one.log") as one:
        expected = workload(one)
        chat(one, sea)
        assert one.request("DELETE", "/v1/cache")[0] == 200
        after = chat(one, sea)
        assert after[1] == 0
    # (A group that drifts apart hangs: --distributed-timeout makes it a 503.)
    with netns.RankServer(hosts, ["--model", model, *extra, "--distributed-timeout", "30"],
                          tmp_path) as two:
        got = workload(two)
        for n, path in enumerate(["batched", "sequential"], 1):
            body = {"messages": [{"role": "user", "content": f"Long one, {path}."}],
                    "max_tokens": 2000, "stream": True, **(SEQUENTIAL if n == 2 else {})}
            req = urllib.request.Request(
                two.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                r.readline()
            stops = [until_logged(two, rank, "cancelled request", n,
                                  after=" at step " if n == 1 else " at ") for rank in (0, 1)]
            # (The same step on both ranks; the sequential one may stop in
            # its prefill, at a prompt token.)
            assert stops[0] == stops[1] and stops[0].split()[-1].isdigit(), stops
        chat(two, sea)
        assert two.request("DELETE", "/v1/cache")[0] == 200
        # (Rank 1's store cleared too: had it kept `sea`, it would resume it
        # where rank 0 recomputes, and the group would drift apart.)
        assert chat(two, sea) == after
        assert two.get("/health") == (200, {"status": "ok"})
    assert got == expected
    assert any(cached for _, cached in got[1:4])  # (the cache did work)
    for rank in (0, 1):
        assert (f"on rank {rank} of 2: " + (
            f"pipelined, layers {PIPELINE_SPLITS[kind][rank]} here" if extra
            else "tensor-parallel")) in two.log(rank)


def test_a_client_gone_during_a_prefill_stops_it_on_every_rank(hosts, fixture_path,
                                                                tmp_path):
    """A request on the sequential path with a long prompt, prefilled in small
    chunks: its client goes during the prefill, and every rank stops it at
    the same chunk (only rank 0 sees the client: they ask it together), then
    goes on serving."""
    two = netns.RankServer(hosts, ["--model", str(fixture_path("qwen3")),
                                   "--prefill-step-size", "8"], tmp_path)
    with two:
        long = " ".join(f"Line {i} is about rivers and boats." for i in range(200))
        body = {"messages": [{"role": "user", "content": long}], "max_tokens": 8,
                "stream": True, **SEQUENTIAL}
        req = urllib.request.Request(two.url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.readline()
        stops = [until_logged(two, rank, "Stopped the prefill of a cancelled", 1,
                              after=" at prompt token ") for rank in (0, 1)]
        assert stops[0] == stops[1] and 0 < int(stops[0]) < 1000, stops
        assert chat(two, [{"role": "user", "content": "Still there?"}])[0]


def until_logged(server, rank: int, what: str, n: int, timeout: float = 30,
                 after: str = " at step ") -> str:
    """The n-th log line of `rank` about `what`, from `after` on (the step,
    or the token, it names), waited for."""
    deadline = time.time() + timeout
    while True:
        lines = [line for line in server.log(rank).splitlines() if what in line]
        if len(lines) >= n:
            return lines[n - 1].partition(after)[2].split(",")[0]
        assert time.time() < deadline, f"rank {rank} did not log {what!r} {n} times"
        time.sleep(0.1)


def test_three_hosts_pipelined_answer_as_one_process(fixture_path, tmp_path):
    """Three hosts, a layer each (the 3-layer qwen2): the same texts and
    cached tokens as one process, and every rank ran its own layer."""
    model = str(fixture_path("qwen2"))
    with ServerProcess(OURS, ["--model", model], log=tmp_path / "one.log") as one:
        expected = workload(one)
    with netns.Hosts(3) as hosts:
        with netns.RankServer(hosts, ["--model", model, "--pipeline",
                                      "--distributed-timeout", "30"], tmp_path) as three:
            got = workload(three)
            for rank, layer in enumerate((2, 1, 0)):
                assert (f"on rank {rank} of 3: pipelined, layers {layer}-{layer} here"
                        in three.log(rank))
    assert got == expected


@pytest.mark.parametrize("extra", [[], ["--pipeline"]])
def test_an_image_conversation_across_hosts(hosts, fixture_path, tmp_path, extra):
    """Qwen3.5 with vision: its language model (mlx-lm's) split across the
    ranks, the vision tower whole on each. A picture, a follow-up, the same
    picture in a new conversation and another picture answer as one
    process, with the same cached tokens (resumed past the image)."""
    model = str(fixture_path("qwen3_5_vl"))
    with ServerProcess(OURS, ["--model", model], log=tmp_path / "one.log") as one:
        expected = image_workload(one)
        whole = weights_bytes(one)
    with netns.RankServer(hosts, ["--model", model, *extra], tmp_path) as two:
        got = image_workload(two)
        part = weights_bytes(two)
    assert got == expected
    # Rank 0 keeps its part of the language layers, not mlx-vlm's copy too.
    assert part <= whole - 0.45 * language_layer_bytes(model), (part, whole)
    assert got[1][1] > got[0][1] and got[2][1] > 0  # (the cache did work)
    for rank in (0, 1):
        assert "the vision tower whole" in two.log(rank)


def weights_bytes(server) -> float:
    """The model's weights in memory, on rank 0 (its /metrics gauge)."""
    status, text = server.request("GET", "/metrics")[::2]
    line = next(l for l in text.decode().splitlines()
                if l.startswith("mlx_lm_plus_model_weights_bytes{"))
    return float(line.rsplit(" ", 1)[1])


def language_layer_bytes(model) -> int:
    """Bytes of the checkpoint's language layers."""
    import mlx.core as mx

    weights = mx.load(str(Path(model) / "model.safetensors"))
    return sum(w.nbytes for k, w in weights.items()
               if "language_model" in k and ".layers." in k)


def image_workload(server):
    red, blue = png((200, 30, 30)), png((30, 30, 200))
    first = [user(image_part(red), "What is in this picture?")]
    out = [chat(server, first)]
    follow = first + [{"role": "assistant", "content": out[0][0]}, user("And its colour?")]
    out.append(chat(server, follow))
    out.append(chat(server, [user(image_part(red), "Describe it again.")]))
    out.append(chat(server, [user(image_part(blue), "What is in this picture?")]))
    return out


def test_ranks_evict_alike(hosts, fixture_path, tmp_path):
    """Each rank's store evicts by its own bytes under its own budget, yet all
    must hold the same entries: the group keeps the smallest budget, and
    evicts as far as the rank with the most to give back. Here rank 1 is
    given a larger budget (the default is a share of each host's memory),
    and pipelined over 3 layers rank 0 holds twice rank 1's bytes of each
    entry: a store that drifted apart would leave one rank resuming a prompt
    the other recomputes, and the pipeline would garble or hang."""
    model = str(fixture_path("qwen2"))
    budget = ["--prompt-cache-bytes", "150000"]
    with ServerProcess(OURS, ["--model", model, *budget], log=tmp_path / "one.log") as one:
        expected = [chat(one, m)[0] for m in eviction_workload()]
    # (A group that drifted apart hangs: --distributed-timeout makes it a 503.)
    with netns.RankServer(hosts, ["--model", model, "--pipeline", *budget,
                                  "--distributed-timeout", "20"], tmp_path,
                          rank_args={1: ["--prompt-cache-bytes", "5000000"]}) as two:
        got = [chat(two, m) for m in eviction_workload()]
        stats = two.get("/v1/cache/stats")[1]

        def summaries():
            return [[re.sub(r"[\d.]+/[\d.]+ MB, ", "", line.partition("Prompt cache: ")[2])
                     for line in two.log(rank).splitlines() if "Prompt cache: " in line]
                    for rank in (0, 1)]

        # (Rank 0 answers; rank 1 may log the last request's summary a moment
        # later, and the ranks are killed at the end of this block.)
        deadline = time.monotonic() + 10
        while len({len(s) for s in summaries()}) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        summaries = summaries()
    assert [text for text, _ in got] == expected
    # The two stores alike after every request: entries, hits, evictions
    # (the bytes differ: each holds its own layers).
    assert summaries[0] == summaries[1] and len(summaries[0]) >= len(expected), summaries
    assert any(cached for _, cached in got)  # (some entries were used...)
    assert stats["evictions"] > 0, stats  # (...and some evicted)
    assert "budget 0.15 MB, the smallest of the 2 ranks'" in two.log(1)


def eviction_workload():
    """Conversations that each overfill a 150 KB store, taken up again in turn."""
    out = []
    for turn in range(3):
        for topic in ("the sea", "the hills", "the old town"):
            out.append([{"role": "system", "content": "You answer briefly. " * 6},
                        {"role": "user", "content": f"Tell me about {topic}, part {turn}."}])
    return out


@pytest.mark.parametrize("case,reason", [
    ("missing on rank 1", "another rank can't load it"),
    ("another model on rank 1", "its config.json differs between the ranks"),
    ("a draft model", "not supported in distributed mode")])
def test_a_model_a_rank_cant_load_is_a_404(hosts, fixture_path, tmp_path, case, reason):
    """Every rank looks before any loads (had one started, it would wait in
    the load's collectives for a rank that gave up): a model one host lacks,
    a different model at the same path, a draft model (not in distributed
    mode, as upstream) are a 404, and the group goes on serving the model it
    had, its prompt cache too. (`ip netns exec` lays /etc/netns/NAME/X over
    /etc/X for that namespace alone: rank 1 sees another folder.)"""
    import shutil

    folder = Path(f"/etc/mlx_lm_plus_test_{os.getpid()}")
    other = Path("/etc/netns") / hosts.names[1] / folder.name
    try:
        shutil.copytree(fixture_path("llama"), folder)
        if case == "another model on rank 1":
            shutil.copytree(fixture_path("qwen3"), other)
        else:
            other.mkdir(parents=True)
        two = netns.RankServer(hosts, ["--model", str(fixture_path("qwen3")),
                                       "--allow-model-loading"], tmp_path)
        with two:
            sea = [{"role": "user", "content": "Tell me about the sea."}]
            before = chat(two, sea)
            named = ({"model": str(fixture_path("qwen3")), "draft_model": str(folder)}
                     if case == "a draft model" else {"model": str(folder)})
            status, r = two.post("/v1/chat/completions",
                                 {**named, "messages": sea, "max_tokens": 4})
            assert status == 404 and reason in json.dumps(r), r
            again = chat(two, sea)
            assert again[0] == before[0] and again[1] > 0, (before, again)
            assert "Unloaded" not in two.log(0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(other.parent, ignore_errors=True)


@pytest.mark.parametrize("signalled", [[0], [0, 1]])
def test_rank_0_stopping_stops_the_group(hosts, fixture_path, tmp_path, signalled):
    """SIGTERM to rank 0 (or to every rank, as Ctrl-C in mlx.launch's
    terminal does): rank 0 finishes the request in flight, then tells the
    others at a hand-off, and every rank exits 0 (not the 70 of a lost
    group, which a supervisor would take for a failure)."""
    import signal

    two = netns.RankServer(hosts, ["--model", str(fixture_path("qwen3"))], tmp_path)
    with two:
        result = {}
        thread = long_request(two, result, max_tokens=1000)
        time.sleep(0.3)
        for rank in signalled:
            os.kill(two.procs[rank].pid, signal.SIGTERM)
        thread.join(60)
        assert result["status"] == 200, result  # (answered whole, before the stop)
        assert two.wait_all(60) == [0, 0], two.log(1)[-2000:]
    assert "Stopping: 1 request(s) in flight" in two.log(0)  # (it was, at the signal)
    assert "Server stopped" in two.log(1)


def long_request(server, result, **extra):
    """A long generation in a thread: its status and body (or the error)."""
    def run():
        t = time.monotonic()
        status, body = server.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Go on and on."}], "max_tokens": 100000,
            **extra}, timeout=120)
        result.update(status=status, body=body, seconds=time.monotonic() - t)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("failure,path", [("rank killed", "batched"),
                                          ("rank killed", "sequential"),
                                          ("link cut", "batched")])
def test_a_lost_host_ends_the_group(fixture_path, tmp_path, failure, path):
    """Mid-generation, rank 1's process is killed (its peer sees the
    connection drop: mostly at once) or its link is cut (nothing is seen:
    the collective never returns, until --distributed-timeout). The client, on
    the batched or the sequential path, is answered with a 503
    naming the reason, /health says it, and the ranks exit with status 70
    (for a supervisor to restart the group)."""
    timeout, grace = 5, 8
    with netns.Hosts(2) as hosts:
        server = netns.RankServer(hosts, ["--model", str(fixture_path("qwen3")),
                                          "--distributed-timeout", str(timeout),
                                          "--watchdog-grace", str(grace)], tmp_path)
        with server:
            result = {}
            thread = long_request(server, result,
                                  **(SEQUENTIAL if path == "sequential" else {}))
            time.sleep(2)  # (generating)
            tic = time.monotonic()
            if failure == "rank killed":
                server.kill(1)
            else:
                hosts.cut(1)
            thread.join(timeout + grace + 30)
            assert not thread.is_alive(), "the client was never answered"
            answered = time.monotonic() - tic
            assert result["status"] == 503, result
            error = result["body"]["error"]
            if failure == "rank killed" and "group was lost" in error:
                assert answered < timeout, (error, answered)
            else:
                # A cut link never shows; nor, now and then, a peer killed
                # mid-collective (the ring backend then waits on it): the
                # timeout catches both.
                assert "stuck" in error and answered < timeout + 5, (error, answered)
            status, health = server.get("/health")
            assert status == 503 and health.get("reason"), (health, result)
            codes = server.wait_all(timeout + grace + 30)
            assert codes[0] == 70, (codes, server.log(0)[-2000:])
            if failure == "link cut":
                assert codes[1] == 70, (codes, server.log(1)[-2000:])


def test_hosts_benchmark_runs(fixture_path, capsys):
    """python -m benchmarks.hosts, one short round: both setups measured."""
    import ast

    from benchmarks.hosts import main

    main(["--model", str(fixture_path("qwen3")), "--rounds", "1", "--max-tokens", "4"])
    out = capsys.readouterr().out
    for clients in ("1 client(s)", "8 client(s)"):
        line = next(x for x in out.splitlines() if x.startswith(f"{clients}: tokens/s"))
        figures = ast.literal_eval(line.split("  ", 1)[1])  # (print_figures: the dict)
        assert figures["one process"] > 0 and figures["two ranks"] > 0
