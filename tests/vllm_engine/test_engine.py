"""The plug-in scheduling real forward passes: outputs, deadlines from measured token times, targets."""

import math

import numpy as np
import pytest
from prometheus_client import REGISTRY

from sloweave.vllm_plugin.engine_driver import generate, scheduler_of

from real_engine import CPU_ANALYTIC, PLUGIN, cpu_engine, prompts


def test_greedy_outputs_are_token_identical_to_vllms_default_scheduler(release):
    batch = prompts(12, seed=0)  # 20-1500 prompt tokens, chunked at 512
    outputs = {}
    for name, cls, config in [("vllm", None, None), ("sloweave", PLUGIN, {"tpot_ms": 40.0, "analytic": CPU_ANALYTIC})]:
        engine = cpu_engine(cls, config)
        release(engine)
        outputs[name] = generate(engine, batch, max_tokens=24)
        if cls is not None:  # the plug-in really chose budgets (chunks below vLLM's 512)
            controller = scheduler_of(engine).sloweave
            assert controller.stats.steps > 0
            assert any(chunk < 512 for chunk, *_ in controller.stats.recent)
        engine.engine_core.shutdown()
    assert all(len(tokens) == 24 for tokens in outputs["vllm"].values())
    assert outputs["sloweave"] == outputs["vllm"]


class StepLog:
    """Records, around the real scheduler, each plan with its inputs and each token's real time."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.plans, self.last_token_ms, self.targets = scheduler, [], {}, {}
        # when the call that returned each request's last token began: the plug-in stamps the
        # token somewhere inside that call, so its time lies in [call start, last_token_ms]
        self.token_call_start_ms = {}
        controller = scheduler.sloweave
        plan_step, update = controller.plan_step, scheduler.update_from_output

        def logged_plan(state):
            plan = plan_step(state)
            self.plans.append((state, plan, dict(self.last_token_ms), dict(self.token_call_start_ms)))
            for request_id in state.decoding_ids:
                self.targets.setdefault(request_id, self.requested_target_ms(request_id))
            return plan

        def logged_update(scheduler_output, runner_output):
            started_ms = scheduler.sloweave_clock_ms()
            outputs = update(scheduler_output, runner_output)
            now_ms = scheduler.sloweave_clock_ms()
            for engine_outputs in outputs.values():
                for out in engine_outputs.outputs:
                    if out.new_token_ids:
                        self.last_token_ms[out.request_id] = now_ms
                        self.token_call_start_ms[out.request_id] = started_ms
            return outputs

        controller.plan_step, scheduler.update_from_output = logged_plan, logged_update

    def requested_target_ms(self, request_id: str) -> float | None:
        """What the request asked for, if it is a usable target (None: the default)."""
        value = (self.scheduler.requests[request_id].sampling_params.extra_args or {}).get("sloweave_tpot_ms")
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    def target_ms(self, request_id: str, default_ms: float) -> float:
        return self.targets[request_id] or default_ms


def test_budgets_follow_deadlines_from_measured_token_times_and_per_request_targets(release):
    default_ms = 120.0
    engine = cpu_engine(PLUGIN, {"tpot_ms": default_ms, "analytic": CPU_ANALYTIC, "online_correction": True}, max_num_batched_tokens=2048)
    release(engine)
    log = StepLog(scheduler_of(engine))
    batch = prompts(24, seed=1, low=50, high=1800)
    # half the requests carry their own, tighter target (as vllm_xargs do over HTTP): below the
    # time of a full 2,048-token step on this CPU (about 65 ms), so the deadline must cut chunks
    extra = {rid: {"sloweave_tpot_ms": 30.0 + 2 * i} for i, rid in enumerate(batch) if i % 2}
    extra["r0"] = {"sloweave_tpot_ms": -1}  # a bad one: served with the default, nobody else harmed
    bad_before = REGISTRY.get_sample_value("sloweave_request_target_errors_total", {"engine": "0"}) or 0.0
    out = generate(engine, batch, max_tokens=30, extra_args=extra)
    assert all(len(tokens) == 30 for tokens in out.values())
    assert REGISTRY.get_sample_value("sloweave_request_target_errors_total", {"engine": "0"}) - bad_before == 1

    checked = tight = 0
    for state, plan, last_token_ms, _ in log.plans:
        if not state.decode_tokens:
            assert math.isinf(plan.budget_ms)
            continue
        # the earliest next-token deadline: each decode's last real token time + its own target
        deadline_ms = min(last_token_ms[r] + log.target_ms(r, default_ms) for r in state.decoding_ids)
        assert plan.budget_ms == pytest.approx(deadline_ms - state.now_ms, abs=0.5)
        if not plan.infeasible:
            assert plan.predicted_ms <= plan.budget_ms + 1e-9  # the chunk fits the deadline...
            if plan.chunk_tokens < min(state.pending_prompt_tokens, 2048 - state.decode_tokens):
                tight += 1  # ...and the deadline, not the queue or vLLM's cap, limited it
        checked += 1
    assert checked >= 20 and tight >= 3
    assert any(log.target_ms(r, default_ms) < default_ms for s, *_ in log.plans for r in s.decoding_ids)
    # online correction learned from the steps that ran: the corrected model's relative residuals
    # (measured / corrected prediction - 1, before any margin) are centred on this CPU's times
    residuals = np.array(scheduler_of(engine).sloweave_correction.calibrator.recent_residuals)
    assert len(residuals) >= 20 and np.median(np.abs(residuals[len(residuals) // 2 :])) < 0.5
