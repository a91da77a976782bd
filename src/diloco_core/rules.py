"""How a config field declares its valid values and how they are checked: every config dataclass of the
project (DiLoCo's, the transports', the trainer's) states its rules in field metadata, and a bad value raises a
``ValueError`` that names the field, the value and the valid range."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "Rule",
    "boolean",
    "check_field",
    "check_fields",
    "choice",
    "from_mapping",
    "integer",
    "is_finite_number",
    "is_int",
    "number",
    "rule",
    "string",
]


def check_field(name: str, value: object, ok: bool, valid: str) -> None:
    """Raise ``ValueError`` naming the field, the value and the valid range unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {valid}")


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


Bound = float | Callable[[Any], float] | None
"""A range's end: a number, or a callable of the config where the range depends on another field."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A config field's valid values, declared in its metadata (``field(default=1, metadata=integer(low=1))``)
    and checked by ``check_fields``: ``test`` holds and the value lies between ``low`` and ``high`` (None: no
    end; ``*_open``: the end itself is out), or it is None where ``unset``."""

    test: Callable[[Any], bool]
    noun: str
    """What the value is, in words: ``an integer``, ``a finite number of seconds``, ``true or false``."""
    low: Bound = None
    high: Bound = None
    low_open: bool = False
    high_open: bool = False
    unset: bool = False
    valid: str | None = None
    """The valid range in words, ``{low}`` and ``{high}`` filled in; None: the noun and the ends, e.g. ``an
    integer in [0, 19]``, ``a number > 0 (or unset)``."""

    def check(self, config: object, name: str, value: Any) -> None:
        """Raise ``ValueError`` naming the field, the value and the valid range unless ``value`` is valid."""
        if self.unset and value is None:
            return
        low = self.low(config) if callable(self.low) else self.low
        high = self.high(config) if callable(self.high) else self.high
        ok = self.test(value) and (low is None or value > low or (value == low and not self.low_open))
        ok = ok and (high is None or value < high or (value == high and not self.high_open))
        check_field(name, value, ok, self._words(low, high))

    def _words(self, low: float | None, high: float | None) -> str:
        if self.valid is not None:
            return self.valid.format(low=low, high=high)
        words = self.noun
        if low is not None and high is not None:
            words += f" in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif low is not None:
            words += f" {'>' if self.low_open else '>='} {low}"
        return f"{words} (or unset)" if self.unset else words


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: Bound = None, high: Bound = None, *, unset: bool = False, valid: str | None = None) -> dict[str, Rule]:
    """Field metadata: an int (a bool is none here) in [low, high]; None too where ``unset``."""
    return {"rule": Rule(test=is_int, noun="an integer", low=low, high=high, unset=unset, valid=valid)}


def number(
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    noun: str = "a number",
    unset: bool = False,
    valid: str | None = None,
) -> dict[str, Rule]:
    """Field metadata: a finite int or float (not a bool) above ``gt`` or from ``ge``, below ``lt`` or up to ``le``."""
    low, high = ge if gt is None else gt, le if lt is None else lt
    ends = {"low": low, "high": high, "low_open": gt is not None, "high_open": lt is not None}
    return {"rule": Rule(test=is_finite_number, noun=noun, unset=unset, valid=valid, **ends)}


def choice(options: Iterable[object]) -> dict[str, Rule]:
    """Field metadata: one of ``options`` (the message lists them in this order)."""
    valid = tuple(options)
    return rule(lambda v: v in valid, f"one of {list(valid)}")


def boolean() -> dict[str, Rule]:
    """Field metadata: a bool (TOML's true or false)."""
    return rule(lambda v: isinstance(v, bool), "true or false")


def string(*, empty: bool = True, valid: str | None = None) -> dict[str, Rule]:
    """Field metadata: a string (not empty unless ``empty``)."""
    words = valid or ("a string" if empty else "a non-empty string")
    return rule(lambda v: isinstance(v, str) and (empty or v != ""), words)


def rule(test: Callable[[Any], bool], valid: str) -> dict[str, Rule]:
    """Field metadata: valid where ``test(value)``, ``valid`` in words."""
    return {"rule": Rule(test=test, noun=valid)}


def check_fields(config: object) -> None:
    """Check every field of the dataclass ``config`` that declares a ``Rule``, in field order (a bound taken from
    another field sees it checked): the first invalid one raises ``ValueError`` naming it, its value and range."""
    for f in fields(config):  # type: ignore[arg-type]
        if "rule" in f.metadata:
            f.metadata["rule"].check(config, f.name, getattr(config, f.name))


def from_mapping(cls: type, section: Mapping[str, Any], where: str) -> Any:
    """Build the dataclass ``cls`` from a config section, rejecting unknown keys with the valid ones."""
    if not isinstance(section, Mapping):
        raise ValueError(f"[{where}] must be a table of key = value, got {type(section).__name__}")
    accepted = [f.name for f in fields(cls) if f.init]
    unknown = sorted(set(section) - set(accepted))
    if unknown:
        valid = [f.name for f in fields(cls) if f.init and f.repr]  # a deprecated alias is accepted, not shown
        raise ValueError(f"unknown key(s) {unknown} in [{where}]; valid keys: {valid}")
    try:
        return cls(**section)
    except ValueError as e:
        raise ValueError(f"[{where}] {e}") from None
