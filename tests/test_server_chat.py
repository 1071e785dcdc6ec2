"""/v1/chat/completions: template, OpenAI chat format with logprobs, streaming, bad input.

The prompt is the tokenizer's chat template applied to the messages; the answer must be the
bits `LLM.generate` gives for those prompt ids, whole or streamed.
"""

from __future__ import annotations

import openai
import pytest

from moe_runtime import LLM, SamplingParams
from moe_runtime.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat
from tests.invariance import TINY_CONFIG, fingerprint
from tests.serving import running_server, sse_events

CHAT = "/v1/chat/completions"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
]
BODY = {
    "messages": MESSAGES,
    "max_tokens": 10,
    "temperature": 0.7,
    "seed": 5,
    "top_k": 40,
    "logprobs": True,
    "top_logprobs": 3,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


@pytest.fixture(scope="module")
def reference():
    llm = LLM(TINY_CONFIG)
    prompt_ids = llm.tokenizer.apply_chat_template(MESSAGES)
    params = SamplingParams(
        max_tokens=10, temperature=0.7, seed=5, top_k=40, logprobs=3, ignore_eos=True
    )
    out = llm.generate([prompt_ids], params)[0]
    llm.shutdown()
    return prompt_ids, fingerprint(out)


def chat_fingerprint(token_ids: list[int], content: list[dict]) -> tuple:
    return (
        tuple(token_ids),
        tuple(float.hex(e["logprob"]) for e in content),
        tuple(
            tuple((t["token_id"], float.hex(t["logprob"])) for t in e["top_logprobs"])
            for e in content
        ),
    )


def test_default_template_is_documented_format():
    text = render_chat(DEFAULT_CHAT_TEMPLATE, MESSAGES)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHello there\n<|assistant|>\n"


def test_chat_response_equals_generate(server, reference):
    prompt_ids, expected = reference
    response = server.http.post(CHAT, json=BODY).json()
    assert response["object"] == "chat.completion" and response["weight_version"] == 0
    (choice,) = response["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert chat_fingerprint(choice["token_ids"], content) == expected
    assert choice["message"]["content"] == server.engine.tokenizer.decode(choice["token_ids"])
    assert all(len(e["top_logprobs"]) == 3 for e in content)
    assert response["usage"]["prompt_tokens"] == len(prompt_ids)


def test_chat_stream_equals_whole(server, reference):
    chunks = sse_events(server.http, CHAT, {**BODY, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = chunks.pop()["usage"]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    content = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert chat_fingerprint(ids, content) == reference[1]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert text == server.engine.tokenizer.decode(ids)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == 10


def test_openai_client_chat_with_n(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(len(c.logprobs.content) == 6 for c in out.choices)
    assert out.choices[0].message.content is not None
    stream = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=6, seed=3, stream=True
    )
    assert sum(len(chunk.choices) for chunk in stream) == 6


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": MESSAGES, "functions": []}, "functions"),
        ({"messages": [{"role": "user", "content": "x" * 2000}]}, "max_model_len"),
    ],
)
def test_bad_chat_requests_are_400s(server, body, problem):
    response = server.http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert problem in response.json()["error"]["message"]


@pytest.mark.parametrize("content", ['"hi \\ud800"', '[{"type": "text", "text": "hi \\ud800"}]'])
def test_a_lone_surrogate_in_a_message_is_named_where_it_stands(server, content):
    """JSON may carry a lone surrogate, which UTF-8 cannot encode: the 400 names the message
    and the position in it, not a position in the rendered chat template."""
    raw = f'{{"messages": [{{"role": "user", "content": {content}}}], "max_tokens": 2}}'
    headers = {"content-type": "application/json"}
    response = server.http.post(CHAT, content=raw.encode(), headers=headers)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("messages.0.content") and "'\\ud800' at position 3" in message


@pytest.mark.parametrize("field", ["temperature", "top_p", "n", "stream", "logprobs"])
def test_null_is_the_default_of_a_nullable_openai_field(server, field):
    body = {"messages": MESSAGES, "max_tokens": 4, "seed": 2, "ignore_eos": True}
    plain = server.http.post(CHAT, json=body).json()["choices"]
    nulled = server.http.post(CHAT, json={**body, field: None})
    assert nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"] == plain


def test_chat_openai_fields_with_values_that_change_nothing_are_accepted(server):
    body = {"messages": MESSAGES, "max_tokens": 4, "seed": 2, "logprobs": True, "top_logprobs": 1}
    no_ops = {
        "user": "alice",
        "frequency_penalty": 0.0,
        "presence_penalty": 0,
        "logit_bias": None,
        "response_format": {"type": "text"},
        "parallel_tool_calls": True,
        "metadata": {},
        "store": False,
    }
    plain = server.http.post(CHAT, json=body).json()["choices"]
    given = server.http.post(CHAT, json={**body, **no_ops})
    assert given.status_code == 200, given.text
    assert given.json()["choices"] == plain
    for field in ("best_of", "suffix"):  # completions' own: unknown here
        error = server.http.post(CHAT, json={**body, field: None}).json()["error"]
        assert error["param"] == field and "Extra inputs are not permitted" in error["message"]


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("presence_penalty", 0.1, "is not supported"),
        ("logit_bias", {"7": -100}, "is not supported"),
        ("response_format", {"type": "json_object"}, "is not supported"),
        ("store", True, "is not supported"),
        ("metadata", {"run": "a"}, "is not supported"),
        ("parallel_tool_calls", "yes", "is not supported"),
        ("user", 5, "valid string"),
        ("stream_options", {"include_usage": True}, "needs stream: true"),
        ("stop", "", "must not be empty"),
    ],
)
def test_chat_fields_it_cannot_honour_are_400s_naming_the_field(server, field, value, problem):
    response = server.http.post(CHAT, json={"messages": MESSAGES, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and problem in error["message"], error


def test_usage_chunk_carries_the_weight_version(server):
    chunks = sse_events(
        server.http, CHAT, {**BODY, "max_tokens": 2, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
    assert all(chunk["weight_version"] == 0 for chunk in chunks)


def test_a_message_name_reaches_the_template():
    """transformers hands a template each message whole: `name` too (templates that name
    speakers write it); it was dropped."""
    from launch.openai.schemas import ChatMessage

    named = ChatMessage(role="user", content=[{"type": "text", "text": "hi"}], name="bob")
    assert named.template_fields() == {"role": "user", "content": "hi", "name": "bob"}
    assert ChatMessage(role="user", content="hi").template_fields() == {
        "role": "user",
        "content": "hi",
    }
