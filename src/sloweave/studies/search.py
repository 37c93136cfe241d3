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
from sloweave.sim.metrics import RunMetrics, slo_met, summarize
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.sim.tiers import Tier, assign_tiers, check_tier_mix, tier_attainment, tier_labels
from sloweave.studies.parallel import SERIAL, Runner, run_tasks
from sloweave.studies.replay import build_policy, run_policy
from sloweave.studies.search_records import ATTAINMENT_TOLERANCE, TOO_SHORT, Capacity, SeedCapacity, TierOutcome
from sloweave.studies.search_records import DEFAULT_ATTAINMENT as DEFAULT_ATTAINMENT
from sloweave.studies.search_records import DEFAULT_LATTICE, SearchLattice
from sloweave.studies.sources import LoadSource, check_scalable

# ``<rule>-tuned`` stands for the rule at its best budget, tuned per cell: a sweep over this
# grid (steps of about 1.4x), then one round of geometric midpoints around the best.
TUNED_RULES = ("fixed", "budget", "sarathi")
TUNING_GRID_TOKENS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


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
        tpot_targets_ms: list[float] | tuple[float, ...] = (),
        ttft_ms: float | None = None,
        lattice: SearchLattice = DEFAULT_LATTICE,
        cost: CostModel | None = None,
        max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
        options: EngineOptions = DEFAULT_OPTIONS,
        tpot_change_ms: float | None = None,
        runner: Runner = SERIAL,
        progress: bool = False,
        store=None,
        tiers: tuple[Tier, ...] = (),
    ) -> None:
        if not policies:
            raise ValueError("need at least one policy")
        # SLO tiers (``sloweave.sim.tiers``): each request carries its tier's TPOT and TTFT targets,
        # served to them by deadline-aware policies and judged against them; one search per policy.
        self.tiers = check_tier_mix(tiers) if tiers else ()
        tpot_targets_ms, ttft_ms = _slo_targets(tpot_targets_ms, ttft_ms, tpot_change_ms, self.tiers)
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
        self.tpot_targets_ms = tpot_targets_ms
        self.ttft_ms = ttft_ms
        self._tier_tpot_ms = np.array([t.tpot_ms for t in self.tiers], dtype=float)
        self._tier_ttft_ms = np.array([t.ttft_ms for t in self.tiers], dtype=float)
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
        for seed in range(source.num_seeds) if self.tiers else ():
            self._tier_of(seed, len(source.workload(seed, 1.0)))  # every tier draws a request

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
            workload, ttft_ms = self.source.workload(seed, self.scale(k)), self.ttft_ms
            if self.tiers:
                tiered = assign_tiers(workload, self.tiers, seed)
                workload, ttft_ms = tiered.workload, tiered.ttft_ms
            elif self.tpot_change_ms is not None:
                workload = replace(workload, tpot_ms=self._targets(len(workload), tpot_ms))
            frame, duration_ms = run_policy(
                workload, self.policies[policy], tpot_ms, self.cost, self.options, ttft_ms, noise_seed=seed
            )
            self._runs[key] = _Run(frame[["request", "ttft_ms", "p99_tpot_ms", "status"]], duration_ms)
        return self._runs[key]

    @property
    def simulations(self) -> int:
        return len(self._runs)

    def metrics(self, policy: str, seed: int, k: int, tpot_ms: float) -> RunMetrics:
        run = self.run(policy, seed, k, tpot_ms)
        return summarize(run.requests, run.duration_ms, *self._judged_targets(run, seed, tpot_ms))

    def _judged_targets(self, run: _Run, seed: int, tpot_ms: float) -> tuple:
        """(TTFT, TPOT) targets the requests of ``run`` are judged against: one each, or one per request."""
        if self.tiers:
            tier_of = self._tiers_of_run(run, seed)
            return self._tier_ttft_ms[tier_of], self._tier_tpot_ms[tier_of]
        if self.tpot_change_ms is None:
            return self.ttft_ms, tpot_ms
        return self.ttft_ms, self._targets(len(run.requests), tpot_ms)[run.requests["request"].to_numpy()]

    def _tiers_of_run(self, run: _Run, seed: int) -> np.ndarray:
        """The tier of each request of ``run``, in the run's row order."""
        return self._tier_of(seed, len(run.requests))[run.requests["request"].to_numpy()]

    def _tier_of(self, seed: int, num_requests: int) -> np.ndarray:
        """Each request's tier: drawn from the seed alone, so the same for every policy and load."""
        labels = tier_labels(num_requests, self.tiers, seed)
        missing = [t.name for i, t in enumerate(self.tiers) if not np.any(labels == i)]
        if missing:
            raise ValueError(
                f"{self.source.name}, seed {seed}: tier(s) {', '.join(missing)} drew none of the {num_requests} "
                "requests: raise their share or the number of requests"
            )
        return labels

    def tier_attainment(self, policy: str, seed: int, k: int, tpot_ms: float) -> np.ndarray:
        """Each tier's attainment at lattice point ``k``, every request judged against its own tier."""
        run = self.run(policy, seed, k, tpot_ms)
        tier_of = self._tiers_of_run(run, seed)  # drawn once: the targets and the grouping both read it
        met = slo_met(run.requests, self._tier_ttft_ms[tier_of], self._tier_tpot_ms[tier_of])
        return tier_attainment(met, tier_of, len(self.tiers))

    def _tiers_missing(self, policy: str, seed: int, k: int, tpot_ms: float) -> str:
        """The tiers under the attainment target at lattice point ``k``, in the mix's order, "+"-joined."""
        attained = self.tier_attainment(policy, seed, k, tpot_ms)
        missed = attained < self.attainment_target - ATTAINMENT_TOLERANCE
        return "+".join(t.name for t, miss in zip(self.tiers, missed) if miss)

    def _targets(self, num_requests: int, tpot_ms: float) -> np.ndarray:
        targets = np.full(num_requests, float(tpot_ms))
        targets[num_requests // 2 :] = self.tpot_change_ms
        return targets

    def passes(self, policy: str, seed: int, k: int, tpot_ms: float) -> bool:
        """Attainment at or above the target at lattice point ``k``; with tiers, in every tier."""
        if self.tiers:
            return not self._tiers_missing(policy, seed, k, tpot_ms)
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
            Capacity(
                self.source.name,
                p,
                t,
                self.ttft_ms,
                self.attainment_target,
                tuple(seeds),
                step,
                tiers=self.tiers,
                tier_outcomes=tuple(self._tier_outcome(p, t, s) for s in seeds) if self.tiers else (),
            )
            for (p, t), seeds in found.items()
        ]

    def _tier_outcome(self, policy: str, tpot_ms: float, found: SeedCapacity) -> TierOutcome:
        """Each tier at a seed's capacity, and the tiers that miss at the next load the search ran
        (one lattice step above, or the lowest load where even that fails): runs already made."""
        if found.k is None:
            return TierOutcome(
                (math.nan,) * len(self.tiers), self._tiers_missing(policy, found.seed, self.min_k, tpot_ms)
            )
        attained = tuple(float(a) for a in self.tier_attainment(policy, found.seed, found.k, tpot_ms))
        above = "" if found.k >= self.max_k else self._tiers_missing(policy, found.seed, found.k + 1, tpot_ms)
        return TierOutcome(attained, above)

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
                    **self._tier_means(policy, k, tpot),
                }
            )
        return pd.DataFrame(rows)

    def _tier_means(self, policy: str, k: int, tpot_ms: float) -> dict:
        """With tiers, each tier's attainment at lattice point ``k``, mean over seeds (the
        pooled ``attainment`` judges each request against its own tier too)."""
        if not self.tiers:
            return {}
        per_seed = np.array([self.tier_attainment(policy, s, k, tpot_ms) for s in range(self.source.num_seeds)])
        return {f"attainment_{t.name}": float(mean) for t, mean in zip(self.tiers, per_seed.mean(axis=0))}

    def requests_at(self, policy: str, k: int, tpot_ms: float) -> pd.DataFrame:
        """Per-request TTFT and P99 gap of every seed at lattice point k (for the CDFs)."""
        frames = []
        for seed in range(self.source.num_seeds):
            frame = self.run(policy, seed, k, tpot_ms).requests.copy()
            frame.insert(0, "seed", seed)
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)


