"""HFTokenizer and load_tokenizer: a tokenizer.json built here with the tokenizers library.

A WordLevel tokenizer over a few words stands in for a model's tokenizer; the engine must pick
it up from `model.path` and use it for text prompts, decoding and chat templates.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from moe_runtime import LLM, SamplingParams
from moe_runtime.config import load_config
from moe_runtime.model_config import ModelConfig
from moe_runtime.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.checkpoints import TINY_HF, write_tiny_checkpoint
from tests.invariance import TINY_CONFIG

WORDS = ["<bos>", "<eos>", "[UNK]", "hello", "world", "the", "fox", "<|user|>", "<|assistant|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(
    directory,
    chat_template: str | None = None,
    add_bos_token: bool | None = True,
    is_bos_post_processed: bool = False,
) -> None:
    """add_bos_token: tokenizer_config.json's (None: no key); is_bos_post_processed: the
    tokenizer's post-processor puts bos before the text (a TemplateProcessing, as Llama's)."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<bos>", "<eos>", "<|user|>", "<|assistant|>"])
    if is_bos_post_processed:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 0)]
        )
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<bos>", "eos_token": {"content": "<eos>"}}
    if add_bos_token is not None:
        settings["add_bos_token"] = add_bos_token
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.fixture
def model_config(tmp_path):
    write_tokenizer(tmp_path, TEMPLATE)
    raw = load_config(TINY_CONFIG).model
    # ModelConfig.path would read config.json; set it on a copy for load_tokenizer only.
    ids = {"bos_token_id": 0, "eos_token_id": 1}  # the tokenizer's <bos> and <eos>
    return raw.__class__(**{**raw.__dict__, "path": str(tmp_path), **ids})


def test_hf_tokenizer_encodes_decodes_and_templates(tmp_path):
    write_tokenizer(tmp_path, TEMPLATE)
    tok = HFTokenizer(tmp_path, bos_token_id=0, eos_token_id=1)
    assert tok.encode("hello the fox") == [0, 3, 5, 6]
    assert tok.encode("hello zebra") == [0, 3, 2]
    assert tok.decode([0, 3, 4, 1]) == "hello world"  # special tokens skipped
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>"
    ids = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert ids == [0, 7, 3, 4, 8]  # the template writes bos itself: no second one


def test_hf_tokenizer_without_template_uses_default(tmp_path):
    write_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path, bos_token_id=0, eos_token_id=1)
    assert not tok.has_chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "fox"}]) == [0, 7, 6, 8]


@pytest.mark.parametrize(
    ("add_bos_token", "is_bos_post_processed", "bos"),
    [
        (None, False, []),
        (False, False, []),
        (True, False, [0]),
        (None, True, [0]),
        (False, True, []),
    ],
    ids=["neither", "config_false", "config_true", "post_processor", "config_wins"],
)
def test_bos_is_added_by_the_tokenizers_own_rule(
    tmp_path, add_bos_token, is_bos_post_processed, bos
):
    """tokenizer_config.json's add_bos_token where it is set, else whether the tokenizer's
    post-processor adds bos, as transformers encodes text; bos was put before every text,
    for tokenizers that add none too. A model template writing {{ bos_token }} gets one."""
    write_tokenizer(tmp_path, None, add_bos_token, is_bos_post_processed)
    tok = HFTokenizer(tmp_path, bos_token_id=0, eos_token_id=1)
    assert tok.encode("hello the fox") == [*bos, 3, 5, 6]
    assert tok.apply_chat_template([{"role": "user", "content": "fox"}]) == [*bos, 7, 6, 8]
    write_tokenizer(tmp_path, TEMPLATE, add_bos_token, is_bos_post_processed)
    templated = HFTokenizer(tmp_path, bos_token_id=0, eos_token_id=1)
    assert templated.apply_chat_template([{"role": "user", "content": "fox"}]) == [0, 7, 6, 8]


