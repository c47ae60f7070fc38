"""The prompt cache's disk tier in the engine and the server
(--prompt-cache-dir): greedy outputs from disk hits equal cold ones, a
conversation resumes after a graceful restart, another model never reads
the entries, and a server killed with SIGKILL restarts and serves.

Store-level behaviour (what goes to disk, exact arrays back, stats) is in
test_cache_store.py; the file format and crash safety in test_disk_cache.py.
"""

import os
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from compat.launch import OURS, ServerProcess
from testkit.engine_harness import EngineRunner
from tests.cache.test_cache_exactness import workload

# A long system prompt, so that a turn's new tokens (the reply and the next
# question) are a small share of its prompt.
SYSTEM = ("You are the harbour master's assistant. You keep the tide tables, "
          "the berth list and the pilot rota, and you answer in short lists. ") * 24


def question(t):
    return f"Turn {t}: which berth is free at high tide?"


def chat(server, messages, max_tokens=6):
    """(generated token ids, cached tokens, prompt tokens, text), greedy."""
    status, r = server.post("/v1/chat/completions", {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": True})
    assert status == 200, r
    usage = r["usage"]
    ids = [c["id"] for c in r["choices"][0]["logprobs"]["content"]]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return ids, cached, usage["prompt_tokens"], r["choices"][0]["message"]["content"] or ""


def metric(server, name, **labels):
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == f"mlx_lm_plus_{name}" and s.labels == labels:
                return s.value
    return None


def cache_stats(server, timeout=60):
    """/v1/cache/stats once the disk tier is open: /health answers while the
    generation thread still loads the model, and the tier opens after it."""
    deadline = time.time() + timeout
    while True:
        stats = server.get("/v1/cache/stats")[1]
        if stats["disk"] is not None or time.time() > deadline:
            return stats
        time.sleep(0.1)


def wait_for_writes(server, writes, timeout=30):
    """Until the disk tier has written `writes` files and has none queued."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        disk = server.get("/v1/cache/stats")[1]["disk"]
        if disk["writes"] >= writes and disk["queued_bytes"] == 0:
            return disk
        time.sleep(0.1)
    raise AssertionError(f"disk writes: {disk}")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_disk_hits_equal_cold_generation(kind, fixture_path, tmp_path):
    """A memory budget of one byte: every entry is evicted as it is stored,
    so every hit comes from disk (attention, and hybrid checkpoints)."""
    path = fixture_path(kind)
    disk = EngineRunner(path, max_bytes=1, argv=["--prompt-cache-dir", str(tmp_path)])
    cold = EngineRunner(path, max_bytes=0)
    try:
        hits = 0
        for name, bodies in workload():
            if name not in ("multi_turn", "edit_earlier"):
                continue
            for i, body in enumerate(bodies):
                tokens, _, cached = disk.run(body)
                disk.store.disk_for(disk.provider.default_key).flush(10)
                assert tokens == cold.run(body)[0], (kind, name, i)
                hits += cached > 0
        snap = disk.store.snapshot()
        assert hits > 0 and snap["hits_by_tier"]["disk"] == hits
        assert snap["hits_by_tier"]["memory"] == 0 and snap["disk"]["writes"] > 0
    finally:
        disk.close()
        cold.close()


def test_warm_restart_resumes_exactly_and_other_models_see_nothing(fixture_path, tmp_path):
    model = str(fixture_path("qwen3"))
    folder = str(tmp_path / "prompt-cache")
    args = ["--model", model, "--prompt-cache-dir", folder, "--shutdown-timeout", "5"]
    messages = [{"role": "system", "content": SYSTEM}]
    server = ServerProcess(OURS, args, log=tmp_path / "first.log").start()
    try:
        for t in range(3):
            messages.append({"role": "user", "content": question(t)})
            text = chat(server, messages)[3]
            messages.append({"role": "assistant", "content": text or "Berth 3."})
        assert server.get("/v1/cache/stats")[1]["disk"]["entries"] == 0  # all in memory
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log_tail()  # a graceful stop

    messages.append({"role": "user", "content": question(3)})
    with ServerProcess(OURS, args, log=tmp_path / "second.log") as server:
        stats = cache_stats(server)
        assert stats["entries"] == 0 and stats["disk"]["entries"] >= 1
        warm, cached, prompt, _ = chat(server, messages)
        assert cached >= 0.95 * prompt, (cached, prompt)
        stats = server.get("/v1/cache/stats")[1]
        assert stats["hits_by_tier"] == {"memory": 0, "disk": 1}
        assert stats["hits"]["disk"] == 1 and stats["disk"]["hits"] == 1
        # (Read by the request's handler, before the generation thread.)
        assert stats["disk"]["read_ahead"] == 1 and stats["disk"]["read_ahead_bytes"] == 0
        assert stats["memory"]["entries"] >= 1  # read back into memory
        assert metric(server, "cache_tier_hits_total", tier="disk") == 1
        assert metric(server, "cache_lookups_total", result="disk") == 1
        assert metric(server, "cache_tier_bytes", tier="disk") == stats["disk"]["bytes"] > 0
        # The same turn again: memory now (this turn's own entry, longer).
        again, cached_again, _, _ = chat(server, messages)
        assert again == warm and cached_again >= cached
        assert server.get("/v1/cache/stats")[1]["hits_by_tier"] == {"memory": 1, "disk": 1}

    with ServerProcess(OURS, ["--model", model, "--prompt-cache-bytes", "0"],
                       log=tmp_path / "cold.log") as cold:
        cold_ids, cold_cached, cold_prompt, _ = chat(cold, messages)
    assert cold_cached == 0 and cold_prompt == prompt
    assert warm == cold_ids

    # Another model with the same folder: its own identity, no entries.
    other = ["--model", str(fixture_path("llama")), "--prompt-cache-dir", folder]
    with ServerProcess(OURS, other, log=tmp_path / "other.log") as server:
        _, cached, _, _ = chat(server, messages)
        stats = server.get("/v1/cache/stats")[1]
        assert cached == 0 and stats["hits_by_tier"]["disk"] == 0
        assert stats["disk"]["entries"] == 0
    assert len(os.listdir(folder)) == 2  # one folder per model identity


def test_sigkill_then_restart_serves(fixture_path, tmp_path):
    """Entries written before a SIGKILL are found after it; whatever the kill
    cut short is cleaned up at startup; the server serves."""
    model = str(fixture_path("qwen3"))
    folder = tmp_path / "prompt-cache"
    # One byte of memory: every entry goes to disk as soon as it is stored.
    args = ["--model", model, "--prompt-cache-dir", str(folder), "--prompt-cache-bytes", "1"]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": question(0)}]
    server = ServerProcess(OURS, args, log=tmp_path / "killed.log").start()
    try:
        text = chat(server, messages)[3]
        wait_for_writes(server, 1)
        messages += [{"role": "assistant", "content": text or "Berth 3."},
                     {"role": "user", "content": question(1)}]
        _, cached, _, _ = chat(server, messages)  # a disk hit, no restart
        assert cached > 0 and server.get("/v1/cache/stats")[1]["hits_by_tier"]["disk"] == 1
        os.killpg(server.proc.pid, signal.SIGKILL)  # its write may be in flight
        server.proc.wait()
    finally:
        server.stop()
    (identity,) = folder.iterdir()
    (identity / "stray.123.tmp").write_bytes(b"half a file")

    with ServerProcess(OURS, args, log=tmp_path / "restarted.log") as server:
        # /health answers before the generation thread has loaded the model
        # and opened its disk tier; the first request waits for both.
        _, cached, prompt, _ = chat(server, messages)
        # (Its own writes, which may be in flight, have other names.)
        assert not (identity / "stray.123.tmp").exists()
        assert cached > 0.9 * prompt  # from the first turn's entry at least
        assert server.get("/health")[0] == 200


def test_warm_restart_benchmark_quick(fixture_path, capsys):
    from benchmarks.warm_restart import main

    out = main(["--quick", "--model", str(fixture_path("qwen3")), "--restarts", "1"])
    assert out["cached share (restarted)"] > 0.9
    assert out["hits by tier"] == {"memory": 1, "disk": 1}
    assert out["computed tokens: disk hit, same turn"] == 1
    assert out["computed tokens: disk hit, same turn, 3rd restart"] == 1
    assert out["same output as cold (restarted, memory, 2nd restart)"] == [True] * 3
    assert out["same output as cold, every restart"]
    assert "TTFT cold s" in capsys.readouterr().out


def test_warm_restart_load_benchmark(capsys):
    """--load: DiskTier.load alone, in this process and in fresh ones."""
    from benchmarks.warm_restart import main

    out = main(["--load", "--tokens", "64", "--runs", "2"])
    assert out["entry MB"] > 0 and out["runs"] == 2
    for key in ("load ms, warm: median, min", "load ms, first in a fresh process: median, min"):
        median, least = out[key]
        assert 0 < least <= median
    assert "load ms, warm" in capsys.readouterr().out
