"""The decision core: policies, cost models (``sloweave.core.costs``: analytic, fitted, profiled,
calibrated, and the ``--cost`` resolver), deadlines, the per-step budget.

Nothing here imports an engine (torch, transformers, vLLM) or anything above it in the
package (the simulator, the studies, the bodies, the command line); tests/test_layers.py
checks that rule.
"""
