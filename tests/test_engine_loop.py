"""The engine loop between steps (core/costs/engine_loop.py) and the simulator's clock that adds it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.calibrated import self_correcting
from sloweave.core.costs.engine_loop import EngineLoop, EngineLoopError
from sloweave.core.policy import make_policy
from sloweave.core.step_log import FORMAT, STEP_FIELDS
from sloweave.sim.engine import simulate
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.sim.workloads import get_workload_spec


def test_a_loop_is_a_base_and_a_time_per_decode_fitted_to_the_gaps_no_step_holds():
    decodes = np.arange(100) % 40
    loop = EngineLoop.of_steps(decodes, 0.15 + 0.014 * decodes, "a log")
    assert loop.base_ms == pytest.approx(0.15) and loop.per_decode_ms == pytest.approx(0.014)
    assert loop.after_step(10) == pytest.approx(0.29) and loop.steps == 100
    with_unknown = EngineLoop.of_steps(decodes, np.where(decodes == 3, np.nan, 0.15 + 0.014 * decodes))
    assert with_unknown.steps == 97 and with_unknown.per_decode_ms == pytest.approx(0.014)  # unknown cycles left out
    # no engine's loop shrinks with more decodes, nor takes less than no time: the mean, and at least 0
    shrinking = EngineLoop.of_steps(decodes, 1.0 - 0.01 * decodes)
    assert shrinking.per_decode_ms == 0.0 and shrinking.base_ms == pytest.approx(np.mean(1.0 - 0.01 * decodes))
    assert EngineLoop.of_steps(decodes, -0.5 + 0.1 * decodes).base_ms == 0.0
    with pytest.raises(EngineLoopError, match="few.log: 19 steps with a known cycle, a loop needs 20"):
        EngineLoop.of_steps(decodes[:19], 0.2 + 0 * decodes[:19], "few.log")
    with pytest.raises(ValueError, match="per_decode_ms must be"):
        EngineLoop(0.1, math.nan)


def test_a_drawn_loop_adds_the_logs_own_residuals_seeded_and_never_below_zero():
    rng = np.random.default_rng(0)
    decodes = np.arange(2000) % 40
    measured = 0.15 + 0.014 * decodes + rng.exponential(0.1, decodes.size) - 0.1  # a skewed spread, mean zero
    loop = EngineLoop.of_steps(decodes, measured)
    first, again = loop.drawn(seed=5), loop.drawn(seed=5)
    draws = np.array([first.after_step(10) for _ in range(4000)])
    assert draws.tolist() == [again.after_step(10) for _ in range(4000)]  # the same seed, the same loops
    assert draws.mean() == pytest.approx(loop.after_step(10), abs=0.01)  # the fit is the mean
    assert np.percentile(draws, 99) > loop.after_step(10) + 0.3  # and the log's tail is kept
    assert EngineLoop(0.0, 0.0, residuals_ms=(-5.0,)).drawn(1).after_step(3) == 0.0
    assert EngineLoop(0.2, 0.0).drawn(1).after_step(3) == 0.2  # no residuals: the fit alone


def write_looped_log(path, steps: int = 300, loop_base_ms: float = 0.4, loop_per_decode_ms: float = 0.02) -> None:
    """A step log whose next step starts a loop of ``base + per decode`` after each step ends."""
    lines, start = [{"kind": "header", "format": FORMAT}], 0.0
    for i in range(steps):
        decodes, chunk = 1 + i % 30, 64 * (i % 4)
        step_ms = 2.0 + 0.05 * decodes + 0.01 * chunk
        values = dict.fromkeys(STEP_FIELDS, 0)
        values.update(step=i, start_ms=start, measured_ms=step_ms, decode_tokens=decodes, ran_decode_tokens=decodes,
                      chunk_tokens=chunk, ran_prefill_tokens=chunk, token_budget=2048, budget_ms=40.0, offer=[],
                      predicted_ms=step_ms, margin_ms=0.0, base_predicted_ms=step_ms, infeasible=False, aged=False)  # fmt: skip
        lines.append({"kind": "step", **values})
        start += step_ms + loop_base_ms + loop_per_decode_ms * decodes
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def test_a_served_runs_step_log_gives_its_loop(tmp_path):
    write_looped_log(tmp_path / "run.jsonl")
    loop = EngineLoop.of_step_log(tmp_path / "run.jsonl")
    assert loop.base_ms == pytest.approx(0.4) and loop.per_decode_ms == pytest.approx(0.02)
    assert loop.steps == 299  # the last step's cycle is not known
    assert loop.describe()["source"] == str(tmp_path / "run.jsonl")


def one_stream():
    return get_workload_spec("chat").generate(40, seed=3, rate_scale=0.3)


def test_the_clock_moves_on_by_the_loop_after_each_step_before_the_next_decision():
    workload, loop = one_stream(), EngineLoop(0.5, 0.1)
    policy = make_policy("sloweave", cost=AnalyticCost())
    plain = simulate(workload, policy, tpot_ms=25.0)
    looped = simulate(workload, policy, tpot_ms=25.0, engine_loop=loop)
    start, end, n = looped.iter_start_ms, looped.iter_end_ms, looped.iter_decodes
    straight_on = start[1:] < end[:-1] + loop.after_step(n[:-1]) + 1e-6  # not an idle wait for an arrival
    assert straight_on.any()
    gap = start[1:][straight_on] - end[:-1][straight_on]
    assert gap == pytest.approx(loop.after_step(n[:-1][straight_on]))
    assert np.all(plain.iter_start_ms[1:] >= plain.iter_end_ms[:-1])
    # the next decision's budget is what is left after the loop: the deadline is the last token's + TPOT
    decoding = straight_on & (n[1:] > 0) & (n[:-1] == n[1:])
    assert decoding.any()
    budget = looped.iter_budget_ms[1:][decoding]
    assert np.all(budget <= 25.0 - loop.after_step(n[:-1][decoding]) + 1e-6)


def test_the_correction_observes_the_step_alone_not_the_loop():
    """The served plug-in times a step from its schedule() to its update_from_output(): the loop is in
    none of its measurements, so an exact model stays exact however long the loop."""
    workload, cost = one_stream(), AnalyticCost()
    factors = {}
    for loop in (None, EngineLoop(3.0, 0.2)):
        corrected = self_correcting(cost)
        policy = make_policy("sloweave", cost=corrected.cost, margin=corrected.margin)
        simulate(workload, policy, tpot_ms=25.0, actual_cost=cost, correction=corrected.calibrator, engine_loop=loop)
        factors[loop] = [corrected.calibrator.factor(n, has_chunk) for n in (1, 4, 16) for has_chunk in (False, True)]
    assert factors[None] == pytest.approx([1.0] * 6) and factors[EngineLoop(3.0, 0.2)] == pytest.approx([1.0] * 6)


def test_engine_options_take_a_loop_from_a_served_runs_step_log(tmp_path):
    write_looped_log(tmp_path / "run.jsonl")
    options = EngineOptions(loop_from=str(tmp_path / "run.jsonl"))
    assert options.describe()["loop_from"]["base_ms"] == pytest.approx(0.4)
    assert "loop_from" not in DEFAULT_OPTIONS.describe()
    workload, policy = one_stream(), make_policy("sarathi-512", cost=AnalyticCost())
    looped = options.simulate(workload, policy, 25.0, 1000.0, AnalyticCost())
    plain = DEFAULT_OPTIONS.simulate(workload, policy, 25.0, 1000.0, AnalyticCost())
    assert looped.iter_end_ms[-1] > plain.iter_end_ms[-1]  # the same steps, with the loops between them
    with pytest.raises(ValueError, match="absent.jsonl"):
        EngineOptions(loop_from=str(tmp_path / "absent.jsonl"))
    with pytest.raises(ValueError, match="loop_from must be the path"):
        EngineOptions(loop_from="  ")


def test_the_command_line_takes_the_loop(tmp_path):
    from click.testing import CliRunner

    from sloweave.cli import main

    write_looped_log(tmp_path / "run.jsonl")
    result = CliRunner().invoke(main, ["simulate", "--requests", "40", "--loop-from", str(tmp_path / "run.jsonl")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["engine"]["loop_from"]["per_decode_ms"] == pytest.approx(0.02)
    refused = CliRunner().invoke(main, ["simulate", "--requests", "10", "--loop-from", str(tmp_path / "absent.jsonl")])
    assert refused.exit_code == 2 and "absent.jsonl" in refused.output


def test_the_budget_after_the_loop_is_the_per_token_trackers_for_shared_and_own_targets():
    """check_deadlines holds every budget against the core's DeadlineTracker fed with every token: after
    a loop the tracker's budget, read at the decision's clock, is the target less the loop."""
    workload = one_stream()
    policy = make_policy("sloweave", cost=AnalyticCost())
    loop = EngineLoop(0.7, 0.05, residuals_ms=(-0.3, 0.0, 0.4))
    simulate(workload, policy, tpot_ms=25.0, check_deadlines=True, engine_loop=loop.drawn(2))
    own = replace(workload, tpot_ms=np.where(np.arange(len(workload.arrival_s)) % 2 == 0, 15.0, 40.0))
    simulate(own, policy, tpot_ms=25.0, check_deadlines=True, engine_loop=loop.drawn(2))
