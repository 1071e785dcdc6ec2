"""What the server exports and how it refuses: every metric the README lists and every one the
Grafana dashboard queries exists from the first scrape; every response, 404s and unparsable
bodies included, is counted; context overflow, empty prompts and non-UTF-8 bodies are
OpenAI-shaped 400s."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import running_server

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "launch" / "grafana" / "moe_runtime.json"
MAX_MODEL_LEN = 1024  # scheduler.max_model_len of the tiny config
PROMQL_WORDS = {"rate", "increase", "sum", "avg", "max", "by", "le", "histogram_quantile"}


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


def scrape(server) -> dict[str, float]:
    """{sample name{labels}: value} of every sample, and {family name: nan} of every family."""
    text = server.http.get("/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        samples[family.name] = math.nan
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = samples[s.name] = s.value
    return samples


def test_first_scrape_exports_every_listed_and_queried_metric(server):
    exported = scrape(server)  # the module's first request: nothing ran yet
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("`GET /metrics`") : readme.index("`POST /admin/rebalance`")]
    queries = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    queried = {w for q in queries for w in re.findall(r"[a-z_]+", q) if w.startswith("moe_")}
    names = set(re.findall(r"`(moe_[a-z_]+)", listed))
    assert len(names) >= 15, names  # the README's list was found
    for name in names | queried:
        assert name in exported, name
    assert math.isnan(exported["moe_last_balancedness"])  # no rebalance yet
    assert exported["moe_engine_restarts_total"] == exported["moe_rebalances_failed_total"] == 0
    assert exported["moe_preemptions_total"] == exported["moe_dp_shared_sequences_total"] == 0
    assert exported["moe_rank_load_ratio{rank=0}"] == 1.0
    assert all(w in PROMQL_WORDS for q in queries for w in re.findall(r"\b[a-z_]+(?=\s*\()", q))


def test_the_dashboard_s_balancedness_is_each_server_s_own():
    """Every grouping of the live balancedness keeps the scraped server (`instance`): grouped
    by rank alone, two servers' rank 0 rows were summed into one rank, a figure of neither."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (panel,) = [p for p in panels if p["title"].startswith("Expert balancedness")]
    live = panel["targets"][0]["expr"]
    groupings = re.findall(r"\bby \(([^)]*)\)", live)
    assert len(groupings) == 4 and "moe_expert_rows_total" in live, live
    for labels in groupings:
        assert "instance" in {label.strip() for label in labels.split(",")}, live


def test_expert_rows_count_each_routed_row(server, monkeypatch):
    monkeypatch.setattr("launch.metrics.RANK_STATS_MAX_AGE_S", 0.0)  # every scrape asks
    before = scrape(server)
    prompt = [5, 6, 7, 8]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    assert server.http.post("/v1/completions", json=body).status_code == 200
    after = scrape(server)
    rows = {k: v for k, v in after.items() if k.startswith("moe_expert_rows_total{")}
    grown = sum(v - before[k] for k, v in rows.items())
    config = server.engine.config.model
    num_moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    # prefill of the prompt, then two decode steps of one token: K rows per token and MoE layer
    assert grown == (len(prompt) + 2) * num_moe_layers * config.num_experts_per_tok
    assert after["moe_rank_load_ratio{rank=0}"] == 1.0


OVER = "context_length_exceeded"  # OpenAI's code for it; every other 400 has a null code
BAD = [
    (
        {"prompt": [7] * 1000, "max_tokens": 100},
        "max_tokens",
        OVER,
        "This model's maximum context length is 1024 tokens; the prompt has 1000 tokens and "
        "max_tokens is 100 (1100 in all)",
    ),
    ({"prompt": "x" * 1020}, "max_tokens", OVER, "the prompt has 1021 tokens"),  # bos + 1020
    ({"prompt": ""}, "prompt", None, "non-empty"),
    ({"prompt": [""]}, "prompt", None, "non-empty"),
    ({"prompt": []}, "prompt", None, "non-empty"),
    ({"prompt": [[]]}, "prompt", None, "non-empty"),
]


@pytest.mark.parametrize(("body", "param", "code", "message"), BAD)
def test_bad_prompts_are_400s_naming_the_param(server, body, param, code, message):
    response = server.http.post("/v1/completions", json=body)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, code, param)
    assert message in error["message"]


@pytest.mark.parametrize("param", ["max_completion_tokens", "max_tokens", "messages"])
def test_chat_over_the_context_is_a_400_coded_context_length_exceeded(server, param):
    """A budget past the context, or (no budget) a prompt that fills it and leaves no room."""
    body = {"messages": [{"role": "user", "content": "hi"}], param: MAX_MODEL_LEN}
    if param == "messages":
        template = server.engine.tokenizer.apply_chat_template([{"role": "user", "content": ""}])
        content = "x" * (MAX_MODEL_LEN - len(template))  # a byte a token
        body = {"messages": [{"role": "user", "content": content}]}
    response = server.http.post("/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, OVER, param)
    assert "maximum context length is" in error["message"]
    if param != "messages":
        assert f"{param} is {MAX_MODEL_LEN}" in error["message"]


def test_every_response_is_counted_and_openai_shaped(server):
    before = scrape(server)
    json_type = {"content-type": "application/json"}
    answers = [
        server.http.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=json_type),
        server.http.post("/v1/completions", content=b'{"prompt": ', headers=json_type),
        server.http.get("/no/such/path"),
        server.http.get("/v1/completions"),
        server.http.post("/v1/completions", json={"model": "other", "prompt": "a"}),
    ]
    assert [r.status_code for r in answers] == [400, 400, 404, 405, 404]
    for response in answers:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert [r.json()["error"]["code"] for r in answers] == [None] * 4 + ["model_not_found"]
    after = scrape(server)

    def grew(route: str, status: int) -> float:
        name = f"moe_http_requests_total{{route={route},status={status}}}"
        return after[name] - before.get(name, 0.0)

    assert grew("/v1/completions", 400) == 2
    assert grew("/v1/completions", 404) == 1
    assert grew("/v1/completions", 405) == 1
    assert grew("unmatched", 404) == 1
    assert grew("/metrics", 200) == 1  # the first scrape above
    assert server.http.get("/health").status_code == 200


