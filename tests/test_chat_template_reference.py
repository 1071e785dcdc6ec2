"""Chat prompts against transformers' `apply_chat_template`, the outside reference: the same
token ids for templates that use what transformers gives a template (loop controls, its
`tojson`, its `{% generation %}` blocks, `tools` None, the special-token strings, a message's
`name`, an assistant's `tool_calls` and a tool message's `tool_call_id`), read from
tokenizer_config.json or from `chat_template.jinja` (where transformers saves it now), and the
same refusals. The tokenizer is a byte-level BPE trained here with special tokens added; the
templates are written for this test in the style of real ones.
"""

from __future__ import annotations

import json

import pytest

from moe_runtime.tokenizer import HFTokenizer
from tests.checkpoints import write_byte_level_bpe

transformers = pytest.importorskip("transformers")

SPECIAL = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
TEMPLATES = {
    "loop_controls": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "<User>{{ m['content'] | trim }}{{ eos_token }}"
        "{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<Assistant>{% endif %}"
    ),
    "tojson": (
        "{{ bos_token }}{{ messages | tojson }}{{ messages[0] | tojson(indent=2) }}<Assistant>"
    ),
    "tools_none": (
        "{% if tools is not none %}[TOOLS]{{ tools }}[/TOOLS]{% endif %}"
        "{% if documents is not none %}[DOCS]{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}<Assistant>"
    ),
    "other_specials": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ pad_token }}"
    "{{ unk_token }}{% endfor %}<Assistant>",
    # transformers' tag marking an assistant's text for training masks, with a `set` inside
    # that must not leak out of the block
    "generation_tag": (
        "{% set seen = 'none' %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "<Assistant>{% generation %}{% set seen = 'inner' %}{{ m['content'] }}{{ eos_token }}"
        "{% endgeneration %}{% else %}<User>{{ m['content'] }}{% endif %}{% endfor %}"
        "{{ seen }}{% if add_generation_prompt %}<Assistant>{% endif %}"
    ),
    "named_speakers": (
        "{% for m in messages %}{% if m.name %}{{ m.name }}: {% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<Assistant>"
    ),
}
MESSAGES = [
    {"role": "system", "content": "you are helpful"},
    {"role": "user", "content": '  héllo wörld 日本 <Assistant> "quoted" & <b>  ', "name": "bob"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "and you?"},
]


def _tokenizer_dir(directory, settings: dict, jinja: str | None = None):
    specials = ("<bos>", "<eos>", "<pad>", "<unk>", "<User>", "<Assistant>")
    write_byte_level_bpe(directory, "hello world you are helpful and you", specials)
    (directory / "tokenizer_config.json").write_text(json.dumps({**SPECIAL, **settings}))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    return directory


def _reference_ids(directory) -> list[int]:
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    return list(reference.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])


@pytest.mark.parametrize("where", ["tokenizer_config", "chat_template_jinja"])
@pytest.mark.parametrize("name", TEMPLATES)
def test_prompt_ids_equal_transformers(tmp_path, name, where):
    template = TEMPLATES[name]
    if where == "tokenizer_config":
        directory = _tokenizer_dir(tmp_path, {"chat_template": template})
    else:  # a directory saved by transformers: the template in its own file
        directory = _tokenizer_dir(tmp_path, {}, jinja=template)
    ours = HFTokenizer(directory, bos_token_id=None, eos_token_id=None)
    assert ours.has_chat_template, "engagement: the model's template, not the default"
    assert ours.apply_chat_template(MESSAGES) == _reference_ids(directory)


@pytest.mark.parametrize(
    "in_config",
    [TEMPLATES["loop_controls"], [{"name": "rag", "template": "R"}], 7],
    ids=["a_template", "named_templates_without_default", "not_a_template"],
)
def test_a_chat_template_jinja_file_wins_over_the_configs_template(tmp_path, in_config):
    """transformers reads `chat_template.jinja` over tokenizer_config.json's entry."""
    directory = _tokenizer_dir(tmp_path, {"chat_template": in_config}, TEMPLATES["tojson"])
    ours = HFTokenizer(directory, bos_token_id=None, eos_token_id=None)
    assert ours.apply_chat_template(MESSAGES) == _reference_ids(directory)
    assert ours.decode(ours.apply_chat_template(MESSAGES)).startswith("[{")  # the file's


# A tool-calling history read as templates read it: an assistant turn's tool calls (dicts), a
# tool message's tool_call_id. Written to read a null content and an absent one alike.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['tool_calls'] is defined %}[{{ m['role'] }}]{{ m['content'] or '' }}"
    "{% for t in m['tool_calls'] %}<User>{{ t['type'] }} {{ t['function']['name'] }} "
    "{{ t['function']['arguments'] }} {{ t['id'] }}{% endfor %}{{ m['tool_calls'] | tojson }}"
    "{% elif m['role'] == 'tool' %}<out {{ m['tool_call_id'] }}>{{ m['content'] }}"
    "{% else %}[{{ m['role'] }}]{{ m['content'] }}{% endif %}"
    "{% endfor %}<Assistant>"
)
# DeepSeek-V3's test for the tool-call turn.
NULL_CONTENT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and m['content'] is none %}"
    "{% for t in m['tool_calls'] %}<User>{{ t['function']['name'] }}{% endfor %}"
    "{% else %}[{{ m['role'] }}]{{ m['content'] }}{% endif %}{% endfor %}<Assistant>"
)
TOOL_MESSAGES = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"at": 1}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {
        "role": "assistant",
        "content": "and more",
        "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "v", "arguments": "{}"}}
        ],
    },
]


