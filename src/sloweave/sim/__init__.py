"""The simulator: an iteration-level serving engine made of parts, workloads, traces, metrics.

Imports the decision core and nothing above it (no studies, bodies or engines).
"""
