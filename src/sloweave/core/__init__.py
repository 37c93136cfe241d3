"""The decision core: policies, cost models, deadlines, the per-step budget, calibration, fitting.

Nothing here imports an engine (torch, transformers, vLLM) or anything above it in the
package (the simulator, the studies, the bodies, the command line); tests/test_layers.py
checks that rule.
"""
