"""API key, Prometheus metrics and the admin routes (rebalance, weight updates) over HTTP.

The server loads a tiny DeepSeek-V3 checkpoint written with transformers, so a weight update
to a copy of itself must leave every bit unchanged and one to other weights must not.
`serve_ep.py` runs once as a subprocess for the rebalance's log line.
"""

from __future__ import annotations

import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import ServeEp, running_server, sse_events, write_checkpoint

pytest.importorskip("transformers")

KEY = "s3cret"
# One rank: balancedness is always 1.0, at or above any threshold, so `force: false` skips.
THRESHOLD = 0.5
AUTH = {"authorization": f"Bearer {KEY}"}
BODY = {
    "prompt": [3, 1, 4, 1, 5, 9, 2, 6],
    "max_tokens": 8,
    "temperature": 0.8,
    "seed": 4,
    "logprobs": 2,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return (
        write_checkpoint(tmp_path_factory.mktemp("a"), seed=1),
        write_checkpoint(tmp_path_factory.mktemp("b"), seed=2),
    )


@pytest.fixture(scope="module")
def server(checkpoints):
    config = {
        "model": {"path": checkpoints[0]},
        "scheduler": {"max_model_len": 256},
        "server": {"api_key": KEY},
        # Extra copies: at world size 1 a plan moves only which experts they copy (the one
        # rank holds every expert, in the slots it held them in: keep_held_slots).
        "eplb": {"balancedness_threshold": THRESHOLD, "num_redundant_experts": 4},
    }
    with running_server(headers=AUTH, config=config) as running:
        yield running


def bits(response: httpx.Response) -> tuple:
    choice = response.json()["choices"][0]
    return tuple(choice["token_ids"]), tuple(map(float.hex, choice["logprobs"]["token_logprobs"]))


def metrics(server) -> dict[str, float]:
    """{sample name with labels: value} from /metrics, fetched without the API key."""
    text = httpx.get(f"{server.url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/admin/rebalance"),
        ("POST", "/admin/update_weights"),
    ],
)
def test_api_key_guards_every_route_but_health_and_metrics(server, method, path):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        response = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
        assert response.status_code == 401, (headers, response.text)
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not(server):
    """RFC 7235: an auth scheme is case-insensitive; clients do send `bearer`."""
    for scheme in ("bearer", "BEARER", "Bearer"):
        headers = {"authorization": f"{scheme} {KEY}"}
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert response.status_code == 200, (scheme, response.text)
    for value in (f"Bearer {KEY.upper()}", f"Basic {KEY}", f"Bearer{KEY}", f"bearer {KEY} x"):
        response = httpx.get(f"{server.url}/v1/models", headers={"authorization": value})
        assert response.status_code == 401, value


def test_401s_are_counted_under_their_route(server):
    """A 401 is answered before routing; it is still counted under the route its path names,
    `unmatched` only for a path no route serves."""
    before = metrics(server)
    requests = [
        ("POST", "/v1/completions"),
        ("POST", "/v1/completions"),
        ("GET", f"/v1/models/{server.model}"),
        ("GET", "/v1/completions"),  # the route, not its method
        ("GET", "/no/such/path"),
    ]
    for method, path in requests:
        assert httpx.request(method, f"{server.url}{path}", json={}).status_code == 401
    after = metrics(server)

    def grew(route: str) -> float:
        name = f"moe_http_requests_total{{route={route},status=401}}"
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("/v1/completions") == 3
    assert grew("/v1/models/{model:path}") == 1
    assert grew("unmatched") == 1


