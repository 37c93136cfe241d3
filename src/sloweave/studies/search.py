"""The capacity search: the highest load at which a policy keeps SLO attainment at or above a target.

Load is an arrival-rate scale s (``sloweave.studies.sources``). Scales live on
a geometric lattice s_k = 2 ** (k / steps_per_doubling); a search visits lattice points
only, so simulations are cached and shared (a static policy ignores the TPOT target, so
one simulation at (policy, seed, k) serves every target).

Per seed, the capacity is found by a galloping search (from s = 1, or from the capacity
the previous search of the same policy found, with growing steps until the attainment
flips) followed by a bisection on the lattice, so it is exact to one lattice step: the
true crossing lies in [s_k, s_(k+1)). This assumes
attainment falls as load rises; where noise breaks that, the search returns one crossing
(the curves show the whole picture). The reported capacity is the mean over seeds of the
per-seed capacities, with their standard deviation, minimum and maximum as the
uncertainty (SPEC.md: aggregate per request first, then average over seeds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import CostModel
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS
from sloweave.sim.metrics import RunMetrics, summarize
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.studies.parallel import SERIAL, Runner, run_tasks
from sloweave.studies.replay import build_policy, run_policy
from sloweave.studies.sources import LoadSource, check_scalable

DEFAULT_ATTAINMENT = 0.90
# Attainment is a fraction of whole requests (e.g. 9/10); compare with a hair of slack so
# that exactly meeting the target is never lost to float rounding.
ATTAINMENT_TOLERANCE = 1e-12

# ``<rule>-tuned`` stands for the rule at its best budget, tuned per cell: a sweep over this
# grid (steps of about 1.4x), then one round of geometric midpoints around the best.
TUNED_RULES = ("fixed", "budget", "sarathi")
TUNING_GRID_TOKENS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


@dataclass(frozen=True)
class SearchLattice:
    """Where a capacity search looks and what it asks: the attainment to keep, and the load
    lattice s_k = 2 ** (k / steps_per_doubling) from ``min_scale`` to ``max_scale`` (rounded
    outwards to whole steps), with ``curve_points_per_doubling`` points per doubling on the
    load curves. One value travels through ``CapacityStudy``, ``tune`` and the commands."""

    attainment_target: float = DEFAULT_ATTAINMENT
    steps_per_doubling: int = 16
    min_scale: float = 1.0 / 16.0
    max_scale: float = 256.0
    curve_points_per_doubling: int = 4

    def __post_init__(self) -> None:
        if not 0.0 < self.attainment_target <= 1.0:
            raise ValueError(f"attainment target must be in (0, 1], got {self.attainment_target!r}")
        if self.steps_per_doubling < 1:
            raise ValueError(f"steps_per_doubling must be >= 1, got {self.steps_per_doubling!r}")
        if not (0 < self.min_scale <= 1.0 <= self.max_scale and math.isfinite(self.max_scale)):
            raise ValueError(f"need 0 < min_scale <= 1 <= max_scale (got {self.min_scale!r}, {self.max_scale!r})")
        object.__setattr__(self, "attainment_target", float(self.attainment_target))
        object.__setattr__(self, "steps_per_doubling", int(self.steps_per_doubling))

    @property
    def min_k(self) -> int:
        return math.floor(math.log2(self.min_scale) * self.steps_per_doubling + 1e-9)

    @property
    def max_k(self) -> int:
        return math.ceil(math.log2(self.max_scale) * self.steps_per_doubling - 1e-9)

    def scale(self, k: int) -> float:
        return 2.0 ** (k / self.steps_per_doubling)

    def describe(self) -> dict:
        return {
            "steps_per_doubling": self.steps_per_doubling,
            "min_scale": self.scale(self.min_k),
            "max_scale": self.scale(self.max_k),
        }


DEFAULT_LATTICE = SearchLattice()


@dataclass(frozen=True)
class SeedCapacity:
    seed: int
    k: int | None  # highest passing lattice index (None: fails even at the lowest scale)
    scale: float  # capacity scale (0 when below the lowest scale searched)
    rps: float
    censored: str  # "", "below-min", "above-max", "too-short" (";"-joined where several hold)


# A run whose arrivals all fall inside one TTFT target does not build a queue: at that load
# the capacity measures the run's length, not the server (the search would report any rate).
TOO_SHORT = "too-short"


@dataclass(frozen=True)
class Capacity:
    source: str
    policy: str
    tpot_ms: float
    ttft_ms: float
    attainment_target: float
    seeds: tuple[SeedCapacity, ...]
    step_ratio: float  # s_(k+1) / s_k: each per-seed capacity is exact to this factor
    tuned_to: str = ""  # a ``<rule>-tuned`` row: the budget the sweep chose for this cell

    @property
    def measurable(self) -> bool:
        return not any(TOO_SHORT in s.censored for s in self.seeds)

    @property
    def capacity_scale(self) -> float:
        return float(np.mean([s.scale for s in self.seeds])) if self.measurable else math.nan

    @property
    def capacity_rps(self) -> float:
        return float(np.mean([s.rps for s in self.seeds])) if self.measurable else math.nan

    def _spread(self, values: list[float]) -> float:
        return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0

    def row(self) -> dict:
        scales = [s.scale if self.measurable else math.nan for s in self.seeds]
        rps = [s.rps if self.measurable else math.nan for s in self.seeds]
        censored = sorted({flag for s in self.seeds for flag in s.censored.split(";") if flag})
        return {
            "source": self.source,
            "policy": self.policy,
            "tpot_ms": self.tpot_ms,
            "ttft_ms": self.ttft_ms,
            "attainment_target": self.attainment_target,
            "capacity_scale": self.capacity_scale,
            "capacity_rps": self.capacity_rps,
            "tuned_to": self.tuned_to,
            "capacity_scale_std": self._spread(scales),
            "capacity_scale_min": float(np.min(scales)),
            "capacity_scale_max": float(np.max(scales)),
            "capacity_rps_std": self._spread(rps),
            "capacity_rps_min": float(np.min(rps)),
            "capacity_rps_max": float(np.max(rps)),
            "seeds": len(self.seeds),
            "step_pct": 100.0 * (self.step_ratio - 1.0),
            "censored": ";".join(censored),
        }


@dataclass
class _Run:
    """Per-request outcome of one simulation: enough to judge it against any SLO target."""

    requests: pd.DataFrame
    duration_ms: float


def round_to_64(tokens: float) -> int:
    return max(64, int(round(tokens / 64.0)) * 64)


def refined_budgets(best_tokens: int, swept: list[int]) -> list[int]:
    """One refinement round: the geometric midpoints (multiples of 64) between the best
    budget and its neighbours in the sweep, not already swept."""
    swept = sorted(swept)
    i = swept.index(best_tokens)
    extra = {round_to_64(math.sqrt(best_tokens * swept[j])) for j in (i - 1, i + 1) if 0 <= j < len(swept)}
    return sorted(extra - set(swept))


def budget_of(policy: str, rule: str) -> int | None:
    """The budget of ``<rule>-<tokens>``, else None."""
    head, _, tail = policy.rpartition("-")
    return int(tail) if head == rule and tail.isdigit() else None


def best_of_rule(capacities: list[Capacity], rule: str) -> Capacity | None:
    """The best ``<rule>-<tokens>`` among ``capacities`` (one target): the highest mean
    capacity, a cell too short to measure below every measured one; ties (one lattice step
    resolves nothing finer) go to the smaller budget, which protects TPOT more."""
    rivals = [c for c in capacities if budget_of(c.policy, rule) is not None]
    if not rivals:
        return None
    return max(rivals, key=lambda c: (c.capacity_rps if c.measurable else -1.0, -budget_of(c.policy, rule)))


def _study_task(study: CapacityStudy, method: str, *task):
    """One task of a study, wherever it runs; returns its result and the runs it simulated
    (a worker's cache is its own: the runs come back so the curves can reuse them)."""
    before = set(study._runs)
    result = getattr(study, method)(*task)
    return result, {key: run for key, run in study._runs.items() if key not in before}


class CapacityStudy:
    """Simulations on the load lattice, cached; capacity searches and load curves on top.

    ``jobs`` > 1 runs independent searches and curve points in a pool of forked processes,
    ``ray`` on a Ray cluster (``sloweave.studies.parallel``); every search is a function of
    its own inputs only, so the results are the serial run's, bit for bit, whatever the
    number of workers.
    """

    def __init__(
        self,
        source: LoadSource,
        policies: list[str] | tuple[str, ...],
        tpot_targets_ms: list[float] | tuple[float, ...],
        ttft_ms: float,
        lattice: SearchLattice = DEFAULT_LATTICE,
        cost: CostModel | None = None,
        max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
        options: EngineOptions = DEFAULT_OPTIONS,
        tpot_change_ms: float | None = None,
        runner: Runner = SERIAL,
        progress: bool = False,
        store=None,
    ) -> None:
        if not (math.isfinite(ttft_ms) and ttft_ms > 0) or not all(math.isfinite(t) and t > 0 for t in tpot_targets_ms):
            raise ValueError("SLO targets must be finite numbers of milliseconds > 0")
        if not policies or not tpot_targets_ms:
            raise ValueError("need at least one policy and one TPOT target")
        if tpot_change_ms is not None and not (math.isfinite(tpot_change_ms) and tpot_change_ms > 0):
            raise ValueError(f"tpot_change_ms must be a finite number of milliseconds > 0, got {tpot_change_ms!r}")
        # The operator changes the TPOT target mid-run: requests in the second half of each
        # run are served (and judged) to this target, the first half to the searched one.
        self.tpot_change_ms = tpot_change_ms
        self.source = source
        self.options = options
        self.runner = runner
        self.cost = cost or AnalyticCost()
        self.max_chunk_tokens = max_chunk_tokens
        self.tuned_rules, names = _expand_tuned(policies)
        self.policies = {p.name: p for p in (build_policy(name, self.cost, max_chunk_tokens) for name in names)}
        self.tpot_targets_ms = tuple(float(t) for t in tpot_targets_ms)
        self.ttft_ms = float(ttft_ms)
        self.lattice = lattice
        self.attainment_target = lattice.attainment_target
        self.steps = lattice.steps_per_doubling
        # Lattice bounds, rounded outwards to whole lattice steps.
        self.min_k = lattice.min_k
        self.max_k = lattice.max_k
        self.curve_points_per_doubling = lattice.curve_points_per_doubling
        self.progress = progress
        # where finished tasks are kept for --resume (``sloweave.studies.parallel.TaskStore``); None: nowhere
        self.store = store
        self._runs: dict[tuple, _Run] = {}
        check_scalable(source)

    def __getstate__(self) -> dict:
        # Shipped to Ray workers without the cache of runs: a task never reads another task's
        # runs (searches depend on their own inputs, curve tasks are the points not yet run),
        # so the cache (tens of MB after a search) would be sent for nothing.
        return {**self.__dict__, "_runs": {}, "store": None}

    # ---- lattice and cached simulations

    def scale(self, k: int) -> float:
        return self.lattice.scale(k)

    def _key(self, policy: str, seed: int, k: int, tpot_ms: float) -> tuple:
        # A static policy's schedule does not depend on the TPOT target (unless admission
        # control reads it): one run serves all.
        reads_target = self.policies[policy].uses_deadlines or self.options.admission
        return (policy, seed, k, tpot_ms if reads_target else None)

    def run(self, policy: str, seed: int, k: int, tpot_ms: float) -> _Run:
        key = self._key(policy, seed, k, tpot_ms)
        if key not in self._runs:
            workload = self.source.workload(seed, self.scale(k))
            if self.tpot_change_ms is not None:
                workload = replace(workload, tpot_ms=self._targets(len(workload), tpot_ms))
            frame, duration_ms = run_policy(
                workload, self.policies[policy], tpot_ms, self.cost, self.options, self.ttft_ms, noise_seed=seed
            )
            self._runs[key] = _Run(frame[["request", "ttft_ms", "p99_tpot_ms", "status"]], duration_ms)
        return self._runs[key]

    @property
    def simulations(self) -> int:
        return len(self._runs)

    def metrics(self, policy: str, seed: int, k: int, tpot_ms: float) -> RunMetrics:
        run = self.run(policy, seed, k, tpot_ms)
        targets = (
            tpot_ms
            if self.tpot_change_ms is None
            else self._targets(len(run.requests), tpot_ms)[run.requests["request"].to_numpy()]
        )
        return summarize(run.requests, run.duration_ms, self.ttft_ms, targets)

    def _targets(self, num_requests: int, tpot_ms: float) -> np.ndarray:
        targets = np.full(num_requests, float(tpot_ms))
        targets[num_requests // 2 :] = self.tpot_change_ms
        return targets

    def passes(self, policy: str, seed: int, k: int, tpot_ms: float) -> bool:
        attained = self.metrics(policy, seed, k, tpot_ms).attainment
        return attained >= self.attainment_target - ATTAINMENT_TOLERANCE

    def _map(self, method: str, tasks: list[tuple], desc: str) -> list:
        """``getattr(self, method)(*task)`` for every task, in task order, where the runner says."""
        outcomes = run_tasks(
            _study_task, [(method, *task) for task in tasks], self, self.runner, desc, self.progress, self.store
        )
        for _, runs in outcomes:
            self._runs.update(runs)
        return [result for result, _ in outcomes]

    # ---- search

    def search_seed(self, policy: str, tpot_ms: float, seed: int, start_k: int | None = None) -> SeedCapacity:
        """Highest lattice scale where this seed attains the target.

        Galloping search from ``start_k`` (steps of 1, 2, 4, ... lattice points until the
        attainment flips), then bisection. Without a start it begins at scale 1 with a
        step of one doubling; a start near the answer (the capacity just found for another
        target) needs only a few simulations.
        """
        lo, hi = self._bracket(policy, tpot_ms, seed, start_k)
        base_rate = self.source.base_rate_rps(seed)
        if lo is None:
            return SeedCapacity(seed, None, 0.0, 0.0, "below-min")
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            if self.passes(policy, seed, mid, tpot_ms):
                lo = mid
            else:
                hi = mid
        scale = self.scale(lo)
        censored = ["above-max"] if hi is None else []
        if self._arrival_span_ms(seed, lo) <= self.ttft_ms:
            censored.append(TOO_SHORT)
        return SeedCapacity(seed, lo, scale, scale * base_rate, ";".join(censored))

    def _bracket(self, policy: str, tpot_ms: float, seed: int, start_k: int | None) -> tuple[int | None, int | None]:
        """(lo, hi) by galloping: lo passes, hi fails, lo < hi; None where the lattice ends first."""

        def ok(k: int) -> bool:
            return self.passes(policy, seed, k, tpot_ms)

        if start_k is None:
            k, step = min(max(0, self.min_k), self.max_k), self.steps
        else:
            k, step = min(max(start_k, self.min_k), self.max_k), 1
        if ok(k):
            lo = k
            while lo < self.max_k:
                k = min(lo + step, self.max_k)
                if not ok(k):
                    return lo, k
                lo, step = k, step * 2
            return lo, None
        hi = k
        while hi > self.min_k:
            k = max(hi - step, self.min_k)
            if ok(k):
                return k, hi
            hi, step = k, step * 2
        return None, hi

    def _arrival_span_ms(self, seed: int, k: int) -> float:
        arrivals = self.source.workload(seed, self.scale(k)).arrival_s
        return 1000.0 * float(arrivals[-1] - arrivals[0])

    def search_targets(self, policy: str, seed: int, targets: tuple[float, ...]) -> list[SeedCapacity]:
        """One policy and seed, the targets in the given order, each search starting where
        the previous one ended (capacities of one policy and seed are close). Depends on
        nothing but its arguments, so tasks can run in any order or process."""
        found, last_k = [], None
        for tpot in targets:
            result = self.search_seed(policy, tpot, seed, last_k)
            found.append(result)
            if result.k is not None:
                last_k = result.k
        return found

    def _search(self, cells: dict[str, tuple[float, ...]]) -> dict[tuple[str, float], list[SeedCapacity]]:
        """Per-seed capacities of each policy at its targets (loosest first)."""
        tasks = [
            (p, s, tuple(sorted(ts, reverse=True))) for p, ts in cells.items() for s in range(self.source.num_seeds)
        ]
        found: dict[tuple[str, float], list[SeedCapacity]] = {}
        for (policy, _, targets), results in zip(tasks, self._map("search_targets", tasks, "capacity search")):
            for tpot, result in zip(targets, results):
                found.setdefault((policy, tpot), []).append(result)
        return found

    def capacities(self) -> list[Capacity]:
        caps = self._capacities(self._search({p: self.tpot_targets_ms for p in self.policies}))
        for rule in self.tuned_rules:
            # Refine each target's sweep around its best budget.
            extra: dict[str, list[float]] = {}
            for tpot in self.tpot_targets_ms:
                at = [c for c in caps if c.tpot_ms == tpot]
                swept = [b for b in (budget_of(c.policy, rule) for c in at) if b is not None]
                for b in refined_budgets(budget_of(best_of_rule(at, rule).policy, rule), swept):
                    extra.setdefault(f"{rule}-{b}", []).append(tpot)
            for name in extra:
                self.policies.setdefault(name, build_policy(name, self.cost, self.max_chunk_tokens))
            caps += self._capacities(self._search({name: tuple(ts) for name, ts in extra.items()}))
        for rule in self.tuned_rules:
            for tpot in self.tpot_targets_ms:
                best = best_of_rule([c for c in caps if c.tpot_ms == tpot], rule)
                caps.append(replace(best, policy=f"{rule}-tuned", tuned_to=best.policy))
        return caps

    def _capacities(self, found: dict[tuple[str, float], list[SeedCapacity]]) -> list[Capacity]:
        step = 2.0 ** (1.0 / self.steps)
        return [
            Capacity(self.source.name, p, t, self.ttft_ms, self.attainment_target, tuple(seeds), step)
            for (p, t), seeds in found.items()
        ]

    # ---- curves

    def curve_lattice(self, capacities: list[Capacity], max_doublings: float = 3.0) -> list[int]:
        """Lattice points for the load curves: around the capacities found, at most ``max_doublings`` wide."""
        stride = max(1, self.steps // self.curve_points_per_doubling)
        ks = [s.k for c in capacities for s in c.seeds if s.k is not None]
        if not ks:
            return [self.min_k]
        hi = min(max(ks) + self.steps // 2, self.max_k)
        lo = max(min(ks) - self.steps // 2, hi - int(max_doublings * self.steps), self.min_k)
        first = lo - lo % stride  # align to the stride so points are shared with other runs
        return [k for k in range(first, hi + stride, stride) if self.min_k <= k <= self.max_k]

    def prefetch(self, points: list[tuple[str, int, float]]) -> None:
        """Simulate every seed at the (policy, k, tpot) points not yet run (where the runner says)."""
        keys = {}
        for policy, k, tpot in points:
            for seed in range(self.source.num_seeds):
                key = self._key(policy, seed, k, tpot)
                if key not in self._runs:
                    keys.setdefault(key, (policy, seed, k, tpot))
        self._map("run", list(keys.values()), "load points")

    def curves(self, lattice: list[int], policies: list[str] | None = None) -> pd.DataFrame:
        """Attainment and goodput against load, every policy and TPOT target, mean and std over seeds."""
        rows = []
        seeds = range(self.source.num_seeds)
        base_rates = [self.source.base_rate_rps(s) for s in seeds]
        points = [(p, k, t) for k in lattice for p in (policies or self.policies) for t in self.tpot_targets_ms]
        self.prefetch(points)
        for policy, k, tpot in points:
            per_seed = [self.metrics(policy, s, k, tpot) for s in seeds]
            rows.append(
                {
                    "source": self.source.name,
                    "policy": policy,
                    "tpot_ms": tpot,
                    "ttft_ms": self.ttft_ms,
                    "rate_scale": self.scale(k),
                    "rate_rps": float(np.mean([self.scale(k) * r for r in base_rates])),
                    **_mean_std("attainment", [m.attainment for m in per_seed]),
                    **_mean_std("goodput_rps", [m.goodput_rps for m in per_seed]),
                    "p99_ttft_ms": float(np.mean([m.p99_ttft_ms for m in per_seed])),
                    "p99_tpot_ms": float(np.mean([m.p99_tpot_ms for m in per_seed])),
                    "seeds": len(per_seed),
                }
            )
        return pd.DataFrame(rows)

    def requests_at(self, policy: str, k: int, tpot_ms: float) -> pd.DataFrame:
        """Per-request TTFT and P99 gap of every seed at lattice point k (for the CDFs)."""
        frames = []
        for seed in range(self.source.num_seeds):
            frame = self.run(policy, seed, k, tpot_ms).requests.copy()
            frame.insert(0, "seed", seed)
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)


def _mean_std(name: str, values: list[float]) -> dict:
    return {name: float(np.mean(values)), f"{name}_std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}


def _expand_tuned(policies) -> tuple[list[str], list[str]]:
    """(tuned rules, policy names): ``<rule>-tuned`` becomes the rule at every grid budget."""
    rules, names = [], []
    for name in policies:
        head, _, tail = str(name).strip().lower().rpartition("-")
        if tail == "tuned":
            if head not in TUNED_RULES:
                raise ValueError(
                    f"unknown tuned policy {name!r}: expected one of {', '.join(r + '-tuned' for r in TUNED_RULES)}"
                )
            rules.append(head)
            names += [f"{head}-{b}" for b in TUNING_GRID_TOKENS]
        else:
            names.append(name)
    return list(dict.fromkeys(rules)), list(dict.fromkeys(names))
