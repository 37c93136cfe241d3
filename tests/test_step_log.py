"""The step log's file: written by any engine's controller, read back line by line with errors that name the line."""

import json
import math
import os

import pytest

from sloweave.core.budget import StepPlan
from sloweave.core.step_log import FORMAT, STEP_FIELDS, StepLogError, StepLogWriter, read_step_log


def plan(chunk: int, budget_ms: float = 20.0) -> StepPlan:
    return StepPlan(
        4 + chunk, chunk, 0.0, 0.0, budget_ms, 5.0, False, False, 4, margin_ms=1.0, pending_prompt_tokens=chunk
    )


def written(path, plans, max_steps=100):
    writer = StepLogWriter(path, {"engine": "0"}, max_steps, clock_ms=lambda: 1000.0)
    for i, p in enumerate(plans):
        writer.on_plan(p, 0, (4, p.chunk_tokens))
        writer.on_step_done(p, 6.0, started_ms=10.0 * i)
    writer.close()
    return path


def test_what_is_written_reads_back_with_no_deadline_as_inf(tmp_path):
    log = read_step_log(written(tmp_path / "s.jsonl", [plan(0), plan(128, math.inf)]))
    assert log.header["format"] == FORMAT and log.header["engine"] == "0" and log.stopped is None
    assert list(log.steps.columns) == list(STEP_FIELDS)
    assert log.steps["start_ms"].tolist() == [0.0, 10.0] and log.steps["ran_prefill_tokens"].tolist() == [0, 128]
    assert log.steps["budget_ms"].tolist() == [20.0, math.inf] and log.steps["base_predicted_ms"].isna().all()


def test_a_step_the_engine_never_returned_is_skipped_not_paired_with_the_next(tmp_path):
    writer = StepLogWriter(tmp_path / "s.jsonl", {}, clock_ms=lambda: 0.0)
    lost, kept = plan(64), plan(32)
    writer.on_plan(lost, 0)
    writer.on_plan(kept, 0)
    writer.on_step_done(kept, 7.0, 1.0)
    writer.close()
    steps = read_step_log(tmp_path / "s.jsonl").steps
    assert steps["chunk_tokens"].tolist() == [32] and steps["measured_ms"].tolist() == [7.0]


def test_the_log_stops_at_its_bound_and_says_why(tmp_path):
    log = read_step_log(written(tmp_path / "s.jsonl", [plan(1)] * 5, max_steps=2))
    assert len(log.steps) == 2 and log.stopped == "max_steps (2) reached"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to fill a disk")
def test_a_full_disk_stops_the_log_and_not_the_engine(caplog):
    writer = StepLogWriter("/dev/full", {}, clock_ms=lambda: 0.0)
    writer.on_plan(plan(1), 0)
    writer.on_step_done(plan(1), 1.0)  # nothing raised
    assert not writer.open and "cannot write" in caplog.text


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], "first line must be its header"),
        (['{"kind": "step"}'], "first line must be its header"),
        (['{"kind": "header", "format": 99}'], "format 99"),
        (['{"kind": "header", "format": 1}', "not json"], "line 2: not a JSON object"),
        (['{"kind": "header", "format": 1}', "[1, 2]"], "line 2: not a JSON object"),
        (['{"kind": "header", "format": 1}', '{"kind": "step", "step": NaN}'], "line 2: not a JSON object"),
        (['{"kind": "header", "format": 1}', '{"kind": "step", "step": 0}'], "line 2: a step needs the fields"),
        (['{"kind": "header", "format": 1}', '{"kind": "other"}'], "line 2: unexpected 'other' line"),
    ],
)
def test_a_file_that_is_not_a_step_log_is_refused_naming_the_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(StepLogError, match=message):
        read_step_log(path)


def test_a_step_after_the_stop_line_is_refused(tmp_path):
    path = written(tmp_path / "s.jsonl", [plan(1)] * 3, max_steps=1)
    extra = json.dumps({"kind": "step", **dict.fromkeys(STEP_FIELDS, 0)})
    path.write_text(path.read_text() + extra + "\n")
    with pytest.raises(StepLogError, match="line 4: unexpected 'step' line"):
        read_step_log(path)


