"""Online correction: correct a cost model from the step times measured while serving.

One rule for every body: the CPU runtime feeds it measured step times, the vLLM plug-in's
``BudgetController`` the times of the steps vLLM ran, the simulator's clock the actual
(noisy or mis-predicted) iteration times.

A profile is taken once; the machine then drifts (other processes, caches, thermal state).
``OnlineCalibrator`` keeps, per decode-count bucket and per step kind (decode-only or with
a prefill chunk), an exponentially weighted mean of log(measured / predicted), and
``CalibratedCost`` multiplies the base prediction by exp of it. Factors are constant in c
for a step kind, and the chunk curve is floored by the decode-only one, so the corrected
model stays monotone in c (the policy's binary search stays exact).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from sloweave.core.costs.protocols import CostModel, OfferAware
from sloweave.core.costs.fitted import N_BUCKET_EDGES, ContextualCost, ResidualMargin
from sloweave.core.costs.step_margin import TABLE_REFRESH_STEPS, StepMargin, steps_for_quantile
from sloweave.core.costs.step_residuals import HORIZON_STEPS, StepResiduals
from sloweave.core.validate import finite_number, whole_number


QUANTILE_REFRESH_STEPS = 8
# The margin reads a high quantile (P99.7) of the recent residuals; out of 300 steps that is
# the largest or second largest, an estimate below the true quantile about half the time
# (measured: on `long` under sigma-0.1 noise the 300-step window lost 7 % of capacity to
# TPOT misses, 1000 steps none). 1000 steps are 10-50 s of serving: still recent.
RESIDUAL_WINDOW_STEPS = 1000
# The largest measured / corrected ratio a residual records: far beyond any real stall, and finite.
MAX_STEP_RATIO = 1e6
# A bucket's factor stands for this many steps of any kind after its last step; then the bucket
# borrows the machine-wide correction again, as one never seen (its next step sets it anew). A step
# kind kept from running (chunks, after the machine was slow for a while: measured on vLLM's CPU
# engine, a factor of 2.0 for steps with a chunk stood 20 s after the decode-only steps had come back
# to 0.8) must not keep the factor the slowness taught; the per-step margin forgets a residual on the
# same horizon.
FACTOR_HORIZON_STEPS = HORIZON_STEPS
# Nor does a factor stand once the machine-wide correction has moved by more than this factor since
# it was set: the machine changed (a spell began or ended), and a step kind the change keeps from
# running would keep what it was taught before (measured on vLLM's CPU engine: after two processes
# spun on its cores for 6 s, steps with a chunk and 4-7 decodes kept a factor of about 4 and none ran
# for 6 s while prompts waited). One stall moves it by at most alpha x log(max_factor) (0.42): never this.
LOG_MACHINE_CHANGE = math.log(3.0)


class OnlineCalibrator:
    """Per-bucket multiplicative correction learned from (predicted, measured) step pairs."""

    def __init__(
        self,
        alpha: float = 0.2,
        min_factor: float = 0.25,
        max_factor: float = 8.0,
        window_steps: int = RESIDUAL_WINDOW_STEPS,
    ) -> None:
        if isinstance(alpha, bool) or not 0 < finite_number(alpha, "alpha") <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        finite_number(min_factor, "min_factor")
        finite_number(max_factor, "max_factor")
        if not min_factor <= 1.0 <= max_factor:
            raise ValueError(
                f"min_factor <= 1 <= max_factor is needed (1: no correction), got {min_factor!r} and {max_factor!r}"
            )
        whole_number(window_steps, "window_steps")
        self.alpha = alpha
        self.log_min, self.log_max = math.log(min_factor), math.log(max_factor)
        # rows: decode-count bucket; columns: 0 = decode-only step, 1 = step with a chunk
        self.log_factor = np.zeros((len(N_BUCKET_EDGES), 2))
        self.observations = np.zeros((len(N_BUCKET_EDGES), 2), dtype=np.int64)
        self.last_step = np.zeros((len(N_BUCKET_EDGES), 2), dtype=np.int64)  # steps seen when each was last set
        self.global_at = np.zeros((len(N_BUCKET_EDGES), 2))  # the machine-wide log factor then
        # Until a bucket has data, borrow the mean correction of the buckets that have some:
        # drift is mostly machine-wide, so it transfers.
        self._global = 0.0
        self._global_seen = 0
        self._factors: list[tuple[float, float]] | None = None  # exp of the above, per bucket (see factor)
        # Relative residuals of the CORRECTED prediction over the last steps: the spread
        # that is left once the bias is removed, i.e. what a margin still has to cover.
        self.recent_residuals: deque[float] = deque(maxlen=window_steps)
        self._quantiles: dict[float, float] = {}
        self._largest: float | None = None  # of the recent residuals, and them in order (per refresh)
        self._ranked: list[float] | None = None
        # The same residuals in ms per step kind and predicted time, for the per-step margin
        # (``step_margin.StepMargin``); None when the margin is the relative one.
        self.step_residuals: StepResiduals | None = None

    @staticmethod
    def _bucket(n_decodes: int) -> int:
        # bisect, not np.searchsorted: the cost is asked tens of times per decision, and
        # numpy's per-call overhead on one scalar was most of the online correction's cost.
        return bisect.bisect_right(N_BUCKET_EDGES, n_decodes) - 1

    def factor(self, n_decodes: int, has_chunk: bool) -> float:
        # Asked tens of times per decision between two observed steps: the factors are
        # exponentiated once per step, into plain floats (numpy's scalar indexing cost more).
        factors = self._factors
        if factors is None:
            factors = self._factors = self._exp_factors()
        return factors[self._bucket(n_decodes)][1 if has_chunk else 0]

    def _exp_factors(self) -> list[tuple[float, float]]:
        borrowed = math.exp(self._global)
        return [
            tuple(math.exp(self.log_factor[i, j]) if self._stands(i, j) else borrowed for j in (0, 1))
            for i in range(len(N_BUCKET_EDGES))
        ]

    def _stands(self, bucket: int, kind: int) -> bool:
        """Whether a bucket's own factor stands: it has seen a step, at most ``FACTOR_HORIZON_STEPS``
        came after, and the machine-wide correction has moved by at most ``LOG_MACHINE_CHANGE`` since."""
        return (
            bool(self.observations[bucket, kind])
            and self._global_seen - self.last_step[bucket, kind] <= FACTOR_HORIZON_STEPS
            and abs(self._global - self.global_at[bucket, kind]) <= LOG_MACHINE_CHANGE
        )

    def observe(self, n_decodes: int, chunk_tokens: int, predicted_ms: float, measured_ms: float) -> None:
        """Fold one step in; ``predicted_ms`` is the BASE model's prediction (not corrected).

        A count below 0 or a time that is negative or not finite is refused (ValueError): it
        would land in a wrong bucket, or make the margin's quantile NaN, which reads as no
        margin at all. A step of exactly 0 ms (a model that prices it at nothing) teaches no
        ratio and is left out."""
        # comparisons, not the shared checks: this runs every step (a NaN fails every one)
        if not (n_decodes >= 0 and chunk_tokens >= 0 and 0 <= predicted_ms < math.inf and 0 <= measured_ms < math.inf):
            raise ValueError(
                "observe needs n_decodes >= 0, chunk_tokens >= 0 and finite times >= 0 ms, got "
                f"n_decodes={n_decodes!r}, chunk_tokens={chunk_tokens!r}, predicted_ms={predicted_ms!r}, measured_ms={measured_ms!r}"
            )
        corrected = predicted_ms * self.factor(n_decodes, chunk_tokens > 0)
        if corrected == 0 or measured_ms == 0:  # (a subnormal prediction, corrected, is 0 too)
            return
        # capped: two absurd times (1e-110 ms predicted, 1e198 measured) must not overflow to inf
        self.recent_residuals.append(min(measured_ms / corrected, MAX_STEP_RATIO) - 1.0)
        if self.step_residuals is not None:
            self.step_residuals.add(chunk_tokens > 0, corrected, measured_ms)
        # The window's quantiles are re-read every few steps, not every step: a quantile of
        # hundreds of steps barely moves in one, and sorting them per step would cost more
        # than the decision itself.
        if self._global_seen % QUANTILE_REFRESH_STEPS == 0:
            self._quantiles, self._largest, self._ranked = {}, None, None
        # a difference of logs: the quotient of such times can overflow, or underflow to 0
        error = min(max(math.log(measured_ms) - math.log(predicted_ms), self.log_min), self.log_max)
        i, j = self._bucket(n_decodes), int(chunk_tokens > 0)
        if self._stands(i, j):
            self.log_factor[i, j] += self.alpha * (error - self.log_factor[i, j])
        else:
            self.log_factor[i, j] = error
        self.observations[i, j] += 1
        self.last_step[i, j] = self._global_seen + 1
        self._global += (self.alpha if self._global_seen else 1.0) * (error - self._global)
        self.global_at[i, j] = self._global
        self._global_seen += 1
        self._factors = None

    def residual_quantile(self, quantile: float) -> float:
        """The ``quantile`` (in %) of the recent relative residuals, >= 0 (cached per step)."""
        if quantile not in self._quantiles:
            self._quantiles[quantile] = max(0.0, float(np.percentile(self.recent_residuals, quantile)))
        return self._quantiles[quantile]

    def residual_share_above(self, residual: float) -> float:
        """The share of the recent relative residuals above ``residual`` (0 when none is)."""
        largest = self._largest
        if largest is None:
            largest = self._largest = max(self.recent_residuals)
        if residual >= largest:  # a quiet machine, a budget with room: no sort
            return 0.0
        ranked = self._ranked
        if ranked is None:
            ranked = self._ranked = sorted(self.recent_residuals)
        return (len(ranked) - bisect.bisect_right(ranked, residual)) / len(ranked)

    def as_dict(self) -> dict:
        return {
            "n_bucket_lower_edges": list(N_BUCKET_EDGES),
            "factors_decode_only": np.exp(self.log_factor[:, 0]).round(4).tolist(),
            "factors_with_chunk": np.exp(self.log_factor[:, 1]).round(4).tolist(),
            "observations": self.observations.tolist(),
        }


class ContextFreeCost(ContextualCost):
    """A plain T(n, c) (e.g. the analytic model) seen as a contextual cost that ignores the context."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        return self.cost(n_decodes, chunk_tokens)


