"""The real coding agents against the server: Claude Code, Codex CLI (with
its defaults) and opencode, from npm, headless, three turns each and a
second session, on the agent fixture (testkit/fixtures.py: the demo model's
49k tokenizer, answers "Hello." and ends).

Each client is the version pinned here: found on PATH, else installed with
npm into the fixtures' folder; without npm or the registry the test skips
and says why. As root with `ip` (iproute2), each client runs in a network
namespace of its own whose only link is a veth pair to the server's
address: nothing else is reachable from it. Otherwise it runs on loopback
with its telemetry and update checks off.

What is asserted, from the server's request log: every request is a 200;
each turn answers "Hello."; each request of a session after its first
reuses at least 95% of its prompt; the first request of a second session
in the same project reuses the part of the prompt the sessions share (the
system prompt and tools before the first user message, at least a third of
it) and says where it departs (cache_miss)."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from compat.launch import OURS, ServerProcess
from testkit.fixtures import build_agent_fixture

# client: (npm package, version, command)
CLIENTS = {
    "claude": ("@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": ("@openai/codex", "0.171.0", "codex"),
    "opencode": ("opencode-ai", "1.18.33", "opencode"),
}
TURNS = ["Say hello.", "Again.", "Once more."]


def _version_of(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def client_binary(name: str, cache: Path) -> str:
    """The pinned client's executable, installed with npm when not on PATH."""
    package, version, command = CLIENTS[name]
    found = shutil.which(command)
    if found and version in _version_of(found):
        return found
    prefix = cache / "npm" / f"{name}-{version}"
    binary = prefix / "node_modules" / ".bin" / command
    if binary.exists() and version in _version_of(str(binary)):
        return str(binary)
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"{package}@{version} is not installed and npm is not available")
    prefix.mkdir(parents=True, exist_ok=True)
    try:
        out = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                              f"{package}@{version}"], capture_output=True, text=True,
                             timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {package}@{version} took more than 15 minutes")
    if out.returncode != 0 or not binary.exists():
        pytest.skip(f"npm install {package}@{version} failed (is the registry reachable?): "
                    f"{out.stderr.strip()[-300:]}")
    return str(binary)


class Isolation:
    """A network namespace whose only link is a veth pair to `host` (None:
    loopback, where namespaces are not available)."""

    def __init__(self):
        self.name = f"mlxp-{uuid.uuid4().hex[:6]}"
        # (A /30 of its own: runs side by side don't share a route.)
        subnet = int(self.name[5:], 16) % (1 << 14) * 4
        base = f"10.{200 + subnet // 65536}.{subnet // 256 % 256}"
        self.host, self.peer = f"{base}.{subnet % 256 + 1}", f"{base}.{subnet % 256 + 2}"
        self.up = False

    def __enter__(self):
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return self
        host_link, peer_link = f"h{self.name[5:]}", f"c{self.name[5:]}"
        steps = [
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", host_link, "type", "veth", "peer", "name", peer_link],
            ["ip", "link", "set", peer_link, "netns", self.name],
            ["ip", "addr", "add", f"{self.host}/30", "dev", host_link],
            ["ip", "link", "set", host_link, "up"],
            ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.peer}/30",
             "dev", peer_link],
            ["ip", "netns", "exec", self.name, "ip", "link", "set", peer_link, "up"],
            ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"],
        ]
        self._host_link = host_link
        for step in steps:
            if subprocess.run(step, capture_output=True).returncode != 0:
                self.__exit__()
                return self
        self.up = True
        return self

    def __exit__(self, *exc):
        subprocess.run(["ip", "link", "del", getattr(self, "_host_link", "none")],
                       capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    @property
    def server_host(self) -> str:
        return self.host if self.up else "127.0.0.1"

    def run(self, command, **kw):
        prefix = ["ip", "netns", "exec", self.name] if self.up else []
        return subprocess.run(prefix + command, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def agent_server(fixture_dir, tmp_path_factory):
    """The agent fixture served as "local" (the name the clients are given)."""
    model = build_agent_fixture(fixture_dir)
    work = tmp_path_factory.mktemp("agents")
    config = work / "models.json"
    config.write_text(json.dumps({"models": [{"name": "local", "path": str(model)}]}))
    log = work / "server.log"
    with Isolation() as isolation:
        with ServerProcess(OURS, ["--models-config", str(config)], log=log,
                           host=isolation.server_host) as server:
            server.log, server.isolation = log, isolation
            yield server


def _records(log: Path):
    return [json.loads(line.partition(" - INFO - Request ")[2])
            for line in log.read_text().splitlines() if " - INFO - Request {" in line]


def _session_commands(name: str, url: str, prompt: str, first: bool):
    if name == "claude":
        return ["-p", prompt, "--output-format", "json", "--max-turns", "2"] + (
            [] if first else ["--continue"])
    if name == "codex":
        provider = ['-c', 'model_provider="local"', "-c", 'model_providers.local.name="local"',
                    "-c", f'model_providers.local.base_url="{url}/v1"',
                    "-c", 'model_providers.local.wire_api="responses"',
                    "-c", 'model_providers.local.env_key="OPENAI_API_KEY"',
                    "-c", 'model="local"']
        return ["exec", "--skip-git-repo-check", *provider] + (
            [prompt] if first else ["resume", "--last", prompt])
    return ["run", prompt] + ([] if first else ["--continue"])


def _environment(name: str, home: Path, url: str) -> dict:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
           "DISABLE_TELEMETRY": "1", "NO_UPDATE_NOTIFIER": "1"}
    if name == "claude":
        env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="sk-test",
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", ANTHROPIC_MODEL="local",
                   ANTHROPIC_DEFAULT_HAIKU_MODEL="local")
    elif name == "codex":
        env.update(OPENAI_API_KEY="sk-test")
    else:
        env.update(OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1",
                   OPENCODE_DISABLE_LSP_DOWNLOAD="1")
    return env


