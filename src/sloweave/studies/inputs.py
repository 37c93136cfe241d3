"""Command-line options for what every study reads, declared once so one rule gives one message."""

from __future__ import annotations

import click

from sloweave.core.validate import DEFAULT_MAX_MODEL_LEN_TOKENS, positive_number

# numpy's generators take non-negative seeds only (a negative one used to end in a traceback)
SEED = click.IntRange(min=0)

# Requests one run generates: a run keeps per-request arrays and per-iteration records in
# memory, and 1e11 requests ended in a 745 GiB allocation error; 10 million simulate in
# about an hour here and fit in a few GB. (A trace's own size is its limit.)
MAX_REQUESTS = 10_000_000
REQUESTS = click.IntRange(min=1, max=MAX_REQUESTS)


def max_model_len_option():
    """``--max-model-len``: the longest request a trace may hold (``max_model_len_tokens``)."""
    return click.option(
        "--max-model-len",
        "max_model_len_tokens",
        type=click.IntRange(min=1),
        default=None,
        help=f"longest request (prompt + output tokens) the served model's context allows; a trace "
        f"request beyond it is refused with its line [default: {DEFAULT_MAX_MODEL_LEN_TOKENS}]",
    )


def model_len_or_default(max_model_len_tokens: int | None) -> int:
    return DEFAULT_MAX_MODEL_LEN_TOKENS if max_model_len_tokens is None else max_model_len_tokens


class PositiveNumber(click.ParamType):
    """A finite number > 0 on the command line (a target in ms, a rate, a scale, a window)."""

    name = "float"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            number = value
        else:
            number = click.FLOAT.convert(value, param, ctx)
        try:
            return positive_number(number, "the value")
        except ValueError as err:
            self.fail(str(err), param, ctx)


POSITIVE = PositiveNumber()
