"""`sloweave served-run`: pictures and summaries of a served run from its step log."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.core.budget import StepPlan
from sloweave.core.step_log import StepLogWriter
from sloweave.observability.served_run import binned
from sloweave.studies import reproduce
from sloweave.studies.pictures import timeline_window

INF = math.inf
# (decodes, chunk, budget_ms, predicted_ms, margin_ms, infeasible, aged, late requests, ran (decode, prefill), measured_ms)
STEPS = [
    (8, 0, 20.0, 5.0, 0.5, False, False, 0, None, 4.0),  # decode only
    (8, 512, 20.0, 18.0, 1.0, False, False, 0, None, 19.5),  # underpredicted by 1.5
    (0, 2048, INF, 30.0, 2.0, False, False, 0, None, 28.0),  # nothing decoding: no deadline
    (8, 256, 15.0, 12.0, 1.0, False, False, 0, None, 12.0),  # exactly as predicted: not under
    (8, 256, 10.0, 14.0, 1.0, False, True, 3, None, 16.0),  # aged, 3 late, under by 2, over budget
    (8, 0, 3.0, 5.0, 0.5, True, False, 0, None, 5.5),  # infeasible, under by 0.5, over budget
    (8, 1024, 20.0, 19.0, 1.0, False, False, 0, (8, 0), 4.0),  # the engine ran no prefill
    (4, 128, 25.0, 9.0, 0.8, False, False, 0, None, 7.0),
]
START_MS = 5000.0  # the engine's monotonic clock at the first step


def write_log(path, steps=STEPS, max_steps=1000, loop_ms=0.0):
    writer = StepLogWriter(path, {"model": "tiny", "tpot_ms": 25.0}, max_steps=max_steps, clock_ms=lambda: START_MS)
    start_ms = START_MS
    for n, c, budget, predicted, margin, infeasible, aged, late, ran, measured in steps:
        plan = StepPlan(
            token_budget=n + c,
            chunk_tokens=c,
            start_ms=start_ms,
            scheduled_ms=start_ms,
            budget_ms=budget,
            predicted_ms=predicted,
            infeasible=infeasible,
            aged=aged,
            decode_tokens=n,
            margin_ms=margin,
        )
        writer.on_plan(plan, late, ran)
        writer.on_step_done(plan, measured, start_ms)
        start_ms += measured + loop_ms  # the engine loop's work before the next step
    writer.close()
    return path


def served_run(*args):
    return CliRunner().invoke(main, ["served-run", *map(str, args)])


def test_served_run_writes_every_file_with_the_numbers_the_steps_imply(tmp_path):
    out = tmp_path / "served"
    result = served_run(write_log(tmp_path / "steps.jsonl"), "--out", out)
    assert result.exit_code == 0, result.output
    for name in ("timeline.png", "predicted_vs_measured.png", "decomposition.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = json.loads((out / "served_run.json").read_text())
    assert summary["header"]["model"] == "tiny" and summary["settings"]["window_s"] is None  # the whole run
    assert summary["steps"] == 8
    assert (summary["decode_only_steps"], summary["with_chunk_steps"]) == (3, 5)  # step 6 ran no prefill
    assert summary["steps_without_deadline"] == 1 and summary["over_budget_steps"] == 2
    assert (summary["infeasible_steps"], summary["aged_steps"], summary["late_requests"]) == (1, 1, 3)
    assert summary["underpredicted_steps"] == 3 and summary["underpredicted_share"] == pytest.approx(3 / 8)
    spread = summary["measured_minus_predicted_ms"]
    assert spread["p50"] == pytest.approx(-0.5) and spread["max"] == pytest.approx(2.0)
    assert summary["stopped_early"] is False and summary["stopped_why"] is None
    assert summary["duration_s"] == pytest.approx(sum(s[-1] for s in STEPS) / 1000.0)


def test_decision_metrics_match_the_simulators_keys_and_the_plans(tmp_path):
    out = tmp_path / "served"
    assert served_run(write_log(tmp_path / "steps.jsonl"), "--out", out).exit_code == 0
    doc = json.loads((out / "decision_metrics.json").read_text())
    assert doc["source"] == "served" and doc["header"]["tpot_ms"] == 25.0
    metrics = doc["metrics"]
    assert metrics["sloweave_steps_total"] == 8
    assert metrics["sloweave_chunk_tokens"]["sum"] == sum(s[1] for s in STEPS)  # planned, not ran
    assert metrics["sloweave_token_budget_tokens"]["sum"] == sum(s[0] + s[1] for s in STEPS)
    assert metrics["sloweave_time_budget_ms"]["count"] == 7  # the +inf step has no deadline
    assert metrics["sloweave_time_budget_ms"]["sum"] == pytest.approx(113.0)
    assert metrics["sloweave_infeasible_steps_total"] == 1
    assert metrics["sloweave_slo_exceptions_total"] == 1 and metrics["sloweave_slo_exception_requests_total"] == 3
    assert metrics["sloweave_underpredicted_steps_total"] == 3
    assert metrics["sloweave_margin_ms"]["sum"] == pytest.approx(sum(s[4] for s in STEPS))
    assert metrics["sloweave_measured_step_ms"]["sum"] == pytest.approx(sum(s[-1] for s in STEPS))
    # the same metric names a simulated run writes
    simulated = tmp_path / "sim"
    result = CliRunner().invoke(main, ["simulate", "--requests", "40", "--policy", "sloweave", "--out", str(simulated)])
    assert result.exit_code == 0, result.output
    assert set(json.loads((simulated / "decision_metrics.json").read_text())["metrics"]) <= set(metrics)


def test_steps_csv_has_the_derived_columns(tmp_path):
    out = tmp_path / "served"
    assert served_run(write_log(tmp_path / "steps.jsonl"), "--out", out).exit_code == 0
    steps = pd.read_csv(out / "steps.csv")
    starts_ms = START_MS + np.concatenate([[0.0], np.cumsum([s[-1] for s in STEPS])[:-1]])
    assert np.allclose(steps["t_s"], (starts_ms - START_MS) / 1000.0)
    assert np.allclose(steps["model_ms"], [s[3] - s[4] for s in STEPS])
    assert np.allclose(steps["overrun_ms"], [s[-1] - s[3] for s in STEPS])
    assert steps["underpredicted"].tolist() == [False, True, False, False, True, True, False, False]
    assert math.isinf(steps["budget_ms"][2])


def test_the_engine_loop_between_steps_is_measured_and_the_cycles_written_as_a_profile(tmp_path):
    """The time from one step's end to the next one's start, while requests run, is the engine's too:
    served-run measures it and writes each step's cycle as the profile a twin of the engine fits."""
    from sloweave.core.costs.step_profiles import read_profile

    out = tmp_path / "served"
    assert served_run(write_log(tmp_path / "steps.jsonl", loop_ms=0.5), "--out", out).exit_code == 0
    loop = json.loads((out / "served_run.json").read_text())["engine_loop"]
    # the step before the one with nothing decoding (its gap may be idle) and the last are not known
    assert loop["steps_with_a_known_cycle"] == 6
    assert loop["loop_ms"]["p50"] == pytest.approx(0.5) and loop["loop_ms"]["max"] == pytest.approx(0.5)
    known = [i for i in range(len(STEPS)) if i not in (1, len(STEPS) - 1)]
    assert loop["share_of_cycle_time"] == pytest.approx(3.0 / sum(STEPS[i][-1] + 0.5 for i in known))
    steps = pd.read_csv(out / "steps.csv")
    assert steps["loop_ms"].isna().tolist() == [i not in known for i in range(len(STEPS))]
    cycles = read_profile(out / "cycles.csv")
    assert cycles["step_ms"].tolist() == pytest.approx([STEPS[i][-1] + 0.5 for i in known])
    assert json.loads((out / "served_run.json").read_text())["cycles_profile"] == "cycles.csv"


