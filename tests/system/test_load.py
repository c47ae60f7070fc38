"""The load test, short form: 32 streaming clients on loopback, a quarter of
them hanging up at random (the long form is `python -m benchmarks.load`)."""

import asyncio

from benchmarks.load import disconnect_latencies_ms, run_load
from compat.launch import OURS, ServerProcess


def test_32_clients_with_random_disconnects(fixture_path, tmp_path):
    log = tmp_path / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))], log=log) as server:
        result = asyncio.run(run_load(server.url, clients=32, duration=8.0,
                                      disconnect_rate=0.25, pid=server.proc.pid))
        waits = disconnect_latencies_ms(server.log_tail(10**8))
    print(result, f"disconnect->removal ms: max {max(waits, default=0):.1f}")
    assert result["server_errors_5xx"] == 0 and result["error_count"] == 0, result["errors"]
    assert set(result["status_counts"]) == {200}
    assert result["completed"] >= 32 and result["disconnected"] > 0
    # Every request that was not hung up on is complete and equals its reply alone.
    assert result["mismatches"] == 0
    assert result["healthy_after"]
    # Each hang-up was seen by the engine and the request removed.
    assert len(waits) >= 1
    # With the cache cleared, MLX holds what it held before the load.
    assert result["mlx_active_bytes_after_clear"] <= result["mlx_active_bytes_before"] + (1 << 20)
    assert result["mlx_active_bytes_peak_during"] > result["mlx_active_bytes_before"]
    # The process's resident memory does not run away (allocator arenas stay).
    assert result["rss_bytes_after_clear"] < result["rss_bytes_before"] + (256 << 20)