def test_load_tokenizer_picks_by_model_dir(model_config):
    assert isinstance(load_tokenizer(model_config), HFTokenizer)
    no_path = model_config.__class__(**{**model_config.__dict__, "path": None})
    assert isinstance(load_tokenizer(no_path), ByteTokenizer)
    small = {"vocab_size": 4, "bos_token_id": 0, "eos_token_id": 1}
    tiny_vocab = model_config.__class__(**{**model_config.__dict__, **small})
    with pytest.raises(ValueError, match="model.vocab_size=4"):
        load_tokenizer(tiny_vocab)


def write_checkpoint(directory) -> None:
    """The tiny random V3 checkpoint, its bos and eos the tokenizer's <bos> and <eos>."""
    write_tiny_checkpoint(directory, "v3", seed=0, q_lora_rank=None, bos_token_id=0, eos_token_id=1)


@pytest.mark.parametrize(
    ("file", "fields", "generation", "key", "token_id"),
    [
        ("config.json", {"bos_token_id": 256}, None, "bos_token_id", 256),
        ("config.json", {"eos_token_id": 257}, None, "eos_token_id", 257),
        ("config.json", {"eos_token_id": [1, 300]}, None, "eos_token_id", 300),
        ("generation_config.json", {}, {"eos_token_id": [1, 9]}, "eos_token_id", 9),
    ],
    ids=["bos", "eos", "eos_list", "generation_eos"],
)
def test_a_bos_or_eos_id_the_tokenizer_lacks_is_refused_at_load(
    tmp_path, file, fields, generation, key, token_id
):
    """A bos or eos id inside model.vocab_size but past tokenizer.json's tokens loaded without
    a word (the template's eos_token string came out empty; the id had no text): refused at
    load, naming the file, the key and the id."""
    config = {**TINY_HF, "model_type": "deepseek_v3", "q_lora_rank": None}
    config.update(routed_scaling_factor=1.0, bos_token_id=0, eos_token_id=1)
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    write_tokenizer(tmp_path, TEMPLATE)
    model_config = ModelConfig.from_dict({"path": str(tmp_path)})
    with pytest.raises(ValueError) as err:
        load_tokenizer(model_config)
    expected = f"{tmp_path / file}: {key} {token_id} is refused: {tmp_path / 'tokenizer.json'}"
    assert f"{expected} has no token {token_id} (its {len(WORDS)} tokens)" in str(err.value)


@pytest.mark.parametrize("name", ["tokenizer.model", "tokenizer_config.json"])
def test_a_model_dir_with_another_tokenizer_alone_is_refused(model_config, name):
    """A sentencepiece model (or a tokenizer config) without tokenizer.json was silently
    replaced by bytes: a real model fed ids it never learned. The refusal names the file."""
    directory = Path(model_config.path)
    (directory / "tokenizer.json").unlink()
    for other in ("tokenizer_config.json", "tokenizer.model"):
        (directory / other).unlink(missing_ok=True)
    assert isinstance(load_tokenizer(model_config), ByteTokenizer)  # nothing there: bytes
    (directory / name).write_text("{}")
    with pytest.raises(ValueError, match=rf"holds {re.escape(name)} but no tokenizer\.json"):
        load_tokenizer(model_config)


def test_engine_uses_the_model_dirs_tokenizer(tmp_path):
    """A written checkpoint plus tokenizer.json: text prompts go through the HF tokenizer."""
    pytest.importorskip("transformers")
    write_checkpoint(tmp_path)
    write_tokenizer(tmp_path, TEMPLATE)
    llm = LLM({"model": {"path": str(tmp_path)}, "scheduler": {"max_model_len": 64}})
    assert isinstance(llm.tokenizer, HFTokenizer)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    by_text = llm.generate(["hello the fox"], params)[0]
    bos = llm.tokenizer.bos_token_id
    by_ids = llm.generate([[*([bos] if bos is not None else []), 3, 5, 6]], params)[0]
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.token_ids == by_ids.token_ids
    # (WordLevel's decode joins with spaces: a continuation's text starts with one)
    assert by_text.text.lstrip() == llm.tokenizer.decode(by_text.token_ids)
    llm.shutdown()


