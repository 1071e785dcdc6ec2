"""The README's main command: `ray job submit ... launch/serve_ep.py` against a local cluster.

Starts a private head node, submits the server as a Ray job with two expert-parallel ranks,
waits for /health 200, checks one completion against the in-process runtime bit for bit, stops
the job and checks it drained and stopped cleanly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _get_json(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return 0, {}


@pytest.fixture
def ray_head():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard_port = _free_port(), _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths are capped
    started = _ray(
        env,
        "start",
        "--head",
        "--num-cpus",
        "4",
        "--port",
        str(gcs_port),
        "--dashboard-port",
        str(dashboard_port),
        "--include-dashboard",
        "true",
        "--temp-dir",
        temp_dir,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    yield env, f"http://127.0.0.1:{dashboard_port}"
    _ray(env, "stop", "--force")
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_serves_and_stops(ray_head):
    env, address = ray_head
    port = _free_port()
    submitted = _ray(
        env,
        "job",
        "submit",
        "--address",
        address,
        "--no-wait",
        "--working-dir",
        ".",
        "--",
        "python",
        "launch/serve_ep.py",
        "--config",
        "launch/configs/tiny_cpu.yaml",
        "--port",
        str(port),
        "--set",
        "parallel.world_size=2",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", submitted.stdout + submitted.stderr).group(0)
    deadline = time.monotonic() + 180
    while _get_json(f"http://127.0.0.1:{port}/health")[0] != 200:
        logs = _ray(env, "job", "logs", "--address", address, job_id).stdout
        assert time.monotonic() < deadline, f"server never became healthy:\n{logs[-3000:]}"
        time.sleep(1)

    prompt = [72, 101, 108, 108, 111]
    status, body = _get_json(
        f"http://127.0.0.1:{port}/v1/completions",
        {
            "model": "moe-runtime",
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0.0,
            "logprobs": 3,
        },
    )
    assert status == 200
    choice = body["choices"][0]
    expected = LLM(TINY_CONFIG).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert choice["token_ids"] == expected.token_ids
    assert [float.hex(x) for x in choice["logprobs"]["token_logprobs"]] == [
        float.hex(x) for x in expected.logprobs
    ]

    stopped = _ray(env, "job", "stop", "--address", address, job_id)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    logs = _ray(env, "job", "logs", "--address", address, job_id).stdout
    assert "draining" in logs and "serve_ep: stopped" in logs, logs[-3000:]