def _slo_targets(tpot_targets_ms, ttft_ms, tpot_change_ms, tiers: tuple[Tier, ...]) -> tuple[tuple[float, ...], float]:
    """The TPOT targets searched and the TTFT target that marks a run too short. With tiers,
    each tier names its own targets: the search runs once, its runs' single TPOT target (for
    a request without one; every request has its tier's) is the tightest tier's, and a run is
    too short when every arrival falls within the loosest tier's TTFT target."""
    if tiers:
        given = ["tpot_targets_ms"] if len(tpot_targets_ms) else []
        given += [
            name for name, value in (("ttft_ms", ttft_ms), ("tpot_change_ms", tpot_change_ms)) if value is not None
        ]
        if given:
            raise ValueError(f"{' and '.join(given)} cannot go with SLO tiers: each tier names its own targets")
        return (min(t.tpot_ms for t in tiers),), max(t.ttft_ms for t in tiers)
    if not tpot_targets_ms:
        raise ValueError("need at least one TPOT target")
    if ttft_ms is None or not (math.isfinite(ttft_ms) and ttft_ms > 0):
        raise ValueError(f"need a TTFT target: a finite number of milliseconds > 0, got {ttft_ms!r}")
    if not all(math.isfinite(t) and t > 0 for t in tpot_targets_ms):
        raise ValueError("SLO targets must be finite numbers of milliseconds > 0")
    if tpot_change_ms is not None and not (math.isfinite(tpot_change_ms) and tpot_change_ms > 0):
        raise ValueError(f"tpot_change_ms must be a finite number of milliseconds > 0, got {tpot_change_ms!r}")
    return tuple(float(t) for t in tpot_targets_ms), float(ttft_ms)


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
