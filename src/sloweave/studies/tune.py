"""``sloweave tune``: the best fixed token budget for engines that only have one.

Operators of vLLM (``--max-num-batched-tokens``), SGLang (``--chunked-prefill-size``) and
TensorRT-LLM (``max_num_tokens``) set one number, usually from a rule of thumb: a quarter
to a half of the mean prompt length. This module measures it instead. For every budget of
a sweep it simulates the engine's rule on the operator's workload or trace and cost model,
and reports:

- its capacity: the highest load at which SLO attainment stays at the target (the
  capacity search of ``sloweave.studies.search``, same lattice, same seeds for every budget);
- at one given load: goodput, attainment, P99 TTFT and P99 TPOT (the trade-off: small
  budgets protect TPOT and pay in TTFT, large ones the reverse);
- the budget with the highest capacity and the one with the highest goodput at that load,
  the flag that sets it, how far it stays from SLOWeave on the same input, and how the
  rule of thumb (rounded to a power of two) would have fared.

Engine rules (the simulator's static policies):
- ``sarathi``: a budget of B tokens per iteration shared by the decodes (one token each)
  and prompt chunks, several prompts per iteration: vLLM's ``max_num_batched_tokens`` and
  TensorRT-LLM's ``max_num_tokens`` (both count decode tokens);
- ``budget``: the same with at most one prompt per iteration;
- ``fixed``: one prompt chunk of at most C tokens next to all decodes, which do not count:
  SGLang's ``chunked_prefill_size`` limits the prefill tokens of a batch.
SLOWeave is compared in the matching form: ``sloweave-multi`` (several prompts, as the vLLM
plug-in runs) for ``sarathi``, ``sloweave`` (one prompt) otherwise.

The budgets swept by default follow the model (``sloweave.studies.tune_grid.model_grid``): a
ladder of about 1.5x steps from the decode batch that fills a TPOT step by the cost model up to
the largest prompt that prefills within the TTFT target, extended past an edge while the best
budget sits on it (``BudgetSweep.extended``); a best budget no seed sustains at any load is
reported as such. With an SLO tier mix the sweep serves and judges each request by its tier,
and the best budget is the best for the mix (``sloweave.studies.tune_tiers``).

This module runs the sweep; ``sloweave.studies.tune_report`` writes what it found (the flag per
engine, the table, the advice, the files) and ``sloweave.cli.tune`` is the command.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.sim.tiers import Tier
from sloweave.studies.search import DEFAULT_LATTICE, Capacity, CapacityStudy, SearchLattice, best_of_rule, budget_of
from sloweave.studies.parallel import SERIAL, Runner
from sloweave.studies.search_records import tier_columns_of
from sloweave.studies.sources import LoadSource
from sloweave.studies.tune_grid import LADDER_FLOOR_TOKENS as LADDER_FLOOR_TOKENS
from sloweave.studies.tune_grid import BudgetGrid, model_grid
from sloweave.studies.tune_grid import SweepEnd as SweepEnd
from sloweave.studies.tune_grid import ladder as ladder
from sloweave.studies.tune_tiers import grid_ends_plan, sweep_targets
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import CostModel
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS

RULES = ("sarathi", "budget", "fixed")
MAX_EXTENSIONS = 3  # rounds of edge extension, at most
RESULT_COLUMNS = (  # tune.csv: one row per budget, then SLOWeave's
    "budget_tokens policy capacity_rps capacity_rps_std capacity_scale censored load_rps goodput_rps attainment "
    "p99_ttft_ms p99_tpot_ms rule_of_thumb"
).split()


def policy_name(rule: str, budget_tokens: int) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: choose one of {', '.join(RULES)}")
    return f"{rule}-{int(budget_tokens)}"


def sloweave_variant(rule: str) -> str:
    return "sloweave-multi" if rule == "sarathi" else "sloweave"


def nearest_power_of_two(tokens: float) -> int:
    """Nearest power of two in log space (so 384 -> 512, 360 -> 256); at least 64 tokens."""
    return max(64, 2 ** int(round(math.log2(max(tokens, 1.0)))))


@dataclass(frozen=True)
class RuleOfThumb:
    """A quarter to a half of the mean prompt length, each end rounded to a power of two."""

    mean_prompt_tokens: float
    quarter_tokens: int
    half_tokens: int

    @classmethod
    def of(cls, mean_prompt_tokens: float) -> RuleOfThumb:
        return cls(
            float(mean_prompt_tokens),
            nearest_power_of_two(mean_prompt_tokens / 4),
            nearest_power_of_two(mean_prompt_tokens / 2),
        )

    @property
    def budgets_tokens(self) -> tuple[int, ...]:
        return tuple(sorted({self.quarter_tokens, self.half_tokens}))


def mean_prompt_tokens(source: LoadSource) -> float:
    """Mean prompt length over every seed's requests (at load 1; load does not change lengths)."""
    prompts = np.concatenate([source.workload(seed, 1.0).prompt_tokens for seed in range(source.num_seeds)])
    return float(prompts.mean())


