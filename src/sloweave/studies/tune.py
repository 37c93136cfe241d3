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

This module runs the sweep; ``sloweave.studies.tune_report`` writes what it found (the
flag per engine, the table, the advice, the files) and ``sloweave.cli.tune`` is the command.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.sim.workloads import mean_context_tokens
from sloweave.studies.search import (
    DEFAULT_LATTICE,
    Capacity,
    CapacityStudy,
    SearchLattice,
    best_of_rule,
    budget_of,
    refined_budgets,
)
from sloweave.studies.parallel import SERIAL, Runner
from sloweave.studies.sources import LoadSource
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import CostModel
from sloweave.core.costs.resolve import ResolvedCost
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS

RULES = ("sarathi", "budget", "fixed")
# Powers of two and the 1.5x points between them: every value a multiple of 64 tokens.
DEFAULT_BUDGETS_TOKENS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
QUICK_BUDGETS_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
RESULT_COLUMNS = [
    "budget_tokens",
    "policy",
    "capacity_rps",
    "capacity_rps_std",
    "capacity_scale",
    "censored",
    "load_rps",
    "goodput_rps",
    "attainment",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "rule_of_thumb",
]


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
    tpot_ms: float
    ttft_ms: float
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

    def row(self, budget_tokens: int) -> dict:
        return self.table.set_index("budget_tokens").loc[budget_tokens].to_dict() | {"budget_tokens": budget_tokens}

    def comparisons(self) -> dict:
        """Best fixed budget against SLOWeave, and the rule of thumb against the best."""
        best = self.row(self.best_capacity_tokens)
        best_goodput = self.row(self.best_goodput_tokens)
        ours = self.sloweave

        def ratio(a: float, b: float) -> float | None:
            return a / b if b > 0 else None

        thumb = []
        for tokens in self.rule_of_thumb.budgets_tokens:
            row = self.row(tokens)
            thumb.append(
                {
                    "budget_tokens": tokens,
                    "capacity_rps": row["capacity_rps"],
                    "capacity_vs_best": ratio(row["capacity_rps"], best["capacity_rps"]),
                    "goodput_rps": row["goodput_rps"],
                    "goodput_vs_best": ratio(row["goodput_rps"], best_goodput["goodput_rps"]),
                    "p99_ttft_ms": row["p99_ttft_ms"],
                    "p99_tpot_ms": row["p99_tpot_ms"],
                }
            )
        return {
            "best_capacity": {"budget_tokens": self.best_capacity_tokens, "capacity_rps": best["capacity_rps"]},
            "best_goodput_at_load": {
                "budget_tokens": self.best_goodput_tokens,
                "goodput_rps": best_goodput["goodput_rps"],
            },
            "sloweave": {
                "policy": ours["policy"],
                "capacity_rps": ours["capacity_rps"],
                "goodput_rps": ours["goodput_rps"],
            },
            "sloweave_capacity_over_best": ratio(ours["capacity_rps"], best["capacity_rps"]),
            "sloweave_goodput_over_best": ratio(ours["goodput_rps"], best_goodput["goodput_rps"]),
            "rule_of_thumb": {
                "mean_prompt_tokens": self.rule_of_thumb.mean_prompt_tokens,
                "rounding": "nearest power of two (log scale), at least 64",
                "budgets": thumb,
            },
        }


