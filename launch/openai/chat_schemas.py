"""The /v1/chat/completions request and its messages (launch.openai.schemas has the fields it
shares with /v1/completions).

A chat history may hold tool calls (an assistant's `tool_calls`, a tool message's
`tool_call_id`): they reach the chat template as transformers hands them over, though the server
offers no tools. The other fields of an assistant message as the openai client dumps it are
accepted with the values that carry nothing, and refused naming the field otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from launch.openai.schemas import (
    SamplingFields,
    Strict,
    is_no_list,
    is_null,
    no_op_only,
    utf8_encodable,
)

# The same for a chat message's fields: what an assistant message of the openai client's
# `message.model_dump()` holds besides its content and tool calls.
MESSAGE_NO_OP_VALUES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "refusal": ("null", is_null),
    "annotations": ("null or []", is_no_list),
    "audio": ("null", is_null),
    "function_call": (
        "null; the deprecated function_call is not supported, send tool_calls",
        is_null,
    ),
}


class TextPart(Strict):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _encodable(cls, value: str) -> str:
        return utf8_encodable(value)


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text as the model wrote it, passed on unparsed as OpenAI does

    @field_validator("name", "arguments")
    @classmethod
    def _encodable(cls, value: str) -> str:
        return utf8_encodable(value)


class ToolCall(Strict):
    """A tool call in an assistant message of the history, OpenAI's shape."""

    id: str
    type: Literal["function"]
    function: FunctionCall

    @field_validator("id")
    @classmethod
    def _encodable(cls, value: str) -> str:
        return utf8_encodable(value)


class ChatMessage(Strict):
    """A message of the history. `content` may be null (or absent) or `[]` only in an
    assistant message with tool calls, as OpenAI allows; `tool_calls` belong to assistant
    messages, `tool_call_id` to tool messages (required there); the other fields of the openai
    client's `message.model_dump()` are accepted with the values that carry nothing."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None

    @field_validator("content", "name", "tool_call_id")
    @classmethod
    def _encodable(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        return utf8_encodable(value) if isinstance(value, str) else value

    @field_validator(*MESSAGE_NO_OP_VALUES, mode="before")
    @classmethod
    def _no_op_only(cls, value: Any, info) -> Any:
        return no_op_only(MESSAGE_NO_OP_VALUES, info.field_name, value)

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has them, not a {self.role}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id: only a tool message has one, not a {self.role}")
        if self.tool_call_id is None and self.role == "tool":  # OpenAI requires it too
            raise ValueError("tool_call_id: required in a tool message (the call it answers)")
        if self.content is None and not self.tool_calls:
            raise ValueError(
                "content: required (null or absent only in an assistant message with tool_calls)"
            )
        if self.content == [] and not self.tool_calls:  # OpenAI refuses it too
            raise ValueError(
                "content: [] holds no parts (an empty list only in an assistant message with "
                "tool_calls); send at least one text part, or a string"
            )
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        if not self.content:  # [] beside tool_calls: no content, as a null one
            return None
        return "\n".join(part.text for part in self.content)

    def template_fields(self) -> dict[str, Any]:
        """The message as the chat template reads it, as transformers hands it over: role,
        content (text parts joined with newlines, as vLLM joins them; a null content kept as
        None, as transformers 4 kept it: DeepSeek-V3's template finds the tool-call turn by
        `content is none`, and fails on it where transformers 5 drops the key), and `name`,
        `tool_calls` (a list of dicts) and `tool_call_id` when given. Null or empty tool_calls
        and the no-op fields are left out: they carry nothing, and a template that tests
        `'tool_calls' in message` would take them for calls."""
        fields: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            fields["name"] = self.name
        if self.tool_calls:
            fields["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        return fields


class ChatCompletionRequest(SamplingFields):
    """/v1/chat/completions; `max_tokens` (or `max_completion_tokens`) defaults to the room
    left in the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: the template opens the assistant's next turn (OpenAI's behaviour), or, instead,
    # the prompt ends inside the final message for the model to continue it (a prefill)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most server.max_logprobs: check_served
    response_format: Any = None
    parallel_tool_calls: Any = None
    metadata: Any = None
    store: Any = None
    tools: Any = None
    tool_choice: Any = None
    service_tier: Any = None
    modalities: Any = None
    reasoning_effort: Any = None

    @field_validator("continue_final_message")
    @classmethod
    def _a_final_message_to_continue(cls, value: bool, info) -> bool:
        if not value:
            return value
        if info.data.get("add_generation_prompt"):  # info.data: fields above
            raise ValueError("needs add_generation_prompt: false (no new turn is opened)")
        messages = info.data.get("messages")  # absent when they are bad themselves
        if messages and messages[-1].text() is None:  # null, or [] beside tool_calls
            shown = "null" if messages[-1].content is None else "[]"
            raise ValueError(
                f"messages[{len(messages) - 1}] (the final message) has no content to continue: "
                f"an assistant message with tool_calls and content {shown}"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info) -> int | None:
        if value is not None and not info.data.get("logprobs"):  # info.data: fields above
            raise ValueError("needs logprobs: true")
        return value

    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_options(self) -> dict[str, bool]:
        """The chat template's options (render_chat's)."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }

    def token_budget(self) -> int | None:
        """max_completion_tokens, else max_tokens: OpenAI deprecated max_tokens for it, so it
        wins where both are sent."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def token_budget_field(self) -> str:
        """The field `token_budget` reads, for errors to name."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def top_logprobs_field(self) -> str:
        return "top_logprobs"