def test_a_step_log_is_a_profile_of_the_steps_that_ran(tmp_path):
    """`sloweave fit` and `--cost` read a served engine's log: a profile taken while serving."""
    from sloweave.core.costs.analytic import AnalyticCost
    from sloweave.core.costs.profile_fit import fit_profile_file
    from sloweave.core.costs.step_profiles import read_profile

    cost = AnalyticCost()
    writer = StepLogWriter(tmp_path / "served.jsonl", {}, clock_ms=lambda: 0.0)
    shapes = [(n, c) for n in (0, 2, 8, 32) for c in (0, 64, 256, 1024) if n or c] * 3
    for i, (n, c) in enumerate(shapes):
        step = StepPlan(n + c, c, 0.0, 0.0, 50.0, 1.0, False, False, n, decode_kv_tokens=100 * n)
        ran_decodes = n - (i % 2 and n > 0)  # vLLM ran one decode fewer than planned on odd steps
        writer.on_plan(step, 0, (ran_decodes, c))
        writer.on_step_done(step, 1.5 * cost(ran_decodes, c), started_ms=float(i))
    writer.close()
    profile = read_profile(tmp_path / "served.jsonl")
    assert profile["n_decodes"].tolist() == [n - (i % 2 and n > 0) for i, (n, c) in enumerate(shapes)]
    assert profile["chunk_tokens"].tolist() == [c for _, c in shapes]
    # the KV context of the decodes that ran: 100 tokens each
    assert (profile["decode_kv_tokens"] == 100 * profile["n_decodes"]).all()
    fitted = fit_profile_file(tmp_path / "served.jsonl", holdout_share=0.0).cost("regression")
    for n, c in ((4, 512), (16, 0), (0, 2048)):
        assert fitted.predict(n, c, 100 * n, 0) == pytest.approx(1.5 * cost(n, c), rel=0.02)


def test_a_bad_step_log_is_a_profile_error_naming_the_line(tmp_path):
    from sloweave.core.costs.step_profiles import ProfileError, read_profile

    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "header", "format": 1}\nnot json\n')
    with pytest.raises(ProfileError, match="line 2: not a JSON object"):
        read_profile(path)


