"""The decision of one iteration: the policy's chunk, the lookahead view, aging and the size grid.

Without aging, lookahead or a size grid the policy decides alone (``policy.decide``). Else the
chunk goes through the core's ``decide_step``, the same path as a real engine's
``BudgetController``; each chunk aging forces is an SLO exception naming the running requests
the iteration is predicted to make late.
"""

from __future__ import annotations

from sloweave.core.policy import Aging, Decision, decide_step
from sloweave.core.slo import SLOException
from sloweave.core.size_grid import SizeGrid


def chunk_decider(policy, aging: Aging | None, predicted_ms, grid: SizeGrid | None = None):
    """A callable (n_decodes, waiting_tokens, budget_ms) -> (chunk, infeasible)."""
    if aging is None and grid is None and not getattr(policy, "lookahead", False):
        return policy.decide
    return StepDecider(policy, aging, predicted_ms, grid)


class StepDecider:
    def __init__(self, policy, aging: Aging | None, predicted_ms, grid: SizeGrid | None = None) -> None:
        self.policy = policy
        self.aging = aging
        self.grid = grid
        self.predicted_ms = predicted_ms
        self.lookahead = getattr(policy, "lookahead", False)
        self.exceptions: list[SLOException] = []
        self.engine = None  # the engine it decides for (attach)

    def attach(self, engine) -> None:
        self.engine = engine

    def __call__(self, n: int, waiting_tokens: int, budget_ms: float) -> Decision:
        engine = self.engine
        head = engine.queue.waiting[0] if waiting_tokens else None
        decision = self._lookahead(engine, n, waiting_tokens, budget_ms, head) if self.lookahead else None
        waited_ms = engine.now_ms - engine.requests.progress_ms[head] if head is not None else 0.0
        chunk, infeasible, aged = decide_step(
            self.policy, n, waiting_tokens, budget_ms, self.aging, waited_ms, decision, self.grid
        )
        if aged:
            self._record(engine, head, chunk, budget_ms)
        return Decision(chunk, infeasible)

    def _lookahead(self, engine, n: int, waiting_tokens: int, budget_ms: float, head: int | None) -> Decision:
        deadlines = engine.deadlines
        head_remaining = engine.requests.remaining_prompt[head] if head is not None else 0
        next_fresh = deadlines.next_fresh_budget_ms(budget_ms, head)
        return self.policy.decide_lookahead(n, waiting_tokens, budget_ms, head_remaining, next_fresh, deadlines.banked)

    def _record(self, engine, head: int, chunk: int, budget_ms: float) -> None:
        predicted_ms = self.predicted_ms(engine.batch.n, chunk)
        now_ms, iteration, late = engine.now_ms, engine.iteration, engine.deadlines.late
        affected = tuple(r for r in engine.batch.running if late(r, now_ms, iteration, predicted_ms))
        self.exceptions.append(SLOException(now_ms, head, chunk, predicted_ms, budget_ms, affected, iteration))
