"""The requests of one run: what each asked for and how far it got (shared by the parts).

Plain lists indexed by request number, because the loop reads them every iteration.
A request's KV while it decodes is ``prefill_total + (iteration - segment_first)``: the
prompt (or prompt + tokens so far, after a preemption) plus one token per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sloweave.sim.result import NOT_STARTED
from sloweave.sim.workloads import Workload


@dataclass(eq=False)
class Requests:
    arrival_ms: list[float]
    prompt: list[int]
    output: list[int]
    tpot_ms: list[float] | None  # per-request TPOT targets (None: the shared one)
    remaining_prompt: list[int] = field(init=False)
    # tokens the current prefill must process: the prompt, or prompt + generated after a preemption
    prefill_total: list[int] = field(init=False)
    first_token_iter: list[int] = field(init=False)
    finish_iter: list[int] = field(init=False)
    # iteration of the first token of the current run of tokens (differs from first_token_iter after a preemption)
    segment_first: list[int] = field(init=False)
    progress_ms: list[float] = field(init=False)  # when a prompt arrived or last got tokens (aging)
    emitted_before: dict[int, int] = field(default_factory=dict)  # preempted: tokens before the current run
    closed_segments: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    rejected_reason: list[str] = field(init=False)
    deferred_reason: list[str] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.arrival_ms)
        self.remaining_prompt = list(self.prompt)
        self.prefill_total = list(self.prompt)
        self.first_token_iter = [NOT_STARTED] * n
        self.finish_iter = [NOT_STARTED] * n
        self.segment_first = [NOT_STARTED] * n
        self.progress_ms = list(self.arrival_ms)
        self.rejected_reason = [""] * n
        self.deferred_reason = [""] * n

    @classmethod
    def from_workload(cls, workload: Workload) -> Requests:
        tpot = None if workload.tpot_ms is None else workload.tpot_ms.tolist()
        return cls(
            (workload.arrival_s * 1000.0).tolist(),
            workload.prompt_tokens.tolist(),
            workload.output_tokens.tolist(),
            tpot,
        )

    def __len__(self) -> int:
        return len(self.arrival_ms)

    def started(self, request: int) -> bool:
        """Its (current) prefill has begun."""
        return self.remaining_prompt[request] < self.prefill_total[request]

    def token_segments(self, iterations: int) -> dict[int, list[tuple[int, int]]]:
        """Preempted requests: the (first, last) iterations of each run of tokens, in order."""
        segments = {}
        for request, closed in self.closed_segments.items():
            runs = list(closed)
            first = self.segment_first[request]
            if first != NOT_STARTED:
                left_tokens = self.output[request] - self.emitted_before[request]
                runs.append((first, min(first + left_tokens, iterations) - 1))
            segments[request] = runs
        return segments
