"""Run Vidur with sloweave's analytic iteration cost instead of its profiled predictors.

This file runs INSIDE Vidur's own virtual environment (``benchmarks/.vidur-venv``, created
by ``benchmarks/vidur_side_by_side.py``); it is not importable from the project's venv and
contains no Vidur code. It

1. defines ``AnalyticExecutionTimePredictorConfig`` (a subclass of Vidur's
   ``BaseExecutionTimePredictorConfig``, so Vidur's own command line grows
   ``--execution_time_predictor_config_type dummy`` and
   ``--analytic_execution_time_predictor_config_*`` coefficient flags) and
   ``AnalyticExecutionTimePredictor`` (a subclass of ``BaseExecutionTimePredictor``)
   and registers it in ``ExecutionTimePredictorRegistry`` under the key that Vidur declares
   but leaves unregistered (``ExecutionTimePredictorType.DUMMY``). Nothing is downloaded:
   the profile-based predictors, which fetch model profiles from the Hugging Face hub at
   start-up, are never constructed;
2. parses the remaining command line with Vidur's own ``SimulationConfig`` parser and runs
   ``vidur.simulator.Simulator`` exactly as ``python -m vidur.main`` does;
3. writes ``timing.json`` (import / set-up / event loop / output-writing seconds, iteration
   count) next to Vidur's outputs and prints one ``VIDUR_RESULT {json}`` line.

The cost model is the paper's (SPEC.md), in milliseconds, with n = decode tokens and
c = prefill tokens in the batch (summed over prompts):

    T(n, c) = base + 1[n>0] (decode_base + decode_per_req n) + 1[c>0] (prefill_base + prefill_per_token c)

evaluated term by term in the same order as ``sloweave.core.costs.analytic.AnalyticCost`` so that both
simulators see bit-identical iteration times. Vidur's ``ExecutionTime`` is a per-layer
breakdown multiplied by the layers per pipeline stage and converted to seconds; the
predictor reports the whole iteration as one component of a one-layer stage, which makes
Vidur's ``total_time`` exactly ``T(n, c) * 1e-3`` seconds (a split over several components
is summed in a different order by Vidur's native code and drifts by an ulp).
"""

# No `from __future__ import annotations`: Vidur's command-line builder reads the
# dataclass field types as real types.
import time

_T_START = time.perf_counter()

import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from vidur._native.entities import ExecutionTime as NativeExecutionTime  # noqa: E402
from vidur.config import BaseExecutionTimePredictorConfig, SimulationConfig  # noqa: E402
from vidur.execution_time_predictor import (  # noqa: E402
    BaseExecutionTimePredictor,
    ExecutionTimePredictorRegistry,
)
from vidur.simulator import Simulator  # noqa: E402
from vidur.types import ExecutionTimePredictorType  # noqa: E402
from vidur.utils.random import set_seeds  # noqa: E402
from vidur_timing import phase_seconds, report, time_output_writing  # noqa: E402 (beside this driver)

_T_IMPORTED = time.perf_counter()

ANALYTIC_KEY = ExecutionTimePredictorType.DUMMY  # declared by Vidur, registered by nobody


@dataclass
class AnalyticExecutionTimePredictorConfig(BaseExecutionTimePredictorConfig):
    """Coefficients of the analytic iteration cost, in milliseconds (SPEC.md defaults)."""

    base_ms: float = field(default=0.35, metadata={"help": "Per-iteration cost (ms)."})
    decode_base_ms: float = field(default=0.90, metadata={"help": "Cost when any decode runs (ms)."})
    decode_per_req_ms: float = field(default=0.055, metadata={"help": "Cost per decode token (ms)."})
    prefill_base_ms: float = field(default=0.40, metadata={"help": "Cost when any prefill runs (ms)."})
    prefill_per_token_ms: float = field(default=0.006, metadata={"help": "Cost per prefill token (ms)."})

    @staticmethod
    def get_type():
        return ANALYTIC_KEY


