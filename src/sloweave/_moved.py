"""Old import paths of modules that moved when the package was split into layers.

``sloweave.cost`` and the like still import, with a DeprecationWarning naming the new
place: the old module name becomes an alias of the new module (the very same object), so
code that imported, patched or pickled through the old path keeps working. An import
hook answers for the old names, so the package tree shows only the layers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# sloweave.core.cost was split in four: its names are gathered into one module
_COST = (
    "sloweave.core.costs.protocols",
    "sloweave.core.costs.analytic",
    "sloweave.core.costs.margins",
    "sloweave.core.costs.noisy",
)

# old module -> new module (or the modules its names went to)
MOVED = {
    "sloweave.cost": _COST,
    "sloweave.deadlines": "sloweave.core.deadlines",
    "sloweave.policy": "sloweave.core.policy",
    "sloweave.admission": "sloweave.core.admission",
    "sloweave.fit": "sloweave.core.costs.fitted",
    "sloweave.engine_budget": "sloweave.core.budget",
    "sloweave.runtime.calibration": "sloweave.core.costs.calibrated",
    "sloweave.decision_metrics": "sloweave.core.decision_metrics",
    "sloweave.simulator": "sloweave.sim.engine",
    "sloweave.workloads": "sloweave.sim.workloads",
    "sloweave.traces": "sloweave.sim.traces",
    "sloweave.metrics": "sloweave.sim.metrics",
    "sloweave.experiments": "sloweave.studies.reproduce",
    "sloweave.replay": "sloweave.studies.replay",
    "sloweave.capacity": "sloweave.studies.capacity",
    "sloweave.ablation": "sloweave.studies.ablate",
    "sloweave.tune": "sloweave.studies.tune",
    # split in three: its names are gathered into one module
    "sloweave.beyond": ("sloweave.core.costs.context_analytic", "sloweave.sim.tiers", "sloweave.sim.metrics"),
    # the cost models, gathered in sloweave.core.costs. sloweave.core.costs itself, the
    # old --cost resolver, is now that package: its names are still found there (with a warning)
    "sloweave.core.cost": _COST,
    "sloweave.core.fit": "sloweave.core.costs.fitted",
    "sloweave.core.profile_cost": "sloweave.core.costs.profile",
    "sloweave.core.operator_profiles": "sloweave.core.costs.operator_profiles",
    "sloweave.core.calibration": "sloweave.core.costs.calibrated",
    "sloweave.core.context_cost": "sloweave.core.costs.context_analytic",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return None  # a throwaway module; exec_module puts the real one in its place

    def exec_module(self, module) -> None:
        old = module.__name__
        new = MOVED[old]
        where = new if isinstance(new, str) else ", ".join(new)
        warnings.warn(
            f"{old} has moved to {where}; import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        if isinstance(new, tuple):
            for name in new:
                module.__dict__.update(
                    {k: v for k, v in vars(importlib.import_module(name)).items() if not k.startswith("__")}
                )
            return
        # The import system returns whatever sys.modules holds once this returns.
        sys.modules[old] = importlib.import_module(new)


def install() -> None:
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
