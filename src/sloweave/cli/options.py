"""Options several commands share, each declared once so one rule gives one message.

Numbers are checked against their ``sloweave.core.validate.Range`` (``ranged``); options that
travel together reach the command as one object (``gathered``, ``engine_options``,
``out_folder_options``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
import importlib
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

import click

from sloweave.core.costs.resolve import (
    ANALYTIC,
    COST_HELP,
    KIND_STEP_PROFILE,
    STEP_PROFILE_KINDS,
    ResolvedCost,
    resolve_cost,
)
from sloweave.core.costs.kv_memory import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GPU_MEMORY_UTILIZATION,
    given_kv_memory,
    unlimited_kv_memory,
)
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS
from sloweave.core.validate import (
    DEFAULT_MAX_MODEL_LEN_TOKENS,
    DURATION_MS,
    REPEATS,
    TOKENS,
    Range,
)
from sloweave.sim.options import EngineOptions
from sloweave.sim.tiers import TIER_SPEC, Tier, check_tier_mix, parse_tier
from sloweave.sim.traces import FORMATS
from sloweave.studies.inputs import REQUESTS, runner_of
from sloweave.studies.result_folders import result_folder


class CheckedNumber(click.ParamType):
    """A command-line number checked against a ``Range`` (the same rule, and words, as the API)."""

    def __init__(self, limits: Range, infinity: bool = False) -> None:
        self.limits, self.infinity = limits, infinity  # infinity: "inf" also means "no limit"
        self.name = "integer" if limits.whole else "float"

    def convert(self, value, param, ctx):
        number = (click.INT if self.limits.whole else click.FLOAT).convert(value, param, ctx)
        if self.infinity and number == math.inf:
            return number
        try:
            return self.limits.check(number, "the value", " (or inf)" if self.infinity else "")
        except ValueError as err:
            self.fail(str(err), param, ctx)


def ranged(limits: Range, infinity: bool = False) -> CheckedNumber:
    """``limits`` as a click type (``infinity``: "inf" is accepted too, meaning no limit)."""
    return CheckedNumber(limits, infinity)


def stacked(*options):
    """Several option decorators as one, in the order the help shows them."""

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def gathered(dest: str, build, names: tuple[str, ...]):
    """Hand the command its parameters ``names`` as one object, ``build(**those)``, named ``dest``.

    The options themselves are declared where they stand in the help; this only groups what
    the command receives (the result files still record every option by its own name)."""

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            kwargs[dest] = build(**{name: kwargs.pop(name) for name in names})
            return command(*args, **kwargs)

        return wrapper

    return decorate


# --------------------------------------------------------------------------- result folders


@dataclass(frozen=True)
class OutFolder:
    """Where a command writes its results (``--out``) and how (``--force``, ``--resume``)."""

    path: Path | None
    force: bool = False
    resume: bool = False

    def open(self, resumable: bool = False, inputs: dict[str, Path] | None = None):
        """The result folder (``sloweave.studies.result_folders.result_folder``) of this run."""
        return result_folder(self.path, self.force, self.resume, resumable=resumable, inputs=inputs)


def out_folder_options(resumable: bool = False, dest: str = "out", **settings):
    """``--out`` (a folder), ``--force`` and, for a study that runs independent tasks that a
    later run can reuse, ``--resume``: one ``OutFolder`` named ``dest``. ``settings``: the
    ``--out`` option's own (``default``, ``required``, ``help``)."""
    if settings.get("default") is not None:
        settings = {"show_default": True, **settings}
    names = ("out_dir", "force", "resume") if resumable else ("out_dir", "force")

    def build(out_dir, force, resume=False):
        return OutFolder(out_dir, force, resume)

    def decorate(command):
        command = gathered(dest, build, names)(command)
        if resumable:
            command = click.option(
                "--resume",
                is_flag=True,
                help="go on with an interrupted run: reuse the finished tasks it kept in OUT.incomplete, compute the rest "
                "(the results are an uninterrupted run's, byte for byte)",
            )(command)
        command = click.option(
            "--force", is_flag=True, help="replace --out if it holds an earlier result (once this run is complete)"
        )(command)
        return click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), **settings)(command)

    return decorate


# --------------------------------------------------------------------------- the cost model


def _resolved_cost(ctx, param, value) -> ResolvedCost:
    """The ``--cost`` value as a ``ResolvedCost``; a bad spec is that option's error."""
    if isinstance(value, ResolvedCost):
        return value
    try:
        return resolve_cost(value)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--cost") from None


def cost_option(default: str = ANALYTIC, help: str | None = None):
    """The ``--cost`` option every command takes, resolved into a ``ResolvedCost``."""
    return click.option(
        "--cost",
        "cost",
        default=default,
        show_default=True,
        metavar="SPEC",
        callback=_resolved_cost,
        help=help or COST_HELP,
    )


# --------------------------------------------------------------------------- the engine


