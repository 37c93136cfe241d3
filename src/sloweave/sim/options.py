"""Engine options: properties of the serving engine, the same for every policy.

Multi-prefill is part of a policy's rule (``sloweave-multi``, ``sarathi-B``); everything
else a serving engine offers is here, and any policy runs with any of it: a cap on
running requests, admission control, aging, a KV capacity, the deadline form, and the
machine's prediction error (seeded lognormal noise and a systematic bias on the model's
time). ``correction`` is SLOWeave's answer to that error without a hand-set margin: the
core's online recalibration and adaptive P99.7 margin (``core.calibration.self_correcting``);
it changes only deadline-aware policies (a static rule has no model to correct).

A comparison is like for like when every policy runs with one ``EngineOptions``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from sloweave.core.admission import ADMISSION_ACTIONS, AdmissionControl
from sloweave.core.costs.calibrated import self_correcting
from sloweave.core.costs.noisy import NoisyCost
from sloweave.core.costs.protocols import CostModel
from sloweave.core.policy import Aging, Policy
from sloweave.core.validate import BATCH_SIZE, DURATION_MS, NOISE_SIGMA, SCALE, TOKENS, positive_ms, positive_tokens
from sloweave.sim.engine import DEADLINE_FORMS, simulate
from sloweave.sim.result import SimResult
from sloweave.sim.workloads import Workload

# Noise streams are seeded apart from the workload generator's seeds.
NOISE_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class EngineOptions:
    max_batch_size: int | None = None
    admission: str | None = None  # "reject" | "defer" (core.admission.AdmissionControl)
    aging_ms: float | None = None
    aging_chunk_tokens: int = 256
    kv_capacity_tokens: int | None = None
    deadline_form: str = "per-token"
    noise_sigma: float = 0.0  # actual time = model time x lognormal(0, sigma) x bias
    bias: float = 1.0
    correction: bool = False  # deadline-aware policies: online recalibration + adaptive P99.7 margin

    def __post_init__(self) -> None:
        if self.max_batch_size is not None:
            BATCH_SIZE.check(self.max_batch_size, "max_batch_size")
        if self.admission is not None and self.admission not in ADMISSION_ACTIONS:
            raise ValueError(
                f"admission must be one of {', '.join(ADMISSION_ACTIONS)} (or None), got {self.admission!r}"
            )
        if self.aging_ms is not None:
            positive_ms(self.aging_ms, "aging_ms")
        positive_tokens(self.aging_chunk_tokens, "aging_chunk_tokens")
        if self.kv_capacity_tokens is not None:
            TOKENS.check(self.kv_capacity_tokens, "kv_capacity_tokens")
        if self.deadline_form not in DEADLINE_FORMS:
            raise ValueError(f"deadline_form must be one of {', '.join(DEADLINE_FORMS)}, got {self.deadline_form!r}")
        NOISE_SIGMA.check(self.noise_sigma, "noise_sigma")
        SCALE.check(self.bias, "bias")  # 1 = the model is exact
        if not isinstance(self.correction, bool):
            raise ValueError(f"correction must be true or false, got {self.correction!r}")

    @property
    def exact_prediction(self) -> bool:
        return self.noise_sigma == 0 and self.bias == 1.0

    def describe(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        """A short name for tables: only the options that differ from the defaults."""
        changed = [f"{k}={v}" for k, v in asdict(self).items() if v != getattr(DEFAULT_OPTIONS, k)]
        return ", ".join(changed) or "defaults"

    def actual_cost(self, cost: CostModel, noise_seed: int) -> CostModel:
        if self.exact_prediction:
            return cost
        return NoisyCost(cost, self.noise_sigma, seed=NOISE_SEED_OFFSET + noise_seed, bias=self.bias)

    def simulate(
        self,
        workload: Workload,
        policy: Policy,
        tpot_ms: float,
        ttft_ms: float | np.ndarray,
        cost: CostModel,
        noise_seed: int = 0,
    ) -> SimResult:
        """Run ``policy`` on ``workload`` in this engine; ``cost`` is the machine's model.

        The policy predicts with its own cost (normally ``cost``); the iteration really
        takes ``cost`` x noise x bias. With ``correction`` a deadline-aware policy gets a
        fresh calibrator per run (its state is the run's own).
        """
        calibrator = None
        if self.correction and policy.uses_deadlines:
            corrected = self_correcting(policy.cost)
            policy, calibrator = replace(policy, cost=corrected.cost, margin=corrected.margin), corrected.calibrator
        return simulate(
            workload,
            policy,
            tpot_ms=tpot_ms,
            actual_cost=self.actual_cost(cost, noise_seed),
            max_batch_size=self.max_batch_size,
            deadline_form=self.deadline_form,
            aging=Aging(self.aging_ms, self.aging_chunk_tokens) if self.aging_ms is not None else None,
            admission=AdmissionControl(self.admission) if self.admission else None,
            ttft_ms=ttft_ms,
            kv_capacity_tokens=self.kv_capacity_tokens,
            correction=calibrator,
        )


DEFAULT_OPTIONS = EngineOptions()


def engine_options(dest: str = "engine"):
    """The engine options every study command takes, turned into one ``EngineOptions``
    passed to the command as ``dest``.

    Each option is named once: its ``EngineOptions`` field, beside its flag; the flag's
    parameter is the field's name and its default the field's default."""
    import functools

    import click

    defaults = {f.name: f.default for f in fields(EngineOptions)}
    flags = {  # EngineOptions field: (the flag, or None for --<field>, its click settings); aging_chunk_tokens has no flag
        "max_batch_size": (
            "--max-batch",
            {"type": BATCH_SIZE.option(), "help": "cap on started requests, every policy (vLLM's max_num_seqs)"},
        ),
        "admission": (
            None,
            {
                "type": click.Choice(ADMISSION_ACTIONS),
                "help": "admission control for every policy: reject or defer (a best-effort lane)",
            },
        ),
        "aging_ms": (
            None,
            {
                "type": DURATION_MS.option(),
                "help": "starvation control for every policy: after this wait the oldest prompt gets a chunk",
            },
        ),
        "kv_capacity_tokens": (
            None,
            {
                "type": TOKENS.option(),
                "help": "KV cache capacity in tokens (admission by memory, preemption with recompute)",
            },
        ),
        "deadline_form": (None, {"type": click.Choice(DEADLINE_FORMS), "show_default": True}),
        "noise_sigma": (
            None,
            {
                "type": NOISE_SIGMA.option(),
                "show_default": True,
                "help": "prediction error: actual step = model x lognormal(0, sigma) x bias (seeded)",
            },
        ),
        "bias": (
            None,
            {
                "type": SCALE.option(),
                "show_default": True,
                "help": "systematic prediction error: the machine is this many times slower than the model",
            },
        ),
        "correction": (
            "--correction/--no-correction",
            {
                "show_default": True,
                "help": "deadline-aware policies correct the model online and keep an adaptive P99.7 margin (no hand-set margin)",
            },
        ),
    }

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            given = {name: kwargs.pop(name) for name in flags if name in kwargs}
            try:
                kwargs[dest] = EngineOptions(**given)
            except ValueError as err:
                raise click.UsageError(str(err)) from None
            return command(*args, **kwargs)

        for name, (flag, settings) in reversed(flags.items()):
            wrapper = click.option(flag or "--" + name.replace("_", "-"), name, default=defaults[name], **settings)(
                wrapper
            )
        return wrapper

    return decorate