def test_sloweave_fit_reads_a_step_log(tmp_path):
    from click.testing import CliRunner

    from sloweave.cli import main

    writer = StepLogWriter(tmp_path / "served.jsonl", {}, clock_ms=lambda: 0.0)
    for i, (n, c) in enumerate([(n, c) for n in (1, 4, 16) for c in (0, 128, 512)] * 2):
        step = StepPlan(n + c, c, 0.0, 0.0, 50.0, 1.0, False, False, n)
        writer.on_plan(step, 0, (n, c))
        writer.on_step_done(step, 2.0 + 0.1 * n + 0.01 * c + 0.001 * i, started_ms=float(i))
    writer.close()
    result = CliRunner().invoke(main, ["fit", str(tmp_path / "served.jsonl")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["report"]["fit_steps"] + json.loads(result.stdout)["report"]["holdout_steps"] == 18


def test_each_step_records_its_prompts_on_offer_one_by_one(tmp_path):
    step = StepPlan(
        4 + 300, 300, 0.0, 0.0, 20.0, 5.0, False, False, 4,
        pending_prompt_tokens=1100, offer=((900, 128), (200, 0)),
    )  # fmt: skip
    steps = read_step_log(written(tmp_path / "s.jsonl", [step, plan(0)])).steps
    assert steps["offer"].tolist() == [[[900, 128], [200, 0]], []]


def test_a_format_1_log_without_offers_still_reads(tmp_path):
    path = written(tmp_path / "s.jsonl", [plan(64)])
    header, line = (json.loads(text) for text in path.read_text().splitlines())
    header["format"] = 1
    del line["offer"]
    path.write_text(json.dumps(header) + "\n" + json.dumps(line) + "\n")
    steps = read_step_log(path).steps
    assert steps["chunk_tokens"].tolist() == [64] and steps["offer"].tolist() == [None]


@pytest.mark.parametrize(
    "offer, message",
    [
        ([[100, 0]], "offer must be a list of 0 prompts"),
        ("none", "offer must be a list of 0 prompts"),
    ],
)
def test_an_offer_that_does_not_match_its_count_is_refused(tmp_path, offer, message):
    path = written(tmp_path / "s.jsonl", [plan(0)])
    header, line = (json.loads(text) for text in path.read_text().splitlines())
    line["offer"] = offer
    path.write_text(json.dumps(header) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(StepLogError, match=f"line 2: {message}"):
        read_step_log(path)


@pytest.mark.parametrize("prompt", [[0, 0], [10, -1], [10], [10.5, 0], [True, 0], "10,0"])
def test_a_prompt_on_offer_that_is_not_tokens_and_computed_tokens_is_refused(tmp_path, prompt):
    path = written(tmp_path / "s.jsonl", [plan(0)])
    header, line = (json.loads(text) for text in path.read_text().splitlines())
    line.update(offer=[prompt], prompts_on_offer=1)
    path.write_text(json.dumps(header) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(StepLogError, match="line 2: each prompt on offer must be"):
        read_step_log(path)


def served_log(path, steps):
    """A log of (decodes, chunk, prefix, offer, measured ms) steps, each run as planned."""
    writer = StepLogWriter(path, {}, clock_ms=lambda: 0.0)
    for i, (n, c, prefix, offer, measured_ms) in enumerate(steps):
        step = StepPlan(
            n + c, c, 0.0, 0.0, 50.0, 1.0, False, False, n,
            decode_kv_tokens=100 * n, prefill_prefix_tokens=prefix, offer=offer,
        )  # fmt: skip
        writer.on_plan(step, 0, (n, c))
        writer.on_step_done(step, measured_ms, started_ms=float(i))
    writer.close()
    return path


def test_a_chunk_over_several_prompts_keeps_the_prompts_it_was_taken_from(tmp_path):
    from sloweave.core.costs.step_profiles import read_profile

    path = served_log(
        tmp_path / "s.jsonl",
        [
            (4, 300, 128, ((900, 128), (200, 0)), 5.0),  # within the first prompt: one piece
            (4, 1000, 128, ((900, 128), (200, 0), (700, 0)), 9.0),  # the first's rest, then 100 of the second
            (0, 1200, 0, ((900, 0), (200, 64)), 9.0),  # past the offer: the rest as a prompt of its own
            (4, 0, 0, (), 3.0),
        ],
    )
    profile = read_profile(path)
    assert profile["offer"].tolist() == ["", "900:128;200:0", "900:0;200:64;100:0", ""]


def test_a_fit_to_a_served_log_prices_each_prompts_piece_of_a_chunk(tmp_path):
    """About half of a tuned budget's chunks on vLLM's CPU build span two prompts: taken for one piece,
    their attention pairs are overcounted and the fit prices a large chunk of one prompt low."""
    from sloweave.core.costs.fitted import REGRESSION_TERMS, RegressionCost
    from sloweave.core.costs.profile_fit import fit_profile_file

    true = RegressionCost([2.0, 0.5, 0.05, 1.0, 0.012, 0.01, 0.0, 14.0, 14.0, 0.0])
    steps = []
    for n in (0, 4, 16):
        for c in (256, 512, 1024, 2048):
            for prefix in (0, 512):
                # one prompt, or the last quarter of one prompt and the start of the next
                for offer in (((c + 1, prefix), (4096, 0)), ((c // 4, prefix), (4096, 0))):
                    true.set_offer(offer)
                    steps.append((n, c, prefix, offer, true.predict(n, c, 100 * n, prefix)))
    true.set_offer(None)
    path = served_log(tmp_path / "served.jsonl", steps)
    fitted = fit_profile_file(path, holdout_share=0.0).cost("regression")
    pairs = [REGRESSION_TERMS.index("per_1m_chunk_pairs_ms"), REGRESSION_TERMS.index("per_1m_prefix_pairs_ms")]
    assert fitted.coefficients[pairs] == pytest.approx([14.0, 14.0], rel=1e-6)
    for n, c, prefix in ((0, 2048, 0), (16, 1536, 512)):
        assert fitted.predict(n, c, 100 * n, prefix) == pytest.approx(true.predict(n, c, 100 * n, prefix), rel=1e-6)
    # the same steps without the prompts they spanned (a format 1 log): a 2,048-token chunk priced 10 % low
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines[1:], start=1):
        step = json.loads(line)
        step.update(offer=[], prompts_on_offer=0)
        lines[i] = json.dumps(step)
    path.write_text("\n".join(lines) + "\n")
    blind = fit_profile_file(path, holdout_share=0.0).cost("regression")
    assert blind.predict(0, 2048, 0, 0) < 0.9 * true.predict(0, 2048, 0, 0)


def steps_frame(rows):
    """(step, start_ms, measured_ms, decode_tokens) rows as the reader's steps."""
    import pandas as pd

    return pd.DataFrame(rows, columns=["step", "start_ms", "measured_ms", "decode_tokens"])


def test_a_steps_cycle_runs_to_the_next_steps_start_while_the_engine_goes_straight_on():
    from sloweave.core.step_log import cycle_ms

    steps = steps_frame(
        [
            (1, 0.0, 5.0, 4),
            (2, 5.4, 3.0, 4),  # 0.4 ms of the loop after step 1
            (3, 9.0, 2.0, 4),  # then 0.6 ms
            (4, 40.0, 2.0, 0),  # nothing decoding: the engine may have idled before it (step 3: unknown)
            (5, 42.5, 2.0, 2),
            (7, 45.0, 2.0, 2),  # step 6 not logged: step 5's cycle unknown
            (8, 10.0, 2.0, 2),  # another run of a combined log: starts before step 7 ended
            (9, 12.3, 2.0, 2),
        ]
    )
    assert cycle_ms(steps) == pytest.approx([5.4, 3.6, math.nan, 2.5, math.nan, math.nan, 2.3, math.nan], nan_ok=True)
    assert cycle_ms(steps.iloc[:1]).tolist() == [pytest.approx(math.nan, nan_ok=True)]


def loop_log(path, cost, loop_ms):
    """Steps with decodes running that take ``cost``, each followed by ``loop_ms(n)`` of the engine loop."""
    writer = StepLogWriter(path, {}, clock_ms=lambda: 0.0)
    start = 0.0
    shapes = [(n, c) for n in (2, 8, 32) for c in (0, 64, 256, 1024)] * 3
    for n, c in shapes:
        step = StepPlan(n + c, c, 0.0, 0.0, 50.0, 1.0, False, False, n, decode_kv_tokens=100 * n)
        writer.on_plan(step, 0, (n, c))
        writer.on_step_done(step, cost(n, c), started_ms=start)
        start += cost(n, c) + loop_ms(n)
    writer.close()
    return path


def test_a_profile_of_cycles_prices_the_engine_loop_between_steps(tmp_path):
    """A simulator's clock has no engine loop: a twin fitted to the steps as the plug-in times them runs
    every step about 0.15 ms plus 12 us a decode too fast (on vLLM's CPU build, 6 % of a busy run)."""
    from sloweave.core.costs.analytic import AnalyticCost
    from sloweave.core.costs.profile_fit import fit_profile
    from sloweave.core.step_log import profile_rows

    cost = AnalyticCost()
    log = read_step_log(loop_log(tmp_path / "s.jsonl", cost, lambda n: 0.15 + 0.012 * n))
    measured, cycles = profile_rows(log), profile_rows(log, step_time="cycle")
    assert len(cycles) == len(measured) - 1  # the last step's cycle is not known
    assert (cycles["step_ms"] - measured["step_ms"].iloc[:-1]).to_numpy() == pytest.approx(
        0.15 + 0.012 * measured["n_decodes"].iloc[:-1].to_numpy()
    )
    as_measured = fit_profile(measured, holdout_share=0.0).cost("regression")
    with_loop = fit_profile(cycles, holdout_share=0.0).cost("regression")
    for n, c in ((8, 512), (32, 0), (2, 1024)):
        assert as_measured.predict(n, c, 100 * n, 0) == pytest.approx(cost(n, c), rel=1e-3)
        assert with_loop.predict(n, c, 100 * n, 0) == pytest.approx(cost(n, c) + 0.15 + 0.012 * n, rel=1e-3)


def test_a_profile_of_cycles_needs_a_known_cycle_and_a_known_step_time(tmp_path):
    from sloweave.core.step_log import profile_rows

    one_step = read_step_log(written(tmp_path / "one.jsonl", [plan(64)]))
    with pytest.raises(StepLogError, match="no step with a known cycle"):
        profile_rows(one_step, step_time="cycle")
    with pytest.raises(ValueError, match="step_time must be one of measured, cycle, got 'wall'"):
        profile_rows(one_step, step_time="wall")
