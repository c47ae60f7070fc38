"""The soak, short form: 45 s of streaming and non-streamed clients hanging up
at random, bad inputs mixed in, a prompt cache small enough to evict all the
time (the long form is `python -m benchmarks.soak --minutes 30`). The server
serves an embedder and a reranker beside the chat model (testkit/bad_input.py's
EMBEDDING_SERVED): their requests and bad inputs are part of the traffic.

RSS growth is printed, not asserted: 45 s is warm-up, not a soak."""

import asyncio

from benchmarks.soak import report, run_soak
from compat.launch import OURS, ServerProcess
from testkit.bad_input import models_config_file


def test_short_soak(fixture_path, tmp_path):
    log = tmp_path / "server.log"
    config = models_config_file(fixture_path, tmp_path)
    args = ["--models-config", str(config), "--prompt-cache-bytes", str(1 << 20)]
    with ServerProcess(OURS, args, log=log) as server:
        result = asyncio.run(run_soak(server.url, server.proc.pid, minutes=0.75, interval=10,
                                      clients=8, warmup_intervals=1, flood_every=12))
    print(report(result))
    print("(the RSS check above is not asserted here: 45 s is mostly warm-up)")
    assert result["mismatches"] == 0, result["examples"]["mismatch"]
    assert result["unanswered"] == 0, result["examples"]["unanswered"]
    assert result["failed"] == 0, result["examples"]["failed"]
    assert result["bad_sent"] > 0 and result["bad_4xx"] == result["bad_sent"], \
        result["examples"]["bad_other"]
    assert result["flood_sent"] > 0 and result["flood_other"] == 0, \
        result["examples"]["flood_other"]
    assert result["completed"] > 0 and result["disconnected"] > 0
    assert result["embedders"] and result["embeddings"] > 0
    assert result["evictions"] > 0
    assert result["healthy_after"]
    assert len(result["samples"]) >= 4
