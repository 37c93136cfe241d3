"""Simulator runs over every option and policy, reduced to one digest each.

``tests/golden/simulator.json`` holds one digest per case (``workload/policy/option``); the test
recomputes them, so every option keeps its results bit for bit. Every case is chosen so that its
option changes the result it pins: no two cases share a digest (tested), so a case that ran as
another one would show.

- Options 0-3, 6, 7 and 9-12, every plain policy: the digests the simulator gave before it was split into
  parts (made by ``python tests/golden/sim_cases.py OUT.json`` on that code).
- Options 4 and 5 (admission: reject, defer), every plain policy: made with the simulator after the
  split (``REMADE_OPTIONS``). Before, they ran at a 2,000 ms TTFT and 10 ms TPOT, where admission
  refused nothing in 19 of 21 runs, so reject and defer gave the same digest there; at 100 ms and
  5 ms every run refuses requests (a TTFT out of reach, a saturated decode batch, a TTFT expired
  in the queue), and the two actions differ in every run.
- Option 8 (seeded noise on the actual iteration time), every plain policy: made again when
  ``NoisyCost`` moved from numpy's exp to libm's (``math.exp``). numpy's float64 exp is
  vectorised per CPU, and its AVX-512 kernel differs from libm in the last bit: the digests made
  on an AVX-512 machine failed on an AVX2 one in 12 of 21 cases.
- Options 13 and 14 (``LOOKAHEAD_OPTIONS``): SLOWeave with and without its two-iteration view
  (``+lookahead``), made after the split. Lookahead shrinks a chunk only when the next, decode-only
  iteration would otherwise be late, which the paper's cost (0.055 ms a decode) did not bring about
  in any of the 13 other options: there lookahead gave the plain policy's digest every time, so
  those cases pinned nothing and are gone. These options price a decode at 1 ms, more than a small
  chunk, at a 10 ms TPOT, with per-token (13) and cumulative deadlines (14).
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
        from sloweave.core.costs.context_analytic import ContextAnalyticCost
        from sloweave.core.costs.analytic import AnalyticCost
        from sloweave.core.costs.margins import RelativeMargin
        from sloweave.core.costs.noisy import NoisyCost
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

POLICIES = ("sloweave", "sloweave-multi", "fixed-512", "budget-1024", "sarathi-512", "full", "orca")
WORKLOAD_NAMES = ("mixed", "long", "bursty")
OPTIONS = 13  # options 0-12, each with every policy in POLICIES
# options where lookahead changes the chunk, each with SLOWeave's two variants with and without it
LOOKAHEAD_OPTIONS = (13, 14)
LOOKAHEAD_POLICIES = ("sloweave", "sloweave+lookahead", "sloweave-multi", "sloweave-multi+lookahead")
REMADE_OPTIONS = (4, 5, 8, *LOOKAHEAD_OPTIONS)  # digests made with the simulator after the split (see above)
# Cases allowed to share a digest, each with the reason (none: every option changes its result).
SAME_DIGEST_BY_DESIGN: dict[frozenset[str], str] = {}
REQUESTS = 200

ARRAYS = (
    "iter_start_ms",
    "iter_end_ms",
    "iter_decodes",
    "iter_chunk_tokens",
    "iter_budget_ms",
    "iter_infeasible",
    "prefill_iter",
    "prefill_request",
    "prefill_tokens",
    "first_token_iter",
    "finished",
)


def digest(result) -> str:
    h = hashlib.sha256()
    for name in ARRAYS:
        h.update(np.ascontiguousarray(getattr(result, name)).tobytes())
    for name in ("rejected_reason", "deferred_reason"):
        value = getattr(result, name)
        h.update(b"none" if value is None else "|".join(value.tolist()).encode())
    exceptions = [
        (e.iteration, e.request, e.chunk_tokens, e.predicted_ms, e.budget_ms, list(e.affected))
        for e in result.slo_exceptions
    ]
    extra = [
        result.preemptions,
        result.recompute_tokens,
        sorted((k, v) for k, v in result.token_segments.items()),
        exceptions,
    ]
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
        kw["admission"], kw["ttft_ms"], tpot = AdmissionControl("reject" if option == 4 else "defer"), 100.0, 5.0
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
        kw.update(
            aging=Aging(100.0, 64),
            kv_capacity_tokens=50000,
            admission=AdmissionControl("defer", ttft_slack=1.5),
            ttft_ms=tiered.ttft_ms,
            max_batch_size=32,
        )
    elif option == 12:
        kw["aging"], tpot, kw["check_deadlines"] = Aging(30.0, 100), 1.8, True
    elif option in LOOKAHEAD_OPTIONS:
        # one more decode (1 ms) costs more than a small chunk (0.4 ms + 6 us a token): a chunk
        # that completes the head prompt can make the next, decode-only iteration late
        cost, tpot = AnalyticCost(decode_per_req_ms=1.0), 10.0
        if option == 14:
            kw["deadline_form"] = "cumulative"
    # a margin is SLOWeave's (a static rule has none: make_policy refuses one)
    margin = RelativeMargin(cost or AnalyticCost(), 0.1) if option == 8 and policy_name.startswith("sloweave") else None
    policy = make_policy(policy_name, cost=cost, margin=margin)
    if cost is not None and not hasattr(policy, "cost"):
        kw.setdefault("actual_cost", cost)
    return work, policy, tpot, kw


def case_keys() -> list[tuple[str, str, int]]:
    """(workload, policy, option) of every case."""
    plain = [(w, p, option) for w in WORKLOAD_NAMES for p in POLICIES for option in range(OPTIONS)]
    return plain + [(w, p, option) for w in WORKLOAD_NAMES for p in LOOKAHEAD_POLICIES for option in LOOKAHEAD_OPTIONS]


def all_digests(keys=None) -> dict[str, str]:
    out = {}
    for w, p, option in case_keys() if keys is None else keys:
        work, policy, tpot, kw = case(w, p, option)
        out[f"{w}/{p}/{option}"] = digest(simulate(work, policy, tpot, **kw))
    return out


if __name__ == "__main__":
    # python tests/golden/sim_cases.py OUT.json: every case. With --remade, OUT.json's cases of
    # REMADE_OPTIONS are made anew and the others kept as they are (cases no longer listed dropped).
    out_path, remade_only = sys.argv[1], "--remade" in sys.argv[2:]
    digests = all_digests()
    if remade_only:
        with open(out_path) as f:
            kept = json.load(f)
        digests = {k: (v if int(k.rsplit("/", 1)[1]) in REMADE_OPTIONS else kept[k]) for k, v in digests.items()}
    with open(out_path, "w") as f:
        json.dump(digests, f, indent=0, sort_keys=True)
        f.write("\n")
