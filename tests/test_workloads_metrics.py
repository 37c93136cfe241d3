import numpy as np
import pandas as pd
import pytest

from sloweave.sim.metrics import per_request_frame, slo_met, summarize
from sloweave.core.policy import make_policy
from sloweave.sim.engine import NOT_STARTED, simulate
from sloweave.sim.workloads import WORKLOADS, Workload, WorkloadError, WorkloadSpec, get_workload_spec


def test_chat_prompt_median_is_about_256_and_long_is_long():
    chat = WORKLOADS["chat"].generate(5000, seed=0)
    assert 230 <= np.median(chat.prompt_tokens) <= 280
    long = WORKLOADS["long"].generate(2000, seed=0)
    assert np.median(long.prompt_tokens) > 4000
    mixed = WORKLOADS["mixed"].generate(5000, seed=0)
    share_long = np.mean(mixed.prompt_tokens > 1500)
    assert 0.15 <= share_long <= 0.25


def test_generators_are_seeded_and_rates_hold():
    a = WORKLOADS["mixed"].generate(3000, seed=4)
    b = WORKLOADS["mixed"].generate(3000, seed=4)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    rate = len(a) / a.span_s
    assert rate == pytest.approx(WORKLOADS["mixed"].rate_rps, rel=0.1)
    assert len(a) / WORKLOADS["mixed"].generate(3000, seed=4, rate_scale=2.0).span_s == pytest.approx(2 * rate, rel=0.1)


def test_bursty_arrivals_are_burstier_than_poisson():
    gaps_bursty = np.diff(WORKLOADS["bursty"].generate(5000, seed=0).arrival_s)
    gaps_poisson = np.diff(WORKLOADS["mixed"].generate(5000, seed=0).arrival_s)
    cv = lambda g: g.std() / g.mean()  # noqa: E731
    assert cv(gaps_bursty) > 2.0 and 0.9 < cv(gaps_poisson) < 1.1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"arrival_s": [], "prompt_tokens": [], "output_tokens": []}, "no requests"),
        ({"arrival_s": [0, 1], "prompt_tokens": [10, 0], "output_tokens": [5, 5]}, "prompt_tokens=0"),
        ({"arrival_s": [0, 1], "prompt_tokens": [10, 10], "output_tokens": [5, -1]}, "output_tokens=-1"),
        ({"arrival_s": [1, 0], "prompt_tokens": [10, 10], "output_tokens": [5, 5]}, "not sorted"),
        ({"arrival_s": [0, 1], "prompt_tokens": [10.5, 10], "output_tokens": [5, 5]}, "whole numbers"),
        ({"arrival_s": [0, float("nan")], "prompt_tokens": [10, 10], "output_tokens": [5, 5]}, "finite"),
        ({"arrival_s": [0, 1], "prompt_tokens": [10], "output_tokens": [5, 5]}, "one length"),
    ],
)
def test_bad_workloads_are_rejected(kwargs, message):
    with pytest.raises(WorkloadError, match=message):
        Workload("bad", **{k: np.asarray(v) for k, v in kwargs.items()})


def test_bad_specs_and_names():
    with pytest.raises(WorkloadError, match="rate_rps"):
        WorkloadSpec("x", rate_rps=0, ttft_ms=1000)
    with pytest.raises(WorkloadError, match="ttft_ms"):
        WorkloadSpec("x", rate_rps=1, ttft_ms=-1)
    with pytest.raises(WorkloadError, match="num_requests"):
        WORKLOADS["chat"].generate(0, seed=0)
    with pytest.raises(WorkloadError, match="unknown workload"):
        get_workload_spec("nope")


def test_slo_judgement_and_summary():
    frame = pd.DataFrame(
        {
            "ttft_ms": [100.0, 900.0, 1200.0, 50.0, np.nan, np.nan],
            "p99_tpot_ms": [10.0, 30.0, 10.0, 25.0, np.nan, np.nan],
            "status": ["finished"] * 4 + ["pending", "rejected"],
        }
    )
    met = slo_met(frame, ttft_ms=1000.0, tpot_ms=25.0)
    assert met.tolist() == [True, False, False, True, False, False]
    metrics = summarize(frame, duration_ms=2000.0, ttft_ms=1000.0, tpot_ms=25.0)
    assert metrics.slo_met == 2 and metrics.attainment == pytest.approx(2 / 6)
    assert metrics.goodput_rps == pytest.approx(1.0)
    assert (metrics.num_finished, metrics.num_pending, metrics.num_rejected) == (4, 1, 1)
    with pytest.raises(ValueError, match="targets"):
        slo_met(frame, ttft_ms=0.0, tpot_ms=25.0)
    with pytest.raises(ValueError, match="targets"):
        slo_met(frame, ttft_ms=100.0, tpot_ms=-2.0)


def reference_p99_gaps(result):
    """The plain definition, one request at a time: P99 of its own inter-token gaps."""
    p99 = np.full(len(result.workload), np.nan)
    for i in np.flatnonzero(result.finished):
        times = result.token_times_ms(i)
        p99[i] = np.percentile(np.diff(times), 99) if len(times) > 1 else 0.0
    return p99


def test_grouped_per_request_frame_equals_the_plain_definition_bit_for_bit():
    wl = WORKLOADS["mixed"].generate(300, seed=3, rate_scale=1.5)
    for name, horizon_s in (("sloweave", None), ("fixed-256", None), ("full", 2.0)):
        result = simulate(wl, make_policy(name), tpot_ms=25.0, horizon_s=horizon_s)
        frame = per_request_frame(result)
        assert np.array_equal(frame["p99_tpot_ms"].to_numpy(), reference_p99_gaps(result), equal_nan=True)
        started = result.first_token_iter != NOT_STARTED
        assert np.array_equal(
            frame["ttft_ms"].to_numpy()[started],
            result.iter_end_ms[result.first_token_iter[started]] - wl.arrival_s[started] * 1000.0,
        )
    assert (frame["status"] == "pending").any()  # the horizon case has unfinished requests


def test_frame_from_measured_token_times():
    """A real engine's token times give the simulator's per-request columns."""
    from sloweave.sim.metrics import frame_from_token_times

    frame = frame_from_token_times(
        np.array([0.0, 5.0, 10.0]), np.array([8, 8, 8]), np.array([3, 1, 4]), [[10.0, 20.0, 40.0], [15.0], [30.0, 31.0]]
    )
    assert frame["status"].tolist() == ["finished", "finished", "pending"]
    assert frame["ttft_ms"].tolist() == [10.0, 10.0, 20.0]
    assert frame["p99_tpot_ms"].iloc[0] == pytest.approx(np.percentile([10.0, 20.0], 99))
    assert frame["max_tpot_ms"].tolist()[:2] == [20.0, 0.0] and np.isnan(frame["p99_tpot_ms"].iloc[2])
    assert frame["finish_ms"].tolist()[:2] == [40.0, 15.0]