def as_contextual(cost: CostModel) -> ContextualCost:
    """``cost`` itself when it reads the KV context, else ``ContextFreeCost(cost)``."""
    return cost if isinstance(cost, ContextualCost) else ContextFreeCost(cost)


class CalibratedCost(ContextualCost):
    """T'(n, c) = max(k0(n) T(n, 0), k1(n) T(n, c)) for c > 0, and k0(n) T(n, 0) for c = 0."""

    def __init__(self, base: ContextualCost, calibrator: OnlineCalibrator) -> None:
        self.base = base
        self.calibrator = calibrator
        # A cost that prices a chunk piece by piece over the prompts on offer (ProfileCost)
        # gets the offer through its wrapper too; a cost without it stays without.
        if isinstance(base, OfferAware):
            self.set_offer = base.set_offer

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        k = self.calibrator.factor
        decode_only = k(n_decodes, False) * self.base.predict(n_decodes, 0, decode_kv_tokens, prefill_prefix_tokens)
        if chunk_tokens <= 0:
            return decode_only
        with_chunk = k(n_decodes, True) * self.base.predict(
            n_decodes, chunk_tokens, decode_kv_tokens, prefill_prefix_tokens
        )
        return max(with_chunk, decode_only) if n_decodes > 0 else with_chunk

    @property
    def prices_any_prefix(self) -> bool:
        """As its base (``fastest_chunk.reads_positions``): the correction is a factor per step kind."""
        return getattr(self.base, "prices_any_prefix", False)

    def chunk_pricer(self, n_decodes: int) -> CostModel:
        """T'(n, c) for this n at the context set, the same floats as the cost: the factors and
        the decode-only floor are taken once, for a search that asks this n only (``PricesChunks``)."""
        k = self.calibrator.factor
        kv, prefix = self.decode_kv_tokens, self.prefill_prefix_tokens
        base_predict = self.base.predict
        decode_only = k(n_decodes, False) * base_predict(n_decodes, 0, kv, prefix)
        with_chunk_factor = k(n_decodes, True)
        floored = n_decodes > 0

        def price(n: int, chunk_tokens: int) -> float:
            if n != n_decodes:  # another decode batch: the cost itself
                return self.predict(n, chunk_tokens, kv, prefix)
            if chunk_tokens <= 0:
                return decode_only
            with_chunk = with_chunk_factor * base_predict(n, chunk_tokens, kv, prefix)
            return max(with_chunk, decode_only) if floored else with_chunk

        return price


