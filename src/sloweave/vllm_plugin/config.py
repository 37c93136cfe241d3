"""Configuration of the vLLM plug-in (no vLLM import: parsed and checked at start-up).

Sources, later ones win: defaults, environment variables ``SLOWEAVE_*``, and vLLM's own
``--additional-config '{"sloweave": {...}}'`` (``LLM(..., additional_config=...)``).

| key | env variable | default | meaning |
|---|---|---|---|
| tpot_ms | SLOWEAVE_TPOT_MS | 25 | default TPOT target (ms, at most one hour); a request overrides it with `extra_args={"sloweave_tpot_ms": D}` (the same rule; see `request_check` for what happens to a bad one) |
| max_chunk_tokens | SLOWEAVE_MAX_CHUNK_TOKENS | 4096 | C_max (also capped by `--max-num-batched-tokens`) |
| cost | SLOWEAVE_COST | analytic | `analytic`, an operator-profile preset (`llama2-70b-tp2-a100`, `llama3-8b-tp1-a100`) or folder (Vidur's CSVs + `model.json`), or a step-time profile file (CSV/JSON) from `sloweave profile` / the GPU profiler, or a served run's step log (`.jsonl`); the same specs as the commands' `--cost` (`sloweave.core.costs.resolve.resolve_cost`); with `online_correction` it is the prior that measured step times correct |
| cost_kind | SLOWEAVE_COST_KIND | regression | model fitted from a step-time profile file: `regression` or `table` |
| analytic | - | paper's | coefficients of the analytic model (`base_ms`, `decode_base_ms`, ...) |
| margin_ms | SLOWEAVE_MARGIN_MS | 0 | constant safety margin, at most one hour (with `online_correction`: added on top of the adaptive margin) |
| margin_fraction | SLOWEAVE_MARGIN_FRACTION | 0 | margin proportional to the prediction, at most 100 (with `online_correction`: of the corrected prediction, on top of the adaptive margin) |
| profile_margin | SLOWEAVE_PROFILE_MARGIN | false | use the profile's P99 residual margin (needs a step-time profile file; not with `online_correction`, whose adaptive margin replaces it) |
| aging_ms | SLOWEAVE_AGING_MS | 2000 | a prompt waiting this long without progress gets a chunk anyway (`0`: off) |
| aging_chunk_tokens | SLOWEAVE_AGING_CHUNK_TOKENS | 256 | size of that forced chunk |
| step_log | SLOWEAVE_STEP_LOG | (off) | a file to write every step planned and ran into, one JSON line each (`sloweave.core.step_log`; read by `sloweave served-run`); replaced at start-up; data-parallel rank N > 0 writes `<file>.N` |
| step_log_max_steps | SLOWEAVE_STEP_LOG_MAX_STEPS | 1000000 | the log stops (and says so in its last line) after this many steps, about 400 bytes each |
| online_correction | SLOWEAVE_ONLINE_CORRECTION | false | self-correction from the measured step times (`sloweave.core.costs.calibrated.self_correcting`, as the CPU runtime and the simulator): the cost is recalibrated online and the margin is the adaptive P99.7 of the corrected model's recent residuals |
| budget_rule | SLOWEAVE_BUDGET_RULE | deadline | `deadline`: each step's token budget from the earliest next-token deadline (SLOWeave); `fixed`: vLLM's own `--max-num-batched-tokens` every step, planned, priced and logged as SLOWeave's would be (a step log and metrics of the tuned baseline, for the simulator's twin of it) |
| chunk_choice | SLOWEAVE_CHUNK_CHOICE | fastest | among the chunks that meet the deadline (the whole offer's included), `fastest`: the one with the most prompt tokens per millisecond the chunk costs (what it adds to its step plus the step of one decode; `sloweave.core.fastest_chunk`), which differs from the largest where the cost's per-token time rises with the chunk, as on vLLM's CPU build, `largest`: the largest (the paper's rule); the same on a cost whose per-token time does not rise |
| margin_form | SLOWEAVE_MARGIN_FORM | per-step (with `online_correction`) | the adaptive margin's form: `per-step` (milliseconds: the P99.7 of measured - corrected of recent steps of the same kind and predicted time, `sloweave.core.costs.step_margin`; on vLLM's CPU build it served more than `relative` at the tight target (at 60 ms both lost to a tuned budget), docs/vllm-plugin.md) or `relative` (the P99.7 of measured / corrected - 1 over all recent steps, times the step's prediction: the simulator's and the CPU runtime's default); a form given needs `online_correction` |
| step_grid_tokens | SLOWEAVE_STEP_GRID_TOKENS | 32 | a step's token budget (decodes + chunk) is rounded down to a multiple of this where the deadline (or the chunk's rate) cut the chunk short of the prompts on offer, the engine's budget and `max_chunk_tokens`, and a chunk stays, so that steps repeat a few sizes (vLLM's CPU build runs the first steps of a size it has not run 3-8 ms slower: 32 there is worth 16-24 % of capacity; the simulator rounds the same way with `--step-grid`); `1`: no rounding; with `budget_rule: deadline` only |

With ``online_correction`` the controller decides with ``SelfCorrection.cost`` (the ``cost``
prior times the factors learned per decode-count bucket and step kind) and
``SelfCorrection.margin`` (``StepMargin``, the ``per-step`` form: ``DEFAULT_MARGIN_QUANTILE`` of the
corrected model's residuals in ms of recent steps like the one it guards, once 50 steps are in). Before that
the margin is the profile's P99 residual table when ``cost`` is a step-time profile file (it
has a fit), and zero for the analytic model, a preset or an operator-profile folder. Every
step vLLM ran feeds ``SelfCorrection.calibrator`` its measured time against the base
model's prediction. ``margin_ms`` and ``margin_fraction`` still add on top when set (a floor
a user wants regardless); ``profile_margin`` is refused with ``online_correction``, since the
adaptive margin replaces the profile's (which it already uses as its fallback).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from sloweave.core.budget import make_policy_for_engine
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.margins import ConstantMargin, RelativeMargin, ZeroMargin
from sloweave.core.costs.protocols import CostModel, Margin
from sloweave.core.policy import CHUNK_CHOICES, SLOWeave
from sloweave.core.step_log import DEFAULT_MAX_STEPS
from sloweave.core.validate import MARGIN_MS, TOKENS, Range, whole_number

if TYPE_CHECKING:
    from sloweave.core.costs.calibrated import SelfCorrection

CONFIG_KEY = "sloweave"
# The plug-in's margin form with online_correction: on vLLM's CPU build the relative form's one
# quantile, multiplied onto the large steps, held chunks back where the steps had slack
DEFAULT_PLUGIN_MARGIN_FORM = "per-step"
# deadline: SLOWeave's budget; fixed: vLLM's own budget every step, planned and logged the same way
BUDGET_RULES = ("deadline", "fixed")
REQUEST_TPOT_KEY = "sloweave_tpot_ms"
# An hour per token is past any real target; far larger ones (1e300) overflow the chunk
# arithmetic, so a target above it is refused rather than clipped.
MAX_TPOT_MS = 3_600_000.0


REQUEST_TPOT_RANGE = Range(0, MAX_TPOT_MS, " of milliseconds", low_open=True)


def tpot_target_ms(value, name: str) -> float:
    """A TPOT target: a finite number of milliseconds > 0 and at most ``MAX_TPOT_MS``
    (ValueError naming ``name`` otherwise; 10**400 too: served with the default, no crash).
    One rule for the configured default and for a request's own target."""
    return REQUEST_TPOT_RANGE.check(value, name)


