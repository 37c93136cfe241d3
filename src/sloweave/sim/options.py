"""Engine options: properties of the serving engine, the same for every policy.

Multi-prefill is part of a policy's rule (``sloweave-multi``, ``sarathi-B``); everything
else a serving engine offers is here, and any policy runs with any of it: a cap on
running requests, admission control, aging, a KV capacity, the deadline form, and the
machine's prediction error (seeded lognormal noise and a systematic bias on the model's
time, or the machine's own measured noise: ``step_noise_from``, a step log whose residuals
``sloweave.core.costs.empirical_noise`` replays by predicted step time). ``correction`` is SLOWeave's answer to that error without a hand-set margin: the
core's online recalibration and adaptive P99.7 margin (``core.calibration.self_correcting``);
it changes only deadline-aware policies (a static rule has no model to correct).

A comparison is like for like when every policy runs with one ``EngineOptions``.

``kv_memory`` says how ``kv_capacity_tokens`` was obtained (the model's memory figures, given,
or unlimited and why: ``sloweave.core.costs.kv_memory.KVMemory``); the command line sets it
(``sloweave.cli.options.engine_options``), and ``describe`` records it when set.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from os import PathLike

import numpy as np

from sloweave.core.admission import ADMISSION_ACTIONS, AdmissionControl
from sloweave.core.costs.calibrated import DEFAULT_MARGIN_FORM, MARGIN_FORMS, self_correcting
from sloweave.core.costs.empirical_noise import EmpiricalNoiseCost, read_step_samples, start_times, step_noise_from_file
from sloweave.core.costs.engine_loop import EngineLoop
from sloweave.core.costs.kv_memory import KVMemory
from sloweave.core.costs.noisy import NoisyCost
from sloweave.core.costs.protocols import CostModel
from sloweave.core.costs.warm_start import warm_correction
from sloweave.core.policy import Aging, Policy
from sloweave.core.validate import (
    BATCH_SIZE,
    DURATION_MS,
    MARGIN_MS,
    NOISE_SIGMA,
    SCALE,
    STEP_COUNT,
    TOKENS,
    positive_ms,
    positive_tokens,
    setting,
)
from sloweave.sim.engine import DEADLINE_FORMS, simulate
from sloweave.sim.result import SimResult
from sloweave.sim.workloads import Workload

# Noise streams are seeded apart from the workload generator's seeds.
NOISE_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class EngineOptions:
    """Each field carries its help text and the values it takes; the command line's options are
    built from them (``sloweave.cli.options.engine_options``). Fields without help have no flag."""

    max_batch_size: int | None = setting(
        None, "cap on started requests, every policy (vLLM's max_num_seqs)", values=BATCH_SIZE, flag="--max-batch"
    )
    admission: str | None = setting(
        None, "admission control for every policy: reject or defer (a best-effort lane)", values=ADMISSION_ACTIONS
    )
    aging_ms: float | None = setting(
        None,
        "starvation control for every policy: after this wait the oldest prompt gets a chunk",
        values=DURATION_MS,
    )
    aging_chunk_tokens: int = 256
    kv_capacity_tokens: int | None = setting(
        None, "KV cache capacity in tokens (admission by memory, preemption with recompute)", values=TOKENS
    )
    deadline_form: str = setting(
        "per-token",
        "per-token: each token is due one TPOT after the previous one; cumulative: token k is due "
        "k TPOTs after the first",
        values=DEADLINE_FORMS,
    )
    noise_sigma: float = setting(
        0.0, "prediction error: actual step = model x lognormal(0, sigma) x bias (seeded)", values=NOISE_SIGMA
    )
    bias: float = setting(
        1.0, "systematic prediction error: the machine is this many times slower than the model", values=SCALE
    )
    step_noise_from: str | None = setting(
        None,
        "the machine's own step-time noise instead of a lognormal: a step log (.jsonl) or a step-time profile "
        "(CSV/JSON) with measured times; each step adds a residual (measured - predicted) drawn, seeded, from the "
        "file's steps of about its predicted time, every prediction the run's --cost model's (normally fitted to "
        "the same file)",
    )
    step_noise_block_steps: int = setting(
        0,
        "with step_noise_from: draw its residuals along its own timeline in blocks of this many steps, from a "
        "seeded start each (a slow minute of the machine stays a run of slow steps); 0: each step independently",
        values=STEP_COUNT,
        flag="--noise-block-steps",
    )
    step_noise_pace_ms: float = setting(
        0.0,
        "with step_noise_from (a step log, or a profile with start_ms): keep the machine's drift apart from its noise. "
        "The file's median measured / predicted over this many ms around each moment is replayed along the simulated "
        "clock from the file's start, and the residuals are taken against that paced prediction. 0: no pace",
        values=MARGIN_MS,
        flag="--noise-pace-ms",
    )
    correction: bool = setting(
        False,
        "deadline-aware policies correct the model online and keep an adaptive P99.7 margin (no hand-set margin)",
    )
    warm_from: str | None = setting(
        None,
        "with --correction: a step log or step-time profile whose steps the online correction observes, in order, "
        "before the run (a served engine's state when a run begins: the steps it served before)",
    )
    loop_from: str | None = setting(
        None,
        "a served run's step log: after each step the clock moves on by the engine loop's time between steps as that "
        "log shows it (a base plus a time per decode, fitted, plus one of its residuals drawn with the noise seed), "
        "which no step's time holds and no correction sees",
    )
    margin_form: str = setting(
        DEFAULT_MARGIN_FORM,
        "with --correction, the adaptive margin's form: relative (one quantile of measured / predicted - 1, "
        "times the prediction) or per-step (milliseconds, the quantile of steps of the same kind and predicted time)",
        values=MARGIN_FORMS,
    )
    step_grid_tokens: int = setting(
        1,
        "deadline-aware policies round a step (decodes + chunk) the deadline cut short down to a multiple of this, "
        "as the vLLM plug-in's step_grid_tokens (1: no rounding)",
        values=TOKENS,
        flag="--step-grid",
    )
    kv_memory: KVMemory | None = None  # how kv_capacity_tokens was obtained (no flag: the command line sets it)

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
        TOKENS.check(self.step_grid_tokens, "step_grid_tokens")
        if self.deadline_form not in DEADLINE_FORMS:
            raise ValueError(f"deadline_form must be one of {', '.join(DEADLINE_FORMS)}, got {self.deadline_form!r}")
        NOISE_SIGMA.check(self.noise_sigma, "noise_sigma")
        SCALE.check(self.bias, "bias")  # 1 = the model is exact
        STEP_COUNT.check(self.step_noise_block_steps, "step_noise_block_steps")
        MARGIN_MS.check(self.step_noise_pace_ms, "step_noise_pace_ms")
        if self.step_noise_from is not None:
            self._check_step_noise()
        elif self.step_noise_block_steps:
            raise ValueError("step_noise_block_steps draws the residuals of step_noise_from: give that file too")
        elif self.step_noise_pace_ms:
            raise ValueError("step_noise_pace_ms paces the machine of step_noise_from: give that file too")
        if self.step_noise_block_steps and self.step_noise_pace_ms:
            raise ValueError(
                "step_noise_block_steps and step_noise_pace_ms are two ways to keep the machine's drift: give one"
            )
        if not isinstance(self.correction, bool):
            raise ValueError(f"correction must be true or false, got {self.correction!r}")
        if self.warm_from is not None:
            self._check_warm_from()
        if self.loop_from is not None:
            engine_loop_of(self._path_of("loop_from"))  # a bad log refused before any simulation
        if self.margin_form not in MARGIN_FORMS:
            raise ValueError(f"margin_form must be one of {', '.join(MARGIN_FORMS)}, got {self.margin_form!r}")
        if self.margin_form != DEFAULT_MARGIN_FORM and not self.correction:
            raise ValueError(f"margin_form {self.margin_form} needs correction (it shapes the adaptive margin)")
        if self.kv_memory is not None:
            if not isinstance(self.kv_memory, KVMemory):
                raise ValueError(f"kv_memory must be a KVMemory (or None), got {self.kv_memory!r}")
            if self.kv_memory.tokens != self.kv_capacity_tokens:
                raise ValueError(
                    f"kv_memory states {self.kv_memory.tokens} tokens but kv_capacity_tokens is {self.kv_capacity_tokens}"
                )

    def _check_step_noise(self) -> None:
        """A path (kept as text: the options stay plain and picklable) to a file of enough measured
        steps, read now (once per process) so a bad file is refused before any simulation."""
        source = self._path_of("step_noise_from")
        if self.noise_sigma != 0 or self.bias != 1.0:
            raise ValueError(
                "step_noise_from replaces noise_sigma and bias (the machine's measured noise instead of a lognormal "
                f"one): give one or the other, not step_noise_from with noise_sigma={self.noise_sigma:g}, "
                f"bias={self.bias:g}"
            )
        samples = read_step_samples(source)
        if self.step_noise_pace_ms:
            start_times(samples)  # a pace needs them: refused here, before any simulation

    def _check_warm_from(self) -> None:
        source = self._path_of("warm_from")
        if not self.correction:
            raise ValueError("warm_from warms the online correction: give correction too")
        read_step_samples(source)

    def _path_of(self, name: str) -> str:
        """The option ``name``, a path to a step log or step-time profile, kept as text (the options stay
        plain and picklable)."""
        source = getattr(self, name)
        if not isinstance(source, (str, PathLike)) or not str(source).strip():
            raise ValueError(f"{name} must be the path of a step log or step-time profile, got {source!r}")
        object.__setattr__(self, name, str(source))
        return str(source)

    @property
    def exact_prediction(self) -> bool:
        return self.noise_sigma == 0 and self.bias == 1.0 and self.step_noise_from is None

    def describe(self, cost: CostModel | None = None) -> dict:
        """Every option; ``kv_memory``, ``warm_from``, ``loop_from`` and ``step_noise_from`` (with its block and pace) only when set
        (a run without them records what it always has). The noise source is described by its file (the same
        whatever the cost); given the run's ``cost``, with its residual buckets against that cost too."""
        noise_keys = ("step_noise_from", "step_noise_block_steps", "step_noise_pace_ms")
        left_out = ("kv_memory", "warm_from", "loop_from", *noise_keys)
        described = {k: v for k, v in asdict(self).items() if k not in left_out}
        if self.loop_from is not None:
            described["loop_from"] = engine_loop_of(self.loop_from).describe()
        if self.warm_from is not None:
            warm = read_step_samples(self.warm_from)
            described["warm_from"] = {"source": warm.source, "sha256": warm.sha256, "steps": warm.steps}
        if self.kv_memory is not None:
            described["kv_memory"] = self.kv_memory.describe()
        if self.step_noise_from is not None:
            described |= {k: getattr(self, k) for k in noise_keys}
            noise = (
                read_step_samples(self.step_noise_from)
                if cost is None
                else step_noise_from_file(self.step_noise_from, cost, self.step_noise_pace_ms)
            )
            described["step_noise"] = noise.describe()
        return described

    def label(self) -> str:
        """A short name for tables: only the options that differ from the defaults."""
        changed = [f"{k}={v}" for k, v in asdict(self).items() if k != "kv_memory" and v != getattr(DEFAULT_OPTIONS, k)]
        return ", ".join(changed) or "defaults"

    def actual_cost(self, cost: CostModel, noise_seed: int) -> CostModel:
        """The machine: ``cost`` itself, times lognormal noise and bias, or plus the measured noise of
        ``step_noise_from`` (its residuals against ``cost``, read once per process and cost)."""
        if self.exact_prediction:
            return cost
        seed = NOISE_SEED_OFFSET + noise_seed
        if self.step_noise_from is not None:
            noise = step_noise_from_file(self.step_noise_from, cost, self.step_noise_pace_ms)
            return EmpiricalNoiseCost(cost, noise, seed, self.step_noise_block_steps)
        return NoisyCost(cost, self.noise_sigma, seed=seed, bias=self.bias)

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
        takes ``cost`` x noise x bias, or ``cost`` plus a residual of ``step_noise_from``. With ``correction`` a deadline-aware policy gets a
        fresh calibrator per run (its state is the run's own), which first observes ``warm_from``'s steps where given.
        """
        calibrator = None
        if self.correction and policy.uses_deadlines:
            corrected = self_correcting(policy.cost, margin_form=self.margin_form)
            policy, calibrator = replace(policy, cost=corrected.cost, margin=corrected.margin), corrected.calibrator
            if self.warm_from is not None:
                warm_correction(calibrator, corrected.cost.base, self.warm_from)
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
            step_grid_tokens=self.step_grid_tokens,
            engine_loop=None if self.loop_from is None else engine_loop_of(self.loop_from).drawn(noise_seed),
        )


@functools.cache
def engine_loop_of(path: str) -> EngineLoop:
    """The engine loop of a step log, read once per process."""
    return EngineLoop.of_step_log(path)


DEFAULT_OPTIONS = EngineOptions()
