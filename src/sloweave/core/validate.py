"""Argument checks shared by every layer, so the same rule gives the same message everywhere.

Every number that enters (a command-line option, a file cell, a configuration key, an API
argument) has a stated range (``Range``; the named ones below, listed in the README's inputs
table) that keeps the arithmetic exact: a token count fits int64 with room for products and
sums, a millisecond clock can still add a millisecond, and no factor overflows a float. A value
past its range is refused where it enters, naming it, rather than wrapping, overflowing or
turning into inf or NaN deep inside numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

# The default limit on one request's tokens (prompt + output), what a served model's context
# allows: 2**20 tokens, the longest context of widely served open models (Qwen2.5-1M, Llama 4
# Scout serves more only with special set-ups). Traces and workloads beyond it are refused (a
# 1e12-token prompt would otherwise run until killed); --max-model-len (vLLM's name) raises it.
DEFAULT_MAX_MODEL_LEN_TOKENS = 1_048_576

# 2**31 tokens: 2,048 times the default context, so any chunk, budget, KV capacity or context a
# machine can hold fits, while a product of two token counts (a chunk x a context) stays exact in
# int64 (a larger count such as 1e20 wraps to a negative chunk or fails to cast inside numpy).
MAX_TOKENS = 2**31
# 1e10 ms (116 days) for any duration in ms: a target, an aging threshold, a step time. A clock
# at 1e10 s (below) in ms still resolves 0.002 ms, so it can add a step of any size.
MAX_MS = 1e10
# 1e10 s (317 years) for arrival times and windows: Unix time stamps fit; a float clock of 1e300 s
# or 2**63 s could not add a millisecond (every request got TTFT 0 and attainment 1.0).
MAX_SECONDS = 1e10
# Factors (rate, prompt and output scales, a bias, a stale factor): 1e-6 to 1e6 keeps a scaled
# time or rate inside the ranges above.
MIN_SCALE, MAX_SCALE = 1e-6, 1e6
# A lognormal sigma of 3 already makes P99.9 of the noise 10,000x the model (1,000 made it inf).
MAX_NOISE_SIGMA = 3.0
# Seeds are numpy's (>= 0) and are written to result files as int64.
MAX_SEED = 2**63 - 1
# Repetitions a run makes by hand (seeds or trace windows, profile repeats, load-lattice steps,
# worker processes, threads): far past any study, well short of what would never finish.
MAX_REPEATS = 10_000


@dataclass(frozen=True)
class Range:
    """The numbers one kind of input accepts: ``low`` to ``high`` (``low`` itself refused when
    ``low_open``), whole numbers only when ``whole``; ``unit`` (" of tokens") shapes the message."""

    low: float
    high: float
    unit: str = ""
    whole: bool = False
    low_open: bool = False

    def describe(self) -> str:
        if self.whole:
            return f"a whole number{self.unit} >= {self.low:,} and <= {self.high:,}"
        return f"a finite number{self.unit} {'>' if self.low_open else '>='} {self.low:g} and <= {self.high:g}"

    def check(self, value, name: str, otherwise: str = ""):
        """``value`` as an int (``whole``) or float when it is in range, else ``ValueError``:
        "<name> must be <describe()><otherwise>, got <value>"."""
        shown = None
        try:
            if self.whole:
                ok = not isinstance(value, bool) and isinstance(value, Integral) and self.low <= value <= self.high
            else:
                ok = not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)
                ok = ok and (value > self.low if self.low_open else value >= self.low) and value <= self.high
        except OverflowError:  # an integer too large for a float (10**400 in a JSON request)
            ok, shown = False, f"an integer of {len(str(value))} digits"
        if not ok:
            raise ValueError(f"{name} must be {self.describe()}{otherwise}, got {shown or repr(value)}")
        return int(value) if self.whole else float(value)


TOKENS = Range(1, MAX_TOKENS, " of tokens", whole=True)  # a chunk, a budget, a KV capacity, a length limit
TOKEN_COUNT = Range(0, MAX_TOKENS, " of tokens", whole=True)  # tokens waiting, a context, a profile's counts
REQUEST_COUNT = Range(0, MAX_TOKENS, " of requests", whole=True)  # running requests, a batch cap
STEP_COUNT = Range(0, MAX_TOKENS, " of steps", whole=True)  # a block of engine steps
DURATION_MS = Range(0, MAX_MS, " of milliseconds", low_open=True)  # a target, an aging threshold
MARGIN_MS = Range(0, MAX_MS, " of milliseconds")  # a margin, a tolerance, a step time (0 allowed)
TIME_S = Range(0, MAX_SECONDS, " of seconds")  # an arrival time, a window's start
CLOCK_MS = Range(0, MAX_SECONDS * 1000, " of milliseconds")  # a clock reading: a step's start
DURATION_S = Range(0, MAX_SECONDS, " of seconds", low_open=True)  # a window, a horizon
SCALE = Range(MIN_SCALE, MAX_SCALE)  # a factor on rates, lengths or times
NOISE_SIGMA = Range(0, MAX_NOISE_SIGMA)
SEED = Range(0, MAX_SEED, whole=True)
REPEATS = Range(1, MAX_REPEATS, whole=True)
RATE_RPS = Range(0, MAX_SCALE, " of requests per second", low_open=True)
BATCH_SIZE = Range(1, MAX_TOKENS, " of requests", whole=True)  # a cap on running requests
ATTAINMENT = Range(0, 1, low_open=True)  # a share of requests that meet their targets
GIB = Range(0, MAX_MS, " of GiB", low_open=True)


def finite_number(
    value, name: str, *, positive: bool = True, unit: str = "", otherwise: str = "", high: float = MAX_MS
) -> float:
    """A finite number > 0 (``positive``) or >= 0, at most ``high`` (1e10 unless a range says
    otherwise); ``unit`` (" of GiB") and ``otherwise`` (" or None") only shape the message."""
    return Range(0, high, unit, low_open=positive).check(value, name, otherwise)


def positive_ms(value, name: str) -> float:
    """A finite number of milliseconds > 0 (a TPOT target, an aging threshold, ...)."""
    return DURATION_MS.check(value, name)


def positive_number(value, name: str) -> float:
    """A finite number > 0 (in whatever unit ``name`` says)."""
    return finite_number(value, name)


def non_negative_number(value, name: str) -> float:
    """A finite number >= 0 (a margin, an off-able threshold)."""
    return finite_number(value, name, positive=False)


def positive_fraction(value, name: str) -> float:
    """A finite number > 0 for an option that may also be None (a slack factor, a headroom share)."""
    return finite_number(value, name, otherwise=" or None")


def whole_number(value, name: str, minimum: int = 1, unit: str = "", maximum: int = MAX_TOKENS) -> int:
    """A whole number from ``minimum`` to ``maximum`` (``unit`` names what it counts, e.g. " of tokens")."""
    return Range(minimum, maximum, unit, whole=True).check(value, name)


def positive_tokens(value, name: str) -> int:
    """A positive whole number of tokens (a chunk size, a token budget)."""
    return TOKENS.check(value, name)


def max_model_len(value, name: str = "max_model_len_tokens") -> int:
    """The limit on one request's prompt + output tokens (a model's context length)."""
    return whole_number(value, name, 1, " of tokens")


def over_context(prompt_tokens, output_tokens, max_model_len_tokens: int) -> str:
    """Why one request does not fit the model's context (the same words for files and the API)."""
    return (
        f"prompt {prompt_tokens} + output {output_tokens} tokens exceed the model's context of "
        f"{max_model_len_tokens} tokens (--max-model-len / max_model_len_tokens raises the limit)"
    )


def setting(
    default,
    help: str,
    *,
    values: Range | tuple[str, ...] | None = None,
    flag: str | None = None,
    repeat: bool = False,
):
    """A config field that describes itself: its default, its help text and the values it takes
    (a ``Range`` or a tuple of names), from which a command line builds its option (``flag``:
    the option's name when it is not ``--<field-name>``; ``repeat``: the option may be given
    several times, each value once, and the field holds them as a tuple, ``()`` if none)."""
    return field(default=default, metadata={"help": help, "values": values, "flag": flag, "repeat": repeat})


class OptionError(ValueError):
    """A value given for one option that cannot be used: the command line shows it as that
    option's error (``option``: its flag, e.g. ``--out``), a program reads it as a ValueError."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


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
