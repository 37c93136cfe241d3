"""Argument checks shared by every layer, so the same rule gives the same message everywhere."""

from __future__ import annotations

import math
from numbers import Integral, Real

# The default limit on one request's tokens (prompt + output), what a served model's context
# allows: 2**20 tokens, the longest context of widely served open models (Qwen2.5-1M, Llama 4
# Scout serves more only with special set-ups). Traces and workloads beyond it are refused (a
# 1e12-token prompt would otherwise run until killed); --max-model-len (vLLM's name) raises it.
DEFAULT_MAX_MODEL_LEN_TOKENS = 1_048_576


def finite_number(value, name: str, *, positive: bool = True, unit: str = "", otherwise: str = "") -> float:
    """A finite number > 0 (``positive``) or >= 0; ``unit`` (" of GiB") and ``otherwise`` (" or None")
    only shape the message: "<name> must be a finite number<unit> > 0<otherwise>, got <value>"."""
    shown = None
    try:
        ok = not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value) and (value > 0 if positive else value >= 0)
    except OverflowError:  # an integer too large for a float (10**400 in a JSON request): not finite
        ok, shown = False, f"an integer of {len(str(value))} digits"
    if not ok:
        raise ValueError(f"{name} must be a finite number{unit} {'>' if positive else '>='} 0{otherwise}, got {shown or repr(value)}")
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


def max_model_len(value, name: str = "max_model_len_tokens") -> int:
    """The limit on one request's prompt + output tokens (a model's context length)."""
    return whole_number(value, name, 1, " of tokens")


def over_context(prompt_tokens, output_tokens, max_model_len_tokens: int) -> str:
    """Why one request does not fit the model's context (the same words for files and the API)."""
    return (
        f"prompt {prompt_tokens} + output {output_tokens} tokens exceed the model's context of "
        f"{max_model_len_tokens} tokens (--max-model-len / max_model_len_tokens raises the limit)"
    )


class RepeatedKeyError(ValueError):
    """A JSON object that gives one key twice (its message says which; readers prefix the place)."""


def one_value_per_key(pairs: list) -> dict:
    """``json.loads``' ``object_pairs_hook`` for every JSON file the project reads: json keeps the
    last of a repeated key, which would drop one of the two values silently."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise RepeatedKeyError(f"key {key!r} is given twice (which one is meant?)")
        seen.add(key)
    return dict(pairs)
