"""The cost models: what a serving iteration costs, T(n, c), and how a ``--cost`` spec becomes one.

| module | what it holds |
|---|---|
| ``protocols`` | ``CostModel`` and ``Margin``; the capabilities a cost may declare (``ContextAware``, ``OfferAware``, ``HasTileEdges``, ``Invertible``, ``CountsQueries``, ``Calibrated``, ``Wrapper``, ``Described``); ``ContextFeed``, the one place a step's KV context reaches the costs; the monotonicity check and ``MonotoneRepair`` |
| ``analytic`` | ``AnalyticCost``: the paper's T(n, c) |
| ``context_analytic`` | ``ContextAnalyticCost``: the analytic cost plus what the KV context adds |
| ``margins`` | ``ZeroMargin``, ``ConstantMargin``, ``RelativeMargin`` |
| ``noisy`` | ``NoisyCost``: the simulator's actual time (prediction x seeded noise x bias) |
| ``fitted`` | step-time profiles and the costs fitted from them (``ContextualCost``, regression, lookup table, ``FixedContextCost``, ``ResidualMargin``) |
| ``operator_profiles`` | Vidur-format operator profiles (the shipped presets, a folder) |
| ``profile`` | ``ProfileCost``: T(n, c) from operator profiles |
| ``calibrated`` | online correction: ``OnlineCalibrator``, ``CalibratedCost``, ``AdaptiveMargin``, ``self_correcting`` |
| ``resolve`` | a ``--cost`` spec resolved into a model (``resolve_cost``, ``ResolvedCost``, ``cost_option``) |

Before this package, ``sloweave.core.costs`` was the module now in ``resolve``: its names are
still found here, with a DeprecationWarning (the other old modules, ``sloweave.core.cost``,
``sloweave.core.fit`` and the like, are aliases kept by ``sloweave._moved``). Nothing is
imported until it is asked for, so ``sloweave.core.costs.protocols`` stays light.
"""

from __future__ import annotations

import importlib
import warnings

_SUBMODULES = {
    "analytic",
    "calibrated",
    "context_analytic",
    "fitted",
    "margins",
    "noisy",
    "operator_profiles",
    "profile",
    "protocols",
    "resolve",
}


def __getattr__(name: str):
    # the old module sloweave.core.costs's names (now sloweave.core.costs.resolve's)
    if name.startswith("_") or name in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    resolve = importlib.import_module(f"{__name__}.resolve")
    if not hasattr(resolve, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"sloweave.core.costs.{name} has moved to sloweave.core.costs.resolve; import it from there (the old path will be removed)",
        DeprecationWarning,
        stacklevel=2,
    )
    value = globals()[name] = getattr(resolve, name)  # warned once (``from ... import`` asks twice)
    return value
