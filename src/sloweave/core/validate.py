"""Argument checks shared by every layer, so the same rule gives the same message everywhere."""

from __future__ import annotations

import math
from numbers import Integral, Real


def finite_number(value, name: str, *, positive: bool = True, unit: str = "", otherwise: str = "") -> float:
    """A finite number > 0 (``positive``) or >= 0; ``unit`` (" of GiB") and ``otherwise`` (" or None")
    only shape the message: "<name> must be a finite number<unit> > 0<otherwise>, got <value>"."""
    if isinstance(value, bool) or not isinstance(value, Real) or not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{name} must be a finite number{unit} {'>' if positive else '>='} 0{otherwise}, got {value!r}")
    return float(value)


def positive_ms(value, name: str) -> float:
    """A finite number of milliseconds > 0 (a TPOT target, an aging threshold, ...)."""
    return finite_number(value, name, unit=" of milliseconds")


def positive_number(value, name: str) -> float:
    """A finite number > 0 (in whatever unit ``name`` says)."""
    return finite_number(value, name)


def non_negative_number(value, name: str) -> float:
    """A finite number >= 0 (a margin, an off-able threshold)."""
    return finite_number(value, name, positive=False)


def positive_fraction(value, name: str) -> float:
    """A finite number > 0 for an option that may also be None (a slack factor, a headroom share)."""
    return finite_number(value, name, otherwise=" or None")


def whole_number(value, name: str, minimum: int = 1, unit: str = "") -> int:
    """A whole number >= ``minimum`` (``unit`` names what it counts, e.g. " of tokens")."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be a whole number{unit} >= {minimum}, got {value!r}")
    return int(value)


def positive_tokens(value, name: str) -> int:
    """A positive whole number of tokens (a chunk size, a token budget)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive whole number of tokens, got {value!r}")
    return value
