"""Start a server (ours, upstream's, or any command) on a free loopback port.

Shared by the tests, the compat suite and the benchmarks.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

OURS = [sys.executable, "-m", "mlx_lm_plus.server"]
UPSTREAM = [sys.executable, "-m", "mlx_lm.server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess; `with ServerProcess(OURS, ["--model", p]) as s: s.url`."""

    def __init__(self, command: List[str], args: List[str], *, log: Optional[Path] = None,
                 env: Optional[dict] = None, port: Optional[int] = None,
                 startup_timeout: float = 300, cwd: Optional[Path] = None,
                 host: str = "127.0.0.1"):
        self.port = port or free_port()
        self.command = list(command) + list(args) + ["--host", host, "--port", str(self.port)]
        self.url = f"http://{host}:{self.port}"
        self.log_path = log
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        # (`python -m` imports from its working folder first, PYTHONPATH after.)
        self.cwd = cwd
        self.proc = None

    def start(self):
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True, cwd=self.cwd,
        )
        return self.wait_healthy()

    def wait_healthy(self):
        """Poll /health until it answers 200. A process that exits
        (`exited`) or the deadline stops the server and raises."""
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            exited = self.exited()
            if exited:
                self.stop()
                raise RuntimeError(exited)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(self.not_healthy())

    def exited(self) -> Optional[str]:
        """Why the server can't come up now (its process exited), or None."""
        if self.proc.poll() is None:
            return None
        return (f"server exited with {self.proc.returncode}: {' '.join(self.command)}"
                + (f"\n{self.log_tail()}" if self.log_path else ""))

    def not_healthy(self) -> str:
        return f"server did not become healthy: {' '.join(self.command)}"

    def log_tail(self, n=4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except Exception:
            return ""

    def stop(self, timeout=20):
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- a tiny synchronous client --

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes = None,
                timeout: float = 300):
        """(status, headers, body bytes)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def post(self, path: str, body, **kw):
        status, headers, data = self.request("POST", path, body, **kw)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def get(self, path: str, **kw):
        status, headers, data = self.request("GET", path, **kw)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data


def parse_sse(data: bytes):
    """The events of an SSE body: ("comment", text) / ("data", obj or "[DONE]")."""
    events = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        for line in block.split("\n"):
            if line.startswith(":"):
                events.append(("comment", line[1:].strip()))
            elif line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(("data", payload if payload == "[DONE]" else json.loads(payload)))
    return events
