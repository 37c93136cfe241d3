"""The plug-in scheduling real forward passes: outputs, deadlines from measured token times, targets."""

import math

from prometheus_client import REGISTRY

from sloweave.core.step_log import read_step_log
from sloweave.vllm_plugin.engine_driver import generate, scheduler_of

from real_engine import CPU_ANALYTIC, PLUGIN, cpu_engine, prompts


def within(low_ms: float, value_ms: float, high_ms: float) -> bool:
    """``low <= value <= high`` up to float rounding: times here are read from the scheduler's own
    clock (sloweave_clock_ms), the one the plug-in stamps with, so a sum of them differs from a
    stamp by a few units in the last place, whatever the machine's speed."""
    rounding = 8 * math.ulp(max(abs(low_ms), abs(value_ms), abs(high_ms)))
    return low_ms - rounding <= value_ms <= high_ms + rounding


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
    """Records, around the real scheduler, each plan with its inputs and each token's real time.

    Beside each plan it keeps the model's prediction for one size more than the chunk (one token,
    or one step of the size grid: the chunk is the policy's rounded down to it), taken right
    after planning (online correction changes the model once the step's time is back).
    """

    def __init__(self, scheduler) -> None:
        self.scheduler, self.plans, self.last_token_ms, self.targets = scheduler, [], {}, {}
        self.one_more_ms = []  # T(n, c + g) + delta(n, c + g) of each plan (g: the grid), as the policy saw it
        # when the call that returned each request's last token began: the plug-in stamps the
        # token somewhere inside that call, so its time lies in [call start, last_token_ms]
        self.token_call_start_ms = {}
        # each step that ran: its plan, the tokens vLLM scheduled, and when the call that returned
        # its output began and ended; with online correction, what the calibrator was fed
        self.ran, self.observed = [], []
        controller = scheduler.sloweave
        plan_step, update = controller.plan_step, scheduler.update_from_output
        grid_tokens = controller.grid.grid_tokens if controller.grid is not None else 1

        def logged_plan(state):
            plan = plan_step(state)
            self.plans.append((state, plan, dict(self.last_token_ms), dict(self.token_call_start_ms)))
            self.one_more_ms.append(
                controller.policy.predicted_ms(state.decode_tokens, plan.chunk_tokens + grid_tokens)
            )
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
            if scheduler_output.total_num_scheduled_tokens:
                self.ran.append((scheduler.last_plan, scheduler_output.total_num_scheduled_tokens, started_ms, now_ms))
            return outputs

        controller.plan_step, scheduler.update_from_output = logged_plan, logged_update
        correction = scheduler.sloweave_correction
        if correction is not None:
            observe = correction.calibrator.observe

            def logged_observe(n_decodes, chunk_tokens, base_ms, measured_ms):
                self.observed.append((n_decodes, chunk_tokens, base_ms, measured_ms))
                observe(n_decodes, chunk_tokens, base_ms, measured_ms)

            correction.calibrator.observe = logged_observe

    def requested_target_ms(self, request_id: str) -> float | None:
        """What the request asked for, if it is a usable target (None: the default)."""
        value = (self.scheduler.requests[request_id].sampling_params.extra_args or {}).get("sloweave_tpot_ms")
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    def target_ms(self, request_id: str, default_ms: float) -> float:
        return self.targets[request_id] or default_ms

    def check_budgets(self, default_ms: float, cap_tokens: int) -> tuple[int, int]:
        """Every plan's budget is the earliest deadline from real token times and each request's
        own target, and its chunk is the largest that fits it. Returns (plans with decodes, plans
        where the deadline held prompt tokens back: it cut the chunk below what the queue and the
        engine's cap allowed, or allowed none (infeasible), or allowed none for so long that aging
        forced one). How the binding plans split between the three depends on the machine's speed
        that minute (a slow one turns cut plans infeasible, then aged); their number does not."""
        checked = held_back = 0
        for (state, plan, last_token_ms, call_start_ms), one_more_ms in zip(self.plans, self.one_more_ms):
            if not state.decode_tokens:
                assert math.isinf(plan.budget_ms)
                continue
            # each token was stamped inside the call that returned it, on the clock read here around
            # that call: the earliest deadline lies between the one from those calls' starts and the
            # one from their ends (up to float rounding, whatever the calls took)
            earliest_ms = min(call_start_ms[r] + self.target_ms(r, default_ms) for r in state.decoding_ids)
            latest_ms = min(last_token_ms[r] + self.target_ms(r, default_ms) for r in state.decoding_ids)
            assert within(earliest_ms, state.now_ms + plan.budget_ms, latest_ms), (
                earliest_ms,
                state.now_ms + plan.budget_ms,
                latest_ms,
            )
            checked += 1
            if plan.aged:  # a prompt waited past aging_ms (a slow minute): its chunk is forced, by design
                assert 0 < plan.chunk_tokens <= self.scheduler.sloweave.aging.chunk_tokens
                held_back += 1
                continue
            if plan.infeasible:
                assert plan.chunk_tokens == 0
                held_back += state.pending_prompt_tokens > 0
                continue
            assert plan.predicted_ms <= plan.budget_ms + 1e-9  # the chunk fits the deadline...
            if plan.chunk_tokens < min(state.pending_prompt_tokens, cap_tokens - state.decode_tokens):
                assert one_more_ms > plan.budget_ms  # ...and is the largest that does (on the grid)
                held_back += 1
        return checked, held_back


