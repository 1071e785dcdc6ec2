"""/v1/chat/completions: template, OpenAI chat format with logprobs, streaming, bad input.

The prompt is the tokenizer's chat template applied to the messages; the answer must be the
bits `LLM.generate` gives for those prompt ids, whole or streamed.
"""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from launch.generation import Backend
from launch.server_app import create_app
from moe_runtime import LLM, SamplingParams
from moe_runtime.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat
from moe_runtime.config import load_config
from moe_runtime.tokenizer import HFTokenizer
from tests.checkpoints import write_byte_level_bpe
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


# A stream's first delta of each sample, as OpenAI's.
ROLE_DELTA = {"role": "assistant", "content": "", "refusal": None}


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
    assert chunks.pop(0)["choices"][0]["delta"] == ROLE_DELTA
    usage = chunks.pop()["usage"]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    content = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert chat_fingerprint(ids, content) == reference[1]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert text == server.engine.tokenizer.decode(ids)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == 10


def test_a_stream_opens_each_sample_with_a_role_chunk_as_openai(server):
    """OpenAI's first chunk of a sample is `{"role": "assistant", "content": "", "refusal":
    null}` alone, its text in the chunks after; the role came with the first token's text, and
    the role chunk had no `refusal` (OpenAI's has it there only)."""
    body = {**BODY, "n": 2, "max_tokens": 3}
    chunks = [c["choices"][0] for c in sse_events(server.http, CHAT, body)]
    for index in (0, 1):
        first, *rest = [c for c in chunks if c["index"] == index]
        assert first["delta"] == ROLE_DELTA
        assert (first["token_ids"], first["logprobs"], first["finish_reason"]) == ([], None, None)
        assert all("role" not in c["delta"] and "refusal" not in c["delta"] for c in rest)
        assert sum(len(c["token_ids"]) for c in rest) == 3


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
    assert sum(len(chunk.choices) for chunk in stream) == 1 + 6  # the role chunk, the tokens


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
    from launch.openai.chat_schemas import ChatMessage

    named = ChatMessage(role="user", content=[{"type": "text", "text": "hi"}], name="bob")
    assert named.template_fields() == {"role": "user", "content": "hi", "name": "bob"}
    assert ChatMessage(role="user", content="hi").template_fields() == {
        "role": "user",
        "content": "hi",
    }


def test_text_parts_are_joined_with_newlines_as_vllm_joins_them():
    """A content list's text parts reach the template one per line, as vLLM joins them; they
    were run together ("a" and "b" gave "ab")."""
    from launch.openai.chat_schemas import ChatMessage

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    message = ChatMessage(role="user", content=parts)
    assert message.template_fields() == {"role": "user", "content": "a\nb"}


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}
TOOL_HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_a_final_message_without_text_to_continue_is_named_by_index():
    """render_chat (LLM's chat and the server alike) names the final message by its index."""
    with pytest.raises(ValueError, match=r"messages\[1\] \(the final message\) has no content"):
        render_chat(DEFAULT_CHAT_TEMPLATE, TOOL_HISTORY[:2], **CONTINUE)


def test_default_template_writes_tool_calls_a_line_each():
    text = render_chat(
        DEFAULT_CHAT_TEMPLATE,
        [
            *TOOL_HISTORY,
            {"role": "assistant", "content": "two", "tool_calls": [TOOL_CALL, TOOL_CALL]},
        ],
    )
    assert text == (
        '<|user|>\nweather?\n<|assistant|>\n<|tool_call|>w({"a": 1})\n<|tool|>\nsunny\n'
        '<|assistant|>\ntwo\n<|tool_call|>w({"a": 1})\n<|tool_call|>w({"a": 1})\n<|assistant|>\n'
    )