def test_a_log_without_a_known_cycle_writes_no_cycles_profile(tmp_path):
    out = tmp_path / "served"
    assert served_run(write_log(tmp_path / "steps.jsonl", steps=STEPS[:1]), "--out", out).exit_code == 0
    summary = json.loads((out / "served_run.json").read_text())
    assert summary["engine_loop"] == {"steps_with_a_known_cycle": 0, "loop_ms": None, "share_of_cycle_time": None}
    assert summary["cycles_profile"] is None and not (out / "cycles.csv").exists()


def test_out_is_refused_when_not_empty_and_replaced_with_force(tmp_path):
    log = write_log(tmp_path / "steps.jsonl")
    out = tmp_path / "served"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused = served_run(log, "--out", out)
    assert refused.exit_code != 0 and "not empty" in refused.output and "--force" in refused.output
    assert (out / "keep.txt").read_text() == "mine" and not (out / "served_run.json").exists()
    forced = served_run(log, "--out", out, "--force")
    assert forced.exit_code == 0, forced.output
    assert not (out / "keep.txt").exists() and (out / "served_run.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served", "steps.jsonl"]  # no staging folders left


def test_force_never_deletes_the_folder_holding_the_log(tmp_path):
    log = write_log(tmp_path / "steps.jsonl")
    result = served_run(log, "--out", tmp_path, "--force")
    assert result.exit_code != 0 and "holds the step log" in result.output
    assert log.exists()


