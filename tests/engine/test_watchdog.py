"""A generation step that hangs without raising: /health turns 503 with the
reason, every waiting request is answered, and the process exits non-zero
for a supervisor to restart it (found in review: nobody noticed)."""

import json
import sys
import threading
import time

from compat.launch import ServerProcess, parse_sse
from mlx_lm_plus.engine.watchdog import HANG_EXIT_STATUS


def chat(text, **kw):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 3, **kw}


def hanging_server(fixture_path, tmp_path, grace=3):
    """tests/engine/hanging_server.py on the qwen3 fixture, --step-timeout 1.5."""
    command = [sys.executable, "-m", "tests.engine.hanging_server"]
    argv = ["--model", str(fixture_path("qwen3")), "--step-timeout", "1.5",
            "--watchdog-grace", str(grace)]
    return ServerProcess(command, argv, log=tmp_path / "server.log")


def test_stuck_step_answers_everyone_and_exits(fixture_path, tmp_path):
    with hanging_server(fixture_path, tmp_path) as server:
        assert server.post("/v1/chat/completions", chat("fine"))[0] == 200
        answers = {}

        def ask(name, body):
            answers[name] = server.request("POST", "/v1/chat/completions", body, timeout=60)

        # A stream decoding in the batch when the step hangs, then the
        # request that makes it hang.
        threads = [threading.Thread(target=ask, args=args) for args in [
            ("streamed", chat("stream me", stream=True, max_tokens=5000)),
            ("stuck", chat("HANG now")),
        ]]
        started = time.monotonic()
        for t in threads:
            t.start()
            time.sleep(1.0)
        for t in threads:
            t.join(60)
        answered = time.monotonic() - started

        status, _, body = answers["stuck"]
        assert status == 503 and "generation stuck" in json.loads(body)["error"]
        status, _, body = answers["streamed"]
        events = parse_sse(body)
        assert status == 200 and any("generation stuck" in str(e) for e in events), events
        status, health = server.get("/health")
        assert status == 503 and "a batch step" in health["reason"], health
        # New requests get a fast 503 until the process goes.
        assert server.post("/v1/chat/completions", chat("later"))[0] == 503

        assert server.proc.wait(timeout=30) == HANG_EXIT_STATUS
        print(f"answered {answered:.1f} s after the hang began; exited "
              f"{HANG_EXIT_STATUS} after the grace period")
        assert "Watchdog" in server.log_tail()


def test_stuck_admission_answers_the_request_being_admitted(fixture_path, tmp_path):
    """The request the generation thread is admitting (planning, image
    prefill) is held nowhere else: the watchdog must still answer it."""
    with hanging_server(fixture_path, tmp_path) as server:
        status, _, body = server.request("POST", "/v1/chat/completions",
                                         chat("HANG_ADMIT please"), timeout=60)
        assert status == 503 and "admitting a request" in json.loads(body)["error"]
        assert server.proc.wait(timeout=30) == HANG_EXIT_STATUS


def test_stuck_planning_fails_its_own_request_only(fixture_path, tmp_path):
    """Prompts are planned in lanes before they reach the engine: a plan
    that never ends fails its own request with a 503 once --planning-timeout
    is over, the request behind it in the same lane is served (a spare
    thread takes it), and the process goes on serving (it exited before:
    the watchdog took a slow plan for a stuck engine)."""
    hang_plan = [sys.executable, "-m", "tests.engine.hanging_server"]
    argv = ["--model", str(fixture_path("qwen3")), "--step-timeout", "1.5",
            "--planning-timeout", "3"]
    with ServerProcess(hang_plan, argv, log=tmp_path / "server.log") as server:
        assert server.post("/v1/chat/completions", chat("fine"))[0] == 200
        results = {}

        def send(name, text):
            results[name] = server.request("POST", "/v1/chat/completions", chat(text),
                                           timeout=60)

        stuck = threading.Thread(target=send, args=("stuck", "HANG_PLAN please"))
        stuck.start()
        time.sleep(0.3)
        started = time.monotonic()
        send("behind", "behind it")
        behind = time.monotonic() - started
        stuck.join(timeout=30)
        assert results["behind"][0] == 200, results["behind"]
        assert behind < 3, behind  # (not its own deadline: the spare thread served it)
        status, headers, body = results["stuck"]
        assert status == 503 and "--planning-timeout" in json.loads(body)["error"]
        assert headers.get("Retry-After")
        assert server.request("GET", "/health")[0] == 200
        assert server.post("/v1/chat/completions", chat("later"))[0] == 200
        assert server.proc.poll() is None
