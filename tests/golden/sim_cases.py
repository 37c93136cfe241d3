"""Simulator runs over every option and policy, reduced to one digest each.

``tests/golden/simulator.json`` holds the digests the simulator gave before it was split
into parts (made by ``python tests/golden/sim_cases.py OUT.json`` on that code); the test
recomputes them, so every option keeps its results bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings

import numpy as np

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the old paths, for the code before the split
    try:
        from sloweave.core.admission import AdmissionControl
        from sloweave.core.context_cost import ContextAnalyticCost
        from sloweave.core.cost import AnalyticCost, NoisyCost, RelativeMargin
        from sloweave.core.policy import Aging, make_policy
        from sloweave.sim.engine import simulate
        from sloweave.sim.tiers import assign_tiers, default_tiers
        from sloweave.sim.workloads import WORKLOADS
    except ImportError:
        from sloweave.admission import AdmissionControl
        from sloweave.beyond import ContextAnalyticCost, assign_tiers, default_tiers
        from sloweave.cost import AnalyticCost, NoisyCost, RelativeMargin
        from sloweave.policy import Aging, make_policy
        from sloweave.simulator import simulate
        from sloweave.workloads import WORKLOADS

POLICIES = ("sloweave", "sloweave-multi", "sloweave+lookahead", "sloweave-multi+lookahead", "fixed-512", "budget-1024", "sarathi-512", "full", "orca")
WORKLOAD_NAMES = ("mixed", "long", "bursty")
OPTIONS = 13
REQUESTS = 200

ARRAYS = (
    "iter_start_ms", "iter_end_ms", "iter_decodes", "iter_chunk_tokens", "iter_budget_ms", "iter_infeasible",
    "prefill_iter", "prefill_request", "prefill_tokens", "first_token_iter", "finished",
)


def digest(result) -> str:
    h = hashlib.sha256()
    for name in ARRAYS:
        h.update(np.ascontiguousarray(getattr(result, name)).tobytes())
    for name in ("rejected_reason", "deferred_reason"):
        value = getattr(result, name)
        h.update(b"none" if value is None else "|".join(value.tolist()).encode())
    exceptions = [(e.iteration, e.request, e.chunk_tokens, e.predicted_ms, e.budget_ms, list(e.affected)) for e in result.slo_exceptions]
    extra = [result.preemptions, result.recompute_tokens, sorted((k, v) for k, v in result.token_segments.items()), exceptions]
    h.update(json.dumps(extra).encode())
    return h.hexdigest()


def case(workload_name: str, policy_name: str, option: int):
    """(workload, policy, tpot_ms, keyword options) of one case."""
    wl = WORKLOADS[workload_name].generate(REQUESTS, seed=1)
    tiered = assign_tiers(wl, default_tiers(2000.0), seed=1)
    kw, tpot, work, cost = {}, 25.0, wl, None
    if option == 1:
        kw["max_batch_size"] = 16
    elif option == 2:
        kw["deadline_form"] = "cumulative"
        if workload_name == "long":
            kw["aging"] = Aging(300.0)
    elif option == 3:
        kw["aging"], tpot = Aging(50.0, 128), 2.6
    elif option in (4, 5):
        kw["admission"], kw["ttft_ms"], tpot = AdmissionControl("reject" if option == 4 else "defer"), 2000.0, 10.0
    elif option == 6:
        kw["kv_capacity_tokens"] = 60000
    elif option == 7:
        cost = ContextAnalyticCost()
    elif option == 8:
        kw["actual_cost"] = NoisyCost(AnalyticCost(), 0.2, seed=3)
    elif option == 9:
        work, kw["check_deadlines"] = tiered.workload, True
    elif option == 10:
        kw["horizon_s"], kw["check_deadlines"] = 3.0, True
    elif option == 11:
        work, cost = tiered.workload, ContextAnalyticCost()
        kw.update(aging=Aging(100.0, 64), kv_capacity_tokens=50000, admission=AdmissionControl("defer", ttft_slack=1.5), ttft_ms=tiered.ttft_ms, max_batch_size=32)
    elif option == 12:
        kw["aging"], tpot, kw["check_deadlines"] = Aging(30.0, 100), 1.8, True
    # a margin is SLOWeave's (a static rule has none: make_policy refuses one)
    margin = RelativeMargin(cost or AnalyticCost(), 0.1) if option == 8 and policy_name.startswith("sloweave") else None
    policy = make_policy(policy_name, cost=cost, margin=margin)
    if cost is not None and not hasattr(policy, "cost"):
        kw.setdefault("actual_cost", cost)
    return work, policy, tpot, kw


def all_digests() -> dict[str, str]:
    out = {}
    for w in WORKLOAD_NAMES:
        for p in POLICIES:
            for option in range(OPTIONS):
                work, policy, tpot, kw = case(w, p, option)
                out[f"{w}/{p}/{option}"] = digest(simulate(work, policy, tpot, **kw))
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(all_digests(), f, indent=0, sort_keys=True)
        f.write("\n")
