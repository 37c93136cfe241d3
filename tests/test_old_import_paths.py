"""The flat module paths from before the package was split into layers are gone (CHANGELOG.md
lists each one's new place): importing one fails, so none comes back as a silent alias."""

import importlib

import pytest

OLD_PATHS = (
    "sloweave.ablation",
    "sloweave.admission",
    "sloweave.beyond",
    "sloweave.capacity",
    "sloweave.core.calibration",
    "sloweave.core.context_cost",
    "sloweave.core.cost",
    "sloweave.core.fit",
    "sloweave.core.operator_profiles",
    "sloweave.core.profile_cost",
    "sloweave.cost",
    "sloweave.deadlines",
    "sloweave.decision_metrics",
    "sloweave.engine_budget",
    "sloweave.experiments",
    "sloweave.fit",
    "sloweave.metrics",
    "sloweave.policy",
    "sloweave.replay",
    "sloweave.runtime.calibration",
    "sloweave.simulator",
    "sloweave.traces",
    "sloweave.tune",
    "sloweave.workloads",
)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_module_path_does_not_import(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_cost_resolver_is_found_only_in_its_own_module():
    costs = importlib.import_module("sloweave.core.costs")
    with pytest.raises(ImportError):
        exec("from sloweave.core.costs import resolve_cost", {})
    assert not hasattr(costs, "ResolvedCost")
    assert importlib.import_module("sloweave.core.costs.resolve").resolve_cost