def option_of_field(spec) -> Callable:
    """The click option a described config field (``core.validate.setting``) asks for: its
    flag, help and default from the field, its type from the values it takes; a boolean is an
    on/off pair, a repeated field an option given once per value."""
    name, default, meta = spec.name, spec.default, spec.metadata
    flag = meta["flag"] or "--" + name.replace("_", "-")
    settings = {"default": default, "help": meta["help"], "show_default": default not in (None, ())}
    if meta.get("repeat"):
        settings.update(multiple=True, callback=once_each)
    values = meta["values"]
    if isinstance(values, Range):
        settings["type"] = ranged(values)
    elif values is not None:
        settings["type"] = click.Choice(values)
    elif isinstance(default, bool):
        flag = f"{flag}/--no-{flag[2:]}"
    return click.option(flag, name, **settings)


def described_fields(config) -> list:
    """The fields of a config dataclass that carry help text, in declaration order."""
    return [spec for spec in fields(config) if "help" in spec.metadata]


def config_options(config, dest: str):
    """The options of a config dataclass whose fields describe themselves (``core.validate.setting``),
    handed to the command as one ``config`` object named ``dest``; a value the config refuses
    (ValueError) is a usage error. Fields without help get no option and keep their default."""
    described = described_fields(config)

    def build(**given):
        try:
            return config(**given)
        except ValueError as err:
            raise click.UsageError(str(err)) from None

    def decorate(command):
        command = gathered(dest, build, tuple(spec.name for spec in described))(command)
        return stacked(*map(option_of_field, described))(command)

    return decorate


def cost_kind_option(help: str = "model fitted from a step-time profile file as --cost"):
    """``--cost-kind``: which model a step-time profile file as ``--cost`` is fitted to."""
    return click.option(
        "--cost-kind", type=click.Choice(STEP_PROFILE_KINDS), default="regression", show_default=True, help=help
    )


def refuse_step_profile_options(cost: ResolvedCost, options: tuple[tuple[str, str], ...]) -> None:
    """Options (parameter, flag) that only a step-time profile file as --cost reads are refused,
    when given on the command line, for any other cost: nothing is silently ignored."""
    if cost.kind == KIND_STEP_PROFILE:
        return
    given = click.get_current_context().get_parameter_source
    for name, label in options:
        if given(name) == click.core.ParameterSource.COMMANDLINE:
            raise click.BadParameter(
                f"applies to a step-time profile file only, not --cost {cost.spec}", param_hint=label
            )


def gpu_memory_utilization_option():
    """``--gpu-memory-utilization``: the share of each GPU's memory that sizes the model's KV cache."""
    return click.option(
        "--gpu-memory-utilization",
        type=ranged(GPU_MEMORY_UTILIZATION),
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        show_default=True,
        help="share of each GPU's memory the engine uses (vLLM's flag): with a preset or a profile folder whose "
        "model.json gives the weights and GPU memory, the KV capacity is what it leaves after the weights and "
        "activations",
    )


def engine_options(dest: str = "engine"):
    """The engine options every study command takes, one ``EngineOptions`` named ``dest``, with
    the KV capacity of the command's ``--cost`` (``kv_memory_default``) unless ``--kv-capacity-tokens``
    or ``--unlimited-kv`` says otherwise; the command's ``cost`` then states it (``ResolvedCost.kv_memory``)."""
    described = described_fields(EngineOptions)
    names = tuple(spec.name for spec in described)

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            try:
                engine = EngineOptions(**{name: kwargs.pop(name) for name in names})
            except ValueError as err:
                raise click.UsageError(str(err)) from None
            utilisation, unlimited = kwargs.pop("gpu_memory_utilization"), kwargs.pop("unlimited_kv")
            engine, cost = kv_memory_default(engine, kwargs.get("cost"), utilisation, unlimited)
            kwargs[dest] = engine
            if cost is not None:
                kwargs["cost"] = cost
            return command(*args, **kwargs)

        options = [*map(option_of_field, described), gpu_memory_utilization_option()]
        options.append(
            click.option(
                "--unlimited-kv",
                is_flag=True,
                help="no KV capacity: turn off the one the --cost model's memory figures give",
            )
        )
        return stacked(*options)(wrapper)

    return decorate


