"""The paper's analytic cost plus what the KV context adds (an option beyond the paper).

``ContextAnalyticCost`` is ``ContextAware`` (``sloweave.core.costs.fitted.ContextualCost``): the
simulator's ``ContextFeed`` sets the decodes' KV total and the chunked prompt's prefix before
each decision; ``predict`` takes them as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.fitted import ContextualCost


@dataclass
class ContextAnalyticCost(ContextualCost):
    """T(n, c) of the analytic model plus what the KV context adds, in milliseconds:

    T = AnalyticCost(n, c) + kv_read * D / 1000 + 1[c>0] attention * c (P + (c + 1) / 2) / 1e6

    with D the KV tokens the decodes read and P the prefix already prefilled of the chunked
    prompt (its chunk attends to the prefix and, causally, to itself). The coefficients put
    an 8B Llama-shaped model (32 layers, width 4096, 8 KV heads of 128, bf16) on the
    analytic model's own scale, so nothing here is tuned to a result:
    - a KV token is 2 x 32 x 8 x 128 x 2 B = 131 kB against 16 GB of weights, 8.2e-6 of a
      weight read; the analytic model's fixed decode work (0.35 + 0.90 ms) stands for the
      weight read, so a KV token costs 1.25 ms x 8.2e-6 = 0.0103 ms per 1,000 tokens;
    - attention is 4 x 4096 x 32 = 0.52 MFLOP per (query, key) pair against 16 GFLOP per
      token of the linear layers, 3.3e-5 of the analytic 0.006 ms per prompt token:
      0.2 ms per million pairs.
    Monotone in c, so SLOWeave's binary search stays exact for a fixed context.
    """

    base: AnalyticCost = field(default_factory=AnalyticCost)
    kv_read_ms_per_1k_tokens: float = 0.0103
    attention_ms_per_m_pairs: float = 0.2
    decode_kv_tokens: int = 0
    prefill_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_read_ms_per_1k_tokens", "attention_ms_per_m_pairs"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"ContextAnalyticCost.{name} must be a finite number >= 0, got {value!r}")

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        t = self.base(n_decodes, chunk_tokens) + self.kv_read_ms_per_1k_tokens * decode_kv_tokens / 1e3
        if chunk_tokens > 0:
            t += self.attention_ms_per_m_pairs * chunk_tokens * (prefill_prefix_tokens + (chunk_tokens + 1) / 2) / 1e6
        return t
