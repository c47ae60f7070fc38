"""Two hosts, simulated: network namespaces joined by a bridge, one rank of
the server in each over the ring backend (tests/netns.py). The prompt cache,
batching and bad input hold as in one process; a rank killed or its link cut
ends the group within --distributed-timeout, every client answered."""

import json
import threading
import time
import urllib.request

import pytest

from compat.launch import OURS, ServerProcess
from tests import netns

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


@pytest.mark.parametrize("kind,extra", [("qwen3", []), ("qwen3_5", [])])
def test_two_hosts_answer_as_one_process(hosts, fixture_path, tmp_path, kind, extra):
    """Tensor-parallel (as `mlx.launch` runs it by default) on the attention
    and the hybrid fixture. (`--pipeline`: none of the tiny fixtures' mlx-lm
    models supports pipelining.)"""
    model = str(fixture_path(kind))
    sea = [{"role": "user", "content": "Tell me about the sea."}]
    with ServerProcess(OURS, ["--model", model, *extra], log=tmp_path / "one.log") as one:
        expected = workload(one)
        after = chat(one, sea)[0]
    with netns.RankServer(hosts, ["--model", model, *extra], tmp_path) as two:
        got = workload(two)
        # A client that goes mid-stream: the group runs the request to its
        # end on every rank (as upstream), and goes on serving.
        req = urllib.request.Request(
            two.url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"messages": [{"role": "user", "content": "Long one."}],
                             "max_tokens": 200, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            r.readline()
        assert chat(two, sea)[0] == after
        assert two.get("/health") == (200, {"status": "ok"})
    assert got == expected
    assert any(cached for _, cached in got[1:4])  # (the cache did work)


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
    connection drop: at once) or its link is cut (nothing is seen: the
    collective never returns, until --distributed-timeout). The client, on
    the batched or the sequential (seeded) path, is answered with a 503
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
                                  **({"seed": 4} if path == "sequential" else {}))
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
            if failure == "rank killed":
                assert "group was lost" in error and answered < timeout, (error, answered)
            else:
                assert "stuck" in error and answered < timeout + 5, (error, answered)
            status, health = server.get("/health")
            assert status == 503 and health.get("reason"), health
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