@dataclass
class TuneResult:
    source: dict
    rule: str
    tpot_ms: float | None  # None with SLO tiers: each tier names its own targets
    ttft_ms: float | None
    attainment_target: float
    load_scale: float
    load_source: str  # how the load was chosen
    table: pd.DataFrame  # one row per budget, RESULT_COLUMNS
    sloweave: dict  # the same columns for SLOWeave
    rule_of_thumb: RuleOfThumb
    best_capacity_tokens: int
    best_goodput_tokens: int
    simulations: int
    step_pct: float
    sweep_plan: dict = field(default_factory=dict)  # where the budgets came from: ends, extensions, refinement
    loads_searched: dict = field(default_factory=dict)  # the lattice's lowest and highest load
    tiers: tuple[Tier, ...] = ()  # the SLO tier mix (``sloweave.studies.tune_tiers``), or none

    @property
    def no_budget_meets_targets(self) -> bool:
        """No budget kept the attainment target on any seed at any load searched."""
        return bool((self.table["capacity_rps"] == 0).all())

    def row(self, budget_tokens: int) -> dict:
        return self.table.set_index("budget_tokens").loc[budget_tokens].to_dict() | {"budget_tokens": budget_tokens}


def tune(
    source: LoadSource,
    rule: str = "sarathi",
    budgets_tokens: tuple[int, ...] | None = None,
    tpot_ms: float | None = None,
    ttft_ms: float | None = None,
    cost: CostModel | None = None,
    load_scale: float | None = None,
    refine: bool = True,
    lattice: SearchLattice = DEFAULT_LATTICE,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
    options: EngineOptions = DEFAULT_OPTIONS,
    runner: Runner = SERIAL,
    progress: bool = False,
    store=None,
    coarse_grid: bool = False,
    max_extensions: int = MAX_EXTENSIONS,
    tiers: tuple[Tier, ...] = (),
) -> TuneResult:
    """Sweep the engine's fixed budget on ``source``; see the module docstring.

    ``budgets_tokens`` None (the default) sweeps the grid the cost model, the targets and the
    input call for (``model_grid``; ``coarse_grid``: powers of two only) and extends it past an
    edge that holds the best budget, ``max_extensions`` rounds at most; a given tuple is swept
    exactly as given. Targets: 25 ms TPOT and 2000 ms TTFT unless given, or ``tiers``, an SLO tier
    mix (``sloweave.studies.tune_tiers``). ``load_scale``: the load (rate scale, rounded to the
    lattice) where goodput and latencies are compared; None: the best budget's capacity (median
    over seeds). ``refine``: one more round of budgets around the best. ``lattice``, ``max_chunk_tokens``,
    ``options``, ``runner``, ``progress`` and ``store`` (``TaskStore``: --resume) go to every ``CapacityStudy``.
    """
    _check_budgets(budgets_tokens)
    thumb = RuleOfThumb.of(mean_prompt_tokens(source))
    tpot_ms, ttft_ms = sweep_targets(tiers, tpot_ms, ttft_ms)  # with tiers: the searches' keys
    sweep = BudgetSweep(
        source, rule, tpot_ms, ttft_ms, lattice, cost, max_chunk_tokens, options, runner, progress, store, tuple(tiers)
    )
    grid = None if budgets_tokens is not None else model_grid(source, rule, tpot_ms, ttft_ms, cost, coarse_grid)
    budgets, plan = sweep.run(budgets_tokens, grid, thumb, refine, max_extensions)
    best_capacity = sweep.best_budget(budgets)
    k, how = sweep.comparison_load(best_capacity, load_scale)
    table = sweep.table(budgets, thumb, k)
    return TuneResult(
        source=source.describe(),
        rule=rule,
        tpot_ms=None if tiers else tpot_ms,
        ttft_ms=None if tiers else ttft_ms,
        attainment_target=lattice.attainment_target,
        load_scale=lattice.scale(k),
        load_source=how,
        table=table,
        sloweave={"budget_tokens": None, **sweep.at_load(sloweave_variant(rule), k)},
        rule_of_thumb=thumb,
        best_capacity_tokens=int(best_capacity),
        best_goodput_tokens=best_goodput_budget(table),
        simulations=sweep.simulations,
        step_pct=100.0 * (2.0 ** (1.0 / lattice.steps_per_doubling) - 1.0),
        sweep_plan=plan,
        loads_searched=loads_searched(source, lattice),
        tiers=sweep.tiers,
    )


