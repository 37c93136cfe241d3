"""The plug-in under vLLM's distributed execution, offline: what the CPU build cannot run.

Pipeline parallelism keeps several batches in flight (vLLM's batch queue holds one per
stage, each scheduled before the oldest one's output is back): the plug-in's bookkeeping
of planned steps must hold with a queue deeper than one. Data parallelism runs one
scheduler per replica: each must keep its own deadlines. (Tensor parallelism is one
scheduler per engine and runs for real in tests/vllm_engine/test_tensor_parallel.py.)
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.vllm_plugin import SLOWeaveAsyncScheduler, SLOWeaveScheduler
from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request

COST = AnalyticCost()


def engine(cls, depth: int, config=None) -> OfflineEngine:
    extra = {"sloweave": config} if config is not None else None
    scheduler = build_scheduler(cls, max_num_batched_tokens=8192, additional_config=extra)
    return OfflineEngine(scheduler, step_ms=lambda d, p: COST(d, p), overlap=depth > 0, in_flight=max(depth, 1))


def workload(seed: int, n: int = 24):
    rng = np.random.default_rng(seed)
    return [(int(p), int(o)) for p, o in zip(rng.integers(10, 5000, n), rng.integers(1, 40, n))]


def play(eng: OfflineEngine, requests, seed: int = 0) -> list:
    made = [make_request(p, o) for p, o in requests]
    for i, request in enumerate(made):
        if i % 4 == 0:
            eng.advance_to(eng.clock.now_ms + 15.0)
        eng.add(request)
        eng.step()
    eng.run()
    return made


@pytest.mark.parametrize("cls", [SLOWeaveScheduler, SLOWeaveAsyncScheduler])
@pytest.mark.parametrize("depth", [2, 3, 4])
def test_a_batch_queue_deeper_than_one_keeps_the_bookkeeping_aligned(cls, depth):
    eng = engine(cls, depth, {"tpot_ms": 20.0})
    requests = workload(depth)
    made = play(eng, requests)
    assert eng.finished == {r.request_id for r in made}
    for request, (_, out) in zip(made, requests):
        assert len(eng.token_times_ms[request.request_id]) == out
    scheduler = eng.scheduler
    assert not scheduler._planned_in_flight  # every planned step matched to its output
    assert not scheduler._faults_logged  # no step fell back to vLLM's budget
    assert not scheduler.sloweave._in_flight  # the controller's predicted steps all came back
    # the queue really filled: a step was scheduled while `depth` earlier ones awaited their output
    assert eng.deepest_queue == depth + 1
    for step in eng.steps:  # decodes never starved by the budget
        assert step.token_budget is None or step.token_budget >= step.decode_tokens


@pytest.mark.parametrize("depth", [2, 3])
def test_the_plugin_serves_what_vllms_scheduler_serves_at_the_same_depth(depth):
    requests = workload(10 + depth)
    ours, theirs = engine(SLOWeaveScheduler, depth, {"tpot_ms": 20.0}), engine(Scheduler, depth)
    mine, base = play(ours, requests), play(theirs, requests)
    assert [len(ours.token_times_ms[r.request_id]) for r in mine] == [
        len(theirs.token_times_ms[r.request_id]) for r in base
    ]


def test_data_parallel_replicas_keep_their_own_deadlines():
    """Two replicas (one scheduler each, as vLLM's data parallelism runs them): a tight
    target on one replica's requests never tightens the other's budget."""
    tight, loose = engine(SLOWeaveScheduler, 0, {"tpot_ms": 50.0}), engine(SLOWeaveScheduler, 0, {"tpot_ms": 50.0})
    for _ in range(3):
        tight.add(make_request(40, 30, tpot_ms=8.0))
        loose.add(make_request(40, 30))
    for replica in (tight, loose):
        replica.step()
        replica.add(make_request(9000, 2))
        replica.step()
    assert tight.scheduler.last_plan.budget_ms == pytest.approx(8.0, abs=1.0)
    assert loose.scheduler.last_plan.budget_ms > 40.0
    assert loose.steps[-1].prefill_tokens > tight.steps[-1].prefill_tokens
    tight.run()
    loose.run()
    assert len(tight.finished) == len(loose.finished) == 4


REPLICA = textwrap.dedent(
    """
    import sys
    from sloweave.core.costs.analytic import AnalyticCost
    from sloweave.vllm_plugin import SLOWeaveScheduler
    from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request
    rank, requests = int(sys.argv[1]), int(sys.argv[2])
    scheduler = build_scheduler(SLOWeaveScheduler, data_parallel=(rank, 2))
    eng = OfflineEngine(scheduler, step_ms=lambda d, p: AnalyticCost()(d, p))
    for _ in range(requests):
        eng.add(make_request(700, 3 * requests))  # replicas of different load take different steps
    eng.run()
    print(len(eng.steps))
    """
)


def test_each_replicas_metrics_carry_its_data_parallel_rank(tmp_path, monkeypatch):
    """Two replica processes (data parallelism runs one engine core per replica) write to one
    multiprocess directory; /metrics' registry shows each replica's counts apart."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    steps = {}
    for rank, requests in (("0", 1), ("1", 5)):
        done = subprocess.run(
            [sys.executable, "-c", REPLICA, rank, str(requests)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        steps[rank] = float(done.stdout.strip().splitlines()[-1])
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    registry = get_prometheus_registry()
    assert {rank: registry.get_sample_value("sloweave_steps_total", {"engine": rank}) for rank in steps} == steps
    assert steps["0"] != steps["1"]