def given_on_command_line(name: str) -> bool:
    """Whether the parameter ``name`` of the running command was typed on the command line."""
    context = click.get_current_context(silent=True)
    return context is not None and context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def kv_memory_default(
    engine: EngineOptions, cost: ResolvedCost | None, utilisation: float, unlimited: bool
) -> tuple[EngineOptions, ResolvedCost | None]:
    """The engine with the KV capacity a run uses, and the cost stating it.

    ``--kv-capacity-tokens`` is used as given, ``--unlimited-kv`` turns the limit off, and
    otherwise a cost whose model has memory figures gives its capacity at ``utilisation``; a
    measured cost without them runs unlimited and says why. The analytic cost with neither
    option is left as it was (no KV limit, nothing added to what its runs record)."""
    utilisation_given = given_on_command_line("gpu_memory_utilization")
    if unlimited and engine.kv_capacity_tokens is not None:
        raise click.UsageError("give --unlimited-kv or --kv-capacity-tokens, not both")
    if utilisation_given and (unlimited or engine.kv_capacity_tokens is not None):
        flag = "--unlimited-kv" if unlimited else "--kv-capacity-tokens"
        raise click.BadParameter(
            f"sizes the model's KV cache, which {flag} replaces: give one of them",
            param_hint="--gpu-memory-utilization",
        )
    if engine.kv_capacity_tokens is not None:
        kv = given_kv_memory(engine.kv_capacity_tokens, "given: --kv-capacity-tokens")
    elif unlimited:
        kv = unlimited_kv_memory("--unlimited-kv")
    elif cost is None:
        return engine, cost
    else:
        try:
            kv = cost.model_kv_memory(utilisation)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--gpu-memory-utilization") from None
        if kv is None:
            if utilisation_given:
                raise click.BadParameter(cost.no_kv_memory_reason(), param_hint="--gpu-memory-utilization")
            if cost.is_analytic:
                return engine, cost
            kv = unlimited_kv_memory(cost.no_kv_memory_reason())
    engine = replace(engine, kv_capacity_tokens=kv.tokens, kv_memory=kv)
    return engine, None if cost is None else cost.with_kv_memory(kv)


# --------------------------------------------------------------------------- what every study reads


def tpot_ms_option(default: float | None = 25.0, name: str = "tpot_ms", **settings):
    """``--tpot-ms``: the time-per-output-token target, the parameter ``name`` (``settings``:
    ``help``, ``multiple``, ...)."""
    if default is not None:
        settings = {"default": default, "show_default": True, **settings}
    return click.option("--tpot-ms", name, type=ranged(DURATION_MS), **settings)


def ttft_ms_option(default: float | None = None, **settings):
    """``--ttft-ms``: the time-to-first-token target."""
    if default is not None:
        settings = {"show_default": True, **settings}
    return click.option("--ttft-ms", type=ranged(DURATION_MS), default=default, **settings)


def tier_mix(specs: tuple[str, ...]) -> tuple[Tier, ...]:
    """``--tier`` values -> a checked tier mix (empty: none given); ValueError naming the problem."""
    return check_tier_mix(parse_tier(spec) for spec in specs) if specs else ()


def _check_tiers(ctx, param, specs: tuple[str, ...]) -> tuple[str, ...]:
    # the specs stay as given (the settings a result file records); the command parses them again
    try:
        tier_mix(specs)
    except ValueError as err:
        raise click.BadParameter(str(err), ctx=ctx, param=param) from None
    return specs


def tier_option(what_it_finds: str):
    """``--tier NAME:TPOT_MS:TTFT_MS:SHARE`` (repeatable, parameter ``tiers``: the specs as given,
    checked as a mix; ``tier_mix`` reads them): an SLO tier mix. ``what_it_finds`` ends the help:
    what the command measures with a mix and the options it refuses next to it."""
    return click.option(
        "--tier",
        "tiers",
        multiple=True,
        callback=_check_tiers,
        metavar=TIER_SPEC,
        help="an SLO tier: its name, TPOT and TTFT targets (ms) and share of requests (a fraction); repeat for a "
        "mix whose shares add up to 1, e.g. --tier interactive:10:2000:0.3 --tier batch:50:2000:0.7. Every request "
        f"is labelled (seeded), served to its tier's TPOT by deadline-aware policies and judged against its tier; "
        f"{what_it_finds}",
    )


def requests_option(default: int | None = None, **settings):
    """``--requests``: requests a run generates (``num_requests``)."""
    if default is not None:
        settings = {"show_default": True, **settings}
    return click.option("--requests", "num_requests", type=ranged(REQUESTS), default=default, **settings)


def max_chunk_option(default: int = DEFAULT_MAX_CHUNK_TOKENS, **settings):
    """``--max-chunk``: SLOWeave's C_max, in tokens."""
    return click.option("--max-chunk", type=ranged(TOKENS), default=default, show_default=True, **settings)


def trace_format_option():
    """``--format``: how a trace file is read."""
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True)


def max_model_len_option():
    """``--max-model-len``: the longest request a trace may hold (``max_model_len_tokens``)."""
    return click.option(
        "--max-model-len",
        "max_model_len_tokens",
        type=ranged(TOKENS),
        default=None,
        help=f"longest request (prompt + output tokens) the served model's context allows; a trace "
        f"request beyond it is refused with its line [default: {DEFAULT_MAX_MODEL_LEN_TOKENS}]",
    )


def once_each(ctx, param, values: tuple) -> tuple:
    """A repeatable option's callback: a value given twice is refused, naming it (one rule for
    every command). Names compare as the commands read them (case and surrounding spaces do not
    make a new policy)."""
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


def parallel_options(dest: str = "runner"):
    """``--jobs`` and ``--ray``: where a study's independent simulations run, one ``Runner``
    named ``dest`` (``sloweave.studies.inputs.runner_of``)."""

    def decorate(command):
        command = gathered(dest, runner_of, ("jobs", "ray_address"))(command)
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
            type=ranged(REPEATS),
            default=None,
            help="parallel simulation processes on this machine [default: all local cores]; results are the serial run's",
        )(command)

    return decorate
