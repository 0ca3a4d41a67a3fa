"""Argument checks shared by the public functions. Each error names the argument, the value
as given and what is accepted (design invariant 6)."""

from __future__ import annotations

import os

INT64_MAX = 2**63 - 1  # what the C++ core holds sizes, counts and bytes in

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def positive_int(name: str, value, what: str = "") -> int:
    """`value` if it is an int >= 1 (bools are not ints here); else TypeError/ValueError."""
    accepted = f"a positive int{', ' + what if what else ''}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}): expected {accepted}")
    if value < 1:
        raise ValueError(f"{name}={value!r}: expected {accepted}")
    if value > INT64_MAX:
        raise ValueError(f"{name}={value!r}: expected {accepted} of at most 2**63 - 1")
    return value


def non_negative_number(name: str, value, what: str = "") -> float:
    """`value` if it is an int or float >= 0 (not a bool, not NaN); else TypeError/ValueError."""
    accepted = f"a number >= 0{', ' + what if what else ''}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}): expected {accepted}")
    if not value >= 0:
        raise ValueError(f"{name}={value!r}: expected {accepted}")
    return value


def boolean(name: str, value) -> bool:
    """`value` if it is True or False; anything else (a string "false", say) is a TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}): expected True or False")
    return value


def environment_flag(name: str) -> bool:
    """The boolean environment variable `name`: unset or one of 0/false/no/off is False, one of
    1/true/yes/on is True (any case); anything else is a ValueError naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE[1:])} (off)"
    )
