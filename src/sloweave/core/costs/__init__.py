"""The cost models: what a serving iteration costs, T(n, c), and how a ``--cost`` spec becomes one.

| module | what it holds |
|---|---|
| ``protocols`` | ``CostModel`` and ``Margin``; the capabilities a cost may declare (``ContextAware``, ``OfferAware``, ``HasTileEdges``, ``Invertible``, ``CountsQueries``, ``Calibrated``, ``Wrapper``, ``Described``); ``ContextFeed``, the one place a step's KV context reaches the costs; the monotonicity check and ``MonotoneRepair`` |
| ``analytic`` | ``AnalyticCost``: the paper's T(n, c) |
| ``context_analytic`` | ``ContextAnalyticCost``: the analytic cost plus what the KV context adds |
| ``margins`` | ``ZeroMargin``, ``ConstantMargin``, ``RelativeMargin`` |
| ``noisy`` | ``NoisyCost``: the simulator's actual time (prediction x seeded noise x bias) |
| ``empirical_noise`` | ``EmpiricalNoiseCost``: the simulator's actual time (prediction + a residual a real engine's step log measured, by step kind and predicted step time) |
| ``kv_memory`` | ``KVMemory``: the KV cache a served model leaves room for, from the model and the GPU |
| ``step_profiles`` | step-time profiles: their format, ``read_profile``, ``write_profile``, ``validate_profile``, ``ProfileError`` |
| ``step_grid`` | a profile's steps on their (n, c, context) grid and the check that step time does not drop along it |
| ``fitted`` | the costs fitted from step-time profiles (``ContextualCost``, regression, lookup table, ``FixedContextCost``, ``ResidualMargin``) |
| ``fit_acceptance`` | ``accept_fit``: the rule every fitted kind meets before it is used |
| ``profile_fit`` | ``fit_profile``: a profile fitted into those costs, each through ``accept_fit`` |
| ``operator_profiles`` | Vidur-format operator profiles (the shipped presets, a folder) |
| ``profile`` | ``ProfileCost``: T(n, c) from operator profiles |
| ``calibrated`` | online correction: ``OnlineCalibrator``, ``CalibratedCost``, ``AdaptiveMargin``, ``self_correcting`` |
| ``step_margin`` | the per-step margin in ms: residual quantiles by step kind and predicted time (``margin_form="per-step"``) |
| ``resolve`` | a ``--cost`` spec resolved into a model (``resolve_cost``, ``ResolvedCost``) |

The package itself imports none of them, so ``sloweave.core.costs.protocols`` stays light.
"""