def test_tool_calls_reach_the_template_as_transformers_hands_them_over():
    """The message dict as given: `tool_calls` a list of dicts, a null content kept as None
    (DeepSeek-V3's template tests `message['content'] is none`), `tool_call_id` kept."""
    from launch.openai.chat_schemas import ChatMessage

    fields = [ChatMessage.model_validate(m).template_fields() for m in TOOL_HISTORY]
    assert fields == TOOL_HISTORY
    dumped = {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": []}
    assert ChatMessage.model_validate(dumped).template_fields() == {
        "role": "assistant",
        "content": "ok",
    }


def test_a_tool_calling_history_is_accepted(server):
    """OpenAI accepts an assistant's tool calls (content null) and the tool's answer; they
    were 400s. The prompt is the template's rendering of the messages as given."""
    body = {"messages": TOOL_HISTORY, "max_tokens": 2, "temperature": 0}
    response = server.http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    prompt_ids = server.engine.tokenizer.apply_chat_template(TOOL_HISTORY)
    assert response.json()["usage"]["prompt_tokens"] == len(prompt_ids)


def test_a_tool_message_without_its_tool_call_id_is_a_400_naming_it(server):
    """OpenAI requires a tool message's tool_call_id (the call it answers); it was optional."""
    unnamed = [*TOOL_HISTORY[:2], {"role": "tool", "content": "sunny"}]
    response = server.http.post(CHAT, json={"messages": unnamed, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages", error
    assert error["message"].startswith("messages.2: tool_call_id: required"), error


def test_an_openai_client_message_is_sent_back_as_it_dumps(server):
    """A chat loop appends the reply as `message.model_dump()` (refusal, annotations, audio,
    function_call and tool_calls null): the next request must be accepted."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    message = (
        client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2)
        .choices[0]
        .message
    )
    for reply in (message.model_dump(), {**message.model_dump(), "annotations": []}):
        history = [*MESSAGES, reply, {"role": "user", "content": "more"}]
        out = client.chat.completions.create(model=server.model, messages=history, max_tokens=2)
        assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ({"role": "assistant", "content": "x", "refusal": "no"}, "messages.0.refusal"),
        ({"role": "assistant", "content": "x", "audio": {"id": "a"}}, "messages.0.audio"),
        ({"role": "assistant", "content": "x", "annotations": [{"type": "url"}]}, "annotations"),
        (
            {"role": "assistant", "content": None, "function_call": TOOL_CALL["function"]},
            "messages.0.function_call",
        ),
        ({"role": "assistant", "content": None}, "with tool_calls"),
        ({"role": "user", "content": None}, "with tool_calls"),
        ({"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}, "only an assistant"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "only a tool message"),
        (
            {"role": "assistant", "tool_calls": [{**TOOL_CALL, "type": "code"}]},
            "messages.0.tool_calls.0.type",
        ),
        (
            {"role": "assistant", "tool_calls": [{**TOOL_CALL, "function": {"name": "w"}}]},
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_message_fields_that_would_carry_something_are_400s(server, message, problem):
    response = server.http.post(CHAT, json={"messages": [message], "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and problem in error["message"], error
    if "refusal" in message or "audio" in message or "function_call" in message:
        assert "is not supported" in error["message"]


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer"])
def test_an_empty_list_of_content_parts_is_a_400_naming_the_message(server, role):
    """`content: []` holds no text: OpenAI refuses it; it was accepted as an empty message.
    An assistant message with tool_calls may have none (as a null content)."""
    empty = {"role": role, "content": []}
    if role == "tool":
        empty["tool_call_id"] = "call_1"
    body = {"messages": [MESSAGES[1], empty], "max_tokens": 2}
    response = server.http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages", error
    assert error["message"].startswith("messages.1: content: [] holds no parts"), error
    calls = {"role": "assistant", "content": [], "tool_calls": [TOOL_CALL]}
    history = [MESSAGES[1], calls, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]
    assert server.http.post(CHAT, json={**body, "messages": history}).status_code == 200


NO_TOOL_FIELDS = [
    ("tools", None),
    ("tools", []),
    ("tool_choice", None),
    ("tool_choice", "none"),
    ("tool_choice", "auto"),
    ("service_tier", None),
    ("service_tier", "auto"),
    ("service_tier", "default"),
    ("modalities", None),
    ("modalities", ["text"]),
    ("reasoning_effort", None),
    ("stream_options", {"include_obfuscation": False}),
]


@pytest.mark.parametrize(("field", "value"), NO_TOOL_FIELDS)
def test_chat_fields_set_to_change_nothing_are_accepted(server, field, value):
    """They were refused as "Extra inputs are not permitted"; the output is what it is
    without them."""
    body = {"messages": MESSAGES, "max_tokens": 3, "seed": 2, "ignore_eos": True}
    if field == "stream_options":
        body = {**body, "stream": True}
    plain = server.http.post(CHAT, json=body)
    given = server.http.post(CHAT, json={**body, field: value})
    assert given.status_code == 200, given.text
    if field != "stream_options":
        assert given.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("service_tier", "flex"),
        ("modalities", ["text", "audio"]),
        ("reasoning_effort", "low"),
        ("stream_options", {"include_obfuscation": True}),
    ],
)
def test_chat_fields_that_ask_for_something_are_not_supported(server, field, value):
    body = {"messages": MESSAGES, "max_tokens": 2, field: value}
    response = server.http.post(CHAT, json={**body, "stream": field == "stream_options"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "is not supported" in error["message"], error
    if field.startswith("tool"):
        assert "tool calls are not supported" in error["message"]


def test_chat_only_fields_are_unknown_to_completions(server):
    for field, value in NO_TOOL_FIELDS[:-1]:
        body = {"prompt": "a", "max_tokens": 1, field: value}
        error = server.http.post("/v1/completions", json=body).json()["error"]
        assert error["param"] == field and "Extra inputs are not permitted" in error["message"]


def test_max_completion_tokens_wins_over_max_tokens(server):
    """OpenAI deprecated max_tokens for max_completion_tokens: where both are sent, the
    latter is the budget (max_tokens won), and the context error names it."""
    body = {"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 5, "ignore_eos": True}
    response = server.http.post(CHAT, json=body).json()
    assert response["usage"]["completion_tokens"] == 5
    over = server.http.post(CHAT, json={**body, "max_completion_tokens": 1024})
    error = over.json()["error"]
    assert (over.status_code, error["code"]) == (400, "context_length_exceeded")
    assert error["param"] == "max_completion_tokens"
    assert "max_completion_tokens is 1024" in error["message"]


PREFILL = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.mark.parametrize(
    "options", [CONTINUE, {"add_generation_prompt": False}], ids=["continue", "no_turn_opened"]
)
def test_the_template_options_make_the_prompt(server, options):
    """vLLM's add_generation_prompt and continue_final_message (a prefill): were 400s. The
    answer is what /v1/completions gives for the prompt the tokenizer builds with them."""
    body = {"messages": PREFILL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = server.http.post(CHAT, json={**body, **options})
    assert response.status_code == 200, response.text
    prompt_ids = server.engine.tokenizer.apply_chat_template(PREFILL, **options)
    assert prompt_ids != server.engine.tokenizer.apply_chat_template(PREFILL)
    assert response.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    plain = {"prompt": prompt_ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    (expected,) = server.http.post("/v1/completions", json=plain).json()["choices"]
    assert response.json()["choices"][0]["token_ids"] == expected["token_ids"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"messages": PREFILL, "continue_final_message": True}, "add_generation_prompt: false"),
        (
            {"messages": TOOL_HISTORY[:2], **CONTINUE},
            "messages[1] (the final message) has no content to continue: an assistant message "
            "with tool_calls and content null",
        ),
        (
            {"messages": [TOOL_HISTORY[0], {**TOOL_HISTORY[1], "content": []}], **CONTINUE},
            "messages[1] (the final message) has no content to continue: an assistant message "
            "with tool_calls and content []",
        ),
    ],
    ids=["opens_a_turn", "null_content", "no_parts"],
)
def test_continue_final_message_it_cannot_honour_is_a_400_naming_it(server, body, problem):
    """A final assistant message with tool_calls and `content: []` passed the request's check
    (made for null alone) and failed in the template as a fault of `messages` as a whole: it is
    refused as null is, naming the message's index and why."""
    response = server.http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "continue_final_message"
    assert problem in error["message"]


def test_a_whole_message_carries_a_null_refusal_as_openai_sends_it(server):
    body = {"messages": MESSAGES, "max_tokens": 2}
    (choice,) = server.http.post(CHAT, json=body).json()["choices"]
    assert set(choice["message"]) == {"role", "content", "refusal"}
    assert choice["message"]["refusal"] is None
    role, *chunks = sse_events(server.http, CHAT, body)
    assert role["choices"][0]["delta"] == ROLE_DELTA  # a stream's: in its role chunk alone
    assert all("refusal" not in c["choices"][0]["delta"] for c in chunks)


# As DeepSeek's templates: the roles it knows, any other skipped without a word.
KNOWN_ROLES_ONLY = (
    "{% for m in messages %}{% if m['role'] == 'system' %}S:{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}U:{{ m['content'] }}\n{% endif %}{% endfor %}A:"
)


def test_a_developer_message_reaches_a_template_without_that_role_as_system():
    """OpenAI's developer message is the system instruction's newer name; DeepSeek's
    templates skip the role, so the instruction was lost (the request still a 200). A template
    that names the role, and the default template, get it as sent."""
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    as_system = [{**developer[0], "role": "system"}, developer[1]]
    assert render_chat(KNOWN_ROLES_ONLY, developer) == "S:Be brief.\nU:hi\nA:"
    assert render_chat(KNOWN_ROLES_ONLY, as_system) == "S:Be brief.\nU:hi\nA:"
    naming = "{# knows developer #}{% for m in messages %}{{ m['role'] }};{% endfor %}"
    assert render_chat(naming, developer) == "developer;user;"
    assert render_chat(DEFAULT_CHAT_TEMPLATE, developer).startswith("<|developer|>\nBe brief.")
    assert developer[0]["role"] == "developer"  # the caller's messages are left as they were


def test_a_negative_seed_is_a_seed_of_its_own(server):
    """OpenAI's seed is a signed 64-bit int (a negative one was a 400): -1 samples as the seed
    hashed from its two's complement, not as a seed it would fold onto (2**63 - 1)."""
    from moe_runtime.seeds import MAX_SEED, derive_seed, from_signed_seed

    def sampled(seed: int) -> tuple:
        response = server.http.post(CHAT, json={**BODY, "seed": seed})
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        return chat_fingerprint(choice["token_ids"], choice["logprobs"]["content"])

    assert from_signed_seed(-1) == derive_seed(2**64 - 1) and from_signed_seed(7) == 7
    assert sampled(-1) == sampled(derive_seed(2**64 - 1))
    assert sampled(-1) != sampled(MAX_SEED)
    assert sampled(-(2**63)) != sampled(-1)
    for bad in (-(2**63) - 1, 2**63):
        response = server.http.post(CHAT, json={**BODY, "seed": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "seed"
    with pytest.raises(ValueError, match="signed 64-bit"):
        from_signed_seed(2**63)


def test_a_chat_prompt_filling_the_context_names_no_max_tokens_it_was_not_sent(server):
    """Without a budget the room left is the budget: a prompt that fills the context was told
    "max_tokens is 1", a field the client never sent."""
    tokenizer, room = server.engine.tokenizer, server.engine.config.scheduler.max_model_len
    empty = len(tokenizer.apply_chat_template([{"role": "user", "content": ""}]))
    messages = [{"role": "user", "content": "x" * (room - empty)}]
    assert len(tokenizer.apply_chat_template(messages)) == room
    response = server.http.post(CHAT, json={"messages": messages})
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (
        400,
        "context_length_exceeded",
        "messages",
    )
    assert error["message"] == (
        f"messages: This model's maximum context length is {room} tokens and the prompt has "
        f"{room}, which leaves no room to generate. The context is scheduler.max_model_len."
    )


def test_responses_carry_a_system_fingerprint_of_what_the_bits_depend_on(server):
    """OpenAI's system_fingerprint (it was absent): the same in whole and streamed responses of
    both routes, and the digest of launch.fingerprint.bit_settings, so an engine of the same
    config on the same code and machine has the same one."""
    import re

    from launch.fingerprint import system_fingerprint
    from moe_runtime.config import load_config
    from moe_runtime.engine.engine import LLMEngine

    whole = server.http.post(CHAT, json=BODY).json()["system_fingerprint"]
    assert re.fullmatch(r"fp_[0-9a-f]{16}", whole), whole
    chunks = sse_events(server.http, CHAT, {**BODY, "stream_options": {"include_usage": True}})
    assert {chunk["system_fingerprint"] for chunk in chunks} == {whole}
    completion = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert completion.json()["system_fingerprint"] == whole
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    parsed = client.completions.create(model=server.model, prompt="hi", max_tokens=1)
    assert parsed.system_fingerprint == whole
    engine = LLMEngine(load_config(TINY_CONFIG))
    try:
        assert system_fingerprint(engine) == whole
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("overrides", "same"),
    [
        ({"scheduler.max_num_seqs": 3, "cache.num_blocks": 300}, True),  # change no bit
        # neither does the admission reserve (which sequences share a step); it was recorded
        ({"scheduler.admission_reserve": 0}, True),
        ({"parallel.weight_read_timeout_s": 60}, True),  # a bound, in no mode part of the bits
        ({"cache.block_size": 32}, False),  # the attention's KV splits
        ({"kernels.mode": "fast"}, False),
    ],
)
def test_the_system_fingerprint_changes_with_what_can_change_bits(overrides, same):
    from launch.fingerprint import system_fingerprint
    from moe_runtime.config import load_config
    from moe_runtime.engine.engine import LLMEngine

    fingerprints = []
    for config in (load_config(TINY_CONFIG), load_config(TINY_CONFIG, overrides)):
        engine = LLMEngine(config)
        try:
            fingerprints.append(system_fingerprint(engine))
        finally:
            engine.shutdown()
    assert (fingerprints[0] == fingerprints[1]) is same, fingerprints


def test_a_template_refusing_the_messages_is_a_400_naming_them(tmp_path):
    """raise_exception in the model's template (here: more than one message) answered a 400
    whose `param` was null; it names `messages` now, as every other fault of theirs."""
    write_byte_level_bpe(tmp_path, "hello world", ("<bos>", "<eos>"))
    template = (
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages[0]['content'] }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    # The template runs before the engine is reached: no engine needed.
    backend = Backend(engine=None, tokenizer=HFTokenizer(tmp_path, None, None))
    client = TestClient(create_app(load_config(TINY_CONFIG), backend))
    response = client.post(CHAT, json={"messages": [*MESSAGES, *MESSAGES]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "the chat template failed: one message only" in error["message"]
