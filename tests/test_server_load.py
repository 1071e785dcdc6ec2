"""A quick version of bench/serve_load.py: good and bad requests mixed under concurrency.

Every good request (completions, streamed completions, chat) must be answered in full, every
bad one must be a 400, and the server must stay healthy.
"""

from __future__ import annotations

import asyncio

from bench.serve_load import make_requests, run_load
from tests.serving import running_server


def test_mixed_load_loses_nothing():
    requests = make_requests(120, bad_fraction=0.3, max_tokens=8, seed=1)
    with running_server() as server:
        report = asyncio.run(run_load(server.url, requests, concurrency=32))
        assert server.http.get("/health").status_code == 200
    assert report["num_answered"] == len(requests)
    assert report["num_failures"] == 0, report["failures"]
    assert report["num_bad"] > 20 and report["num_good"] > 60
