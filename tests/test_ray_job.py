"""The README's main command: `ray job submit ... launch/serve_ep.py` against a local cluster.

On the session's private head node (tests/ray_head.py: own temp dir and ports, never `ray stop`),
submits the server as a Ray job with two expert-parallel ranks, waits for /health 200, checks one
completion against the in-process runtime bit for bit, stops the job and checks it drained and
stopped cleanly.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG
from tests.ray_head import ray_cli

pytest.importorskip("ray")


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


def test_ray_job_submit_serves_and_stops(ray_head):
    env, address = ray_head.env, ray_head.dashboard_url
    submitted = ray_cli(
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
        "--port",  # its own free port, read from its log: a port picked here and bound by
        "0",  # the job seconds later could be taken meanwhile (Ray's own listeners pick theirs)
        "--set",
        "parallel.world_size=2",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", submitted.stdout + submitted.stderr).group(0)
    url, deadline = None, time.monotonic() + 180
    while url is None or _get_json(f"{url}/health")[0] != 200:
        logs = ray_cli(env, "job", "logs", "--address", address, job_id).stdout
        assert time.monotonic() < deadline, f"server never became healthy:\n{logs[-3000:]}"
        if (ready := re.search(r"ready on (http://\S+)", logs)) is not None:
            url = ready.group(1)
        time.sleep(1)

    prompt = [72, 101, 108, 108, 111]
    status, body = _get_json(
        f"{url}/v1/completions",
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

    stopped = ray_cli(env, "job", "stop", "--address", address, job_id)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    logs = ray_cli(env, "job", "logs", "--address", address, job_id).stdout
    assert "draining" in logs and "serve_ep: stopped" in logs, logs[-3000:]
