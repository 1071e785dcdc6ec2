"""OpenAI response bodies from the engine's outputs: choices, logprobs blocks, usage, JSON.

A whole result and a streamed delta are the same `CompletionOutput` type, so one function
renders a choice of either, and streamed bits equal whole ones. Floats are written by Python's
json (shortest round-tripping repr), so each logprob reaches the client with its exact bits;
the JSON is strict (launch.strict_json): a -inf logprob is written as -9999.0, a NaN one fails
its response (NonFiniteError: a 500, or a stream's error chunk). Routed experts travel as
base64 of little-endian int32 [T, MoE layers, K], one row per generated token (with echo, the
prompt's rows first). Pure formatting: no engine calls, no error mapping.
"""

from __future__ import annotations

import base64
import codecs
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from launch import strict_json
from moe_runtime.engine.outputs import CompletionOutput


class ExactJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def dumps(content: Any) -> str:
    return strict_json.dumps(content, ensure_ascii=False, separators=(",", ":"), default=_plain)


def dumps_by_item(body: dict, key: str) -> str:
    """`dumps(body)`, the list under `key` encoded an item at a time: the same text. Why: json's
    C encoder holds the GIL for a whole call, so one call on a large body (11 MB: 512 samples x
    30 tokens x 20 logprobs) held the event loop for as long even from another thread."""
    fields = (
        f"{dumps(name)}:[{','.join(dumps(item) for item in value)}]"
        if name == key
        else f"{dumps(name)}:{dumps(value)}"
        for name, value in body.items()
    )
    return "{" + ",".join(fields) + "}"


def _plain(value: Any) -> Any:
    """numpy/torch scalars and arrays in engine reports, as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# Characters JSON leaves raw (ensure_ascii=False) that line splitters such as str.splitlines,
# which httpx's and requests' iter_lines use, take for line ends: one of them in a token's text
# cut a data line in two for such a client. Escaped, the JSON decodes to the same text.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict) -> str:
    """One server-sent event: the payload's JSON on one line, whatever text it carries."""
    return f"data: {dumps(payload).translate(_LINE_BREAKS)}\n\n"


def usage(num_in: int, num_out: int) -> dict:
    return {"prompt_tokens": num_in, "completion_tokens": num_out, "total_tokens": num_in + num_out}


class TextOffsets:
    """Where each token of a choice starts in its text, in characters, carried across the
    chunks of a stream: the characters the bytes of the tokens before it decode to (UTF-8,
    invalid bytes replaced by U+FFFD as the text has them). A character split over tokens is
    where each of its tokens starts; counting each token's own decoded text instead (a lone
    piece of a character is a U+FFFD) drifted past the text's end on non-ASCII text. `start`:
    where the first token's bytes begin in the text (negative where the text drops what they
    begin with: an echoed prompt's leading sentencepiece space); offsets stop at 0."""

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = start

    def take(self, token_ids: list[int], tokenizer) -> list[int]:
        """The offsets of the next tokens."""
        offsets = []
        for token_id in token_ids:
            data = tokenizer.token_bytes(token_id)
            held = self._decoder.getstate()[0]  # the start of a character, not yet complete
            offset = self._num_chars
            if data and held and not _can_begin_a_character(held + data[:1]):
                offset += len(held.decode("utf-8", errors="replace"))  # its U+FFFDs first
            offsets.append(max(0, offset))
            self._num_chars += len(self._decoder.decode(data))
        return offsets


def _can_begin_a_character(prefix: bytes) -> bool:
    """Whether the bytes are the start of a well-formed UTF-8 character (Unicode's table of
    well-formed byte sequences; Python's decoder holds ED A0.., a surrogate's, as if they
    were)."""
    lead = prefix[0]
    if not 0xC2 <= lead <= 0xF4:
        return False
    length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    low, high = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF)}.get(
        lead, (0x80, 0x8F) if lead == 0xF4 else (0x80, 0xBF)
    )
    rest = prefix[1:]
    return (
        len(prefix) <= length
        and (not rest or low <= rest[0] <= high)
        and all(0x80 <= b <= 0xBF for b in rest[1:])
    )


def token_text(token_id: int, tokenizer) -> str:
    """A token's text as it stands in the output (its bytes; U+FFFD for a piece of a
    character), so the tokens of a choice joined give its text where no character is split."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Echo:
    """A prompt put before its completion: its text, ids and, where they were asked for,
    each token's logprob and top logprobs (None for the first: nothing comes before it)."""

    text: str
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    # [len - 1, MoE layers, K]: the routed experts of each token but the first (those of the
    # position before it), where they were asked for and the prompt was scored.
    routed_experts: np.ndarray | None = None

    @classmethod
    def of(
        cls,
        text: str,
        token_ids: list[int],
        scored: CompletionOutput | None,
        routed_width: tuple[int, int] | None = None,
    ) -> Echo:
        """scored: the teacher-forced scoring of token_ids[1:] (LLMEngine's), or None (a
        one-token prompt, or nothing asked). routed_width: (MoE layers, K) where routed experts
        were asked: an unscored prompt then has no rows, [0, MoE layers, K]."""
        if scored is None:
            nothing = [None] * len(token_ids)
            rows = None if routed_width is None else np.zeros((0, *routed_width), np.int32)
            return cls(text, token_ids, nothing, list(nothing), rows)
        tops = [None, *scored.top_logprobs]
        return cls(text, token_ids, [None, *scored.logprobs], tops, scored.routed_experts)