def tune(
    source: LoadSource,
    rule: str = "sarathi",
    budgets_tokens: tuple[int, ...] = DEFAULT_BUDGETS_TOKENS,
    tpot_ms: float = 25.0,
    ttft_ms: float = 2000.0,
    cost: CostModel | None = None,
    load_scale: float | None = None,
    refine: bool = True,
    lattice: SearchLattice = DEFAULT_LATTICE,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
    options: EngineOptions = DEFAULT_OPTIONS,
    runner: Runner = SERIAL,
    progress: bool = False,
    store=None,
) -> TuneResult:
    """Sweep the engine's fixed budget on ``source``; see the module docstring.

    ``load_scale`` is the load (arrival-rate scale, rounded to the capacity lattice) at
    which goodput and latencies are compared; None picks the best budget's capacity (the
    median over seeds), the highest load that budget sustains. ``refine`` adds one round
    of budgets between the best one and its neighbours. ``lattice`` (the attainment target
    and load lattice), ``max_chunk_tokens``, ``options``, ``runner``, ``progress`` and
    ``store`` (``sloweave.studies.parallel.TaskStore``: --resume) go to every
    ``CapacityStudy``.
    """
    if not budgets_tokens or any(int(b) != b or b < 1 for b in budgets_tokens):
        raise ValueError(f"budgets must be whole numbers of tokens >= 1, got {budgets_tokens!r}")
    thumb = RuleOfThumb.of(mean_prompt_tokens(source))
    sweep = BudgetSweep(
        source, rule, tpot_ms, ttft_ms, lattice, cost, max_chunk_tokens, options, runner, progress, store
    )
    budgets = sorted({int(b) for b in budgets_tokens} | set(thumb.budgets_tokens))
    sweep.add([policy_name(rule, b) for b in budgets] + [sloweave_variant(rule)])
    if refine:
        budgets = sweep.refined(budgets)
    best_capacity = sweep.best_budget(budgets)
    k, how = sweep.comparison_load(best_capacity, load_scale)
    table = sweep.table(budgets, thumb, k)
    return TuneResult(
        source=source.describe(),
        rule=rule,
        tpot_ms=float(tpot_ms),
        ttft_ms=float(ttft_ms),
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
    )


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
    study_by_policy: dict[str, CapacityStudy] = field(default_factory=dict)
    capacities: dict[str, Capacity] = field(default_factory=dict)

    def add(self, names: list[str]) -> None:
        """Search the capacity of each policy in ``names``, in one study."""
        study = CapacityStudy(
            self.source,
            names,
            [self.tpot_ms],
            self.ttft_ms,
            self.lattice,
            cost=self.cost or AnalyticCost(),
            max_chunk_tokens=self.max_chunk_tokens,
            options=self.options,
            runner=self.runner,
            progress=self.progress,
            store=self.store,
        )
        self.study_by_policy.update(dict.fromkeys(study.policies, study))
        self.capacities.update({c.policy: c for c in study.capacities()})

    def best_budget(self, budgets: list[int]) -> int:
        """The capacity study's own ranking (ties to the smaller budget)."""
        best = best_of_rule([self.capacities[policy_name(self.rule, b)] for b in budgets], self.rule)
        return budget_of(best.policy, self.rule)

    def refined(self, budgets: list[int]) -> list[int]:
        """``budgets`` and one more round between the best one and its neighbours, searched."""
        extra = refined_budgets(self.best_budget(budgets), budgets)
        if extra:
            self.add([policy_name(self.rule, b) for b in extra])
        return sorted(budgets + extra)

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
        return pd.DataFrame(rows)[RESULT_COLUMNS]

    @property
    def simulations(self) -> int:
        return sum(s.simulations for s in set(self.study_by_policy.values()))


def best_goodput_budget(table: pd.DataFrame) -> int:
    """The budget with the highest goodput at the load (ties to the smaller budget)."""
    best = table.sort_values(["goodput_rps", "budget_tokens"], ascending=[False, True]).iloc[0]
    return int(best["budget_tokens"])


# --------------------------------------------------------------------------- cost model


def step_profile_cost(
    resolved: ResolvedCost, kind: str, context_tokens: float | None, source: LoadSource
) -> ResolvedCost:
    """A step-time profile as the sweep uses it: the fitted ``kind`` at a fixed KV context per
    decode (by default the workload's mean context, the advice in sloweave.core.costs.fitted)."""
    if context_tokens is None:
        context_tokens = mean_context_tokens(*(source.workload(seed, 1.0) for seed in range(source.num_seeds)))
    return resolved.step_profile(kind, context_tokens)