def _project(name: str, root: Path, url: str) -> Path:
    project = root / "project"
    project.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    if name == "opencode":
        (project / "opencode.json").write_text(json.dumps({
            "provider": {"local": {"npm": "@ai-sdk/openai-compatible", "name": "mlx_lm_plus",
                                   "options": {"baseURL": f"{url}/v1", "apiKey": "sk-test"},
                                   "models": {"local": {"name": "local"}}}},
            "model": "local/local", "autoupdate": False, "share": "disabled"}))
    return project


@pytest.mark.parametrize("name", list(CLIENTS))
def test_a_client_for_three_turns_and_a_second_session(name, agent_server, fixture_dir,
                                                       tmp_path):
    binary = client_binary(name, Path(fixture_dir))
    url = agent_server.url
    home = tmp_path / "home"
    home.mkdir()
    project = _project(name, tmp_path, url)
    env = _environment(name, home, url)
    seen = len(_records(agent_server.log))
    sessions = []
    for session in ([(t, i == 0) for i, t in enumerate(TURNS)], [("A new session.", True)]):
        start = len(_records(agent_server.log))
        for prompt, first in session:
            out = agent_server.isolation.run(
                [binary, *_session_commands(name, url, prompt, first)], cwd=project, env=env,
                timeout=600)
            assert out.returncode == 0, (name, prompt, out.stdout[-2000:], out.stderr[-2000:])
            assert "Hello." in out.stdout, (name, prompt, out.stdout[-2000:])
        sessions.append(_records(agent_server.log)[start:])
    records = _records(agent_server.log)[seen:]
    assert records and all(r["status"] == 200 for r in records), [
        (r["endpoint"], r["status"], r["error"]) for r in records]
    # The turns' requests: the long prompts (clients also ask for titles).
    longest = max(r["prompt_tokens"] for r in sessions[0])
    main = [r for r in sessions[0] if r["prompt_tokens"] > 0.5 * longest]
    assert len(main) == len(TURNS), [(r["prompt_tokens"], r["cached_tokens"]) for r in main]
    for r in main[1:]:
        assert r["cached_tokens"] >= 0.95 * r["prompt_tokens"], (name, r)
    (again,) = [r for r in sessions[1] if r["prompt_tokens"] > 0.5 * main[0]["prompt_tokens"]]
    assert again["cached_tokens"] >= main[0]["prompt_tokens"] / 3, (name, again)
    for r in records:
        if r["cache_miss"] is None:
            continue
        assert r["cache_miss"]["position"] >= r["cached_tokens"]
    assert again["cache_miss"] and again["cache_miss"]["position"] == again["cached_tokens"]