def request_tpot_ms(extra_args: Mapping | None, request_id: str | None = None) -> float | None:
    """A request's own TPOT target from its extra arguments (``vllm_xargs`` over HTTP), or
    None for the default; a bad one raises ValueError naming the key (and the request)."""
    where = "" if request_id is None else f"request {request_id}: "
    if not extra_args:
        return None
    if not isinstance(extra_args, Mapping):
        raise ValueError(f"{where}extra arguments must be an object (key -> value), got {extra_args!r}")
    if REQUEST_TPOT_KEY not in extra_args:
        return None
    name = f"{where}{REQUEST_TPOT_KEY}"
    return tpot_target_ms(extra_args[REQUEST_TPOT_KEY], name)


# a margin of 100x the prediction is already a different model, not a margin
MAX_MARGIN_FRACTION = 100.0
MARGIN_RANGE_MS = Range(0, MAX_TPOT_MS, " of milliseconds")
MARGIN_FRACTION = Range(0, MAX_MARGIN_FRACTION)


class PluginConfigError(ValueError):
    """A bad plug-in configuration; raised when the scheduler is built, so vLLM fails at start-up."""


@dataclass(frozen=True)
class PluginConfig:
    tpot_ms: float = 25.0
    max_chunk_tokens: int = 4096
    cost: str = "analytic"
    cost_kind: str = "regression"
    analytic: dict = field(default_factory=dict)
    margin_ms: float = 0.0
    margin_fraction: float = 0.0
    profile_margin: bool = False
    aging_ms: float = 2000.0
    aging_chunk_tokens: int = 256
    online_correction: bool = False
    margin_form: str | None = None  # None: ``DEFAULT_PLUGIN_MARGIN_FORM`` with online_correction
    step_log: str = ""
    step_log_max_steps: int = DEFAULT_MAX_STEPS
    budget_rule: str = "deadline"
    chunk_choice: str = "fastest"
    step_grid_tokens: int = 32

    def __post_init__(self) -> None:
        # Numbers are kept as the checked floats: an integer past int64 (2**64 in the JSON) is a
        # fine number of milliseconds, but numpy in the cost models cannot take it as it is.
        object.__setattr__(self, "tpot_ms", _checked(tpot_target_ms, self.tpot_ms, "tpot_ms"))
        for name in ("max_chunk_tokens", "aging_chunk_tokens", "step_grid_tokens"):
            _checked(TOKENS.check, getattr(self, name), name)
        # past these a margin is no margin but another model (and 1e308 overflowed at start-up)
        for name, limits in (
            ("margin_ms", MARGIN_RANGE_MS),
            ("margin_fraction", MARGIN_FRACTION),
            ("aging_ms", MARGIN_MS),
        ):
            object.__setattr__(self, name, _checked(limits.check, getattr(self, name), name))
        if self.cost_kind not in ("regression", "table"):
            raise PluginConfigError(
                f"sloweave config: cost_kind must be 'regression' or 'table', got {self.cost_kind!r}"
            )
        if not isinstance(self.cost, str) or not (
            self.cost == "analytic" or self.cost in _presets() or os.path.exists(self.cost)
        ):
            raise PluginConfigError(
                f"sloweave config: cost must be 'analytic', a preset ({', '.join(_presets())}), an operator-profile folder "
                f"or an existing profile file, got {self.cost!r}"
            )
        if self.cost_kind != "regression" and not os.path.isfile(self.cost):
            # refused, as `tune` does, rather than ignored: the user asked for a table
            raise PluginConfigError(
                f"sloweave config: cost_kind {self.cost_kind!r} needs cost set to a step-time profile file (the analytic "
                f"model, a preset and an operator-profile folder have no lookup table), got cost {self.cost!r}"
            )
        # the types first: "false" is truthy, and would be refused below for the wrong reason
        for name in ("profile_margin", "online_correction"):
            if not isinstance(getattr(self, name), bool):
                raise PluginConfigError(f"sloweave config: {name} must be true or false, got {getattr(self, name)!r}")
        if self.profile_margin and not os.path.isfile(self.cost):
            raise PluginConfigError(
                "sloweave config: profile_margin needs cost set to a step-time profile file "
                "(the analytic model, a preset and an operator-profile folder have no residual margin)"
            )
        if self.profile_margin and self.online_correction:
            raise PluginConfigError(
                "sloweave config: profile_margin and online_correction exclude each other: with online_correction "
                "the margin is the adaptive P99.7 of the measured residuals, which starts from the profile's margin "
                "by itself; drop profile_margin"
            )
        object.__setattr__(self, "margin_form", _margin_form(self.margin_form, self.online_correction))
        if not isinstance(self.analytic, dict):
            raise PluginConfigError(
                f"sloweave config: analytic must be an object of coefficients, got {self.analytic!r}"
            )
        _whole(self.step_log_max_steps, "step_log_max_steps")
        _check_step_log(self.step_log)
        if self.budget_rule not in BUDGET_RULES:
            raise PluginConfigError(
                f"sloweave config: budget_rule must be one of {', '.join(BUDGET_RULES)}, got {self.budget_rule!r}"
            )
        if self.chunk_choice not in CHUNK_CHOICES:
            raise PluginConfigError(
                f"sloweave config: chunk_choice must be one of {', '.join(CHUNK_CHOICES)}, got {self.chunk_choice!r}"
            )

    @classmethod
    def from_sources(cls, additional_config: Mapping | None, environ: Mapping[str, str] | None = None) -> PluginConfig:
        environ = os.environ if environ is None else environ
        values: dict = {}
        by_variable = {f"SLOWEAVE_{f.name.upper()}": f for f in fields(cls) if f.name != "analytic"}
        # a misspelt variable (SLOWEAVE_TPOT) would otherwise be ignored without a word
        stray = sorted(k for k in environ if k.startswith("SLOWEAVE_") and k not in by_variable)
        if stray:
            raise PluginConfigError(
                f"sloweave config: unknown environment variable(s) {', '.join(stray)}; known: {', '.join(sorted(by_variable))} "
                "(the analytic coefficients are given in additional_config only)"
            )
        for variable, f in by_variable.items():
            if variable in environ:
                values[f.name] = _parse_env(f.name, environ[variable], f.type)
        if additional_config is not None and not isinstance(additional_config, Mapping):
            raise PluginConfigError(
                f"additional_config must be an object (a JSON object on the command line), got {additional_config!r}"
            )
        section = (additional_config or {}).get(CONFIG_KEY, {})
        if not isinstance(section, Mapping):
            raise PluginConfigError(f"additional_config['{CONFIG_KEY}'] must be an object, got {section!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known, key=repr)  # keys of several types (1, "a") do not sort
        if unknown:
            raise PluginConfigError(f"sloweave config: unknown key(s) {unknown}; known: {sorted(known)}")
        values.update(section)
        try:
            return cls(**values)
        except TypeError as err:
            raise PluginConfigError(f"sloweave config: {err}") from None

    def build_cost_and_margin(self) -> tuple[CostModel, Margin]:
        """The cost model T(n, c) and margin delta(n, c) the plug-in decides with (see ``build_decision``)."""
        decision = self.build_decision()
        return decision.cost, decision.margin

    def build_decision(self) -> DecisionParts:
        """What the controller decides with: cost, margin and, with ``online_correction``, the
        core's ``SelfCorrection`` whose calibrator the measured step times feed.

        ``analytic`` takes the ``analytic`` coefficients; any other spec goes through the core's
        ``resolve_cost``: a preset or an operator-profile folder gives a ``ProfileCost``, a step-time
        profile file its fitted ``cost_kind``. Both read the KV context the controller sets each step.
        With ``online_correction`` that model is the prior of ``core.calibration.self_correcting``:
        the cost is its ``CalibratedCost`` and the margin its ``AdaptiveMargin`` (falling back to the
        profile's residual margin, when the cost is a step-time profile file, until enough steps
        were measured), plus ``margin_ms`` / ``margin_fraction`` if set.
        """
        resolved = self.resolved_cost()
        if self.online_correction:
            from sloweave.core.costs.calibrated import self_correcting

            fallback = resolved.fit.margin(None) if resolved.fit is not None else None
            correction = self_correcting(resolved.model, fallback=fallback, margin_form=self.margin_form)
            if fallback is not None:
                fallback.cost = correction.cost  # the profile's table, read through the corrected model
            margin = _sum_margins(correction.margin, self._plain_margin(correction.cost))
            return DecisionParts(correction.cost, margin, correction, coverage=correction.margin.quantile / 100.0)
        cost = resolved.model
        if self.profile_margin:
            margin = _sum_margins(resolved.fit.margin(cost), self._plain_margin(cost))
            # the residual quantile the fit's margin table was made at (its report says which)
            return DecisionParts(cost, margin, coverage=resolved.fit.report["margin_quantile"] / 100.0)
        return DecisionParts(cost, self._plain_margin(cost))

    def deadline_policy(self, decision: DecisionParts, max_chunk_tokens: int) -> SLOWeave:
        """The plug-in's SLOWeave on ``decision``'s cost and margin, with this configuration's
        ``chunk_choice``: the one place the scheduler, and whatever replays its decisions, build it."""
        return make_policy_for_engine(decision.cost, decision.margin, max_chunk_tokens, self.chunk_choice)

    def resolved_cost(self):
        """The ``cost`` spec resolved by the core (``sloweave.core.costs.resolve.ResolvedCost``): its model,
        label and the description a result records (which profiles; whether attention is derived)."""
        from sloweave.core.costs.resolve import (
            ANALYTIC,
            KIND_ANALYTIC,
            ResolvedCost,
            analytic_description,
            resolve_cost,
        )

        if self.cost == ANALYTIC:
            try:
                analytic = AnalyticCost(**self.analytic)
            except (TypeError, ValueError) as err:
                raise PluginConfigError(f"sloweave config: analytic: {err}") from None
            return ResolvedCost(analytic, ANALYTIC, ANALYTIC, KIND_ANALYTIC, analytic_description(analytic))
        is_file = os.path.isfile(self.cost)
        try:
            return resolve_cost(self.cost, cost_kind=self.cost_kind if is_file else "regression")
        except ValueError as err:
            what = "cost profile" if is_file else "cost"
            raise PluginConfigError(f"sloweave config: {what} {self.cost}: {err}") from None

    def _plain_margin(self, cost: CostModel) -> Margin:
        margins: list[Margin] = []
        if self.margin_ms:
            margins.append(ConstantMargin(self.margin_ms))
        if self.margin_fraction:
            margins.append(RelativeMargin(cost, self.margin_fraction))
        return _sum_margins(*margins)


@dataclass(frozen=True)
class DecisionParts:
    """The plug-in's decision parts: T(n, c), delta(n, c), and the self-correction (or None)."""

    cost: CostModel
    margin: Margin
    correction: SelfCorrection | None = None
    # the share of steps the margin is meant to cover (its residual quantile); a margin that
    # states none (none at all, or a hand-set one) holds the model to the median
    coverage: float = 0.5


def _presets() -> tuple[str, ...]:
    from sloweave.core.costs.operator_profiles import PRESETS

    return PRESETS


@dataclass(frozen=True)
class _MarginSum:
    parts: tuple

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return sum(part(n_decodes, chunk_tokens) for part in self.parts)


def _sum_margins(*margins: Margin) -> Margin:
    margins = tuple(m for m in margins if not isinstance(m, ZeroMargin))
    if not margins:
        return ZeroMargin()
    return margins[0] if len(margins) == 1 else _MarginSum(margins)


def _checked(check, value, name: str):
    """The core's shared check (its result), its message as a configuration error."""
    try:
        return check(value, name)
    except ValueError as err:
        raise PluginConfigError(f"sloweave config: {err}") from None


def _check_step_log(path) -> None:
    """A file the server can create: refused at start-up rather than lost after an hour of serving."""
    if not isinstance(path, str):
        raise PluginConfigError(f"sloweave config: step_log must be a file path (a string; empty: off), got {path!r}")
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise PluginConfigError(f"sloweave config: step_log {path!r} is a folder; name a file in it")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise PluginConfigError(
            f"sloweave config: step_log {path!r}: its folder {folder} does not exist or is not writable"
        )


def _margin_form(margin_form, online_correction: bool) -> str | None:
    """The adaptive margin's form: one of the core's, the default with ``online_correction``,
    none without. A form shapes the adaptive margin, so one given needs ``online_correction``
    (refused rather than ignored). The core is imported only then."""
    if margin_form is None:
        return DEFAULT_PLUGIN_MARGIN_FORM if online_correction else None
    from sloweave.core.costs.calibrated import MARGIN_FORMS

    if not isinstance(margin_form, str) or margin_form not in MARGIN_FORMS:
        raise PluginConfigError(
            f"sloweave config: margin_form must be one of {', '.join(MARGIN_FORMS)}, got {margin_form!r}"
        )
    if not online_correction:
        raise PluginConfigError(
            f"sloweave config: margin_form {margin_form!r} needs online_correction (it shapes the adaptive margin)"
        )
    return margin_form


def step_log_path(path: str, data_parallel_rank: int) -> str:
    """Each data-parallel rank's own log (rank 0 the file named, rank N ``<file>.N``)."""
    return path if data_parallel_rank == 0 else f"{path}.{data_parallel_rank}"


def _whole(value, name: str) -> None:
    _checked(whole_number, value, name)


def _parse_env(name: str, raw: str, kind) -> object:
    kind = str(kind)
    try:
        if "bool" in kind:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if "int" in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
    except ValueError:
        raise PluginConfigError(f"environment variable SLOWEAVE_{name.upper()}={raw!r} is not a valid {kind}") from None
    return raw