class AnalyticExecutionTimePredictor(BaseExecutionTimePredictor):
    """Whole-iteration analytic cost; no profiles, no training, no network."""

    def __init__(self, predictor_config, replica_config, cache_config) -> None:
        super().__init__(predictor_config, replica_config, cache_config)
        c = predictor_config
        self._coef = (c.base_ms, c.decode_base_ms, c.decode_per_req_ms, c.prefill_base_ms, c.prefill_per_token_ms)
        self.num_calls = 0

    def iteration_ms(self, n_decodes: int, prefill_tokens: int) -> float:
        base, decode_base, decode_per_req, prefill_base, prefill_per_token = self._coef
        t = base
        if n_decodes > 0:
            t += decode_base + decode_per_req * n_decodes
        if prefill_tokens > 0:
            t += prefill_base + prefill_per_token * prefill_tokens
        return t

    def get_execution_time(self, batch, pipeline_stage: int):
        # Batch.num_prefill_tokens sums the q tokens of requests whose prefill is not complete
        # (all prompts in the batch); every other request contributes one decode token.
        self.num_calls += 1
        c = batch.num_prefill_tokens
        n = batch.total_num_q_tokens - c
        t_ms = self.iteration_ms(n, c)
        zero = 0.0
        # One "layer" whose whole time is reported as the pipeline stage's add_time:
        # Vidur computes total_time = (block time * layers + 0 + 0) * 1e-3 = T(n, c) * 1e-3 s.
        return NativeExecutionTime(
            1, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, t_ms, zero, zero
        )

    # The per-operation hooks are abstract in Vidur's base class; this predictor answers for
    # the whole iteration in get_execution_time, so none of them is ever consulted.
    def _unused(self, batch) -> float:
        raise NotImplementedError("AnalyticExecutionTimePredictor predicts whole iterations")

    _get_attention_layer_pre_proj_execution_time = _unused
    _get_attention_layer_post_proj_execution_time = _unused
    _get_attention_rope_execution_time = _unused
    _get_attention_kv_cache_save_execution_time = _unused
    _get_attention_decode_execution_time = _unused
    _get_attention_prefill_execution_time = _unused
    _get_mlp_layer_up_proj_execution_time = _unused
    _get_mlp_layer_down_proj_execution_time = _unused
    _get_mlp_layer_act_execution_time = _unused
    _get_tensor_parallel_communication_time = _unused
    _get_pipeline_parallel_communication_time = _unused
    _get_mlp_norm_layer_act_execution_time = _unused
    _get_attn_norm_layer_act_execution_time = _unused
    _get_add_layer_act_execution_time = _unused
    _get_kv_parallel_communication_time = _unused


ExecutionTimePredictorRegistry.register(ANALYTIC_KEY, AnalyticExecutionTimePredictor)


def main() -> None:
    config = SimulationConfig.create_from_cli_args()
    if config.execution_time_predictor_config.get_type() != ANALYTIC_KEY:
        sys.exit("pass --execution_time_predictor_config_type dummy (the analytic predictor)")
    set_seeds(config.seed)
    t_config = time.perf_counter()

    simulator = Simulator(config)
    t_setup = time.perf_counter()

    write_seconds = time_output_writing(simulator)  # the event loop and the output writing, apart
    simulator.run()
    t_done = time.perf_counter()

    global_scheduler = simulator.scheduler
    predictor = None
    replica_limits = []
    for replica_scheduler in global_scheduler._replica_schedulers.values():
        predictor = replica_scheduler._execution_time_predictor
        replica_limits.append(
            {
                "max_batch_size": replica_scheduler._max_batch_size,
                "num_blocks": replica_scheduler._cache_config.num_blocks,
                "num_stages": replica_scheduler._num_stages,
            }
        )
    result = {
        "output_dir": config.metrics_config.output_dir,
        "iterations": predictor.num_calls if predictor is not None else None,
        **phase_seconds(_T_START, _T_IMPORTED, t_config, t_setup, t_done, write_seconds),
        "replicas": replica_limits,
        "end_time_s": simulator._time,
    }
    report(result, config.metrics_config.output_dir)


if __name__ == "__main__":
    main()
