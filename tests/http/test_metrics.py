"""/metrics, /v1/stats and the per-request log line, after a scripted sequence
of requests (cold, cache hit, disconnect, bad input) on a fresh server."""

import http.client
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from compat.launch import OURS, ServerProcess

MESSAGES = [{"role": "system", "content": "You answer in short sentences about ships."},
            {"role": "user", "content": "Which harbour is the busiest one in the north?"}]


@pytest.fixture(scope="module")
def server(fixture_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("metrics") / "server.log"
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))], log=log) as s:
        yield s


def scrape(server):
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((f"mlx_lm_plus_{name}", tuple(sorted(labels.items()))), 0.0)


def stream_then_hang_up(server, body, chunks):
    """Stream a completion, read `chunks` content chunks, close the connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    seen = 0
    while seen < chunks:
        line = response.fp.readline().decode()
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
            seen += 1
    conn.sock.close()
    conn.close()


def test_counters_and_histograms_after_a_scripted_sequence(server):
    before = scrape(server)
    assert value(before, "requests_total", endpoint="/v1/chat/completions", status="200") == 0

    # 1. A cold streamed request whose client hangs up after 3 tokens.
    stream_then_hang_up(server, {"messages": MESSAGES, "max_tokens": 100000, "stream": True}, 3)
    deadline = time.time() + 20
    while value(scrape(server), "disconnect_removal_seconds_count") < 1:
        assert time.time() < deadline, "the disconnect was not seen"
        time.sleep(0.05)
    # 2. The same prompt, answered in full: a cache hit.
    status, first = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8})
    assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # 3. Again.
    status, second = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8})
    assert status == 200
    # 4. Bad input.
    status, _ = server.post("/v1/chat/completions", {"messages": MESSAGES, "stop": 5})
    assert status == 400
    # 5. A text completion (nothing in common with the chat prompts: a miss).
    status, text = server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6})
    assert status == 200

    m = scrape(server)
    chat, completions = "/v1/chat/completions", "/v1/completions"
    assert value(m, "requests_total", endpoint=chat, status="200") == 2
    assert value(m, "requests_total", endpoint=chat, status="499") == 1
    assert value(m, "requests_total", endpoint=chat, status="400") == 1
    assert value(m, "requests_total", endpoint=completions, status="200") == 1
    assert value(m, "disconnects_total") == 1
    assert value(m, "finish_reasons_total", reason="cancelled") == 1
    assert value(m, "finish_reasons_total", reason="error") == 1
    served = [first, second, text]
    finishes = [r["choices"][0]["finish_reason"] for r in served]
    for reason in set(finishes):
        assert value(m, "finish_reasons_total", reason=reason) == finishes.count(reason)

    usage = [r["usage"] for r in served]
    prompt = first["usage"]["prompt_tokens"]  # the disconnected request had the same prompt
    assert value(m, "prompt_tokens_total") == prompt + sum(u["prompt_tokens"] for u in usage)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)  # + 0: it was cold
    assert value(m, "prompt_tokens_cached_total") == cached
    assert value(m, "prompt_tokens_computed_total") == (
        value(m, "prompt_tokens_total") - cached)
    generated = value(m, "generation_tokens_total") - sum(u["completion_tokens"] for u in usage)
    assert 3 <= generated < 100000  # what the hung-up request generated before it left

    # Histograms: one observation per request that got that far.
    assert value(m, "time_to_first_token_seconds_count") == 4
    assert value(m, "request_duration_seconds_count") == 5
    assert value(m, "prefill_tokens_per_second_count") == 4
    assert value(m, "decode_tokens_per_second_count") == 4
    assert value(m, "cache_match_ratio_count") == 4
    assert value(m, "cache_match_tokens_sum") == cached
    assert value(m, "disconnect_removal_seconds_count") == 1
    assert value(m, "time_to_first_token_seconds_bucket", le="+Inf") == 4

    # The cache's own figures, read at scrape time.
    lookups = {r: value(m, "cache_lookups_total", result=r)
               for r in ("exact", "prefix", "checkpoint", "trimmed", "miss")}
    assert sum(lookups.values()) == 4 and lookups["miss"] == 2, lookups
    status, cache = server.get("/v1/cache/stats")
    assert value(m, "cache_bytes") == cache["bytes"] > 0
    assert value(m, "cache_entries") == cache["entries"]
    assert value(m, "engine_healthy") == 1 and value(m, "engine_restarts_total") == 0
    assert value(m, "requests_in_flight") == 0
    assert value(m, "http_connections") >= 1  # (the scrape's own)
    assert value(m, "http_connections_closed_for_room_total") == 0
    assert value(m, "mlx_memory_bytes", kind="active") > 0

    # /v1/stats: the same totals as JSON, the requests, a time series.
    time.sleep(1.2)
    status, stats = server.get("/v1/stats")
    assert status == 200
    assert stats["totals"]["requests"] == 5 and stats["totals"]["disconnects"] == 1
    assert stats["totals"]["cached_tokens"] == cached
    records = stats["requests"]
    assert [r["status"] for r in records] == [499, 200, 200, 400, 200]
    assert records[1]["id"] == first["id"] and records[1]["cached_tokens"] == cached_of(first)
    assert records[0]["finish_reason"] == "cancelled" and records[0]["cached_tokens"] == 0
    assert all(r["ttft"] > 0 for r in records if r["status"] == 200)
    assert stats["series"] and {"in_flight", "cache_bytes", "generated_tokens"} <= set(stats["series"][-1])
    # (An entry whose KV lies wholly inside a longer one's owns no bytes:
    # the hung-up request's, when the greedy tokens it wrote before it left
    # are a prefix of the next request's entry. How far it got is timing.)
    assert stats["entries"] and all(e["tokens"] > 0 and e["bytes"] >= 0
                                    for e in stats["entries"])
    assert any(e["bytes"] > 0 for e in stats["entries"])
    status, newer = server.get(f"/v1/stats?since={records[-1]['ended']}")
    assert newer["requests"] == []

    # One structured log line per request.
    lines = [json.loads(line.split("Request ", 1)[1])
             for line in server.log_tail(10**7).splitlines() if " - Request {" in line]
    assert [line["status"] for line in lines] == [499, 200, 200, 400, 200]
    assert lines[2]["id"] == second["id"]
    assert lines[2]["generated_tokens"] == second["usage"]["completion_tokens"]


def cached_of(response):
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_metrics_can_be_turned_off(fixture_path, tmp_path):
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3")), "--disable-metrics"],
                       log=tmp_path / "log") as s:
        assert s.request("GET", "/metrics")[0] == 404
        status, stats = s.get("/v1/stats")
        assert status == 200 and "requests" not in stats and stats["engine"]["healthy"]


def test_api_key_guards_metrics_and_stats_not_the_dashboard_page(fixture_path, tmp_path):
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3")), "--api-key", "k"],
                       log=tmp_path / "log") as s:
        assert s.request("GET", "/metrics")[0] == 401
        assert s.request("GET", "/v1/stats")[0] == 401
        auth = {"Authorization": "Bearer k"}
        assert s.request("GET", "/metrics", headers=auth)[0] == 200
        assert s.request("GET", "/v1/stats", headers=auth)[0] == 200
        status, headers, page = s.request("GET", "/dashboard")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b"/v1/stats" in page and b"<script src=" not in page  # self-contained
