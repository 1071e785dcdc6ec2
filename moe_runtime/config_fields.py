"""The keys a config section may hold and the types of their values, read from its dataclass.

A section's own checks cover ranges and choices; this covers what YAML and `--set` hand over
loosely, the same way for every section (`check_section`): a key with no field, `true` where an
int or a float is meant (Python counts a bool as an int), a word where an on/off key is meant
(any non-empty string is truthy), `.inf` or `.nan` for a number, a number where text is meant.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from typing import Any

_NAMES = {
    bool: ("true", "false"),
    int: ("an int",),
    float: ("a finite number",),
    str: ("a string",),
    type(None): ("null",),
}


def is_int(value: Any) -> bool:
    """A Python int that is not a bool (Python counts True as the int 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_section(section: str, cls: type, values: dict[str, Any]) -> None:
    """A config section's keys and value types: a key `cls` has no field for, then a value its
    field does not allow (check_field_types, ints sized), each a ValueError naming
    `section.key`."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key {section}.{unknown[0]} (known: {sorted(known)})")
    check_field_types(section, cls, values, is_sized=True)


def check_field_types(
    section: str, cls: type, values: dict[str, Any], is_sized: bool = False
) -> None:
    """Raise ValueError naming `section.key` for the first value its field's annotation does
    not allow. Annotations other than bool, int, float, str and their unions (with None, or
    with each other) are left to the class's own checks. is_sized: an int must also fit in 64
    bits (a config's sizes and counts; a class with ranges of its own says them itself)."""
    kinds_of = _field_kinds(cls)
    for key, value in values.items():
        kinds = kinds_of.get(key, ())
        is_integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if is_sized and int in kinds and is_integer and not -(2**63) <= value < 2**63:
            # torch's sizes and every counter are 64-bit: past that, an overflow deep inside
            raise ValueError(f"{section}.{key} must be an int that fits in 64 bits, got {value}")
        if kinds and not any(_is_a(value, kind) for kind in kinds):
            names = [name for kind in kinds for name in _NAMES[kind]]
            expected = " or ".join([", ".join(names[:-1]), names[-1]] if names[1:] else names)
            raise ValueError(f"{section}.{key} must be {expected}, got {value!r}")


@functools.cache
def _field_kinds(cls: type) -> dict[str, tuple[type, ...]]:
    """Each field's simple kinds, read once a class (get_type_hints evaluates the annotation
    strings: ~0.2 ms, too dear for a SamplingParams a request)."""
    return {key: _simple_kinds(hint) for key, hint in typing.get_type_hints(cls).items()}


def _simple_kinds(hint: Any) -> tuple[type, ...]:
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    kinds = typing.get_args(hint) if is_union else (hint,)
    return kinds if all(kind in _NAMES for kind in kinds) else ()


def _is_a(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False  # not an int, a float or text
    if kind is int:  # numpy's integer scalars too
        return isinstance(value, numbers.Integral)
    if kind is float:  # numpy's floats too
        return isinstance(value, numbers.Real) and math.isfinite(value)
    if kind is str:
        return isinstance(value, str)
    return value is None
