"""sloweave: deadline-aware adaptive chunked prefill for LLM serving.

Layers, each importing only those before it (tests/test_layers.py checks this):
``core`` (decision core) < ``sim`` (simulator) < ``studies`` < the bodies ``runtime``
(CPU, transformers) and ``vllm_plugin`` < ``cli``.

The names a user needs first are here (``sloweave.SLOWeave``, ``sloweave.simulate``, ...),
each imported from its home module on first use, so ``import sloweave`` stays as light as
the decision core.
"""

from __future__ import annotations

import importlib

# name -> its home module
_API = {
    # the decision core
    "SLOWeave": "sloweave.core.policy",
    "make_policy": "sloweave.core.policy",
    "Aging": "sloweave.core.policy",
    "AnalyticCost": "sloweave.core.costs.analytic",
    "ConstantMargin": "sloweave.core.costs.margins",
    "RelativeMargin": "sloweave.core.costs.margins",
    "DeadlineTracker": "sloweave.core.deadlines",
    "OnlineCalibrator": "sloweave.core.costs.calibrated",
    "self_correcting": "sloweave.core.costs.calibrated",
    "BudgetController": "sloweave.core.budget",
    "StepState": "sloweave.core.budget",
    "StepPlan": "sloweave.core.budget",
    "resolve_cost": "sloweave.core.costs.resolve",
    "fit_profile": "sloweave.core.costs.profile_fit",
    "read_profile": "sloweave.core.costs.step_profiles",
    # the simulator
    "simulate": "sloweave.sim.engine",
    "EngineOptions": "sloweave.sim.options",
    "Workload": "sloweave.sim.workloads",
    "get_workload_spec": "sloweave.sim.workloads",
    "load_trace": "sloweave.sim.traces",
    "replay_workload": "sloweave.sim.trace_replay",
    "evaluate": "sloweave.sim.metrics",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'sloweave' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