def completion_choice(
    index: int,
    out: CompletionOutput,
    tokenizer,
    offsets: TextOffsets | None,
    echo: Echo | None = None,
) -> dict:
    """A text_completion choice, with logprobs where `offsets` is given (the choice's, carried
    from chunk to chunk); `echo`, the prompt, is prepended with its logprobs."""
    text, token_ids = out.text, list(out.token_ids)
    logprobs: list[float | None] = list(out.logprobs)
    tops: list[dict[int, float] | None] = list(out.top_logprobs)
    routed = out.routed_experts
    if echo is not None:
        text, token_ids = echo.text + text, [*echo.token_ids, *token_ids]
        logprobs, tops = [*echo.logprobs, *logprobs], [*echo.top_logprobs, *tops]
        if echo.routed_experts is not None:  # the prompt's rows, then the generated tokens'
            generated = [] if routed is None or not len(routed) else [np.asarray(routed)]
            routed = np.concatenate([np.asarray(echo.routed_experts), *generated])
    choice = {
        "index": index,
        "text": text,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "logprobs": completion_logprobs(token_ids, logprobs, tops, tokenizer, offsets)
        if offsets is not None
        else None,
        "token_ids": token_ids,
    }
    return _with_sample_fields(choice, out, routed)


def completion_logprobs(token_ids, logprobs, tops, tokenizer, offsets: TextOffsets) -> dict:
    """OpenAI's completion logprobs block: each generated token's `top_logprobs` hold the
    sampled token too (OpenAI's rule: up to logprobs + 1 entries), `top_logprob_ids` the
    engine's exact top-k alone."""
    by_text = [
        None
        if top is None
        else _by_text(top if token_id in top else {**top, token_id: logprob}, tokenizer)
        for token_id, logprob, top in zip(token_ids, logprobs, tops, strict=True)
    ]
    return {
        "tokens": [token_text(t, tokenizer) for t in token_ids],
        "token_logprobs": list(logprobs),
        "top_logprobs": by_text,
        "text_offset": offsets.take(token_ids, tokenizer),
        "top_logprob_ids": [None if top is None else dict(top) for top in tops],
    }


def _by_text(top: dict[int, float], tokenizer) -> dict[str, float]:
    """OpenAI's top_logprobs keyed by token text; on a collision the more likely id wins."""
    result: dict[str, float] = {}
    for token_id, logprob in top.items():
        key = token_text(token_id, tokenizer)
        if key not in result or logprob > result[key]:
            result[key] = logprob
    return result


def chat_choice(
    key: str, message: dict, out: CompletionOutput, tokenizer, with_logprobs: bool
) -> dict:
    """A chat choice: `key` is "message" (whole) or "delta" (streamed)."""
    choice = {
        "index": out.index,
        key: message,
        "logprobs": chat_logprobs(out, tokenizer) if with_logprobs else None,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "token_ids": list(out.token_ids),
    }
    return _with_sample_fields(choice, out)


def chat_logprobs(out: CompletionOutput, tokenizer) -> dict:
    """OpenAI's chat logprobs block, with the exact `token_id` on every entry."""
    return {
        "content": [
            {
                **_entry(token_id, logprob, tokenizer),
                "top_logprobs": [_entry(t, lp, tokenizer) for t, lp in top.items()],
            }
            for token_id, logprob, top in zip(
                out.token_ids, out.logprobs, out.top_logprobs, strict=True
            )
        ]
    }


def _entry(token_id: int, logprob: float, tokenizer) -> dict:
    """`bytes` are the token's own (a piece of a character too), so that joined they give
    the text's UTF-8, as OpenAI documents them."""
    return {
        "token": token_text(token_id, tokenizer),
        "logprob": logprob,
        "bytes": list(tokenizer.token_bytes(token_id)),
        "token_id": token_id,
    }


def _with_sample_fields(
    choice: dict, out: CompletionOutput, routed: np.ndarray | None = None
) -> dict:
    """Adds the sample's own `weight_version` and `first_weight_version` (the body's are the
    newest and oldest over all its samples: with n > 1 a client could not tell which sample
    ran across an update), and `routed_experts` when the request asked for them (the engine
    returns them only then; `routed`, the sample's with an echoed prompt's before them):
    {"data": base64 of little-endian int32, "shape": [T, MoE layers, K], "dtype"}."""
    choice["weight_version"] = out.weight_version
    choice["first_weight_version"] = out.first_weight_version
    routed = out.routed_experts if routed is None else routed
    if routed is not None:
        routed = np.asarray(routed, dtype="<i4")
        data = base64.b64encode(routed.tobytes()).decode("ascii")
        choice["routed_experts"] = {"data": data, "shape": list(routed.shape), "dtype": "int32"}
    return choice
