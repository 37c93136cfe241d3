"""A served engine's online correction at a run's start: the steps it ran before, observed in order.

A served plug-in keeps its online correction (factors, residual windows, the margin read from
them) from one run to the next: a run starts where the engine's earlier traffic left it. A
simulation starts cold, and until its margin has seen enough steps it is the relative form, one
quantile of measured / predicted - 1 times the prediction. Measured on vLLM's CPU build at 20 ms
with a competing process: that fraction was 0.99 for the first ~800 steps of a simulated run
(a 7 ms step held a 7 ms margin), where the served plug-in, warm, held 6-7 ms on steps of 12 ms;
the twin's chunks were half the real run's and, with the machine's pace replayed, its attainment
0.46 against a real 0.97 (0.90 once warmed with the 2,000 steps the engine ran before the run).

``warm_correction`` feeds a calibrator the steps of a step log or step-time profile, in file order,
each against the base cost's prediction for its decodes, chunk and context, as the engine fed it.
"""

from __future__ import annotations

from pathlib import Path

from sloweave.core.costs.calibrated import OnlineCalibrator
from sloweave.core.costs.empirical_noise import predicted_times, read_step_samples
from sloweave.core.costs.protocols import CostModel


def warm_correction(calibrator: OnlineCalibrator, base_cost: CostModel, source: str | Path) -> int:
    """Observe every step of ``source`` (``read_step_samples``: a step log or a profile with measured
    times) into ``calibrator``, predicted by ``base_cost`` (the cost it corrects); returns the steps."""
    samples = read_step_samples(source)
    predicted = predicted_times(samples, base_cost).tolist()
    steps = zip(samples.n_decodes.tolist(), samples.chunk_tokens.tolist(), predicted, samples.measured_ms.tolist())
    for n_decodes, chunk_tokens, predicted_ms, measured_ms in steps:
        calibrator.observe(n_decodes, chunk_tokens, predicted_ms, measured_ms)
    return samples.steps
