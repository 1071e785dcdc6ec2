"""Chat templates: messages -> prompt text, rendered with Jinja2 in a sandbox.

A model directory's tokenizer_config.json may carry a `chat_template` (HF's Jinja format,
rendered with `messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`). Without
one, `DEFAULT_CHAT_TEMPLATE` is used: each message as `<|role|>` on its own line followed by its
content and a newline, then `<|assistant|>` and a newline for the reply.
"""

from __future__ import annotations

from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(
    template: str, messages: list[dict[str, str]], bos_token: str = "", eos_token: str = ""
) -> str:
    """The prompt text for `messages` ([{"role", "content"}]); ValueError if the template
    rejects them."""
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as exc:
        raise ValueError(f"messages: the chat template failed: {exc}") from None