def _check_budgets(budgets_tokens: tuple[int, ...] | None) -> None:
    if budgets_tokens is not None and (not budgets_tokens or any(int(b) != b or b < 1 for b in budgets_tokens)):
        raise ValueError(f"budgets must be whole numbers of tokens >= 1, got {budgets_tokens!r}")


def loads_searched(source: LoadSource, lattice: SearchLattice) -> dict:
    """The lowest and highest load of the capacity lattice, as rate scales and in req/s (mean over seeds)."""
    base_rps = float(np.mean([source.base_rate_rps(seed) for seed in range(source.num_seeds)]))
    low, high = lattice.scale(lattice.min_k), lattice.scale(lattice.max_k)
    return {"min_scale": low, "max_scale": high, "min_rps": low * base_rps, "max_rps": high * base_rps}


@dataclass
class BudgetSweep:
    """The capacity studies of one sweep of the budget of ``rule``, on the same seeds, lattice,
    SLO targets and engine for every budget, so capacities compare directly."""

    source: LoadSource
    rule: str
    tpot_ms: float
    ttft_ms: float
    lattice: SearchLattice
    cost: CostModel | None
    max_chunk_tokens: int
    options: EngineOptions
    runner: Runner
    progress: bool
    store: object  # ``sloweave.studies.parallel.TaskStore`` or None
    # an SLO tier mix: then ``tpot_ms`` / ``ttft_ms`` are only the searches' keys (``sweep_targets``)
    tiers: tuple[Tier, ...] = ()
    study_by_policy: dict[str, CapacityStudy] = field(default_factory=dict)
    capacities: dict[str, Capacity] = field(default_factory=dict)

    def add(self, names: list[str]) -> None:
        """Search the capacity of each policy in ``names``, in one study."""
        study = CapacityStudy(
            self.source,
            names,
            () if self.tiers else [self.tpot_ms],
            None if self.tiers else self.ttft_ms,
            self.lattice,
            cost=self.cost or AnalyticCost(),
            max_chunk_tokens=self.max_chunk_tokens,
            options=self.options,
            runner=self.runner,
            progress=self.progress,
            store=self.store,
            tiers=self.tiers,
        )
        self.study_by_policy.update(dict.fromkeys(study.policies, study))
        self.capacities.update({c.policy: c for c in study.capacities()})

    def run(
        self,
        budgets_tokens: tuple[int, ...] | None,
        grid: BudgetGrid | None,
        thumb: RuleOfThumb,
        refine: bool,
        max_ext: int,
    ) -> tuple[list[int], dict]:
        """Search ``budgets_tokens`` (or ``grid``'s, extended), the rule of thumb's and SLOWeave; then
        refine (``max_ext`` rounds of extension at most). Returns the budgets searched and the plan that says where each came from."""
        rule = self.rule
        swept = budgets_tokens if grid is None else grid.budgets_tokens
        budgets = sorted({int(b) for b in swept} | set(thumb.budgets_tokens))
        self.add([policy_name(rule, b) for b in budgets] + [sloweave_variant(rule)])
        plan = {"budgets_from": "given (--budget)" if grid is None else "the cost model, the targets and the input"}
        if grid is not None:
            budgets, plan["extensions"], plan["extension_stop"] = self.extended(budgets, grid, max_ext)
            plan["grid"] = grid.describe()
            plan |= grid_ends_plan(self.tiers)
        plan["rule_of_thumb_tokens"] = list(thumb.budgets_tokens)
        before_refinement = budgets
        if refine and self.capacities[policy_name(rule, self.best_budget(budgets))].capacity_rps != 0:
            budgets = self.refined(budgets)  # (nothing to refine around a best that meets the targets at no load)
        plan["refinement_tokens"] = sorted(set(budgets) - set(before_refinement))
        return budgets, plan

    def best_budget(self, budgets: list[int]) -> int:
        """The capacity study's own ranking (ties to the smaller budget)."""
        best = best_of_rule([self.capacities[policy_name(self.rule, b)] for b in budgets], self.rule)
        return budget_of(best.policy, self.rule)

    def refined(self, budgets: list[int]) -> list[int]:
        """``budgets`` and one more round between the best one and its neighbours, searched."""
        extra = refined_budgets_tokens(self.best_budget(budgets), budgets)
        if extra:
            self.add([policy_name(self.rule, b) for b in extra])
        return sorted(budgets + extra)

    def extended(self, budgets: list[int], grid: BudgetGrid, max_extensions: int) -> tuple[list[int], list[dict], str]:
        """While the best budget is the smallest or the largest swept, and not at one of the grid's
        hard limits, sweep the next ladder values past it (``max_extensions`` rounds at most).
        Returns the budgets, one record per extension, and why extension stopped."""
        extensions: list[dict] = []
        while True:
            best = self.best_budget(budgets)
            side = "low" if best == budgets[0] else "high" if best == budgets[-1] else None
            if side is None:
                return budgets, extensions, f"the best budget ({best} tokens) lies inside the sweep"
            edge = f"the best budget ({best} tokens) is the {'smallest' if side == 'low' else 'largest'} swept"
            limit = grid.low_limit if side == "low" else grid.high_limit
            added = [b for b in grid.beyond(best, side) if b not in budgets]
            if grid.at_limit(best, side) or not added:
                return budgets, extensions, f"{edge}, at the hard limit ({limit.budget_tokens} tokens: {limit.reason})"
            if len(extensions) >= max_extensions:
                return budgets, extensions, f"{edge} after {len(extensions)} extensions, the most tune makes"
            self.add([policy_name(self.rule, b) for b in added])
            budgets = sorted(budgets + added)
            after = self.best_budget(budgets)
            extensions.append(
                {"side": side, "best_before_tokens": best, "added_tokens": added, "best_after_tokens": after}
            )

    def comparison_load(self, best_budget_tokens: int, load_scale: float | None) -> tuple[int, str]:
        """The lattice point where goodput and latencies are compared, and how it was chosen."""
        lattice = self.lattice
        if load_scale is not None:
            k = round(math.log2(load_scale) * lattice.steps_per_doubling)
            return min(max(k, lattice.min_k), lattice.max_k), "given"
        best = self.capacities[policy_name(self.rule, best_budget_tokens)]
        ks = [s.k for s in best.seeds if s.k is not None]
        k = int(np.median(ks)) if ks else lattice.min_k
        return k, f"the capacity of the best budget ({best_budget_tokens} tokens), median over seeds"

    def at_load(self, name: str, k: int) -> dict:
        """Policy ``name``'s capacity, and its goodput and latencies at lattice point ``k``."""
        seeds = range(self.source.num_seeds)
        cap = self.capacities[name].row()
        per_seed = [self.study_by_policy[name].metrics(name, s, k, self.tpot_ms) for s in seeds]
        return {
            "policy": name,
            "capacity_rps": cap["capacity_rps"],
            "capacity_rps_std": cap["capacity_rps_std"],
            "capacity_scale": cap["capacity_scale"],
            "censored": cap["censored"],
            "load_rps": float(np.mean([self.lattice.scale(k) * self.source.base_rate_rps(s) for s in seeds])),
            # mean over seeds of per-seed (per-request-first) numbers, as SPEC.md asks
            "goodput_rps": float(np.mean([m.goodput_rps for m in per_seed])),
            "attainment": float(np.mean([m.attainment for m in per_seed])),
            "p99_ttft_ms": float(np.mean([m.p99_ttft_ms for m in per_seed])),
            "p99_tpot_ms": float(np.mean([m.p99_tpot_ms for m in per_seed])),
            **self.capacities[name].tier_columns(),  # with tiers: each tier at the capacity, the binding one
        }

    def table(self, budgets: list[int], thumb: RuleOfThumb, k: int) -> pd.DataFrame:
        """One row per budget at lattice point ``k``, ``RESULT_COLUMNS``."""
        rows = [
            {
                "budget_tokens": b,
                **self.at_load(policy_name(self.rule, b), k),
                "rule_of_thumb": b in thumb.budgets_tokens,
            }
            for b in budgets
        ]
        return pd.DataFrame(rows)[RESULT_COLUMNS + tier_columns_of(self.tiers)]

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in set(self.study_by_policy.values()))


def refined_budgets_tokens(best_tokens: int, swept: list[int]) -> list[int]:
    """One refinement round: the geometric midpoints between the best budget and its neighbours
    in the sweep, not already swept; rounded to multiples of 64 tokens from 96 up (the values
    earlier sweeps pinned), of 8 below, where 64 would swallow the step."""
    swept = sorted(swept)
    i = swept.index(best_tokens)
    extra = set()
    for j in (i - 1, i + 1):
        if 0 <= j < len(swept):
            middle = math.sqrt(best_tokens * swept[j])
            quantum = 64 if middle >= 96 else 8
            extra.add(max(quantum, int(round(middle / quantum)) * quantum))
    return sorted(extra - set(swept))


def best_goodput_budget(table: pd.DataFrame) -> int:
    """The budget with the highest goodput at the load (ties to the smaller budget)."""
    best = table.sort_values(["goodput_rps", "budget_tokens"], ascending=[False, True]).iloc[0]
    return int(best["budget_tokens"])
