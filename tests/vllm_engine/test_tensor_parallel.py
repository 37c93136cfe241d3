"""The plug-in on the real CPU engine with tensor parallelism 2 (issue 16).

Tensor parallelism is one scheduler for the engine and one worker process per rank; the CPU
build binds each rank's threads to its own cores, which on a one-NUMA-node machine must be
given by hand (VLLM_CPU_OMP_THREADS_BIND, one core per rank here). Pipeline and data
parallelism do not run on this build (see the README); their scheduler-side behaviour is
tested offline in tests/vllm_plugin/test_parallel_vllm.py.
"""

import math

import pytest

from sloweave.vllm_plugin.engine_driver import generate, scheduler_of

from real_engine import CPU_ANALYTIC, PLUGIN, cpu_engine, prompts
from test_engine import StepLog


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # rank 0 on core 0, rank 1 on core 1


def test_tensor_parallel_2_outputs_match_vllm_and_budgets_follow_deadlines(two_ranks, release):
    batch = prompts(8, seed=3, low=50, high=1200)
    default_ms = 60.0
    outputs = {}
    for name, cls, config in [("vllm", None, None), ("sloweave", PLUGIN, {"tpot_ms": default_ms, "analytic": CPU_ANALYTIC, "online_correction": True})]:
        engine = cpu_engine(cls, config, tensor_parallel_size=2)
        release(engine)
        log = StepLog(scheduler_of(engine)) if cls is not None else None
        outputs[name] = generate(engine, batch, max_tokens=16)
        engine.engine_core.shutdown()
    assert all(len(tokens) == 16 for tokens in outputs["vllm"].values())
    assert outputs["sloweave"] == outputs["vllm"]
    checked = 0
    for state, plan, last_token_ms, call_start_ms in log.plans:
        if not state.decode_tokens:
            assert math.isinf(plan.budget_ms)
            continue
        # each token was stamped inside the call that returned it: the earliest deadline lies
        # between the one from those calls' starts and the one from their ends (0.5 ms slack
        # as in test_engine; two worker processes make the call itself take longer)
        earliest_ms = min(call_start_ms[r] + default_ms for r in state.decoding_ids)
        latest_ms = min(last_token_ms[r] + default_ms for r in state.decoding_ids)
        assert earliest_ms - 0.5 <= state.now_ms + plan.budget_ms <= latest_ms + 0.5
        if not plan.infeasible:
            assert plan.predicted_ms <= plan.budget_ms + 1e-9
        checked += 1
    assert checked >= 10