def test_time_to_first_token_counts_from_the_requests_arrival(server, monkeypatch):
    """The time to first token started when the engine was handed the prompt, so a chat's
    template and tokenization (seconds for a long conversation) were left out of it."""
    tokenizer = server.engine.tokenizer
    template = tokenizer.apply_chat_template

    def slow_template(messages, **options):
        time.sleep(0.5)
        return template(messages, **options)

    monkeypatch.setattr(tokenizer, "apply_chat_template", slow_template)
    before = scrape(server)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert server.http.post("/v1/chat/completions", json=body).status_code == 200
    after = scrape(server)
    grown = {
        key: after[key] - before[key]
        for key in ("moe_time_to_first_token_seconds_count", "moe_time_to_first_token_seconds_sum")
    }
    assert grown["moe_time_to_first_token_seconds_count"] == 1
    assert grown["moe_time_to_first_token_seconds_sum"] >= 0.5


def test_a_stream_ended_by_a_fault_is_counted_as_a_stream_error():
    """A stream's status is counted as its 200 starts, so one that a fault ended with an error
    chunk showed nowhere in the metrics; moe_stream_errors_total counts it."""
    from moe_runtime.executor import WorkerError

    with running_server() as running:
        before = scrape(running)
        body = {"prompt": [1, 2, 3], "max_tokens": 300, "ignore_eos": True, "stream": True}
        events = []
        with running.http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not events:  # the stream has begun: its next step fails

                    def broken(per_rank_chunks):
                        raise WorkerError("rank 0 failed: injected")

                    running.engine.executor.execute = broken
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]" and "injected" in events[-2]
        after = scrape(running)
    assert after["moe_stream_errors_total"] - before["moe_stream_errors_total"] == 1
    name = "moe_http_requests_total{route=/v1/completions,status=200}"
    assert after[name] - before.get(name, 0.0) == 1
    error = "moe_samples_finished_total{finish_reason=error}"  # its one sample
    assert after[error] - before[error] == 1


def test_a_refused_prompt_ends_no_sample(server):
    """A prompt the engine refuses as it is admitted (a 400: it never ran) counted its
    samples as ended by 'error', which README keeps for faults and the drain."""
    before = scrape(server)
    body = {"prompt": [1] * 1000, "max_tokens": 100, "n": 2}  # past the context with its tokens
    assert server.http.post("/v1/completions", json=body).status_code == 400
    after = scrape(server)
    for reason in ("stop", "length", "abort", "error"):
        name = f"moe_samples_finished_total{{finish_reason={reason}}}"
        assert after[name] == before[name], name


def test_a_prompt_s_tokens_count_once_at_any_sample_s_first_delta():
    """With n > 1 the prompt was counted at sample 0's first delta only: a request whose
    sample 0 never reported (preempted, then its client left) added no prompt tokens."""
    from launch.metrics import RequestTracker, ServerMetrics
    from moe_runtime.engine.outputs import CompletionOutput, RequestOutput

    def delta(sample_idx: int) -> RequestOutput:
        out = CompletionOutput(sample_idx, [5], [-1.0], [{}], "x", None, 0)
        return RequestOutput("r", [1, 2, 3], [out], False)

    metrics = ServerMetrics(lambda: None)
    tracker = RequestTracker(metrics, time.monotonic())
    total = metrics.registry.get_sample_value
    tracker.observe(0, delta(1))
    assert total("moe_prompt_tokens_total") == 3
    tracker.observe(0, delta(0))
    tracker.observe(0, delta(1))
    assert total("moe_prompt_tokens_total") == 3  # once a prompt
    assert total("moe_generation_tokens_total") == 3


def test_preemptions_and_dp_moves_are_the_engine_s_counts():
    """moe_preemptions_total, moe_dp_shared_sequences_total and moe_rebalances_failed_total
    are the engine's own counts (EngineStats.num_preemptions, num_shared,
    num_failed_rebalances), read at the scrape."""
    from launch.metrics import ServerMetrics
    from moe_runtime.engine.outputs import EngineStats

    stats = EngineStats(num_preemptions=7, num_shared=3, num_failed_rebalances=2)
    families = {f.name: f for f in ServerMetrics(lambda: stats).collect()}
    assert families["moe_preemptions"].samples[0].value == 7
    assert families["moe_dp_shared_sequences"].samples[0].value == 3
    assert families["moe_rebalances_failed"].samples[0].value == 2
