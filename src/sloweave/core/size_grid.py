"""Step sizes on a grid: a step the deadline cut short is rounded down to a multiple of a few tokens.

An engine can pay extra for the first steps of every size (decodes + chunk) it has not run yet:
vLLM's CPU build 3-8 ms for a size's first step and 2-3 ms for its second and third, transformers
on an H200 with cuDNN attention 70-80 ms for a size's first forward (docs/vllm-plugin.md,
docs/gpu-costs.md). A budget chosen anew every step keeps finding new sizes; a grid keeps them
few. Rounding down keeps Proposition 1: a smaller chunk is predicted no slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sloweave.core.validate import whole_number


def on_grid(step_tokens: int, decode_tokens: int, grid_tokens: int) -> int:
    """``step_tokens`` rounded down to a multiple of ``grid_tokens`` where that keeps a chunk
    beside the ``decode_tokens`` (a smaller chunk: still deadline-safe); else unchanged."""
    rounded = step_tokens - step_tokens % grid_tokens
    return rounded if rounded > decode_tokens else step_tokens


@dataclass(frozen=True)
class SizeGrid:
    """Rounds a step only where the deadline (or the chunk's rate) cut its chunk short: the whole
    offer, the policy's C_max (``max_chunk_tokens``) and the engine's own cap on a step
    (``max_step_tokens``) are sizes the engine is given as they are."""

    grid_tokens: int
    max_chunk_tokens: float = math.inf
    max_step_tokens: float = math.inf

    def __post_init__(self) -> None:
        whole_number(self.grid_tokens, "step_grid_tokens", minimum=1)

    def chunk(self, chunk_tokens: int, decode_tokens: int, waiting_tokens: int) -> int:
        """The chunk of a step rounded to the grid (decode-only steps are left alone)."""
        step = decode_tokens + chunk_tokens
        if not chunk_tokens or step >= self.max_step_tokens:
            return chunk_tokens
        if chunk_tokens >= min(waiting_tokens, self.max_chunk_tokens):
            return chunk_tokens
        return on_grid(step, decode_tokens, self.grid_tokens) - decode_tokens


def size_grid(grid_tokens: int, policy, max_step_tokens: float = math.inf) -> SizeGrid | None:
    """The grid a deadline-aware ``policy`` rounds its steps to (None for 1: no rounding; a static
    rule's chunk is its own, never rounded)."""
    grid = SizeGrid(grid_tokens, getattr(policy, "max_chunk_tokens", math.inf), max_step_tokens)
    return grid if grid_tokens > 1 and getattr(policy, "uses_deadlines", False) else None
