"""Chat templates: messages -> prompt text, rendered with Jinja2 in a sandbox.

A model directory's tokenizer_config.json may carry a `chat_template` (HF's Jinja format), or,
as transformers now saves it, a `chat_template.jinja` file beside it. It is rendered as
transformers renders it: with `messages` (each message's fields as given: an assistant's
`tool_calls` and a null `content`, a tool message's `tool_call_id` too), `add_generation_prompt`
(true unless the request says otherwise), `tools` and `documents` None (no tools are offered),
the tokenizer's special token strings (`bos_token`, `eos_token`, `pad_token`, ...),
`raise_exception`, Jinja's loop controls (`{% break %}`, `{% continue %}`), its
`{% generation %}` blocks (rendered as their body) and a `tojson` that keeps non-ASCII text and
key order; a final message to continue (an assistant's prefill) ends the prompt where its
content ends.
Not given: `strftime_now` (a prompt would change with the date, so the same request would not
give the same bits from one day to the next; a template that checks for it takes its own
fallback). A `developer` message (OpenAI's newer name for the system instruction) reaches a
template that never names that role as a `system` message: DeepSeek's templates know system,
user, assistant and tool only, and skip any other role without a word, so the instruction would
be lost. Without a template, `DEFAULT_CHAT_TEMPLATE` is used: each message as `<|role|>` on its
own line followed by its content and a newline (no content line for a null or empty content
with tool calls), then each of its tool calls as `<|tool_call|>name(arguments)` and a newline;
then, with add_generation_prompt, `<|assistant|>` and a newline.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] or not message['tool_calls'] %}"
    "{{ message['content'] or '' }}\n"
    "{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "<|tool_call|>{{ call['function']['name'] }}({{ call['function']['arguments'] }})\n"
    "{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class _GenerationBlock(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks an assistant's text
    for its training masks: rendered as its body alone, in a scope of its own as transformers
    renders it. Without it a template using the tag failed to load."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _tojson(
    value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False
) -> str:
    """transformers' tojson: Jinja's own escapes HTML and non-ASCII and sorts keys."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """The compiled template; ValueError naming the problem if it is not valid Jinja."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc}") from None


def _developer_as_system(message: dict[str, Any]) -> dict[str, Any]:
    return {**message, "role": "system"} if message.get("role") == "developer" else message


# Put after the final message's content to find where it ends in the prompt (continue_final_
# message); its trailing space tells whether the template trimmed the content's end.
_FINAL_MESSAGE_END = "<|moe-runtime:final-message-ends-here|> "


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **special_tokens: str | list[str],
) -> str:
    """The prompt text for `messages` ([{"role", "content", ...}]); ValueError if the template
    rejects them or fails on them (any exception it raises: a bad message is a bad request).
    add_generation_prompt: the template opens the assistant's next turn. continue_final_message
    (not with add_generation_prompt): the prompt ends where the final message's content ends,
    so the model continues that message (an assistant's prefill), as transformers cuts it:
    after the content as rendered, or, where the template trimmed it, with the whitespace at
    its end stripped."""
    compiled = compile_chat_template(template)
    if template != DEFAULT_CHAT_TEMPLATE and "developer" not in template:
        messages = [_developer_as_system(message) for message in messages]
    if continue_final_message:
        messages = _marked_final_message(messages)
    try:
        text = compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **special_tokens,
        )
    except Exception as exc:  # raise_exception's TemplateError, or the template's own bug
        detail = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"messages: the chat template failed: {detail}") from None
    return _cut_at_final_message_end(text) if continue_final_message else text


def _marked_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with _FINAL_MESSAGE_END after the final one's content (a copy)."""
    if not messages:
        raise ValueError("continue_final_message: there is no final message to continue")
    content = messages[-1].get("content")
    if not isinstance(content, str):
        raise ValueError(
            f"continue_final_message: messages[{len(messages) - 1}] (the final message) has no "
            f"content to continue: its content is {content!r}, not text (an assistant message "
            "with tool calls alone)"
        )
    final = messages[-1]
    return [*messages[:-1], {**final, "content": final["content"] + _FINAL_MESSAGE_END}]


def _cut_at_final_message_end(text: str) -> str:
    marker = _FINAL_MESSAGE_END.rstrip()
    at = text.rfind(marker)
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not write the final message's "
            "content as it is (it drops or rewrites its end), so the prompt cannot end inside it"
        )
    if text.startswith(_FINAL_MESSAGE_END, at):
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the content: its end's spaces too