def test_metrics_count_tokens_latencies_and_engine_state(server):
    before = metrics(server)
    assert server.http.post("/v1/completions", json=BODY).status_code == 200
    sse_events(server.http, "/v1/completions", {**BODY, "n": 2})
    assert server.http.post("/v1/completions", json={**BODY, "top_p": 7}).status_code == 400
    # the prompt scored, nothing generated: its tokens count, no time to a first token
    echo_alone = {**BODY, "max_tokens": 0, "echo": True, "logprobs": 1}
    assert server.http.post("/v1/completions", json=echo_alone).status_code == 200
    after = metrics(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("moe_prompt_tokens_total") == 3 * len(BODY["prompt"])
    assert grew("moe_generation_tokens_total") == 3 * BODY["max_tokens"]
    assert grew("moe_time_to_first_token_seconds_count") == 3
    assert grew("moe_inter_token_latency_seconds_count") == 3 * (BODY["max_tokens"] - 1)
    assert grew("moe_http_requests_total{route=/v1/completions,status=200}") == 3
    assert grew("moe_http_requests_total{route=/v1/completions,status=400}") == 1
    for name in ("moe_num_requests_running", "moe_num_requests_waiting", "moe_weight_version"):
        assert name in after
    assert 0.0 <= after["moe_kv_cache_usage_ratio{dp_rank=0}"] <= 1.0
    assert "moe_rebalances_total" in after


def test_admin_rebalance_reports_and_counts(server):
    count = metrics(server)["moe_rebalances_total"]
    assert server.http.post("/v1/completions", json=BODY).status_code == 200  # some load
    report = server.http.post("/admin/rebalance")
    assert report.status_code == 200, report.text
    keys = {"balancedness_before", "balancedness_after", "experts_moved", "bytes_moved"}
    assert keys | {"seconds", "skipped"} <= set(report.json())
    assert not report.json()["skipped"], report.text  # the start-up placement: a plan moves
    after = metrics(server)
    assert after["moe_rebalances_total"] == count + 1
    assert "moe_last_balancedness" in after


def test_admin_rebalance_force_false_skips_a_balanced_enough_load(server):
    count = metrics(server)["moe_rebalances_total"]
    assert server.http.post("/v1/completions", json=BODY).status_code == 200  # some load
    skipped = server.http.post("/admin/rebalance", json={"force": False})
    assert skipped.status_code == 200, skipped.text
    assert skipped.json()["skipped"] and "reason" not in skipped.json()  # balanced, not idle
    assert skipped.json()["balancedness_before"] >= THRESHOLD
    # Forced (no body, or force: true): past the threshold, planned and moved. Each window's
    # load is another prompt's, so its plan is not the placement the last one left.
    for prompt, body in (("forced, no body", {}), ("forced, true", {"json": {"force": True}})):
        load = {**BODY, "prompt": prompt}
        assert server.http.post("/v1/completions", json=load).status_code == 200
        forced = server.http.post("/admin/rebalance", **body)
        assert forced.status_code == 200 and not forced.json()["skipped"], forced.text
    assert metrics(server)["moe_rebalances_total"] == count + 2


def test_a_refused_rebalance_is_a_409_naming_why_and_the_old_placement_serves(server):
    """A move every rank refused together (rank 0 fails staging layer 0, as out of memory
    would) raised RebalanceError, which the server answered 500 internal_error, though nothing
    had changed and the old placement still served: a client took the server for broken. It
    is a 409 now (a state change refused), typed and coded, its message naming the cause."""
    engine = server.engine
    placement = engine.balancer.placement.physical_to_logical.clone()
    rebalance = engine.rebalance  # the bound method the admin route's call runs

    def refused(force: bool = True) -> dict:
        return rebalance(force=force, inject_failure=(0, 0))

    load = {**BODY, "prompt": "a refused move"}  # a window's load that a plan moves
    assert server.http.post("/v1/completions", json=load).status_code == 200
    engine.rebalance = refused
    try:
        response = server.http.post("/admin/rebalance")
    finally:
        del engine.rebalance
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "conflict_error",
        "rebalance_refused",
        None,
    )
    assert error["message"] == (
        "a rank failed while moving experts (rank 0: layer 0: RuntimeError: injected failure "
        "at layer 0); the old placement is in use"
    )
    assert engine.balancer.history[-1].get("failed"), "no move was tried"
    assert engine.balancer.placement.physical_to_logical.equal(placement)
    assert server.http.get("/health").status_code == 200
    assert server.http.post("/v1/completions", json=BODY).status_code == 200


