"""One ``--cost`` choice for every command: a spec string turned into the cost model T(n, c).

| spec | cost model | what results record |
|---|---|---|
| ``analytic`` (default) | the paper's ``AnalyticCost()`` | ``{"cost_model": "analytic", ...}`` with its coefficients |
| a preset (``llama2-70b-tp2-a100``, ``llama3-8b-tp1-a100``) | ``ProfileCost`` of the shipped operator profiles | ``ProfileCost.describe()``: profiles, derived attention, out-of-range counts |
| a folder | ``ProfileCost`` of operator profiles in Vidur's CSV format plus ``model.json`` | as for a preset |
| a file | a step-time profile (``sloweave profile`` / the GPU profiler) fitted by ``core.fit``: ``regression`` (default) or ``table`` | the file, the fitted kind, the KV context it is given, the fit's held-out errors |

A step-time profile's fitted model reads the KV context the simulator tracks; with
``context_tokens`` (``sloweave tune --context-tokens``, and tune's default: the workload's mean
prompt plus half its output) it is wrapped in ``FixedContextCost`` instead, as tune has always done.

``ResolvedCost.description`` is read when a result is written, so a profile cost's counts of
out-of-range (extrapolated) queries cover every simulation that used it; ``summary_lines()`` is
what a command prints beside its tables (for the 8B preset: that its attention is derived, not
measured). The command line's ``--cost`` option is ``sloweave.cli.options.cost_option``.

A preset or a profile folder whose ``model.json`` gives the memory figures has a KV capacity
(``model_kv_memory``, ``sloweave.core.costs.kv_memory``); the command line attaches the one a
run uses (``with_kv_memory``), which the summary lines and the description then state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import ContextAware, CostModel, Described
from sloweave.core.costs.fitted import ContextualCost, FixedContextCost
from sloweave.core.costs.kv_memory import DEFAULT_GPU_MEMORY_UTILIZATION, KVMemory, model_kv_memory
from sloweave.core.costs.profile_fit import FitResult, fit_profile_file
from sloweave.core.costs.step_profiles import ProfileError
from sloweave.core.costs.operator_profiles import PRESETS
from sloweave.core.costs.profile import ProfileCost, profile_cost
from sloweave.core.validate import finite_number

ANALYTIC = "analytic"
# What ResolvedCost.kind says.
KIND_ANALYTIC = "analytic"
KIND_PRESET = "preset"
KIND_FOLDER = "operator-profiles"
KIND_STEP_PROFILE = "step-time-profile"
STEP_PROFILE_KINDS = ("regression", "table")
ANALYTIC_FORMULA = (
    "T(n, c) = base + 1[n>0] (decode_base + decode_per_req n) + 1[c>0] (prefill_base + prefill_per_token c)"
)
COST_HELP = (
    "iteration cost model: 'analytic' (the paper's), a preset ("
    + ", ".join(PRESETS)
    + "), an operator-profile folder (Vidur's CSVs + model.json) or a step-time profile file (sloweave profile)"
)


def choices_text() -> str:
    return f"'{ANALYTIC}', a preset ({', '.join(PRESETS)}), an operator-profile folder or a step-time profile file (CSV/JSON)"


@dataclass(frozen=True)
class ResolvedCost:
    """A cost spec resolved: the model, a short label for tables, and what result files record."""

    model: CostModel
    label: str
    spec: str
    kind: str
    info: dict = field(default_factory=dict, compare=False)  # the static part of the description
    fit: FitResult | None = field(default=None, compare=False, repr=False)  # step-time profiles: the fit
    kv_memory: KVMemory | None = field(default=None, compare=False, repr=False)  # the KV capacity a run uses

    @property
    def is_analytic(self) -> bool:
        return self.kind == KIND_ANALYTIC

    @property
    def profile_cost(self) -> ProfileCost | None:
        return self.model if isinstance(self.model, ProfileCost) else None

    @property
    def description(self) -> dict:
        """The dict a result file records (read now: a profile cost's out-of-range counts so far)."""
        profile = self.profile_cost
        if profile is not None:
            described = {
                **profile.describe(),
                "spec": self.spec,
                "label": self.label,
                "preset": self.kind == KIND_PRESET,
            }
        else:
            described = dict(self.info)
        if self.kv_memory is not None:
            described["kv_memory"] = self.kv_memory.describe()
        return described

    @property
    def attention_note(self) -> str | None:
        """How attention was obtained when it was not measured for this model (else None)."""
        profile = self.profile_cost
        if profile is None:
            return None
        note = profile.profiles.attention_note
        return None if note == "measured" else note

    def summary_lines(self) -> list[str]:
        """What a command prints beside its tables: the model, a derived attention, extrapolations,
        and the KV capacity a run uses (when the command line attached one)."""
        kv = [] if self.kv_memory is None else [self.kv_memory.summary()]
        return self._model_lines() + kv

    def _model_lines(self) -> list[str]:
        if self.is_analytic:
            return [f"cost: {self.label} (the paper's T(n, c))"]
        profile = self.profile_cost
        if profile is None:
            info = self.info
            context = info.get("context_per_decode_tokens")
            how = f"{context:.0f} KV tokens per decode" if context is not None else "the simulator's KV context"
            notes = (info.get("fit") or {}).get("notes", [])  # a kind refused, an error not measured
            return [f"cost: {self.label} (step-time profile {info.get('profile')}, {info.get('kind')} fit, {how})"] + [
                f"cost: {info.get('profile')}: {note}" for note in notes
            ]
        note = self.attention_note
        what = f"attention {note}" if note else f"operator profiles of {profile.shape.name}, attention measured"
        lines = [f"cost: {self.label} ({what})"]
        outside = {k: v for k, v in profile.out_of_range.items() if v}
        if outside:
            counts = ", ".join(f"{k} {v:,}" for k, v in sorted(outside.items()))
            lines.append(f"cost: queries outside the profiled range, extrapolated linearly: {counts}")
        return lines

    def model_kv_memory(self, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> KVMemory | None:
        """The KV capacity the model's memory figures leave at this GPU memory utilisation; None
        when there are none (``no_kv_memory_reason`` says why). ``ValueError`` when nothing is left."""
        profile = self.profile_cost
        if profile is None or profile.profiles.memory is None:
            return None
        profiles = profile.profiles
        return model_kv_memory(profile.shape, profiles.memory, profiles.device, gpu_memory_utilization)

    def no_kv_memory_reason(self) -> str:
        """Why this cost has no KV capacity of its own (for the line that says the KV cache is unlimited)."""
        if self.is_analytic:
            return "the analytic cost has no model to size a KV cache"
        if self.profile_cost is None:
            return "a step-time profile has no model shape, so no KV size per token"
        return f"{self.spec}: model.json gives no parameters and gpu_memory_gib, so no default KV capacity"

    def with_kv_memory(self, kv_memory: KVMemory | None) -> ResolvedCost:
        """This cost, stating the KV capacity a run with it uses."""
        return replace(self, kv_memory=kv_memory)

    def kv_tokens_in(self, gib: float) -> int:
        """KV capacity in tokens of ``gib`` GiB for the profiled model (profile costs only)."""
        profile = self.profile_cost
        if profile is None:
            raise ValueError(
                f"cost {self.spec!r} has no model shape, so no KV size per token: "
                f"use a preset ({', '.join(PRESETS)}) or an operator-profile folder"
            )
        finite_number(gib, "KV memory", unit=" of GiB")
        tokens = profile.shape.kv_tokens_in(gib)
        if tokens < 1:
            raise ValueError(
                f"{gib:g} GiB holds no token of {profile.shape.name}'s KV cache ({profile.shape.kv_bytes_per_token:,} bytes per token)"
            )
        return tokens

    def step_profile(self, cost_kind: str = "regression", context_tokens: float | None = None) -> ResolvedCost:
        """A step-time profile cost with another fitted kind or a fixed KV context (no refit)."""
        if self.kind != KIND_STEP_PROFILE or self.fit is None:
            raise ValueError(
                f"cost {self.spec!r} is not a step-time profile file: --cost-kind and --context-tokens do not apply"
            )
        return _step_profile(self.spec, self.fit, cost_kind, context_tokens).with_kv_memory(self.kv_memory)


def analytic_description(cost: AnalyticCost | None = None) -> dict:
    cost = cost or AnalyticCost()
    return {
        "cost_model": "analytic",
        "spec": ANALYTIC,
        "label": ANALYTIC,
        "formula": ANALYTIC_FORMULA,
        "coefficients_ms": asdict(cost),
        "reads_kv_context": False,
        "units": "milliseconds per iteration",
    }


def resolve_cost(spec: str, *, cost_kind: str = "regression", context_tokens: float | None = None) -> ResolvedCost:
    """``analytic``, a preset name, an operator-profile folder or a step-time profile file.

    ``cost_kind`` and ``context_tokens`` apply to step-time profile files only (see the module
    docstring). Anything else is a ``ValueError`` (``ProfileError`` for a bad profile) naming
    the spec and the choices.
    """
    if not isinstance(spec, (str, Path)):
        raise ValueError(f"cost must be a string: {choices_text()}; got {spec!r}")
    text = str(spec).strip()
    if not text:
        raise ValueError(f"empty cost spec: give {choices_text()}")
    if text == ANALYTIC:
        _no_step_options(text, cost_kind, context_tokens)
        return ResolvedCost(AnalyticCost(), ANALYTIC, ANALYTIC, KIND_ANALYTIC, analytic_description())
    if text in PRESETS:
        _no_step_options(text, cost_kind, context_tokens)
        return ResolvedCost(_profile_cost(text), text, text, KIND_PRESET)
    path = Path(text)
    if path.is_dir():
        _no_step_options(text, cost_kind, context_tokens)
        return ResolvedCost(_profile_cost(text), path.name or text, text, KIND_FOLDER)
    if path.is_file():
        try:
            fit = fit_profile_file(path)
        except ProfileError as err:
            raise ProfileError(
                f"cost {text!r} is a file but not a usable step-time profile ({err}); give {choices_text()}"
            ) from None
        return _step_profile(text, fit, cost_kind, context_tokens)
    near = [p for p in PRESETS if p.startswith(text.lower()) or text.lower().startswith(p)]
    hint = f" (did you mean {near[0]}?)" if near else ""
    raise ValueError(f"unknown cost {text!r}: no such preset, folder or file{hint}; give {choices_text()}")


def _profile_cost(spec: str) -> ProfileCost:
    try:
        return profile_cost(spec)
    except ProfileError as err:
        raise ProfileError(_naming(spec, str(err))) from None


def _naming(spec: str, message: str) -> str:
    return message if spec in message else f"cost {spec!r}: {message}"


def _no_step_options(spec: str, cost_kind: str, context_tokens: float | None) -> None:
    if cost_kind != "regression" or context_tokens is not None:
        raise ValueError(f"cost {spec!r}: a fitted kind and a fixed KV context apply to step-time profile files only")


def _step_profile(spec: str, fit: FitResult, cost_kind: str, context_tokens: float | None) -> ResolvedCost:
    if cost_kind not in STEP_PROFILE_KINDS:
        raise ValueError(f"cost {spec!r}: unknown fitted kind {cost_kind!r}; choose {' or '.join(STEP_PROFILE_KINDS)}")
    if context_tokens is not None:
        finite_number(context_tokens, f"cost {spec!r}: the KV context per decode", positive=False, unit=" of tokens")
    try:
        fitted: ContextualCost = fit.cost(cost_kind)
    except ProfileError as err:
        raise ProfileError(_naming(spec, str(err))) from None
    model: CostModel = fitted if context_tokens is None else FixedContextCost(fitted, float(context_tokens))
    label = f"{Path(spec).name} ({cost_kind})"
    info = {
        "cost_model": "step-time-profile",
        "spec": spec,
        "label": label,
        # tune's keys, kept: the file, the fitted kind and the context each decode is given
        "profile": str(Path(spec)),
        "kind": cost_kind,
        "context_per_decode_tokens": None if context_tokens is None else float(context_tokens),
        "context": (
            "the KV context the simulator tracks"
            if context_tokens is None
            else "fixed: every decode holds context_per_decode_tokens, chunks start from an empty prefix"
        ),
        "fit": fit.report,
        "units": "milliseconds per iteration",
    }
    return ResolvedCost(model, label, spec, KIND_STEP_PROFILE, info, fit)


class ContextBlindCost:
    """A cost that reads the KV context, asked as if there were none (``predict(n, c, 0, 0)``).

    A plain T(n, c) with no ``set_context``: the simulator does not feed it the context, so a
    policy deciding with it is blind to the KV read (``sloweave ablate``'s ctx-blind row).
    """

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._predict = cost.predict if isinstance(cost, ContextAware) else None

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        if self._predict is None:
            return self.cost(n_decodes, chunk_tokens)
        return self._predict(n_decodes, chunk_tokens, 0, 0)


def describe_cost(cost: CostModel) -> dict:
    """What a result file records about a cost model that may not come from a ``--cost`` spec."""
    if isinstance(cost, AnalyticCost):
        return analytic_description(cost)
    return cost.describe() if isinstance(cost, Described) else {"cost_model": type(cost).__name__}


def context_models(resolved: ResolvedCost) -> tuple[CostModel, CostModel]:
    """(a model that reads the KV context, the same model blind to it) for ``resolved``.

    The analytic model has its context-aware sibling ``ContextAnalyticCost``; a profile cost or
    a fitted step-time profile reads the context itself.
    """
    if resolved.is_analytic:
        from sloweave.core.costs.context_analytic import ContextAnalyticCost

        return ContextAnalyticCost(), AnalyticCost()
    model = resolved.model
    if isinstance(model, FixedContextCost):
        model = model.cost
    return model, ContextBlindCost(model)


__all__ = [
    "ANALYTIC",
    "COST_HELP",
    "ContextBlindCost",
    "ResolvedCost",
    "analytic_description",
    "context_models",
    "describe_cost",
    "resolve_cost",
]
