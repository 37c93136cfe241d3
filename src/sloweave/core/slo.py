"""SLO exceptions: steps whose chunk aging forced although they break deadlines.

One record for every body: the simulator fills ``iteration`` (its clock is the iteration
index as well as milliseconds), a real engine leaves it None.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class SLOException:
    start_ms: float  # when the step started (or, in a real engine, was planned to)
    request_id: Hashable  # the starving prompt that got the forced chunk
    chunk_tokens: int
    predicted_ms: float
    budget_ms: float  # time to the earliest deadline when it started
    affected_ids: tuple[Hashable, ...]  # running requests predicted to miss their next-token deadline
    iteration: int | None = None

    # The simulator's earlier names for the same fields.
    @property
    def request(self) -> Hashable:
        return self.request_id

    @property
    def affected(self) -> tuple[Hashable, ...]:
        return self.affected_ids