def test_budgets_follow_deadlines_from_measured_token_times_and_per_request_targets(release):
    """The deadline holds prompt tokens back on every run, however fast the machine is that minute: the cost
    model is the fixed CPU prior (no online correction), which prices a full 2,048-token step
    above every target used here, so a chunk fits only by being cut to the deadline."""
    default_ms = 120.0
    engine = cpu_engine(PLUGIN, {"tpot_ms": default_ms, "analytic": CPU_ANALYTIC}, max_num_batched_tokens=2048)
    release(engine)
    log = StepLog(scheduler_of(engine))
    policy = scheduler_of(engine).sloweave.policy
    batch = prompts(24, seed=1, low=50, high=1800)
    # half the requests carry their own, tighter target (as vllm_xargs do over HTTP)
    extra = {rid: {"sloweave_tpot_ms": 30.0 + 2 * i} for i, rid in enumerate(batch) if i % 2}
    assert policy.predicted_ms(0, 2048) > max(t["sloweave_tpot_ms"] for t in extra.values())
    extra["r0"] = {"sloweave_tpot_ms": -1}  # a bad one: served with the default, nobody else harmed
    bad_before = REGISTRY.get_sample_value("sloweave_request_target_errors_total", {"engine": "0"}) or 0.0
    out = generate(engine, batch, max_tokens=30, extra_args=extra)
    assert all(len(tokens) == 30 for tokens in out.values())
    assert REGISTRY.get_sample_value("sloweave_request_target_errors_total", {"engine": "0"}) - bad_before == 1
    checked, held_back = log.check_budgets(default_ms, cap_tokens=2048)
    assert checked >= 20 and held_back >= 3
    assert any(log.target_ms(r, default_ms) < default_ms for s, *_ in log.plans for r in s.decoding_ids)


def test_online_correction_learns_from_the_steps_the_engine_ran_and_budgets_still_follow_deadlines(release):
    """With online correction the model becomes this machine's, so whether a deadline cuts a
    chunk, and how well the model predicts the next step, depend on the machine's load that
    minute. What holds on every run is checked: budgets from the deadlines, chunks the largest
    that fit, and every step that ran fed to the calibrator with its real tokens and time."""
    default_ms = 60.0
    engine = cpu_engine(
        PLUGIN,
        {"tpot_ms": default_ms, "analytic": CPU_ANALYTIC, "online_correction": True},
        max_num_batched_tokens=2048,
    )
    release(engine)
    log = StepLog(scheduler_of(engine))
    out = generate(engine, prompts(16, seed=2, low=50, high=1800), max_tokens=30)
    assert all(len(tokens) == 30 for tokens in out.values())
    checked, _ = log.check_budgets(default_ms, cap_tokens=2048)
    assert checked >= 20
    # a request emits at most one token a step, so 30 tokens each take at least 30 steps
    assert len(log.observed) == len(log.ran) >= 30
    for (n_decodes, chunk_tokens, base_ms, measured_ms), (plan, scheduled_tokens, started_ms, ended_ms) in zip(
        log.observed, log.ran
    ):
        assert n_decodes + chunk_tokens == scheduled_tokens  # what vLLM scheduled, not the plan's budget
        assert base_ms > 0
        # measured from the step's start to when its output came back inside that call
        assert within(started_ms, plan.start_ms + measured_ms, ended_ms), (
            started_ms,
            plan.start_ms + measured_ms,
            ended_ms,
        )
    calibrator = scheduler_of(engine).sloweave_correction.calibrator
    assert len(calibrator.recent_residuals) == len(log.observed)


def _scheduled_tokens_per_step(engine) -> list[int]:
    """Wraps the engine's scheduler: the tokens each non-empty step scheduled, in order."""
    scheduler, counts = scheduler_of(engine), []
    schedule = scheduler.schedule

    def counted(*args, **kwargs):
        output = schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            counts.append(output.total_num_scheduled_tokens)
        return output

    scheduler.schedule = counted
    return counts


def test_fixed_budget_rule_schedules_as_vllm_does_and_logs_every_step(release, tmp_path):
    """``budget_rule: fixed`` keeps vLLM's own token budget every step (the tuned baseline), so
    the engine schedules what vLLM's default scheduler does, token for token, while every step
    is planned, priced and written to the step log (the simulator's twin reads it)."""
    batch, log_file = prompts(10, seed=4, low=50, high=1500), tmp_path / "steps.jsonl"
    config = {"tpot_ms": 40.0, "analytic": CPU_ANALYTIC, "budget_rule": "fixed", "step_log": str(log_file)}
    runs = {}
    for name, cls, plugin_config in [("vllm", None, None), ("fixed", PLUGIN, config)]:
        engine = cpu_engine(cls, plugin_config)
        release(engine)
        counts = _scheduled_tokens_per_step(engine)
        runs[name] = (generate(engine, batch, max_tokens=16), counts)
        if cls is not None:
            scheduler = scheduler_of(engine)
            assert scheduler.sloweave.stats.steps == len(counts)
            scheduler.sloweave_step_log.close()
        engine.engine_core.shutdown()
    (vllm_out, vllm_counts), (fixed_out, fixed_counts) = runs["vllm"], runs["fixed"]
    assert fixed_out == vllm_out and all(len(tokens) == 16 for tokens in fixed_out.values())
    assert fixed_counts == vllm_counts and max(fixed_counts) == 512  # prompts were chunked at the budget
    steps = read_step_log(log_file).steps
    assert len(steps) == len(fixed_counts)
    assert (steps["token_budget"] <= 512).all() and (steps["token_budget"] == 512).any()
    assert list(steps["ran_decode_tokens"] + steps["ran_prefill_tokens"]) == fixed_counts
    assert steps["predicted_ms"].notna().all() and (steps["measured_ms"] > 0).all()
