"""What the simulator writes down: one row per iteration and per prefill piece."""

from __future__ import annotations

import numpy as np


class Recorder:
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.decodes: list[int] = []
        self.chunks: list[int] = []
        self.budgets: list[float] = []
        self.infeasible: list[bool] = []
        # one row per (iteration, request) prefill piece: several prompts can share an iteration
        self.piece_iter: list[int] = []
        self.piece_request: list[int] = []
        self.piece_tokens: list[int] = []

    def iteration(
        self, start_ms: float, end_ms: float, n_decodes: int, chunk_tokens: int, budget_ms: float, infeasible: bool
    ) -> None:
        self.starts.append(start_ms)
        self.ends.append(end_ms)
        self.decodes.append(n_decodes)
        self.chunks.append(chunk_tokens)
        self.budgets.append(budget_ms)
        self.infeasible.append(infeasible)

    def iteration_writers(self) -> tuple:
        """``iteration`` one column at a time: the bound appends of its columns, in its arguments'
        order (the engine writes a row every iteration, without a call around the appends)."""
        return (
            self.starts.append,
            self.ends.append,
            self.decodes.append,
            self.chunks.append,
            self.budgets.append,
            self.infeasible.append,
        )

    def piece(self, iteration: int, request: int, tokens: int) -> None:
        self.piece_iter.append(iteration)
        self.piece_request.append(request)
        self.piece_tokens.append(tokens)

    def arrays(self) -> dict[str, np.ndarray]:
        """The SimResult fields this part owns."""
        return {
            "iter_start_ms": np.asarray(self.starts, dtype=np.float64),
            "iter_end_ms": np.asarray(self.ends, dtype=np.float64),
            "iter_decodes": np.asarray(self.decodes, dtype=np.int64),
            "iter_chunk_tokens": np.asarray(self.chunks, dtype=np.int64),
            "iter_budget_ms": np.asarray(self.budgets, dtype=np.float64),
            "iter_infeasible": np.asarray(self.infeasible, dtype=bool),
            "prefill_iter": np.asarray(self.piece_iter, dtype=np.int64),
            "prefill_request": np.asarray(self.piece_request, dtype=np.int64),
            "prefill_tokens": np.asarray(self.piece_tokens, dtype=np.int64),
        }
