"""`return_routed_experts` over HTTP: each choice's experts, whole or streamed, decode to exactly
what `LLM.generate(..., SamplingParams(return_routed_experts=True))` returns."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from moe_runtime import LLM, SamplingParams
from moe_runtime.config import load_config
from tests.invariance import TINY_CONFIG
from tests.serving import running_server, sse_events

PROMPTS = [[7, 3, 99, 12], [200, 5, 41]]
MESSAGES = [{"role": "user", "content": "Which experts?"}]
SAMPLING = {"max_tokens": 6, "temperature": 0.8, "seed": 21, "n": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list]]:
    """{"completions": routed experts per choice index, "chat": the same} from LLM.generate."""
    llm = LLM(TINY_CONFIG)
    params = SamplingParams(**SAMPLING, return_routed_experts=True)
    chat_prompt = llm.tokenizer.apply_chat_template(MESSAGES)
    completions = [listed(o) for r in llm.generate(PROMPTS, params) for o in r.outputs]
    chat = [listed(o) for o in llm.generate([chat_prompt], params)[0].outputs]
    llm.shutdown()
    return {"completions": completions, "chat": chat}


def listed(output) -> list:
    return np.asarray(output.routed_experts).tolist()


def decode(block: dict) -> np.ndarray:
    assert block["dtype"] == "int32"
    data = np.frombuffer(base64.b64decode(block["data"]), dtype="<i4")
    return data.reshape(block["shape"])


def check_shape(experts: np.ndarray, num_tokens: int) -> None:
    model = load_config(TINY_CONFIG).model
    assert experts.shape == (num_tokens, model.num_moe_layers, model.num_experts_per_tok)


def streamed_experts(chunks: list[dict]) -> dict[int, np.ndarray]:
    parts: dict[int, list[np.ndarray]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            experts = decode(choice["routed_experts"])
            check_shape(experts, len(choice["token_ids"]))
            parts.setdefault(choice["index"], []).append(experts)
    return {index: np.concatenate(p) for index, p in parts.items()}


def test_completions_whole_and_streamed(server, reference):
    body = {"prompt": PROMPTS, **SAMPLING, "return_routed_experts": True}
    whole = server.http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for choice, expected in zip(whole["choices"], reference["completions"], strict=True):
        experts = decode(choice["routed_experts"])
        check_shape(experts, len(choice["token_ids"]))
        assert experts.tolist() == expected
    streamed = streamed_experts(sse_events(server.http, "/v1/completions", body))
    assert {i: e.tolist() for i, e in streamed.items()} == dict(enumerate(reference["completions"]))


def test_chat_whole_and_streamed(server, reference):
    body = {"messages": MESSAGES, **SAMPLING, "return_routed_experts": True}
    whole = server.http.post("/v1/chat/completions", json=body).json()
    got = [decode(c["routed_experts"]).tolist() for c in whole["choices"]]
    assert got == reference["chat"]
    streamed = streamed_experts(sse_events(server.http, "/v1/chat/completions", body))
    assert {i: e.tolist() for i, e in streamed.items()} == dict(enumerate(reference["chat"]))


def test_absent_unless_asked(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 2}
    choice = server.http.post("/v1/completions", json=body).json()["choices"][0]
    assert "routed_experts" not in choice
    bad = server.http.post("/v1/completions", json={**body, "return_routed_experts": 1})
    assert bad.status_code == 400 and "return_routed_experts" in bad.json()["error"]["message"]


@pytest.fixture(scope="module")
def whole_routing() -> list[list]:
    """Per completion choice index, the routed experts of its whole sequence (the prompt's and
    the generated tokens', every position but the last): LLM.score_outputs from its first
    token, of what LLM.generate gave."""
    llm = LLM(TINY_CONFIG)
    outputs = llm.generate(PROMPTS, SamplingParams(**SAMPLING), use_tqdm=False)
    pairs = zip(PROMPTS, outputs, strict=True)
    sequences = [p + o.token_ids for p, r in pairs for o in r.outputs]
    scored = llm.score_outputs(
        sequences, [1] * len(sequences), return_routed_experts=True, use_tqdm=False
    )
    llm.shutdown()
    return [listed(o) for o in scored]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_echo_carries_the_prompt_s_routed_experts(server, whole_routing, logprobs):
    """With echo, a choice's routed experts start with the echoed prompt's (each token's but
    the first: the position before it routed it), so they are the whole sequence's routing a
    trainer replays, [prompt + generated - 1, L, K]; they reported the generated tokens' only.
    Whole and streamed, with or without logprobs (which scored the prompt before)."""
    body = {"prompt": PROMPTS, **SAMPLING, "return_routed_experts": True, "echo": True}
    body["logprobs"] = logprobs
    whole = server.http.post("/v1/completions", json=body).json()
    for choice, expected in zip(whole["choices"], whole_routing, strict=True):
        experts = decode(choice["routed_experts"])
        assert experts.shape[0] == len(choice["token_ids"]) - 1 == len(expected)
        assert experts.tolist() == expected
    parts: dict[int, list[np.ndarray]] = {}
    for chunk in sse_events(server.http, "/v1/completions", body):
        for choice in chunk["choices"]:
            parts.setdefault(choice["index"], []).append(decode(choice["routed_experts"]))
    streamed = [np.concatenate(parts[i]).tolist() for i in range(len(whole_routing))]
    assert streamed == whole_routing
    # the prompt alone (max_tokens 0): its rows
    alone = {**body, "max_tokens": 0, "n": 1, "prompt": PROMPTS[0]}
    (choice,) = server.http.post("/v1/completions", json=alone).json()["choices"]
    assert decode(choice["routed_experts"]).tolist() == whole_routing[0][: len(PROMPTS[0]) - 1]


def test_echo_of_a_one_token_prompt_has_its_empty_rows(server, whole_routing):
    """A one-token prompt has no routed experts of its own (nothing comes before its token),
    so with echo and max_tokens 0 its choice carries [0, L, K] rows, as every other choice of
    the request does [P - 1, L, K]: the field was missing from that choice alone (a client
    decoding each choice's routed_experts failed on it), streamed or not."""
    body = {"prompt": [[7], PROMPTS[0]], "max_tokens": 0, "echo": True}
    body["return_routed_experts"] = True
    whole = server.http.post("/v1/completions", json=body).json()["choices"]
    streamed = [c for e in sse_events(server.http, "/v1/completions", body) for c in e["choices"]]
    for choices in (whole, streamed):
        one, other = (
            decode(c["routed_experts"]) for c in sorted(choices, key=lambda c: c["index"])
        )
        check_shape(one, 0)
        assert other.tolist() == whole_routing[0][: len(PROMPTS[0]) - 1]
    # generated tokens after it: their rows alone, as before
    body = {**body, "prompt": [7], **SAMPLING, "n": 1}
    (choice,) = server.http.post("/v1/completions", json=body).json()["choices"]
    check_shape(decode(choice["routed_experts"]), SAMPLING["max_tokens"])