JSON = "application/json"


@pytest.mark.parametrize(
    ("content", "content_type", "problem"),
    [
        ('{"force": 1}', JSON, "force: Input should be a valid boolean"),
        ('{"force": "false"}', JSON, "force: Input should be a valid boolean"),
        ('{"bogus": true}', JSON, "bogus: Extra inputs are not permitted"),
        ('{"force": false', JSON, "malformed JSON body"),
        ("[false]", JSON, "body: Input should be a valid dictionary"),
        ("null", JSON, "body: Input should be a valid dictionary"),
        ("force=false", "application/x-www-form-urlencoded", "the body must be JSON"),  # curl -d
    ],
    ids=["force-int", "force-str", "unknown-field", "malformed-json", "list", "null", "form"],
)
def test_admin_rebalance_bad_body(server, content, content_type, problem):
    num_reports = len(server.engine.balancer.history)
    headers = {"content-type": content_type}
    response = server.http.post("/admin/rebalance", content=content, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert problem in response.json()["error"]["message"]
    assert len(server.engine.balancer.history) == num_reports, "the engine was asked to move"
    assert server.http.get("/health").status_code == 200


def test_serve_ep_logs_each_rebalance_at_info():
    """The README's rebalance log line (moe_runtime.eplb, INFO) reaches serve_ep's stderr; it
    was dropped, logging never being configured. No other library logs at INFO there."""
    serve = ServeEp("--set", "eplb.num_redundant_experts=4")  # something to move at world 1
    try:
        with httpx.Client(base_url=serve.ready_url(), timeout=30) as http:
            assert http.post("/v1/completions", json=BODY).status_code == 200  # some load
            report = http.post("/admin/rebalance").json()
        assert not report["skipped"], report
        line = serve.wait_for("moe_runtime.eplb: rebalance 1: balancedness", 10, "stderr")
        assert " INFO " in line and f"{report['experts_moved']} experts moved" in line, line
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=30) == 0
    finally:
        serve.kill()
    others = [
        line for line in serve.rest("stderr") if " INFO " in line and "moe_runtime." not in line
    ]
    assert not others, others


def test_admin_update_weights_to_self_then_other(server, checkpoints):
    first, second = checkpoints
    original = server.http.post("/v1/completions", json=BODY)
    version = original.json()["weight_version"]
    updated = server.http.post("/admin/update_weights", json={"path": first})
    assert updated.status_code == 200 and updated.json() == {"weight_version": version + 1}
    same = server.http.post("/v1/completions", json=BODY)
    assert same.json()["weight_version"] == version + 1
    assert bits(same) == bits(original), "a copy of the weights changed the output"
    assert server.http.post("/admin/update_weights", json={"path": second}).status_code == 200
    changed = server.http.post("/v1/completions", json=BODY)
    assert changed.json()["weight_version"] == version + 2
    assert bits(changed) != bits(original), "other weights left the output unchanged"
    assert metrics(server)["moe_weight_version"] == version + 2
    server.http.post("/admin/update_weights", json={"path": first})
    assert bits(server.http.post("/v1/completions", json=BODY)) == bits(original)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"path": "/nonexistent/weights"}, "path"),
        ({"path": 3}, "path"),
        ({"path": "x", "force": True}, "force"),
        ({}, "path"),
    ],
)
def test_admin_update_weights_bad_input(server, body, problem):
    response = server.http.post("/admin/update_weights", json=body)
    assert response.status_code == 400, response.text
    assert problem in response.json()["error"]["message"]
    assert server.http.get("/health").status_code == 200
