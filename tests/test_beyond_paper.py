"""Options beyond the paper: aging, admission, cumulative deadlines, lookahead, KV memory,
context-aware cost, SLO tiers, and the `sloweave ablate` command.

Small cases are hand-computed with the paper's analytic cost:
T(n, c) = 0.35 + 1[n>0] (0.90 + 0.055 n) + 1[c>0] (0.40 + 0.006 c) ms.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.core.admission import AdmissionControl
from sloweave.core.costs.context_analytic import ContextAnalyticCost
from sloweave.sim.metrics import cumulative_slo_met, evaluate_run
from sloweave.sim.tiers import Tier, assign_tiers, default_tiers, tier_report
from sloweave.cli import main
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.sim.metrics import evaluate, per_request_frame
from sloweave.core.policy import Aging, SLOWeave, make_policy
from sloweave.sim.engine import simulate
from sloweave.sim.workloads import WORKLOADS, Workload

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
T = AnalyticCost()


def workload(arrival_s, prompt, output, tpot_ms=None) -> Workload:
    return Workload("hand", np.asarray(arrival_s, float), np.asarray(prompt), np.asarray(output), tpot_ms=tpot_ms)


# ----------------------------------------------------------------------------- aging


def starving_workload() -> Workload:
    # Request 0 decodes for 1000 iterations; request 1 (200-token prompt) arrives at 1 ms.
    return workload([0.0, 0.001], [10, 200], [1000, 5])


def test_without_aging_the_prompt_starves_until_the_decode_finishes():
    # TPOT 1.5 ms: decode-only takes T(1, 0) = 1.305 ms and even one prompt token needs 1.711 ms.
    result = simulate(starving_workload(), SLOWeave(), tpot_ms=1.5)
    assert result.slo_exceptions == ()
    assert result.first_token_iter[1] > 999  # only after request 0's last token (iteration 999)


def test_aging_forces_a_chunk_after_the_threshold_and_records_the_exception():
    result = simulate(starving_workload(), SLOWeave(), tpot_ms=1.5, aging=Aging(aging_ms=100.0, chunk_tokens=64))
    # Iteration 0 prefills request 0 (0.81 ms); iteration k >= 1 starts at 0.81 + (k - 1) 1.305 ms.
    # Request 1 arrived at 1 ms, so it has waited 100 ms at iteration 78 (start 101.295 ms).
    first, second = result.slo_exceptions[:2]
    assert (first.iteration, first.request, first.chunk_tokens) == (78, 1, 64)
    assert first.predicted_ms == pytest.approx(T(1, 64)) and first.budget_ms == 1.5
    assert first.affected == (0,)  # the running request whose 1.5 ms deadline the 2.089 ms iteration breaks
    assert result.iter_chunk_tokens[78] == 64 and result.iter_chunk_tokens[77] == 0
    # progress resets the clock: the next forced chunk comes 100 ms after iteration 78 ended
    assert second.iteration == 156
    # 200 tokens in 64-token pieces: four exceptions, then the prompt is done
    assert [e.chunk_tokens for e in result.slo_exceptions] == [64, 64, 64, 8]
    assert result.finished.all()


def test_aging_rule_itself():
    aging = Aging(aging_ms=50.0, chunk_tokens=32)
    assert aging.apply(0, 100, 49.9) == (0, False)
    assert aging.apply(0, 100, 50.0) == (32, True)
    assert aging.apply(0, 10, 60.0) == (10, True)  # never more than is waiting
    assert aging.apply(7, 100, 60.0) == (7, False)  # the policy found a chunk: nothing forced


# ----------------------------------------------------------------------------- admission


def burst(n=20, prompt=10, output=50) -> Workload:
    return workload([0.0] * n, [prompt] * n, [output] * n)


def test_admission_rejects_when_decodes_would_pass_the_tpot_target():
    # TPOT 2 ms, headroom 0.92: refuse when T(k, 0) = 1.25 + 0.055 k > 1.84, i.e. k >= 11 committed.
    control = AdmissionControl("reject", decode_headroom=0.92, ttft_slack=None)
    result = simulate(burst(), SLOWeave(), tpot_ms=2.0, admission=control)
    reasons = list(result.rejected_reason)
    assert reasons == [""] * 10 + ["decode_saturated"] * 10
    status = result.status()
    assert (status[:10] == "finished").all() and (status[10:] == "rejected").all()
    frame = per_request_frame(result)
    assert (frame["status"] == "rejected").sum() == 10
    assert evaluate(result, ttft_ms=1e6, tpot_ms=2.0).slo_met <= 10


def test_admission_defer_serves_the_refused_requests_later():
    control = AdmissionControl("defer", decode_headroom=0.92, ttft_slack=None)
    result = simulate(burst(), SLOWeave(), tpot_ms=2.0, admission=control)
    assert result.finished.all()
    assert list(result.deferred_reason) == [""] * 10 + ["decode_saturated"] * 10
    assert (result.rejected_reason == "").all()
    # the deferred ones start only after the admitted ones have left room
    assert result.first_token_iter[10:].min() > result.first_token_iter[:10].max()


def test_admission_rejects_a_request_whose_ttft_cannot_be_met():
    # Alone, a 4,000-token prompt takes T(0, 4000) = 24.75 ms > the 5 ms TTFT target; 100 tokens take 1.35 ms.
    wl = workload([0.0, 0.0], [100, 4000], [3, 3])
    result = simulate(
        wl, SLOWeave(), tpot_ms=25.0, admission=AdmissionControl("reject", decode_headroom=None), ttft_ms=5.0
    )
    assert list(result.rejected_reason) == ["", "ttft_unreachable"]
    assert list(result.status()) == ["finished", "rejected"]


@pytest.mark.parametrize("action", ["reject", "defer"])
def test_every_request_is_accounted_for_under_overload(action):
    spec = WORKLOADS["mixed"]
    wl = spec.generate(600, seed=1, rate_scale=1.5)
    result = simulate(
        wl,
        make_policy("sloweave"),
        tpot_ms=10.0,
        admission=AdmissionControl(action),
        ttft_ms=spec.ttft_ms,
        horizon_s=8.0,
    )
    status = result.status()
    assert set(status) <= {"finished", "rejected", "pending"}
    assert np.all((status == "rejected") == (result.rejected_reason != ""))
    if action == "reject":
        assert (status == "rejected").sum() > 0
        assert set(result.rejected_reason[status == "rejected"]) <= {
            "decode_saturated",
            "ttft_unreachable",
            "ttft_expired",
        }
    else:
        assert (status == "rejected").sum() == 0 and (result.deferred_reason != "").sum() > 0
    # a rejected request never ran
    assert np.all(result.first_token_iter[status == "rejected"] == -1)


def test_admission_raises_goodput_under_overload():
    spec = WORKLOADS["mixed"]
    wl = spec.generate(1000, seed=0)
    plain = evaluate(simulate(wl, SLOWeave(), tpot_ms=10.0), spec.ttft_ms, 10.0)
    admitted = evaluate(
        simulate(wl, SLOWeave(), tpot_ms=10.0, admission=AdmissionControl(), ttft_ms=spec.ttft_ms), spec.ttft_ms, 10.0
    )
    assert admitted.goodput_rps > 1.1 * plain.goodput_rps


# ----------------------------------------------------------------------------- deadline form


def test_cumulative_deadlines_bank_slack():
    # Request 0 (prompt 10) is prefilled in iteration 0 (0.81 ms); it then decodes alone at
    # 1.305 ms per iteration, banking 8.695 ms per 10 ms token. Request 1 (4,000 tokens) arrives
    # at 5 ms; iteration 5 starts at 0.81 + 4 x 1.305 = 6.03 ms.
    wl = workload([0.0, 0.005], [10, 4000], [1000, 5])
    per_token = simulate(wl, SLOWeave(), tpot_ms=10.0)
    cumulative = simulate(wl, SLOWeave(), tpot_ms=10.0, deadline_form="cumulative")
    assert per_token.iter_start_ms[5] == pytest.approx(6.03)
    assert per_token.iter_budget_ms[5] == 10.0
    assert per_token.iter_chunk_tokens[5] == 1382  # (10 - 1.305 - 0.4) / 0.006
    # cumulative: token 5 is due at t_first + 5 D = 50.81 ms, so the budget is 44.78 ms
    assert cumulative.iter_budget_ms[5] == pytest.approx(44.78)
    assert cumulative.iter_chunk_tokens[5] == 4000  # the whole prompt fits
    assert cumulative.finished.all()


def test_cumulative_deadlines_are_met_with_an_exact_model():
    spec = WORKLOADS["mixed"]
    wl = spec.generate(300, seed=4)
    result = simulate(wl, SLOWeave(), tpot_ms=25.0, deadline_form="cumulative")
    # every token k of a request comes out by t_first + k D
    for i in range(len(wl)):
        times = result.token_times_ms(i)
        due = times[0] + 25.0 * np.arange(len(times))
        assert np.all(times <= due + 1e-6)


def test_cumulative_slo_judge_agrees_with_a_per_token_check():
    spec = WORKLOADS["bursty"]
    wl = spec.generate(300, seed=1, rate_scale=2.0)
    for form in ("per-token", "cumulative"):
        result = simulate(wl, SLOWeave(), tpot_ms=10.0, deadline_form=form)
        frame = per_request_frame(result)
        fast = cumulative_slo_met(result, frame, spec.ttft_ms, 10.0)
        slow = np.zeros(len(wl), dtype=bool)
        for i in range(len(wl)):
            if frame.loc[i, "status"] == "finished" and frame.loc[i, "ttft_ms"] <= spec.ttft_ms + 1e-6:
                times = result.token_times_ms(i)
                slow[i] = np.all(times - times[0] - 10.0 * np.arange(times.size) <= 1e-6)
        assert np.array_equal(fast, slow)
        assert 0 < fast.sum() < len(wl)  # the case has both outcomes


# ----------------------------------------------------------------------------- lookahead


def test_lookahead_does_not_complete_a_prompt_the_next_iteration_cannot_afford():
    # Greedy takes all 100 tokens (T(10, 100) = 2.8 ms <= 10 ms) and completes the head, making
    # 11 decodes; T(11, 0) = 1.855 ms exceeds the next iteration's 1.83 ms budget.
    policy = SLOWeave(lookahead=True)
    assert policy.decide(10, 100, 10.0).chunk_tokens == 100
    assert (
        policy.decide_lookahead(
            10, 100, 10.0, head_remaining_tokens=100, next_fresh_budget_ms=1.83, banked=False
        ).chunk_tokens
        == 99
    )
    assert (
        policy.decide_lookahead(
            10, 100, 10.0, head_remaining_tokens=100, next_fresh_budget_ms=1.9, banked=False
        ).chunk_tokens
        == 100
    )


def test_lookahead_keeps_banked_slack_for_the_next_iteration():
    # Banked: next budget = 1.0 + (B - T(n, c)); decode-only next needs T(4, 0) = 1.47 ms,
    # so T(4, c) <= 10.001 + 1.0 - 1.47 = 9.531 ms: c <= (9.531 - 1.47 - 0.4) / 0.006 = 1276.8;
    # greedy: c <= (10.001 - 1.87) / 0.006 = 1355.2.
    policy = SLOWeave(lookahead=True)
    greedy = policy.decide(4, 3000, 10.001).chunk_tokens
    ahead = policy.decide_lookahead(
        4, 3000, 10.001, head_remaining_tokens=3000, next_fresh_budget_ms=1.0, banked=True
    ).chunk_tokens
    assert greedy == 1355 and ahead == 1276


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    n=st.integers(0, 200),
    waiting=st.integers(0, 6000),
    budget=st.floats(0.0, 60.0),
    head=st.integers(0, 6000),
    fresh=st.floats(0.5, 60.0),
    banked=st.booleans(),
)
def test_lookahead_never_yields_an_unsafe_chunk(n, waiting, budget, head, fresh, banked):
    policy = SLOWeave(lookahead=True)
    head = min(head, waiting)
    greedy = policy.decide(n, waiting, budget)
    ahead = policy.decide_lookahead(n, waiting, budget, head, fresh, banked)
    assert 0 <= ahead.chunk_tokens <= greedy.chunk_tokens
    if n > 0 and not ahead.infeasible:
        assert T(n, ahead.chunk_tokens) <= budget  # exact model: this iteration's deadline holds


def test_lookahead_policy_runs_in_the_simulator_and_meets_deadlines():
    wl = WORKLOADS["mixed"].generate(300, seed=2)
    result = simulate(wl, make_policy("sloweave+lookahead"), tpot_ms=10.0)
    assert result.policy_name == "sloweave+lookahead" and result.finished.all()
    feasible = ~result.iter_infeasible & np.isfinite(result.iter_budget_ms)
    duration = result.iter_end_ms - result.iter_start_ms
    assert np.all(duration[feasible] <= result.iter_budget_ms[feasible] + 1e-9)


# ----------------------------------------------------------------------------- KV memory


def test_kv_capacity_forces_preemption_and_counts_the_recompute():
    # Capacity 40 tokens. Both 10-token prompts start (iterations 0 and 1); the two decodes
    # then hold 23, 25, ... tokens and pass 40 at iteration 11: request 1, the newest, is
    # preempted after 10 tokens and recomputed (10 + 10 = 20 tokens) once request 0 is done.
    wl = workload([0.0, 0.0], [10, 10], [20, 20])
    result = simulate(wl, SLOWeave(), tpot_ms=25.0, kv_capacity_tokens=40)
    assert result.preemptions == 1 and result.recompute_tokens == 20
    assert result.token_segments == {1: [(1, 10), (20, 29)]}
    assert result.finished.all()
    assert len(result.token_times_ms(1)) == 20
    # request 1's recompute prefill: 20 tokens in iteration 20
    pieces = [
        (int(i), int(t))
        for i, r, t in zip(result.prefill_iter, result.prefill_request, result.prefill_tokens)
        if r == 1
    ]
    assert pieces == [(1, 10), (20, 20)]
    frame = per_request_frame(result)
    gaps = np.diff(result.iter_end_ms[[*range(1, 11), *range(20, 30)]])
    assert frame.loc[1, "max_tpot_ms"] == pytest.approx(gaps.max())
    assert frame.loc[1, "finish_ms"] == pytest.approx(result.iter_end_ms[29])
    row = evaluate_run(result, ttft_ms=1000.0)
    assert row["preemptions"] == 1 and row["recompute_tokens"] == 20


def test_kv_capacity_rejects_a_request_that_could_never_fit():
    wl = workload([0.0, 0.0], [30, 10], [20, 5])
    result = simulate(wl, SLOWeave(), tpot_ms=25.0, kv_capacity_tokens=40)
    assert list(result.rejected_reason) == ["exceeds_kv_capacity", ""]
    assert list(result.status()) == ["rejected", "finished"]


def test_kv_memory_keeps_every_token_on_a_real_workload():
    wl = WORKLOADS["long"].generate(150, seed=0)
    result = simulate(wl, SLOWeave(max_prefills=None), tpot_ms=25.0, kv_capacity_tokens=60_000)
    assert result.preemptions > 0 and result.finished.all()
    for i in range(len(wl)):
        assert len(result.token_times_ms(i)) == wl.output_tokens[i]
    # recompute prefills count: every prompt token once plus the recomputed tokens
    assert result.prefill_tokens.sum() == wl.prompt_tokens.sum() + result.recompute_tokens


# ----------------------------------------------------------------------------- context-aware cost


def test_simulator_feeds_the_running_kv_total_to_a_contextual_cost():
    wl = WORKLOADS["mixed"].generate(200, seed=5)
    seen = []
    cost = ContextAnalyticCost()
    original = cost.set_context
    cost.set_context = lambda d, p: (seen.append((d, p)), original(d, p))
    result = simulate(wl, SLOWeave(cost=cost), tpot_ms=25.0)
    first, out = result.first_token_iter, wl.output_tokens
    expected = np.zeros(result.num_iterations)
    for i in range(len(wl)):
        j = np.arange(first[i] + 1, first[i] + out[i])  # its decode iterations
        expected[j] += wl.prompt_tokens[i] + (j - first[i])  # prompt + tokens so far
    assert np.array_equal(np.array([d for d, _ in seen]), expected)
    # and the iteration time is the contextual model's
    d, p = seen[100]
    assert result.iter_end_ms[100] - result.iter_start_ms[100] == pytest.approx(
        cost.predict(int(result.iter_decodes[100]), int(result.iter_chunk_tokens[100]), d, p)
    )


def test_context_cost_grows_with_context_and_stays_monotone_in_the_chunk():
    cost = ContextAnalyticCost()
    assert cost.predict(10, 0, 0, 0) == pytest.approx(T(10, 0))
    assert cost.predict(10, 0, 100_000, 0) == pytest.approx(T(10, 0) + 1.03)
    # a 1,000-token chunk after a 4,000-token prefix: 1000 x 4500.5 pairs x 0.2 ms per million
    assert cost.predict(0, 1000, 0, 4000) == pytest.approx(T(0, 1000) + 0.2 * 1000 * 4500.5 / 1e6)
    values = [cost.predict(5, c, 50_000, 3000) for c in range(0, 4097, 64)]
    assert values == sorted(values)


# ----------------------------------------------------------------------------- tiers


def test_tiers_carry_per_request_targets_and_are_judged_against_them():
    wl = WORKLOADS["mixed"].generate(400, seed=0)
    tiered = assign_tiers(wl, default_tiers(2000.0), seed=0)
    assert set(tiered.workload.tpot_ms) == {10.0, 50.0}
    assert np.array_equal(tiered.ttft_ms, np.where(tiered.workload.tpot_ms == 10.0, 2000.0, 8000.0))
    result = simulate(tiered.workload, SLOWeave(), tpot_ms=25.0)
    report = tier_report(result, tiered).set_index("tier")
    frame = per_request_frame(result)
    batch = tiered.tier_of == 1
    expected = ((frame["ttft_ms"] <= 8000.0 + 1e-6) & (frame["p99_tpot_ms"] <= 50.0 + 1e-6))[batch].mean()
    assert report.loc["batch", "attainment"] == pytest.approx(expected)
    assert report["requests"].sum() == 400


def test_tier_assignment_is_seeded_and_checked():
    wl = WORKLOADS["chat"].generate(100, seed=0)
    a = assign_tiers(wl, default_tiers(1000.0), seed=3)
    b = assign_tiers(wl, default_tiers(1000.0), seed=3)
    assert np.array_equal(a.tier_of, b.tier_of)
    with pytest.raises(ValueError, match="add up to 1"):
        assign_tiers(wl, (Tier("a", 10, 1000, 0.5), Tier("b", 50, 1000, 0.3)), seed=0)
    with pytest.raises(ValueError, match="tpot_ms"):
        Tier("a", 0, 1000, 1.0)


# ----------------------------------------------------------------------------- determinism and bad input


def test_all_options_on_same_seed_same_results():
    spec = WORKLOADS["bursty"]

    def run():
        wl = spec.generate(300, seed=7)
        return simulate(
            wl,
            SLOWeave(max_prefills=None, lookahead=True, cost=ContextAnalyticCost()),
            tpot_ms=10.0,
            deadline_form="cumulative",
            aging=Aging(200.0),
            admission=AdmissionControl("defer"),
            ttft_ms=spec.ttft_ms,
            kv_capacity_tokens=50_000,
        )

    a, b = run(), run()
    assert np.array_equal(a.iter_end_ms, b.iter_end_ms)
    assert np.array_equal(a.first_token_iter, b.first_token_iter)
    assert np.array_equal(a.deferred_reason, b.deferred_reason)
    assert a.slo_exceptions == b.slo_exceptions and a.token_segments == b.token_segments


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"deadline_form": "absolute"}, ValueError, "deadline_form"),
        ({"kv_capacity_tokens": 0}, ValueError, "kv_capacity_tokens"),
        ({"kv_capacity_tokens": 1.5}, ValueError, "kv_capacity_tokens"),
        ({"aging": 100.0}, TypeError, "Aging"),
        ({"admission": AdmissionControl()}, ValueError, "needs ttft_ms"),
        ({"admission": AdmissionControl(), "ttft_ms": -1.0}, ValueError, "ttft_ms"),
        ({"admission": AdmissionControl(), "ttft_ms": [1.0, 2.0]}, ValueError, "one per request"),
        ({"deadline_form": "cumulative", "check_deadlines": True}, ValueError, "per-token"),
    ],
)
def test_bad_options_get_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        simulate(burst(3), SLOWeave(), tpot_ms=25.0, **kwargs)


def test_bad_option_objects():
    with pytest.raises(ValueError, match="aging_ms"):
        Aging(aging_ms=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        Aging(aging_ms=10, chunk_tokens=0)
    with pytest.raises(ValueError, match="action"):
        AdmissionControl("drop")
    with pytest.raises(ValueError, match="decode_headroom"):
        AdmissionControl(decode_headroom=-0.5)
    with pytest.raises(ValueError, match="at least one check"):
        AdmissionControl(decode_headroom=None, ttft_slack=None)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("sloweave+foresight")


# ----------------------------------------------------------------------------- the command


def test_ablate_command_writes_every_output(tmp_path):
    out = tmp_path / "ablation"
    result = CliRunner().invoke(
        main,
        [
            "ablate",
            "--quick",
            "--seeds",
            "1",
            "--requests",
            "80",
            "--workload",
            "mixed",
            "--config",
            "best",
            "--trace",
            str(FIXTURES / "azure_conv_first150.csv"),
            "--trace-window-s",
            "10",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    for name in (
        "ablation.csv",
        "ablation.md",
        "ablation.json",
        "ablation.png",
        "ablation_goodput.csv",
        "tiers.csv",
        "runs.csv",
    ):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "ablation.json").read_text())
    assert {row["config"] for row in summary["table"]} == {"greedy", "best"}
    assert {row["source"] for row in summary["table"]} == {"mixed", "azure-trace"}
    assert "goodput" in (out / "ablation.md").read_text()


def test_ablate_command_refuses_a_missing_trace(tmp_path):
    result = CliRunner().invoke(
        main, ["ablate", "--quick", "--seeds", "1", "--trace", str(tmp_path / "none.csv"), "--out", str(tmp_path)]
    )
    assert result.exit_code != 0 and "--no-trace" in result.output