# The quantile of the corrected residuals the margin covers. It follows from how requests
# are judged, not from a deployment: a request meets TPOT when its P99 token gap does, so
# of a typical request's ~100-300 gaps one may overrun and two may not. For 90 % of
# requests to see at most one overrun, P(Poisson(m p) >= 2) <= 0.1 needs m p <= 0.53,
# p ~ 0.27 % at m = 200: the margin covers the P99.7 of the step times' residuals.
DEFAULT_MARGIN_QUANTILE = 99.7


class AdaptiveMargin:
    """delta = r x T', with r the ``quantile`` (P99.7) of the recent corrected residuals once there are enough.

    Told each decision's budget B first (``set_step``, ``WeighsAddedRisk``), it holds a chunk back
    only for the risk the chunk adds: when a decode-only step would itself miss B for a share p0
    of the recent residuals (a burst of stalls that delays any step), r is read at q - p0, so a
    step with a chunk misses at most 1 - q more often than the decode-only step would. On a quiet
    machine p0 = 0 and r is the quantile itself.

    Until ``min_steps`` steps have been seen it is the profile's ``ResidualMargin``. The
    fraction does not depend on c, so T' + delta = (1 + r) T' stays monotone in c. With a
    recalibrated cost the profile's margin would count the profile's bias twice (once in
    the correction, once in the residuals), and it never learns that the machine got
    noisier or quieter; the window does both.
    """

    def __init__(
        self,
        cost: CalibratedCost,
        fallback: ResidualMargin,
        quantile: float = DEFAULT_MARGIN_QUANTILE,
        min_steps: int = 50,
    ) -> None:
        self.cost = cost
        self.fallback = fallback
        self.quantile = quantile
        self.min_steps = min_steps
        self._step_fraction: float | None = None  # r at q - p0 for the step set (None: at q)

    def set_step(self, n_decodes: int, budget_ms: float) -> None:
        """The decision about to be taken: its decode batch and budget (see the class)."""
        self._step_fraction = None
        calibrator = self.cost.calibrator
        if not n_decodes or len(calibrator.recent_residuals) < self.min_steps or not budget_ms < math.inf:
            return  # no deadline, or too few steps seen
        decode_only_ms = self.cost(n_decodes, 0)
        if decode_only_ms > 0.0:
            level = self.quantile - 100.0 * calibrator.residual_share_above(budget_ms / decode_only_ms - 1.0)
            # past the median the decode-only step is itself likely late: the quantile as it is
            if 50.0 <= level < self.quantile:
                self._step_fraction = calibrator.residual_quantile(level)

    def fraction(self, n_decodes: int, chunk_tokens: int) -> float:
        fraction = self.step_fraction()
        return self.fallback.fraction(n_decodes, chunk_tokens) if fraction is None else fraction

    def step_fraction(self) -> float | None:
        """r for every chunk of the decision ``set_step`` announced (``ProportionalPerStep``); None
        while the profile's margin stands in (its r depends on the chunk)."""
        calibrator = self.cost.calibrator
        if len(calibrator.recent_residuals) < self.min_steps:
            return None
        step_fraction = self._step_fraction
        return calibrator.residual_quantile(self.quantile) if step_fraction is None else step_fraction

    def window_fraction(self) -> float:
        """r of the recent residuals, whatever their number (at least one step seen)."""
        return self.cost.calibrator.residual_quantile(self.quantile)

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.margin_for(n_decodes, chunk_tokens, self.cost(n_decodes, chunk_tokens))

    def margin_for(self, n_decodes: int, chunk_tokens: int, predicted_ms: float) -> float:
        return self.fraction(n_decodes, chunk_tokens) * predicted_ms


