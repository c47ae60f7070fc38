"""Hosts on one Linux machine: network namespaces joined by a bridge, each
with its own address, and a server's ranks launched in them over the ring
backend (what `mlx.launch --backend ring --hostfile` does across real hosts,
without ssh: MLX_RANK and MLX_HOSTFILE set per rank).

Only traffic between these namespaces and the root namespace's end of the
bridge. Needs root and `ip`; `unavailable()` says why not.
"""

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from compat.launch import ServerProcess


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def unavailable() -> Optional[str]:
    """Why namespaces can't be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"mlxp{os.getpid() % 100000}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return "this kernel or container does not allow network namespaces"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """`n` namespaces on one bridge: host i at 10.X.K.(i+1), the root
    namespace at 10.X.K.254."""

    _made = itertools.count()  # (several at once in one test session)

    def __init__(self, n: int):
        tag, k = os.getpid() % 10000, next(Hosts._made) % 100
        self.prefix = f"mlx{tag}x{k}"  # (interface names: at most 15 characters)
        self.subnet = f"10.{20 + tag % 200}.{k}"
        self.names = [f"{self.prefix}n{i}" for i in range(n)]
        self.ips = [f"{self.subnet}.{i + 1}" for i in range(n)]
        self.bridge = f"{self.prefix}b"

    def veth(self, i: int) -> str:
        return f"{self.prefix}v{i}"  # (the root namespace's end)

    def __enter__(self):
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            # (Where br_netfilter is loaded, a DROP policy on FORWARD would
            # drop the bridged traffic between the hosts.)
            _ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0",
                check=False)
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (name, ip) in enumerate(zip(self.names, self.ips)):
                _ip("netns", "add", name)
                _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0",
                    "netns", name)
                _ip("link", "set", self.veth(i), "master", self.bridge)
                _ip("link", "set", self.veth(i), "up")
                _ip("-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for i, name in enumerate(self.names):
            # (A namespace outlives its deletion while a socket in it still
            # retransmits to a cut peer; its veth pair would stay with it.)
            _ip("link", "del", self.veth(i), check=False)
            _ip("netns", "del", name, check=False)
        _ip("link", "del", self.bridge, check=False)

    def cut(self, i: int):
        """Host i's link goes down: its packets stop, no peer sees a reset."""
        _ip("link", "set", self.veth(i), "down")


class RankServer(ServerProcess):
    """Our server with one rank per host (ring backend), rank 0's HTTP on
    its host's address; the usual ServerProcess client."""

    def __init__(self, hosts: Hosts, args: List[str], log_dir: Path, port: int = 8080,
                 ring_port: int = 45000, startup_timeout: float = 180,
                 rank_args: Optional[Dict[int, List[str]]] = None):
        self.hosts = hosts
        self.port = port
        self.url = f"http://{hosts.ips[0]}:{port}"
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / "rank0.log"
        self.startup_timeout = startup_timeout
        self.hostfile = self.log_dir / "hostfile.json"
        self.hostfile.write_text(json.dumps([[f"{ip}:{ring_port}"] for ip in hosts.ips]))
        self.args = list(args)
        self.rank_args = rank_args or {}  # rank -> arguments it alone gets, after `args`
        self.procs: List[subprocess.Popen] = []
        self.logs = []
        self.proc = None

    def start(self):
        for rank, (name, ip) in enumerate(zip(self.hosts.names, self.hosts.ips)):
            log = open(self.log_dir / f"rank{rank}.log", "ab")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", name, "env", f"MLX_RANK={rank}",
                 f"MLX_HOSTFILE={self.hostfile}", sys.executable, "-m", "mlx_lm_plus.server",
                 *self.args, *self.rank_args.get(rank, []), "--host", ip,
                 "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self.proc = self.procs[0]
        return self.wait_healthy()

    def exited(self) -> Optional[str]:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                return f"rank {rank} exited with {proc.returncode}:\n" + self.log(rank)[-3000:]
        return None

    def not_healthy(self) -> str:
        return "the ranks did not become healthy:\n" + self.log(0)[-3000:]

    def log(self, rank: int) -> str:
        return (self.log_dir / f"rank{rank}.log").read_text(errors="replace")

    def kill(self, rank: int):
        os.killpg(self.procs[rank].pid, signal.SIGKILL)

    def wait_all(self, timeout: float) -> List[Optional[int]]:
        """Each rank's exit status (None: still running at the deadline)."""
        deadline = time.time() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        return [proc.poll() for proc in self.procs]

    def stop(self, timeout=20):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for log in self.logs:
            log.close()
