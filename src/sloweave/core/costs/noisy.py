"""The simulator's "actual" iteration time: a cost model's prediction times seeded noise and a bias."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sloweave.core.costs.protocols import CostModel, CostModelError


@dataclass(frozen=True)
class NoisyCost:
    """The "actual" iteration time of the simulator: predicted time x seeded noise x bias.

    ``noise`` is a multiplicative factor drawn per iteration from a lognormal with the
    given sigma, optionally capped at ``max_factor`` so tests can bound the one-sided error.
    It is a stateful sampler (owns a numpy Generator), built fresh for every run.
    """

    cost: CostModel
    sigma: float
    seed: int
    max_factor: float | None = None
    # A systematic prediction error: the machine is this many times slower than the model.
    bias: float = 1.0

    def __post_init__(self) -> None:
        if not np.isfinite(self.sigma) or self.sigma < 0:
            raise CostModelError(f"NoisyCost.sigma must be a finite number >= 0, got {self.sigma!r}")
        if not (np.isfinite(self.bias) and self.bias > 0):
            raise CostModelError(f"NoisyCost.bias must be a finite number > 0, got {self.bias!r}")
        if self.max_factor is not None and self.max_factor < 1:
            raise CostModelError(f"NoisyCost.max_factor must be >= 1, got {self.max_factor!r}")
        object.__setattr__(self, "_rng", np.random.default_rng(self.seed))

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        # libm's exp, not numpy's: numpy's is vectorised per CPU (its AVX-512 kernel differs in
        # the last bit), and a seeded run must give the same times on every machine
        factor = math.exp(self._rng.normal(0.0, self.sigma)) if self.sigma else 1.0  # type: ignore[attr-defined]
        if self.max_factor is not None:
            factor = min(factor, self.max_factor)
        return self.cost(n_decodes, chunk_tokens) * factor * self.bias
