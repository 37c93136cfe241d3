"""Configuration of the vLLM plug-in (no vLLM import: parsed and checked at start-up).

Sources, later ones win: defaults, environment variables ``SLOWEAVE_*``, and vLLM's own
``--additional-config '{"sloweave": {...}}'`` (``LLM(..., additional_config=...)``).

| key | env variable | default | meaning |
|---|---|---|---|
| tpot_ms | SLOWEAVE_TPOT_MS | 25 | default TPOT target; a request overrides it with `extra_args={"sloweave_tpot_ms": D}` |
| max_chunk_tokens | SLOWEAVE_MAX_CHUNK_TOKENS | 4096 | C_max (also capped by `--max-num-batched-tokens`) |
| cost | SLOWEAVE_COST | analytic | `analytic`, or a profile file (CSV/JSON) from `sloweave profile` / the GPU profiler |
| cost_kind | SLOWEAVE_COST_KIND | regression | model fitted from a profile: `regression` or `table` |
| analytic | - | paper's | coefficients of the analytic model (`base_ms`, `decode_base_ms`, ...) |
| margin_ms | SLOWEAVE_MARGIN_MS | 0 | constant safety margin |
| margin_fraction | SLOWEAVE_MARGIN_FRACTION | 0 | margin proportional to the prediction |
| profile_margin | SLOWEAVE_PROFILE_MARGIN | false | use the profile's P99 residual margin (needs a profile) |
| aging_ms | SLOWEAVE_AGING_MS | 2000 | a prompt waiting this long without progress gets a chunk anyway (`0`: off) |
| aging_chunk_tokens | SLOWEAVE_AGING_CHUNK_TOKENS | 256 | size of that forced chunk |
| online_correction | SLOWEAVE_ONLINE_CORRECTION | false | correct the cost model from measured step times (core calibration) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from sloweave.core.cost import AnalyticCost, ConstantMargin, CostModel, Margin, RelativeMargin, ZeroMargin
from sloweave.core.validate import non_negative_number, positive_number, whole_number

CONFIG_KEY = "sloweave"
REQUEST_TPOT_KEY = "sloweave_tpot_ms"


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

    def __post_init__(self) -> None:
        _positive(self.tpot_ms, "tpot_ms")
        _whole(self.max_chunk_tokens, "max_chunk_tokens")
        _whole(self.aging_chunk_tokens, "aging_chunk_tokens")
        for name in ("margin_ms", "margin_fraction", "aging_ms"):
            _checked(non_negative_number, getattr(self, name), name)
        if self.cost_kind not in ("regression", "table"):
            raise PluginConfigError(f"sloweave config: cost_kind must be 'regression' or 'table', got {self.cost_kind!r}")
        if self.cost != "analytic" and not os.path.isfile(self.cost):
            raise PluginConfigError(f"sloweave config: cost must be 'analytic' or an existing profile file, got {self.cost!r}")
        if self.profile_margin and self.cost == "analytic":
            raise PluginConfigError("sloweave config: profile_margin needs cost set to a profile file")
        for name in ("profile_margin", "online_correction"):
            if not isinstance(getattr(self, name), bool):
                raise PluginConfigError(f"sloweave config: {name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.analytic, dict):
            raise PluginConfigError(f"sloweave config: analytic must be an object of coefficients, got {self.analytic!r}")

    @classmethod
    def from_sources(cls, additional_config: Mapping | None, environ: Mapping[str, str] | None = None) -> PluginConfig:
        environ = os.environ if environ is None else environ
        values: dict = {}
        for f in fields(cls):
            raw = environ.get(f"SLOWEAVE_{f.name.upper()}")
            if raw is not None and f.name != "analytic":
                values[f.name] = _parse_env(f.name, raw, f.type)
        section = (additional_config or {}).get(CONFIG_KEY, {}) if isinstance(additional_config, Mapping) else {}
        if not isinstance(section, Mapping):
            raise PluginConfigError(f"additional_config['{CONFIG_KEY}'] must be an object, got {section!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise PluginConfigError(f"sloweave config: unknown key(s) {unknown}; known: {sorted(known)}")
        values.update(section)
        try:
            return cls(**values)
        except TypeError as err:
            raise PluginConfigError(f"sloweave config: {err}") from None

    def build_cost_and_margin(self) -> tuple[CostModel, Margin]:
        """The cost model T(n, c) and margin delta(n, c) the plug-in decides with."""
        if self.cost == "analytic":
            try:
                cost: CostModel = AnalyticCost(**self.analytic)
            except TypeError as err:
                raise PluginConfigError(f"sloweave config: analytic: {err}") from None
            except ValueError as err:
                raise PluginConfigError(f"sloweave config: analytic: {err}") from None
        else:
            from sloweave.core.fit import ProfileError, fit_profile_file

            try:
                fitted = fit_profile_file(self.cost)
                cost = fitted.cost(self.cost_kind)
            except (ProfileError, ValueError) as err:
                raise PluginConfigError(f"sloweave config: cost profile {self.cost}: {err}") from None
            cost = self._corrected(cost)
            if self.profile_margin:
                return cost, _sum_margins(fitted.margin(cost), self._plain_margin(cost))
            return cost, self._plain_margin(cost)
        cost = self._corrected(cost)
        return cost, self._plain_margin(cost)

    def _corrected(self, cost: CostModel) -> CostModel:
        """With online correction, the cost wrapped so measured step times correct it."""
        if not self.online_correction:
            return cost
        from sloweave.core.calibration import CalibratedCost, OnlineCalibrator, as_contextual

        return CalibratedCost(as_contextual(cost), OnlineCalibrator())

    def _plain_margin(self, cost: CostModel) -> Margin:
        margins: list[Margin] = []
        if self.margin_ms:
            margins.append(ConstantMargin(self.margin_ms))
        if self.margin_fraction:
            margins.append(RelativeMargin(cost, self.margin_fraction))
        return _sum_margins(*margins)


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


def _checked(check, value, name: str) -> None:
    """The core's shared check, its message as a configuration error."""
    try:
        check(value, name)
    except ValueError as err:
        raise PluginConfigError(f"sloweave config: {err}") from None


def _positive(value, name: str) -> None:
    _checked(positive_number, value, name)


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