@pytest.mark.parametrize(
    ("file", "text", "match"),
    [
        ("tokenizer.json", '{1: "x"}', "is not a valid tokenizer file"),
        ("tokenizer_config.json", "{not json", "is not valid JSON"),
        ("tokenizer_config.json", "[1, 2]", "holds a JSON list, not an object"),
    ],
    ids=["tokenizer_json", "config_syntax", "config_list"],
)
def test_malformed_tokenizer_file_is_named(model_config, tmp_path, file, text, match):
    (tmp_path / file).write_text(text)
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / file))} {match}"):
        load_tokenizer(model_config)


def test_a_long_text_is_encoded_without_holding_pythons_lock(tmp_path):
    """Prompts are tokenized in a worker thread so that the event loop and the engine's thread
    go on meanwhile; tokenizers' encode held Python's lock for the whole call (a 5 MB text:
    3.6 s of every other thread stopped), its encode_batch releases it. Counted: a thread's
    ticks during one encode. The ids are encode's."""
    import threading
    import time

    from tests.checkpoints import write_byte_level_bpe

    write_byte_level_bpe(tmp_path, "the cat sat on the mat. " * 50)
    tokenizer = HFTokenizer(tmp_path, bos_token_id=None, eos_token_id=None)
    text = "the cat sat on the mat, and the dog did not. " * 60_000  # 2.7 MB
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(0.05)
    before = ticks[0]
    started = time.monotonic()
    ids = tokenizer.encode(text)
    seconds, during = time.monotonic() - started, ticks[0] - before
    stop.set()
    ticker.join(5)
    assert ids == tokenizer._tokenizer.encode(text, add_special_tokens=False).ids
    # ~900 ticks a second with the lock free; a held lock lets through one or two at most
    assert during >= max(5, 200 * seconds), f"{during} ticks in a {seconds:.2f} s encode"


@pytest.mark.parametrize("world_size", [1, 2])
def test_ids_past_the_tokenizer_are_never_sampled(tmp_path, request, world_size):
    """The model's vocabulary is often padded past its tokenizer's (V2-Lite: 102400 rows for
    100002 tokens); ids there decode to nothing, so a sample of them came back as empty text
    without a word. Here a tokenizer of 9 tokens serves a model of 512 (its EOS is the
    tokenizer's <eos>: one past the tokenizer is refused at load): every sampled id, greedy or
    drawn, is one the tokenizer has, on one rank and on two (the engine hands every rank the
    bound). Raw logprobs stay the model's: decode equals score()."""
    pytest.importorskip("transformers")
    if world_size > 1:
        request.getfixturevalue("ray_local")
    write_checkpoint(tmp_path)
    write_tokenizer(tmp_path, TEMPLATE)
    config = {"path": str(tmp_path)}
    parallel = {"world_size": world_size}
    llm = LLM({"model": config, "parallel": parallel, "scheduler": {"max_model_len": 64}})
    num_tokens, eos = llm.tokenizer.vocab_size, llm.config.model.eos_token_id
    assert eos < num_tokens == len(WORDS) < llm.config.model.vocab_size
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
        *(SamplingParams(max_tokens=8, temperature=2.0, seed=s, logprobs=2) for s in range(6)),
        SamplingParams(max_tokens=8, temperature=1.0, top_k=3, seed=9, logprobs_mode="processed"),
    ]
    outs = llm.generate(["hello the fox"] * len(params), params)
    sampled = {t for out in outs for t in out.token_ids}
    assert sampled <= set(range(num_tokens)), sorted(sampled)
    # (WordLevel's decode joins with spaces: a continuation's text starts with one)
    assert all(out.text.lstrip() == llm.tokenizer.decode(out.token_ids) for out in outs)
    greedy = outs[0]
    scored = llm.score([greedy.prompt_token_ids + greedy.token_ids], [len(greedy.prompt_token_ids)])
    assert scored[0] == greedy.logprobs
    llm.shutdown()
