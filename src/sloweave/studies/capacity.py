"""Capacity: the highest load at which a policy keeps SLO attainment at or above a target.

Load is an arrival-rate scale s: every seed's base workload is replayed with its arrival
times divided by s (same requests, same burst structure, s times the rate). Scales live on
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

What a "seed" is depends on the source:
- a synthetic workload: the generator seed (new arrivals and lengths);
- a timed trace: a disjoint time window of the trace. Different windows are different
  samples of the real arrival process (its rate and burstiness drift over the hour), so
  their spread is the uncertainty a user of the trace actually faces; jittering arrivals
  of one window would keep the same requests and understate it;
- a length-only file with generated arrivals: a random subsample of the lengths and a
  Poisson arrival stream, both drawn from the seed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import click
import numpy as np
import pandas as pd

from sloweave.core.cost import AnalyticCost, CostModel
from sloweave.core.costs import ResolvedCost, analytic_description, cost_option
from sloweave.sim.metrics import RunMetrics, summarize
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS
from sloweave.core.validate import ATTAINMENT, DURATION_MS, DURATION_S, RATE_RPS, REPEATS, SCALE, TOKENS
from sloweave.studies.inputs import REQUESTS, max_model_len_option, model_len_or_default, once_each, parallel_options
from sloweave.studies.parallel import Runner, local_cores, run_tasks
from sloweave.studies.outputs import check_writable, command_settings, write_result_json
from sloweave.studies.result_folders import result_folder, result_folder_options
from sloweave.studies.replay import DEFAULT_TRACE_TTFT_MS, _pyplot, build_policy, plot_cdfs, policy_style, run_policy
from sloweave.sim.traces import FORMATS, ReplayOptions, Trace, TraceError, load_trace, replay_workload, split_windows
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions, engine_options
from sloweave.sim.workloads import ALL_WORKLOADS, Workload, WorkloadError, WorkloadSpec, back_to_back_workloads

# Fixed chunks from 256 to C_max = 4096 bracket the best static chunk on every target we
# measured (Fixed-64 is never close and is the slowest to simulate; pass --policy fixed-64 to add it).
DEFAULT_POLICIES = ("sloweave", "full", "fixed-256", "fixed-512", "fixed-1024", "fixed-2048", "fixed-4096")
DEFAULT_WINDOW_S = 300.0
DEFAULT_TPOT_TARGETS_MS = (10.0, 25.0, 50.0)
DEFAULT_ATTAINMENT = 0.90
# Attainment is a fraction of whole requests (e.g. 9/10); compare with a hair of slack so
# that exactly meeting the target is never lost to float rounding.
ATTAINMENT_TOLERANCE = 1e-12
CAPACITY_COLUMNS = ["source", "policy", "tpot_ms", "ttft_ms", "attainment_target", "capacity_scale", "capacity_rps", "tuned_to"]

# ``<rule>-tuned`` stands for the rule at its best budget, tuned per cell: a sweep over this
# grid (steps of about 1.4x), then one round of geometric midpoints around the best.
TUNED_RULES = ("fixed", "budget", "sarathi")
TUNING_GRID_TOKENS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
# The comparisons made like for like: SLOWeave with one prompt per iteration against the
# fixed chunk (and the one-prompt token budget); with several prompts, against vLLM's rule.
PAIRS = (("sloweave", "fixed"), ("sloweave", "budget"), ("sloweave-multi", "sarathi"))


# --------------------------------------------------------------------------- load sources


class LoadSource(Protocol):
    """Something that yields a workload per (seed, load scale)."""

    name: str

    @property
    def num_seeds(self) -> int: ...

    def workload(self, seed: int, rate_scale: float) -> Workload: ...

    def base_rate_rps(self, seed: int) -> float: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class ScaledWorkloads:
    """One base workload per seed; load scale s divides its arrival times by s."""

    name: str
    base: tuple[Workload, ...]
    base_rates_rps: tuple[float, ...]  # request rate of each base workload at scale 1
    seed_labels: tuple[str, ...] = ()
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base:
            raise WorkloadError(f"{self.name}: need at least one seed workload")
        if len(self.base_rates_rps) != len(self.base):
            raise WorkloadError(f"{self.name}: one base rate per seed workload")

    @property
    def num_seeds(self) -> int:
        return len(self.base)

    def workload(self, seed: int, rate_scale: float) -> Workload:
        wl = self.base[seed]
        return replace(wl, arrival_s=wl.arrival_s / rate_scale, params={**wl.params, "rate_scale": rate_scale})

    def base_rate_rps(self, seed: int) -> float:
        return self.base_rates_rps[seed]

    def describe(self) -> dict:
        seeds = [
            {"seed": i, "label": self.seed_labels[i] if self.seed_labels else str(i), "requests": len(wl), "base_rate_rps": rate}
            for i, (wl, rate) in enumerate(zip(self.base, self.base_rates_rps))
        ]
        return {"name": self.name, **self.info, "seeds": seeds}


@dataclass(frozen=True)
class SpecSource:
    """A synthetic workload family; seed i is generator seed ``seeds[i]``, load scales its rate."""

    spec: WorkloadSpec
    num_requests: int
    seeds: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_seeds(self) -> int:
        return len(self.seeds)

    def workload(self, seed: int, rate_scale: float) -> Workload:
        return self.spec.generate(self.num_requests, self.seeds[seed], rate_scale)

    def base_rate_rps(self, seed: int) -> float:
        return self.spec.rate_rps

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": "synthetic workload",
            "requests_per_seed": self.num_requests,
            "generator_seeds": list(self.seeds),
            "base_rate_rps": self.spec.rate_rps,
        }


def trace_source(
    trace: Trace,
    num_seeds: int,
    window_s: float | None = None,
    max_prompt_tokens: int | None = None,
    arrivals: str = "trace",
    rate_rps: float | None = None,
    requests_per_seed: int | None = None,
) -> ScaledWorkloads:
    """Seeds of a trace: disjoint time windows, or (length-only files) subsamples with Poisson arrivals."""
    base, rates, labels = [], [], []
    capped = 0
    if arrivals == "trace":
        if not trace.has_arrivals:
            # Same refusal as replay_workload, raised before any window is cut.
            replay_workload(trace, ReplayOptions())
        for start_s, end_s in split_windows(trace, num_seeds, window_s):
            options = ReplayOptions(start_s=start_s, end_s=end_s, max_prompt_tokens=max_prompt_tokens, max_requests=requests_per_seed)
            wl, report = replay_workload(trace, options)
            base.append(wl)
            rates.append(report.base_rate_rps)
            capped += report.num_prompts_capped
            labels.append(f"window [{report.window_start_s:.1f}, {report.window_end_s:.1f}) s")
        info = {"kind": "trace, seeds are disjoint time windows", "path": trace.path, "format": trace.fmt}
    else:
        n = min(requests_per_seed or 2000, len(trace))
        for seed in range(num_seeds):
            rng = np.random.default_rng(seed)
            rows = np.sort(rng.choice(len(trace), size=n, replace=False))
            sub = replace(trace, arrival_s=None, prompt_tokens=trace.prompt_tokens[rows], output_tokens=trace.output_tokens[rows])
            options = ReplayOptions(arrivals="poisson", poisson_rate_rps=rate_rps, seed=seed, max_prompt_tokens=max_prompt_tokens)
            wl, report = replay_workload(sub, options)
            base.append(wl)
            rates.append(report.base_rate_rps)
            capped += report.num_prompts_capped
            labels.append(f"subsample seed {seed}: {report.arrivals}")
        info = {
            "kind": "GENERATED Poisson arrivals on the file's lengths (it has none, or they were replaced); seeds are random subsamples",
            "path": trace.path,
            "format": trace.fmt,
        }
    info["max_prompt_tokens"] = max_prompt_tokens
    info["num_prompts_capped"] = capped
    return ScaledWorkloads(trace.name, tuple(base), tuple(rates), tuple(labels), info)


def back_to_back(sources: list[ScaledWorkloads]) -> ScaledWorkloads:
    """Several traces replayed one after another: seed i is window i of each, in order.

    Load scale s divides every arrival time, so the whole sequence runs s times faster.
    The base rate is the joined workload's own (requests over its span).
    """
    if len({s.num_seeds for s in sources}) != 1:
        raise WorkloadError("back-to-back traces need the same number of seeds (windows) each")
    name = "+".join(s.name for s in sources)
    base, rates = [], []
    for seed in range(sources[0].num_seeds):
        wl = back_to_back_workloads([s.base[seed] for s in sources], name)
        base.append(wl)
        rates.append(len(wl) / wl.span_s if wl.span_s > 0 else float("nan"))
    labels = tuple(" then ".join(s.seed_labels[i] if s.seed_labels else str(i) for s in sources) for i in range(len(base)))
    info = {"kind": "traces back to back; seed i is window i of each", "parts": [s.describe() for s in sources]}
    return ScaledWorkloads(name, tuple(base), tuple(rates), labels, info)


# --------------------------------------------------------------------------- search


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


def _check_scalable(source: LoadSource) -> None:
    """A load scale divides arrival times: with every request at one instant it changes nothing."""
    for seed in range(source.num_seeds):
        workload = source.workload(seed, 1.0)
        if workload.span_s <= 0:
            raise ValueError(
                f"{source.name}, seed {seed}: all {len(workload)} request(s) arrive at the same instant, so scaling "
                "the load (which divides arrival times) cannot change it and capacity is undefined; use a trace "
                "(window) whose arrivals are spread in time, more requests, or generated arrivals (--arrivals poisson)"
            )


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
        attainment_target: float = DEFAULT_ATTAINMENT,
        steps_per_doubling: int = 16,
        min_scale: float = 1.0 / 16.0,
        max_scale: float = 256.0,
        cost: CostModel | None = None,
        max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
        curve_points_per_doubling: int = 4,
        progress: bool = False,
        options: EngineOptions = DEFAULT_OPTIONS,
        jobs: int = 1,
        tpot_change_ms: float | None = None,
        ray: str | None = None,
        store=None,
    ) -> None:
        if not 0.0 < attainment_target <= 1.0:
            raise ValueError(f"attainment target must be in (0, 1], got {attainment_target!r}")
        if steps_per_doubling < 1:
            raise ValueError(f"steps_per_doubling must be >= 1, got {steps_per_doubling!r}")
        if not (0 < min_scale <= 1.0 <= max_scale and math.isfinite(max_scale)):
            raise ValueError(f"need 0 < min_scale <= 1 <= max_scale (got {min_scale!r}, {max_scale!r})")
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
        self.runner = Runner(jobs, ray)
        self.cost = cost or AnalyticCost()
        self.max_chunk_tokens = max_chunk_tokens
        self.tuned_rules, names = _expand_tuned(policies)
        self.policies = {p.name: p for p in (build_policy(name, self.cost, max_chunk_tokens) for name in names)}
        self.tpot_targets_ms = tuple(float(t) for t in tpot_targets_ms)
        self.ttft_ms = float(ttft_ms)
        self.attainment_target = float(attainment_target)
        self.steps = int(steps_per_doubling)
        # Lattice bounds, rounded outwards to whole lattice steps.
        self.min_k = math.floor(math.log2(min_scale) * self.steps + 1e-9)
        self.max_k = math.ceil(math.log2(max_scale) * self.steps - 1e-9)
        self.curve_points_per_doubling = curve_points_per_doubling
        self.progress = progress
        # where finished tasks are kept for --resume (``sloweave.studies.parallel.TaskStore``); None: nowhere
        self.store = store
        self._runs: dict[tuple, _Run] = {}
        _check_scalable(source)

    def __getstate__(self) -> dict:
        # Shipped to Ray workers without the cache of runs: a task never reads another task's
        # runs (searches depend on their own inputs, curve tasks are the points not yet run),
        # so the cache (tens of MB after a search) would be sent for nothing.
        return {**self.__dict__, "_runs": {}, "store": None}

    # ---- lattice and cached simulations

    def scale(self, k: int) -> float:
        return 2.0 ** (k / self.steps)

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
            frame, duration_ms = run_policy(workload, self.policies[policy], tpot_ms, self.cost, self.options, self.ttft_ms, noise_seed=seed)
            self._runs[key] = _Run(frame[["request", "ttft_ms", "p99_tpot_ms", "status"]], duration_ms)
        return self._runs[key]

    @property
    def simulations(self) -> int:
        return len(self._runs)

    def metrics(self, policy: str, seed: int, k: int, tpot_ms: float) -> RunMetrics:
        run = self.run(policy, seed, k, tpot_ms)
        targets = tpot_ms if self.tpot_change_ms is None else self._targets(len(run.requests), tpot_ms)[run.requests["request"].to_numpy()]
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
        outcomes = run_tasks(_study_task, [(method, *task) for task in tasks], self, self.runner, desc, self.progress, self.store)
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
        tasks = [(p, s, tuple(sorted(ts, reverse=True))) for p, ts in cells.items() for s in range(self.source.num_seeds)]
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
        return [Capacity(self.source.name, p, t, self.ttft_ms, self.attainment_target, tuple(seeds), step) for (p, t), seeds in found.items()]

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
            rows.append({
                "source": self.source.name, "policy": policy, "tpot_ms": tpot, "ttft_ms": self.ttft_ms,
                "rate_scale": self.scale(k), "rate_rps": float(np.mean([self.scale(k) * r for r in base_rates])),
                **_mean_std("attainment", [m.attainment for m in per_seed]),
                **_mean_std("goodput_rps", [m.goodput_rps for m in per_seed]),
                "p99_ttft_ms": float(np.mean([m.p99_ttft_ms for m in per_seed])),
                "p99_tpot_ms": float(np.mean([m.p99_tpot_ms for m in per_seed])),
                "seeds": len(per_seed),
            })
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
                raise ValueError(f"unknown tuned policy {name!r}: expected one of {', '.join(r + '-tuned' for r in TUNED_RULES)}")
            rules.append(head)
            names += [f"{head}-{b}" for b in TUNING_GRID_TOKENS]
        else:
            names.append(name)
    return list(dict.fromkeys(rules)), list(dict.fromkeys(names))


def capacity_frame(capacities: list[Capacity]) -> pd.DataFrame:
    return pd.DataFrame([c.row() for c in capacities])


def seeds_frame(capacities: list[Capacity]) -> pd.DataFrame:
    rows = []
    for c in capacities:
        for s in c.seeds:
            rows.append({"source": c.source, "policy": c.policy, "tpot_ms": c.tpot_ms, **asdict(s)})
    return pd.DataFrame(rows)


def pairwise_ratios(capacities: list[Capacity]) -> pd.DataFrame:
    """Each SLOWeave variant over the best of its like-for-like rule, per TPOT target (``PAIRS``).

    The best budget of a rule is chosen per target by mean capacity in req/s (what a user
    who tunes the budget offline would do; a ``<rule>-tuned`` row is that choice already);
    ``ratio`` is the ratio of the two means. Its spread uses the per-seed ratios (same seeds
    or windows, so paired), skipping seeds where the baseline's capacity is 0; a per-seed
    ratio is only known to about one lattice step (``step_pct``). A cell whose run was too
    short to build queues has no ratio (empty), and says so in ``note``.
    """
    rows = []
    for tpot in sorted({c.tpot_ms for c in capacities}):
        at = {c.policy: c for c in capacities if c.tpot_ms == tpot}
        for ours_name, rule in PAIRS:
            best = best_of_rule(list(at.values()), rule)
            if ours_name not in at or best is None:
                continue
            swept = sum(budget_of(name, rule) is not None for name in at)
            rows.append(_pair_row(at[ours_name], best, rule, swept))
    return pd.DataFrame(rows)


def _pair_row(ours: Capacity, best: Capacity, rule: str, swept: int) -> dict:
    measurable = ours.measurable and best.measurable
    paired = [a.scale / b.scale for a, b in zip(ours.seeds, best.seeds) if b.scale > 0] if measurable else []
    return {
        "source": ours.source,
        "tpot_ms": ours.tpot_ms,
        "ttft_ms": ours.ttft_ms,
        "policy": ours.policy,
        "capacity_rps": ours.capacity_rps,
        "capacity_rps_std": ours.row()["capacity_rps_std"],
        "baseline_rule": rule,
        "budgets_swept": swept,
        "best_baseline": best.policy,
        "best_baseline_capacity_rps": best.capacity_rps,
        "best_baseline_capacity_rps_std": best.row()["capacity_rps_std"],
        "ratio": ours.capacity_rps / best.capacity_rps if measurable and best.capacity_rps > 0 else math.nan,
        "ratio_seed_mean": float(np.mean(paired)) if paired else math.nan,
        "ratio_seed_min": float(np.min(paired)) if paired else math.nan,
        "ratio_seed_max": float(np.max(paired)) if paired else math.nan,
        "step_pct": 100.0 * (ours.step_ratio - 1.0),
        # the best budget at the grid's end: the true best may lie beyond what was swept
        "edge_of_sweep": budget_of(best.policy, rule) in (min(TUNING_GRID_TOKENS), max(TUNING_GRID_TOKENS)),
        "note": "" if measurable else "run too short to build queues: no capacity (lengthen the run)",
    }


# --------------------------------------------------------------------------- plots


def plot_curves(
    curves: pd.DataFrame, column: str, ylabel: str, path: Path, target: float | None = None, upper_bound: float | None = None
) -> None:
    plt = _pyplot()
    targets = sorted(curves["tpot_ms"].unique())
    fig, axes = plt.subplots(1, len(targets), figsize=(4.6 * len(targets), 3.8), squeeze=False)
    for ax, tpot in zip(axes[0], targets):
        at = curves[curves["tpot_ms"] == tpot]
        for index, (policy, rows) in enumerate(at.groupby("policy", sort=False)):
            mean, std = rows[column].to_numpy(), rows[f"{column}_std"].to_numpy()
            # +-1 std over seeds, clipped to the range the quantity can take.
            upper = np.minimum(std, upper_bound - mean) if upper_bound is not None else std
            lower = np.minimum(std, mean)
            ax.errorbar(rows["rate_rps"], mean, yerr=[lower, upper], marker="o", markersize=3, capsize=2, label=policy, **policy_style(policy, index))
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"TPOT {tpot:g} ms, TTFT {at['ttft_ms'].iloc[0]:g} ms", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(str(curves["source"].iloc[0]), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- command


def run_capacity(study: CapacityStudy, out_dir: Path, meta: dict, cost: ResolvedCost | None = None, curves: bool = True) -> dict:
    """Search (and, unless ``curves`` is off, load curves and CDFs); write every output file
    under ``out_dir``; return the JSON payload.

    ``cost`` is what ``study.cost`` was resolved from; its description is read after the
    simulations (a profile cost's out-of-range counts). None: the study's analytic model.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    capacities = study.capacities()
    table = capacity_frame(capacities)
    table[CAPACITY_COLUMNS].to_csv(out_dir / "capacity.csv", index=False)
    table.to_csv(out_dir / "capacity_detail.csv", index=False)
    seeds_frame(capacities).to_csv(out_dir / "capacity_seeds.csv", index=False)
    relative = pairwise_ratios(capacities)
    relative.to_csv(out_dir / "relative.csv", index=False)
    cdf_loads = _write_curves(study, capacities, out_dir) if curves else {}
    payload = {
        **meta,
        "source": study.source.describe(),
        "engine_options": study.options.describe(),
        "ttft_ms": study.ttft_ms,
        "tpot_targets_ms": list(study.tpot_targets_ms),
        "attainment_target": study.attainment_target,
        "lattice": {"steps_per_doubling": study.steps, "min_scale": study.scale(study.min_k), "max_scale": study.scale(study.max_k)},
        "simulations": study.simulations,
        "parallel": study.runner.describe(),
        "cost": cost.description if cost is not None else _describe(study.cost),
        "cdf_rate_scale": {f"{t:g}": s for t, s in cdf_loads.items()},
        "capacity": table.to_dict(orient="records"),
        "pairwise": relative.to_dict(orient="records"),
        "null_means": "a capacity or ratio the run was too short to measure (see 'censored' and 'note')",
    }
    write_result_json(out_dir / "capacity.json", payload)
    return payload


def _write_curves(study: CapacityStudy, capacities: list[Capacity], out_dir: Path) -> dict[float, float]:
    """Load curves of the searched policies (a tuned rule's grid only at its best budgets),
    and CDFs at SLOWeave's capacity per target; return the CDFs' load per target."""
    shown = [p for p in study.policies if not any(budget_of(p, r) is not None for r in study.tuned_rules)]
    shown += list(dict.fromkeys(c.tuned_to for c in capacities if c.tuned_to))
    curves = study.curves(study.curve_lattice(capacities), shown)
    curves.to_csv(out_dir / "curves.csv", index=False)
    plot_curves(curves, "attainment", "SLO attainment", out_dir / "attainment_vs_load.png", study.attainment_target, upper_bound=1.0)
    plot_curves(curves, "goodput_rps", "goodput (req/s)", out_dir / "goodput_vs_load.png")
    # CDFs at SLOWeave's capacity for each target (or the middle of the curve without it):
    # the load where the comparison matters. Requests of all seeds are pooled for the plot.
    cdf_frames, cdf_loads = [], {}
    for tpot in study.tpot_targets_ms:
        ours = [c for c in capacities if c.tpot_ms == tpot and c.policy.startswith("sloweave")]
        ks = [s.k for s in ours[0].seeds if s.k is not None] if ours else []
        k = int(np.median(ks)) if ks else int(np.median(study.curve_lattice(capacities)))
        cdf_loads[tpot] = study.scale(k)
        study.prefetch([(p, k, tpot) for p in shown])
        for policy in shown:
            frame = study.requests_at(policy, k, tpot)
            frame.insert(0, "policy", policy)
            frame.insert(1, "tpot_ms", tpot)
            frame.insert(2, "rate_scale", study.scale(k))
            cdf_frames.append(frame)
        per_policy = {p: f for p, f in pd.concat(cdf_frames).query("tpot_ms == @tpot").groupby("policy", sort=False)}
        title = f"{study.source.name}, load x{study.scale(k):.3g}, TPOT {tpot:g} ms"
        plot_cdfs({p: f["ttft_ms"].to_numpy() for p, f in per_policy.items()}, out_dir / f"cdf_ttft_tpot{tpot:g}.png", "TTFT (ms)", title, study.ttft_ms, log_x=True)
        plot_cdfs(
            {p: f["p99_tpot_ms"].to_numpy() for p, f in per_policy.items()},
            out_dir / f"cdf_p99_tpot_tpot{tpot:g}.png",
            "per-request P99 inter-token gap (ms)",
            title,
            tpot,
        )
    pd.concat(cdf_frames, ignore_index=True).to_csv(out_dir / "cdf_requests.csv", index=False)
    return cdf_loads


def _describe(cost: CostModel) -> dict:
    if isinstance(cost, AnalyticCost):
        return analytic_description(cost)
    describe = getattr(cost, "describe", None)
    return describe() if describe is not None else {"cost_model": type(cost).__name__}


@click.command()
@click.option("--trace", "trace_paths", multiple=True, type=click.Path(dir_okay=False, path_type=Path), help="request trace file; repeat to replay several back to back (each seed: one window of each, in order)")
@click.option("--workload", type=click.Choice(list(ALL_WORKLOADS)), default=None, help="synthetic workload or scenario instead of a trace")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True)
@click.option("--policy", "policies", multiple=True, callback=once_each, help=f"repeat for several; fixed-tuned / budget-tuned / sarathi-tuned: that rule at its best budget per target, from a refined sweep [default: {', '.join(DEFAULT_POLICIES)}]")
@click.option("--tpot-ms", "tpot_targets", type=DURATION_MS.option(), multiple=True, callback=once_each, help="repeat for several [default: 10, 25, 50]")
@click.option("--tpot-change-ms", type=DURATION_MS.option(), default=None, help="the TPOT target changes to this for requests arriving in the second half of each run")
@click.option("--ttft-ms", type=DURATION_MS.option(), default=None, help=f"TTFT target [default: the workload's; {DEFAULT_TRACE_TTFT_MS:g} for a trace]")
@click.option("--attainment", type=ATTAINMENT.option(), default=DEFAULT_ATTAINMENT, show_default=True)
@click.option("--seeds", type=REPEATS.option(), default=None, help="seeds / trace windows [default: 5; --quick 3]")
@click.option("--window-s", type=DURATION_S.option(), default=DEFAULT_WINDOW_S, show_default=True, help="trace window length; windows are spread evenly over the trace")
@click.option("--whole-trace", is_flag=True, help="cut the whole trace into --seeds equal consecutive windows instead")
@click.option("--requests", "num_requests", type=REQUESTS, default=None, help="requests per seed for workloads and length-only files [default: 2000; --quick 800]")
@click.option("--max-prompt-tokens", type=TOKENS.option(), default=None, help="cap prompts (the count is reported)")
@click.option("--arrivals", type=click.Choice(["trace", "poisson"]), default="trace", show_default=True, help="poisson: generate arrivals (length-only files)")
@click.option("--rate-rps", type=RATE_RPS.option(), default=None, help="base rate of generated arrivals (load scale 1)")
@click.option("--steps-per-doubling", type=REPEATS.option(), default=None, help="load lattice resolution [default: 16 (4.4%); --quick 8 (9%)]")
@click.option("--min-scale", type=SCALE.option(), default=1.0 / 16.0, show_default=True)
@click.option("--max-scale", type=SCALE.option(), default=256.0, show_default=True)
@click.option("--max-chunk", type=TOKENS.option(), default=DEFAULT_MAX_CHUNK_TOKENS, show_default=True)
@click.option("--quick", is_flag=True, help="3 seeds instead of 5, a lattice of 8 instead of 16 steps per doubling, fewer curve points")
@parallel_options()
@click.option("--no-curves", is_flag=True, help="capacities only: skip the load curves and CDFs")
@max_model_len_option()
@engine_options()
@cost_option()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results/capacity"), show_default=True)
@result_folder_options(resumable=True)
def capacity(trace_paths, workload, fmt, policies, tpot_targets, tpot_change_ms, ttft_ms, attainment, seeds, window_s, whole_trace, num_requests, max_prompt_tokens, arrivals, rate_rps, max_model_len_tokens, steps_per_doubling, min_scale, max_scale, max_chunk, quick, jobs, ray_address, no_curves, engine: EngineOptions, cost: ResolvedCost, out_dir, force, resume) -> None:
    """Highest load (arrival-rate scale) at which each policy keeps SLO attainment >= the target."""
    if bool(trace_paths) == (workload is not None):
        raise click.UsageError("give --trace PATH (one or more) or --workload NAME, not both and not neither")
    check_writable(out_dir, "--out")
    policies = list(policies) or list(DEFAULT_POLICIES)
    seeds = seeds or (3 if quick else 5)
    try:
        source, ttft_ms = _cli_source(trace_paths, workload, fmt, seeds, window_s, whole_trace, num_requests, max_prompt_tokens, arrivals, rate_rps, quick, ttft_ms, max_model_len_tokens)
        study = CapacityStudy(
            source, policies, list(tpot_targets) or list(DEFAULT_TPOT_TARGETS_MS), ttft_ms,
            attainment_target=attainment, steps_per_doubling=steps_per_doubling or (8 if quick else 16),
            min_scale=min_scale, max_scale=max_scale, cost=cost.model, max_chunk_tokens=max_chunk,
            curve_points_per_doubling=2 if quick else 4, progress=True, options=engine,
            jobs=jobs or default_jobs(), ray=ray_address, tpot_change_ms=tpot_change_ms,
        )
    except (TraceError, WorkloadError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    _print_notes(source.describe(), rate_rps, trace_paths, max_prompt_tokens)
    meta = {"command": "capacity", "options": command_settings(), "policies": policies, "max_chunk_tokens": max_chunk}
    with result_folder(out_dir, force, resume, resumable=True) as folder:
        study.store = folder.store  # every finished search and curve point is kept for --resume
        payload = run_capacity(study, folder.path, meta, cost, curves=not no_curves)
    _print_results(payload, cost, out_dir, study)


default_jobs = local_cores  # the name tune and the benchmarks import


def _cli_source(trace_paths, workload, fmt, seeds, window_s, whole_trace, num_requests, max_prompt_tokens, arrivals, rate_rps, quick, ttft_ms, max_model_len_tokens=None):
    """The load source the options describe, and the TTFT target (the source's default unless given)."""
    if workload is not None:
        if whole_trace or max_prompt_tokens is not None or arrivals != "trace" or rate_rps is not None or max_model_len_tokens is not None:
            raise click.UsageError("--whole-trace, --max-prompt-tokens, --arrivals, --rate-rps and --max-model-len apply to --trace only")
        spec = ALL_WORKLOADS[workload]
        return SpecSource(spec, num_requests or (800 if quick else 2000), tuple(range(seeds))), ttft_ms or spec.ttft_ms
    if arrivals == "trace" and rate_rps is not None:
        raise click.UsageError("--rate-rps only applies with --arrivals poisson")
    sources = []
    for path in trace_paths:
        trace = load_trace(path, fmt, model_len_or_default(max_model_len_tokens))
        window = None if whole_trace else window_s
        if window is not None and trace.has_arrivals and arrivals == "trace" and window * seeds > trace.span_s:
            raise click.UsageError(
                f"{path}: {seeds} windows of {window:g} s do not fit in the trace's {trace.span_s:.1f} s: "
                "lower --window-s or --seeds, or use --whole-trace"
            )
        # Generated arrivals subsample the lengths; trace windows keep every request unless told.
        requests_per_seed = num_requests
        if arrivals == "poisson" and num_requests is None:
            requests_per_seed = 800 if quick else 2000
        sources.append(trace_source(trace, seeds, window, max_prompt_tokens, arrivals, rate_rps, requests_per_seed))
    return (sources[0] if len(sources) == 1 else back_to_back(sources)), ttft_ms or DEFAULT_TRACE_TTFT_MS


def _print_notes(description: dict, rate_rps, trace_paths, max_prompt_tokens) -> None:
    if "GENERATED" in str(description.get("kind", "")):
        click.echo(f"NOTE: arrivals are GENERATED (Poisson, {rate_rps:g} req/s at scale 1), not read from {', '.join(map(str, trace_paths))}", err=True)
    if description.get("num_prompts_capped"):
        click.echo(f"NOTE: {description['num_prompts_capped']} prompt(s) capped at {max_prompt_tokens} tokens", err=True)


def _print_results(payload: dict, cost: ResolvedCost, out_dir: Path, study: CapacityStudy) -> None:
    table = pd.DataFrame(payload["capacity"])
    if not cost.is_analytic:
        for line in cost.summary_lines():
            click.echo(line)
    shown = table[~table["policy"].map(lambda p: any(budget_of(p, r) is not None for r in study.tuned_rules))]
    columns = ["policy", "tuned_to", "tpot_ms", "capacity_scale", "capacity_scale_std", "capacity_rps", "capacity_rps_std", "censored"]
    click.echo(shown[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    short = sorted({f"{r['policy']} at TPOT {r['tpot_ms']:g} ms" for r in payload["capacity"] if TOO_SHORT in r["censored"]})
    if short:
        click.echo(
            f"WARNING: the run is too short to measure capacity for {len(short)} cell(s) ({'; '.join(short[:4])}"
            f"{'; ...' if len(short) > 4 else ''}): at the highest passing load every request arrives within one TTFT "
            "target, so no queue forms; use more --requests or a longer --window-s", err=True,
        )
    relative = pd.DataFrame(payload["pairwise"])
    if not relative.empty:
        click.echo("like for like (each with the same engine options):")
        click.echo(relative[["tpot_ms", "policy", "capacity_rps", "best_baseline", "best_baseline_capacity_rps", "ratio", "ratio_seed_min", "ratio_seed_max"]].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    curves = "curves.csv, cdf_requests.csv, PNG plots, " if payload["cdf_rate_scale"] else ""
    click.echo(f"wrote {out_dir}/capacity.csv (+ capacity_detail.csv, capacity_seeds.csv, relative.csv, {curves}capacity.json) from {study.simulations} simulations")