def test_a_tool_calling_history_renders_as_transformers_renders_it(tmp_path):
    """The server's messages (ChatMessage.template_fields) give the ids transformers gives
    the client's dicts: tool_calls as dicts, a null content as None, tool_call_id kept."""
    from launch.openai.chat_schemas import ChatMessage

    directory = _tokenizer_dir(tmp_path, {"chat_template": TOOL_TEMPLATE})
    served = [ChatMessage.model_validate(m).template_fields() for m in TOOL_MESSAGES]
    ours = HFTokenizer(directory, None, None).apply_chat_template(served)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    expected = reference.apply_chat_template(TOOL_MESSAGES, add_generation_prompt=True)
    assert ours == list(expected["input_ids"])


def test_a_null_content_reaches_the_template_as_none(tmp_path):
    """DeepSeek-V3's template finds the tool-call turn by `message['content'] is none`, so
    None is kept, as transformers 4 kept it (transformers 5 drops the key, and that template
    then fails on the turn)."""
    from launch.openai.chat_schemas import ChatMessage

    directory = _tokenizer_dir(tmp_path, {"chat_template": NULL_CONTENT_TEMPLATE})
    served = [ChatMessage.model_validate(m).template_fields() for m in TOOL_MESSAGES[:2]]
    ours = HFTokenizer(directory, None, None)
    assert ours.decode(ours.apply_chat_template(served)) == "[user]weather in Paris?w"


def test_named_templates_without_a_default_are_refused_as_transformers_does(tmp_path):
    named = [{"name": "rag", "template": "R"}, {"name": "tool_use", "template": "T"}]
    directory = _tokenizer_dir(tmp_path, {"chat_template": named})
    with pytest.raises(ValueError, match=r"chat templates \['rag', 'tool_use'\] and none named"):
        HFTokenizer(directory, None, None).apply_chat_template(MESSAGES)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    with pytest.raises(ValueError):
        reference.apply_chat_template(MESSAGES)
    with_default = [*named, {"name": "default", "template": "D{{ messages[0]['role'] }}"}]
    directory = _tokenizer_dir(tmp_path, {"chat_template": with_default})
    assert HFTokenizer(directory, None, None).apply_chat_template(MESSAGES) == _reference_ids(
        directory
    )


def test_a_template_that_fails_is_a_refusal_naming_the_error(tmp_path):
    """A template's own bug (a TypeError here) on a message is a ValueError, not a crash."""
    directory = _tokenizer_dir(tmp_path, {"chat_template": "{{ messages[0]['content'] + 1 }}"})
    with pytest.raises(ValueError, match=r"the chat template failed: TypeError"):
        HFTokenizer(directory, None, None).apply_chat_template(MESSAGES)


def test_a_template_that_is_not_jinja_is_refused_at_load_naming_its_file(tmp_path):
    directory = _tokenizer_dir(tmp_path, {}, jinja="{% for m in messages %}unclosed")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: the chat template is not valid"):
        HFTokenizer(directory, None, None)


# Templates as real ones close a turn: an end token after the content, or the content trimmed
# first (its end's spaces then go too).
CLOSING_TEMPLATES = {
    "eos_after": TEMPLATES["generation_tag"],
    "trimmed": (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}<Assistant>{% endif %}"
    ),
}
PREFILLED = [*MESSAGES, {"role": "assistant", "content": "hello wörld  "}]


@pytest.mark.parametrize("name", CLOSING_TEMPLATES)
@pytest.mark.parametrize(
    "options",
    [
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False, "continue_final_message": False},
    ],
    ids=["continue_final_message", "no_generation_prompt"],
)
def test_the_template_options_cut_the_prompt_as_transformers_does(tmp_path, name, options):
    directory = _tokenizer_dir(tmp_path, {"chat_template": CLOSING_TEMPLATES[name]})
    ours = HFTokenizer(directory, None, None).apply_chat_template(PREFILLED, **options)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert ours == list(reference.apply_chat_template(PREFILLED, **options)["input_ids"])
    default = HFTokenizer(directory, None, None).apply_chat_template(PREFILLED)
    assert ours != default  # engagement: the options change the prompt


def test_a_final_message_the_template_drops_cannot_be_continued(tmp_path):
    directory = _tokenizer_dir(tmp_path, {"chat_template": TEMPLATES["loop_controls"]})
    options = {"add_generation_prompt": False, "continue_final_message": True}
    with pytest.raises(ValueError, match="continue_final_message: the chat template does not"):
        HFTokenizer(directory, None, None).apply_chat_template(PREFILLED, **options)
