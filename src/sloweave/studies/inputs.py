"""Command-line options for what every study reads, declared once so one rule gives one message."""

from __future__ import annotations

import importlib

import click

from sloweave.core.validate import DEFAULT_MAX_MODEL_LEN_TOKENS, REPEATS, TOKENS, Range

# Requests one run generates: a run keeps per-request arrays and per-iteration records in
# memory, and 1e11 requests ended in a 745 GiB allocation error; 10 million simulate in
# about an hour here and fit in a few GB. (A trace's own size is its limit.)
MAX_REQUESTS = 10_000_000
REQUESTS = Range(1, MAX_REQUESTS, " of requests", whole=True).option()


def max_model_len_option():
    """``--max-model-len``: the longest request a trace may hold (``max_model_len_tokens``)."""
    return click.option(
        "--max-model-len",
        "max_model_len_tokens",
        type=TOKENS.option(),
        default=None,
        help=f"longest request (prompt + output tokens) the served model's context allows; a trace "
        f"request beyond it is refused with its line [default: {DEFAULT_MAX_MODEL_LEN_TOKENS}]",
    )


def model_len_or_default(max_model_len_tokens: int | None) -> int:
    return DEFAULT_MAX_MODEL_LEN_TOKENS if max_model_len_tokens is None else max_model_len_tokens


def once_each(ctx, param, values: tuple) -> tuple:
    """A repeatable option's callback: a value given twice is refused, naming it (one rule for
    every command: it used to be doubled by one and dropped by another). Names compare as the
    commands read them (case and surrounding spaces do not make a new policy)."""
    seen = set()
    for value in values:
        key = value.strip().lower() if isinstance(value, str) else value
        if key in seen:
            raise click.BadParameter(
                f"{value!r} is given more than once (each value is run once)", ctx=ctx, param=param
            )
        seen.add(key)
    return values


def _ray_address(ctx, param, value: str | None) -> str | None:
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("give 'local', 'auto' or a cluster address (host:port, ray://host:10001)")
    try:  # checked before the work, not after it
        importlib.import_module("ray")
    except ImportError as err:
        from sloweave.studies.parallel import RAY_EXTRA_HINT

        raise click.BadParameter(f"Ray cannot be imported ({err}); {RAY_EXTRA_HINT}") from None
    return value.strip()


def parallel_options():
    """``--jobs`` and ``--ray``: where a study's independent simulations run (see ``runner_of``)."""

    def decorate(command):
        command = click.option(
            "--ray",
            "ray_address",
            default=None,
            callback=_ray_address,
            metavar="local|auto|ADDRESS",
            help="run the simulations as Ray tasks: 'local' starts a private Ray instance on loopback with --jobs CPUs, "
            "'auto' joins the cluster Ray finds (RAY_ADDRESS, `ray start`), or give its address; results are the serial run's",
        )(command)
        return click.option(
            "--jobs",
            type=REPEATS.option(),
            default=None,
            help="parallel simulation processes on this machine [default: all local cores]; results are the serial run's",
        )(command)

    return decorate


def runner_of(jobs: int | None, ray_address: str | None):
    from sloweave.studies.parallel import Runner, local_cores

    return Runner(jobs or local_cores(), ray_address)
