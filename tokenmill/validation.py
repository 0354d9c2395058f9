"""Type and range rules for option dataclasses.

Options arrive from Python callers, JSON bodies and the command line, so a wrong type
is as likely as a wrong value; both must fail the same way: a ``ValueError`` that names
the field, the rule and the value (never a ``TypeError`` from deep in the engine).
A field opts in with ``ruled(default, rule)``; ``check_fields`` applies every rule and
stores the value in its normal form (a numpy integer becomes an ``int``, an ``int``
given for a float becomes a ``float``).
"""

from __future__ import annotations

import functools
import math
import numbers
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

REJECT: Any = object()
"""What a converter returns for a value of the wrong type."""

_show = reprlib.Repr()
_show.maxstring = _show.maxother = 60
_show.maxlong = 40


@dataclass(frozen=True)
class Rule:
    """A field's type (``convert``) and range (``within``), and the words for both."""

    kind: str  # "an integer", "a finite number", ...
    bounds: str  # ">= 1", "in (0, 1]"; empty when the type says it all
    convert: Callable[[Any], Any]  # the value in normal form, or REJECT
    within: Callable[[Any], bool] | None = None

    def __call__(self, name: str, value: Any) -> Any:
        """``value`` in normal form; a ValueError naming ``name`` if it breaks the rule."""
        converted = self.convert(value)
        if converted is REJECT:
            raise ValueError(f"{name} must be {self.describe()}, got {_show.repr(value)}")
        if self.within is not None and not self.within(converted):
            raise ValueError(f"{name} must be {self.bounds}, got {_show.repr(value)}")
        return converted

    def describe(self) -> str:
        return f"{self.kind} {self.bounds}" if self.bounds else self.kind

    def normal(self, value: Any) -> Any:
        """``value`` in normal form, or REJECT: for rules applied to each item of a list."""
        converted = self.convert(value)
        if converted is REJECT or (self.within is not None and not self.within(converted)):
            return REJECT
        return converted

    def or_none(self) -> Rule:
        within = self.within
        return Rule(
            f"None or {self.kind}",
            self.bounds,
            lambda v: None if v is None else self.convert(v),
            None if within is None else lambda v: v is None or within(v),
        )


def ruled(default: Any, rule: Rule, **metadata: Any) -> Any:
    """A dataclass field that ``check_fields`` validates with ``rule``."""
    return field(default=default, metadata={"rule": rule, **metadata})


def check_fields(obj: Any) -> None:
    """Apply every field's rule to a dataclass instance, storing the normal forms."""
    for name, rule in _rules(type(obj)):  # type: ignore[arg-type]  # (mypy takes no class for Hashable)
        setattr(obj, name, rule(name, getattr(obj, name)))


@functools.cache
def _rules(cls: type) -> tuple[tuple[str, Rule], ...]:
    return tuple((f.name, f.metadata["rule"]) for f in fields(cls) if "rule" in f.metadata)


def field_rules(cls: type) -> dict[str, Rule]:
    """Each ruled field's rule by name: for a class that checks every assignment (its ``__setattr__``
    applies them) rather than its fields once after construction (``check_fields``)."""
    return dict(_rules(cls))


def _bounds_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi}"
    return ""


def _within(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> Callable[[Any], bool] | None:
    if lo is None and hi is None:
        return None

    def within(v: Any) -> bool:
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return hi is None or (v < hi if hi_open else v <= hi)

    return within


def _as_int(value: Any) -> Any:
    """An ``int`` (numpy integers too), never a bool or a float; else REJECT."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return REJECT
    return int(value)


def _as_float(value: Any) -> Any:
    """A finite ``float`` from any real number but a bool; else REJECT."""
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return REJECT
        try:
            value = float(value)
        except OverflowError:  # an int beyond the float range
            return REJECT
    return value if math.isfinite(value) else REJECT


def _as_bool(value: Any) -> Any:
    return value if type(value) is bool else REJECT


def integer(lo: int | None = None, hi: int | None = None, bounds: str | None = None) -> Rule:
    """An integer in [lo, hi]; ``bounds`` words the range when the numbers alone would not."""
    return Rule(
        "an integer",
        _bounds_text(lo, hi, False, False) if bounds is None else bounds,
        _as_int,
        _within(lo, hi, False, False),
    )


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False) -> Rule:
    """A finite real number between ``lo`` and ``hi``, each end closed unless said open."""
    return Rule("a finite number", _bounds_text(lo, hi, lo_open, hi_open), _as_float, _within(lo, hi, lo_open, hi_open))


BOOLEAN = Rule("True or False", "", _as_bool)


def one_of(spellings: Mapping[str, str]) -> Rule:
    """A string among ``spellings``' keys, normalised to its value (aliases map to one name)."""
    return Rule(
        f"one of {', '.join(spellings)}", "", lambda v: spellings.get(v, REJECT) if isinstance(v, str) else REJECT
    )
