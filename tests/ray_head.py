"""A private Ray head node for tests: its own temp dir and ports, stopped without `ray stop`.

`ray stop` ends every Ray process on the machine (a user's cluster included) and Ray's default
ports and /tmp/ray belong to the user's cluster, so a test head gets a short temp dir of its own,
a free port for every listener, and is started in a new session. Stopping it signals only that
session's process group, then kills any process still running inside its temp dir (a job's
driver runs in a session of its own, with its working dir there). Linux only (/proc).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RayHead:
    temp_dir: Path
    pgid: int  # the `ray start` CLI's session: every process it started
    gcs_address: str  # for ray.init(address=...)
    dashboard_url: str  # for `ray job submit --address`
    env: dict[str, str]  # for Ray CLI calls against this head


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """count distinct free ports. Every socket stays bound until all are picked: a port closed
    before the next pick can be handed out again (a CI run once gave the dashboard and the
    object manager the same port, and `ray start` refused)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def ray_env() -> dict[str, str]:
    """The caller's environment with no Ray address: a CLI call names its cluster itself."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


def ray_cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parent.parent,
    )


def start_ray_head(num_cpus: int, num_gpus: int = 0, use_default_ports: bool = False) -> RayHead:
    """`ray start --head` in a new session; use_default_ports stands in for a user's cluster."""
    env = ray_env()
    temp_dir = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: socket paths are capped
    listeners = (
        "--dashboard-port",
        "--port",
        "--ray-client-server-port",
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
    )
    picked = [] if use_default_ports else free_ports(len(listeners))
    ports = dict(zip(listeners, picked, strict=False))  # empty with the default ports
    dashboard_port = ports.get("--dashboard-port", 8265)
    args = ["--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus), "--temp-dir", str(temp_dir)]
    args += ["--include-dashboard", "true", "--disable-usage-stats"]
    if not use_default_ports:
        ports |= {"--min-worker-port": 0, "--max-worker-port": 0}  # each worker: an OS-picked port
        args += [str(x) for item in ports.items() for x in item]
    started = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    head = RayHead(temp_dir, started.pid, "", f"http://127.0.0.1:{dashboard_port}", env)
    try:
        output, _ = started.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        stop_ray_head(head)
        raise
    address_file = temp_dir / "ray_current_cluster"
    if started.returncode != 0 or not address_file.exists():
        stop_ray_head(head)
        raise RuntimeError(f"ray start --head failed:\n{output}")
    return RayHead(temp_dir, head.pgid, address_file.read_text().strip(), head.dashboard_url, env)


def stop_ray_head(head: RayHead, grace_s: float = 2.0) -> None:
    """SIGTERM the head's process group, SIGKILL what is left (gcs_server lingers on SIGTERM),
    then any straggler inside its temp dir."""
    _signal_all(_group_pids(head.pgid), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_pids(head.pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_all(_group_pids(head.pgid) | _pids_inside(head.temp_dir), signal.SIGKILL)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def head_pids(head: RayHead) -> set[int]:
    """Live processes of the head: its process group and anything running inside its temp dir."""
    return _group_pids(head.pgid) | _pids_inside(head.temp_dir)


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _group_pids(pgid: int) -> set[int]:
    """Live (not zombie) processes whose process group is pgid."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.add(int(stat.parent.name))
    return pids


def _pids_inside(temp_dir: Path) -> set[int]:
    """Processes whose command line names temp_dir or whose working dir lies under it."""
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if str(temp_dir) in cmdline or cwd.startswith(f"{temp_dir}/"):
            pids.add(int(proc.name))
    pids.discard(os.getpid())
    return pids