class ScaledCost(ContextualCost):
    """A base cost times a constant: a stale profile on purpose (drift experiments)."""

    def __init__(self, base: ContextualCost, factor: float) -> None:
        self.base = base
        self.factor = float(factor)

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        return self.factor * self.base.predict(n_decodes, chunk_tokens, decode_kv_tokens, prefill_prefix_tokens)


class ProfileFreeMargin:
    """The adaptive margin's stand-in before it has seen enough steps, with no profile: none."""

    def fraction(self, n_decodes: int, chunk_tokens: int) -> float:
        return 0.0


@dataclass(frozen=True)
class SelfCorrection:
    """Online recalibration plus the adaptive margin: what stands in for a hand-set margin.

    Every body builds it the same way (``self_correcting``) and feeds ``calibrator`` the
    (base prediction, measured time) of every step it runs; the policy decides with
    ``cost`` and ``margin`` (``AdaptiveMargin``, or ``StepMargin`` for the per-step form).
    """

    calibrator: OnlineCalibrator
    cost: CalibratedCost
    margin: AdaptiveMargin | StepMargin


# How the adaptive margin is shaped: ``relative``, one quantile of measured / corrected - 1 over
# all recent steps, times the step's corrected prediction; ``per-step``, in milliseconds, the
# quantile of the residuals of steps of the same kind and predicted time (``step_margin``).
MARGIN_FORMS = ("relative", "per-step")
DEFAULT_MARGIN_FORM = "relative"