def test_a_bad_line_names_the_line_and_leaves_no_folder(tmp_path):
    log = write_log(tmp_path / "steps.jsonl")
    with open(log, "a") as f:
        f.write("{not json\n")
    out = tmp_path / "served"
    result = served_run(log, "--out", out)
    assert result.exit_code != 0 and "line 10" in result.output  # header + 8 steps, then the bad line
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]


def test_a_step_without_a_measured_time_is_refused_before_anything_is_written(tmp_path):
    log = write_log(tmp_path / "steps.jsonl")
    lines = log.read_text().splitlines()
    step = json.loads(lines[3])
    step["measured_ms"] = None
    lines[3] = json.dumps(step)
    log.write_text("\n".join(lines) + "\n")
    result = served_run(log, "--out", tmp_path / "served")
    assert (
        result.exit_code != 0
        and "steps.jsonl, line 4: measured_ms must be a finite number of milliseconds >= 0" in result.output
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]  # complete or absent


def test_an_empty_log_is_a_clear_error(tmp_path):
    log = write_log(tmp_path / "steps.jsonl", steps=[])
    result = served_run(log, "--out", tmp_path / "served")
    assert result.exit_code != 0 and "has no steps" in result.output
    assert not (tmp_path / "served").exists()


def test_a_stopped_log_is_reported(tmp_path):
    out = tmp_path / "served"
    result = served_run(write_log(tmp_path / "steps.jsonl", max_steps=5), "--out", out)
    assert result.exit_code == 0, result.output
    assert "stopped early" in result.output
    summary = json.loads((out / "served_run.json").read_text())
    assert summary["steps"] == 5 and summary["stopped_early"] is True and "max_steps (5)" in summary["stopped_why"]


def test_many_steps_are_binned_into_means_and_no_deadline_is_no_budget():
    n = 1000
    steps = pd.DataFrame(
        {
            "step": np.arange(n),
            "model_ms": np.arange(n, dtype=float),
            "margin_ms": np.ones(n),
            "overrun_ms": np.where(np.arange(n) % 2 == 0, 4.0, -4.0),
            "budget_ms": np.where(np.arange(n) < 3, [10.0, INF, 20.0] + [0.0] * (n - 3), 30.0),
        }
    )
    parts, per_point = binned(steps, max_points=400)
    assert per_point == 3 and len(parts) == 334
    assert parts["model_ms"].iloc[0] == pytest.approx(1.0) and parts["step"].iloc[0] == 1.0  # mean of steps 0, 1, 2
    assert parts["overrun_ms"].iloc[0] == pytest.approx(8.0 / 3)  # only the positive overruns count
    assert parts["budget_ms"].iloc[0] == pytest.approx(15.0)  # the +inf step is left out, not averaged in
    few, one = binned(steps.head(10), max_points=400)
    assert one == 1 and len(few) == 10


def test_the_timeline_window_skips_the_warm_up():
    t_s = np.arange(0.0, 30.0, 0.5)
    keep = timeline_window(t_s, window_s=5.0)
    assert t_s[keep].min() == 5.0 and t_s[keep].max() == 9.5
    short = np.arange(0.0, 3.0, 0.5)  # a short run skips a third of itself
    assert timeline_window(short, window_s=5.0).tolist() == [False] * 2 + [True] * 4
    # a served run is drawn from its first step
    assert timeline_window(short, window_s=math.inf, skip_warmup=False).all()


def test_the_simulators_timeline_is_drawn_from_its_iterations(tmp_path, monkeypatch):
    from sloweave.core.policy import SLOWeave
    from sloweave.sim.engine import simulate
    from sloweave.sim.workloads import get_workload_spec

    result = simulate(get_workload_spec("mixed").generate(60, seed=1), SLOWeave(), tpot_ms=25.0)
    reproduce.plot_chunk_timeline(result, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    seen = {}
    monkeypatch.setattr(reproduce, "plot_step_timeline", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    reproduce.plot_chunk_timeline(result, tmp_path / "again.png", window_s=2.0)
    t_s, chunk, step_ms, budget_ms = seen["args"]
    assert np.array_equal(t_s, result.iter_start_ms / 1000.0) and np.array_equal(chunk, result.iter_chunk_tokens)
    assert np.array_equal(step_ms, result.iter_end_ms - result.iter_start_ms)
    assert np.array_equal(budget_ms, result.iter_budget_ms)
    assert seen["kwargs"]["window_s"] == 2.0 and seen["kwargs"]["xlabel"] == "simulated time (s)"
