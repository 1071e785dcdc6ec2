"""Strict JSON for what the server sends and the rollout job writes: never NaN nor Infinity.

Python's json writes `NaN`, `Infinity` and `-Infinity` by default, which are not JSON: strict
parsers (JavaScript's JSON.parse, Go's encoding/json, serde_json) refuse the whole body or line.
A logprob of -inf (a token of no probability: a -inf logit, or a token filtered out or held off
in processed logprobs) is written as LOGPROB_FLOOR instead, as vLLM's OpenAI server writes it.
Any other value that is not finite (a NaN logprob: the model's logits held NaN for that
request) has no JSON form and raises NonFiniteError, so the one response, stream or row that
holds it fails, saying why, and nothing else does. A generated sample never holds one (the
engine ends it at its NaN logits with finish_reason "error", keeping no NaN): a scoring may.
"""

from __future__ import annotations

import json
import math
from typing import Any

# What a logprob of -inf is written as (vLLM's: exp of it is 0.0 in fp64 as exp(-inf) is).
LOGPROB_FLOOR = -9999.0


class NonFiniteError(Exception):
    """A value with no JSON form (NaN, +inf) in what was to be written. Not a ValueError: the
    HTTP error table would take it for a bad request; it is the model's failure (a 500)."""


def dumps(content: Any, **options: Any) -> str:
    """json.dumps(content, **options) with -inf as LOGPROB_FLOOR; NonFiniteError for NaN or
    +inf. The content is walked only where the strict encoder refuses it (a rare body)."""
    try:
        return json.dumps(content, allow_nan=False, **options)
    except ValueError:  # a float that is not finite somewhere
        pass
    return json.dumps(_finite(content), allow_nan=False, **options)


def _finite(value: Any) -> Any:
    """value with every -inf float as LOGPROB_FLOOR (numpy's and torch's arrays and scalars as
    Python's); NonFiniteError for a NaN or +inf."""
    if isinstance(value, float):
        if value == -math.inf:
            return LOGPROB_FLOOR
        if not math.isfinite(value):
            raise NonFiniteError(
                f"a value of {value} has no JSON form (a NaN logprob: the model's logits held "
                "NaN for this request)"
            )
        return value
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    if hasattr(value, "tolist"):
        return _finite(value.tolist())
    return value