def self_correcting(
    cost: CostModel,
    fallback=None,
    quantile: float = DEFAULT_MARGIN_QUANTILE,
    min_steps: int = 50,
    margin_form: str = DEFAULT_MARGIN_FORM,
) -> SelfCorrection:
    """Wrap ``cost`` (the prior: analytic, a profile or a fit) for online correction.

    ``fallback`` is the margin used until ``min_steps`` steps are seen (a profile's
    ``ResidualMargin``; None: no margin until then). ``margin_form`` is one of ``MARGIN_FORMS``.
    """
    if not 50.0 <= quantile < 100.0:
        raise ValueError(f"margin quantile must be in [50, 100) %, got {quantile!r}")
    if margin_form not in MARGIN_FORMS:
        raise ValueError(f"margin form must be one of {', '.join(MARGIN_FORMS)}, got {margin_form!r}")
    calibrator = OnlineCalibrator()
    corrected = CalibratedCost(as_contextual(cost), calibrator)
    margin = AdaptiveMargin(corrected, fallback or ProfileFreeMargin(), quantile, min_steps)
    if margin_form == "per-step":
        calibrator.step_residuals = StepResiduals(quiet_steps=steps_for_quantile(quantile) + 1)
        margin = StepMargin(
            corrected, calibrator.step_residuals, margin, quantile, max(min_steps, 1), TABLE_REFRESH_STEPS
        )
    return SelfCorrection(calibrator, corrected, margin)
