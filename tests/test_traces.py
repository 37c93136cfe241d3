"""Trace loaders (every format, every bad-file case) and replay options, on small fixture files."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from sloweave.sim.trace_replay import ReplayOptions, replay_workload, split_windows
from sloweave.sim.traces import TraceError, load_trace
from sloweave.sim.workloads import WorkloadError

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"

# The first four requests of the real Azure conversation trace plus two made-up ones
# (equal arrival times allowed), the same requests in the normalised and original forms.
EXPECTED_ARRIVAL_S = np.array([0.0, 4.314579, 4.541877, 4.710427, 6.0, 6.0])
EXPECTED_PROMPT = np.array([374, 396, 879, 91, 5000, 120])
EXPECTED_OUTPUT = np.array([44, 109, 55, 16, 3, 1])


def test_normalised_csv_loads_exact_values():
    trace = load_trace(FIXTURES / "normalised.csv")
    assert trace.fmt == "normalised"
    assert trace.has_arrivals
    np.testing.assert_array_equal(trace.arrival_s, EXPECTED_ARRIVAL_S)
    np.testing.assert_array_equal(trace.prompt_tokens, EXPECTED_PROMPT)
    np.testing.assert_array_equal(trace.output_tokens, EXPECTED_OUTPUT)
    assert trace.span_s == 6.0
    assert trace.mean_rate_rps == pytest.approx(1.0)


def test_azure_original_form_matches_normalised_form():
    trace = load_trace(FIXTURES / "azure_orig.csv")
    assert trace.fmt == "azure"
    # Wall-clock stamps with 7 fractional digits become seconds since the first request.
    np.testing.assert_allclose(trace.arrival_s, EXPECTED_ARRIVAL_S, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(trace.prompt_tokens, EXPECTED_PROMPT)
    np.testing.assert_array_equal(trace.output_tokens, EXPECTED_OUTPUT)


def test_mooncake_jsonl_timestamps_are_milliseconds_and_rebased():
    trace = load_trace(FIXTURES / "mooncake.jsonl")
    assert trace.fmt == "mooncake"
    np.testing.assert_allclose(trace.arrival_s, [0.0, 3.053, 3.053, 9.167])
    np.testing.assert_array_equal(trace.prompt_tokens, [6955, 6472, 512, 1300])
    np.testing.assert_array_equal(trace.output_tokens, [52, 26, 1, 300])


def test_forced_format_must_match_the_columns():
    with pytest.raises(TraceError, match=r"normalised\.csv, line 1: missing column\(s\) TIMESTAMP"):
        load_trace(FIXTURES / "normalised.csv", fmt="azure")


@pytest.mark.parametrize("name, fmt", [("lengths_only.csv", "normalised"), ("vidur_lengths.csv", "vidur")])
def test_length_only_files_load_without_arrivals(name, fmt):
    trace = load_trace(FIXTURES / name)
    assert trace.fmt == fmt
    assert not trace.has_arrivals
    assert trace.arrival_s is None
    assert trace.prompt_tokens[0] == 3772 and trace.output_tokens[0] == 54


@pytest.mark.parametrize("name", ["lengths_only.csv", "vidur_lengths.csv"])
def test_length_only_files_are_refused_as_traces(name):
    trace = load_trace(FIXTURES / name)
    with pytest.raises(TraceError, match=rf"{name}: has no arrival times.*--arrivals poisson"):
        replay_workload(trace)
    with pytest.raises(TraceError, match="no arrival times"):
        split_windows(trace, 2)


def test_length_only_file_with_generated_poisson_arrivals_says_so():
    trace = load_trace(FIXTURES / "lengths_only.csv")
    options = ReplayOptions(arrivals="poisson", poisson_rate_rps=4.0, rate_scale=2.0, seed=7)
    wl, report = replay_workload(trace, options)
    assert report.arrivals_generated
    assert "generated" in report.arrivals and "Poisson" in report.arrivals and "no arrival times" in report.arrivals
    assert any("generated" in note for note in report.notes)
    assert report.offered_rate_rps == 8.0
    assert len(wl) == 4 and wl.arrival_s[0] == 0.0 and np.all(np.diff(wl.arrival_s) >= 0)
    np.testing.assert_array_equal(wl.prompt_tokens, [3772, 2015, 3858, 2509])
    # Same seed, same arrivals; another seed, other arrivals.
    again, _ = replay_workload(trace, options)
    np.testing.assert_array_equal(again.arrival_s, wl.arrival_s)
    other, _ = replay_workload(trace, ReplayOptions(arrivals="poisson", poisson_rate_rps=4.0, rate_scale=2.0, seed=8))
    assert not np.array_equal(other.arrival_s, wl.arrival_s)


def test_generated_arrivals_need_a_rate():
    with pytest.raises(TraceError, match="rate"):
        ReplayOptions(arrivals="poisson")


# Every bad file: (fixture, line named in the message or None, text of the problem).
BAD_FILES = [
    ("empty.csv", None, "file is empty"),
    ("empty.jsonl", None, "file is empty"),
    ("header_only.csv", None, "no requests"),
    ("bad_missing_column.csv", 1, r"missing column\(s\) output_tokens"),
    ("bad_unknown_columns.csv", 1, "unrecognised columns"),
    ("bad_zero_length.csv", 4, "output_tokens is 0; token lengths must be >= 1"),
    ("bad_negative_length.csv", 3, "prompt_tokens is -5; token lengths must be >= 1"),
    ("bad_fractional_length.csv", 3, "prompt_tokens must be a whole number"),
    ("bad_nonnumeric_length.csv", 3, "output_tokens is not a finite number: 'many'"),
    ("bad_unsorted.csv", 5, "arrival_s goes backwards .* on line 4"),
    ("bad_nonnumeric_arrival.csv", 3, "arrival_s is not a finite number: 'soon'"),
    ("bad_partial_arrivals.csv", 3, "arrival_s is missing"),
    ("bad_blank_line.csv", 3, "blank line"),
    ("bad_azure_timestamp.csv", 4, "TIMESTAMP is not a timestamp: 'yesterday at noon'"),
    ("bad_azure_unsorted.csv", 4, "TIMESTAMP goes backwards"),
    ("bad_azure_zero_length.csv", 2, "ContextTokens is 0"),
    ("bad_mooncake_missing_key.jsonl", 2, r"missing key\(s\) output_length"),
    ("bad_mooncake_unsorted.jsonl", 3, "timestamp goes backwards"),
    ("bad_mooncake_timestamp.jsonl", 2, "timestamp is not a finite number: 'later'"),
    ("bad_mooncake_negative.jsonl", 2, "output_length is -3"),
    ("bad_mooncake_json.jsonl", 2, "not valid JSON"),
]


@pytest.mark.parametrize("name, line, problem", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_name_the_file_the_line_and_the_problem(name, line, problem):
    with pytest.raises(TraceError) as info:
        load_trace(FIXTURES / name)
    message = str(info.value)
    assert str(FIXTURES / name) in message
    if line is not None:
        assert f"line {line}:" in message
    assert re.search(problem, message), message
    # A TraceError is a WorkloadError, so callers of the simulator catch it with the rest.
    assert isinstance(info.value, WorkloadError)


@pytest.mark.parametrize("name, requests", [("trailing_blank_lines.csv", 2), ("trailing_blank_lines.jsonl", 1)])
def test_blank_lines_after_the_last_request_are_not_an_error(name, requests):
    # They hold no request, so nothing is lost; a blank line between requests is an error (above).
    assert len(load_trace(FIXTURES / name)) == requests


def test_missing_file_and_unknown_format():
    with pytest.raises(TraceError, match="no such file"):
        load_trace(FIXTURES / "does_not_exist.csv")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(FIXTURES / "normalised.csv", fmt="parquet")


# ---------------------------------------------------------------- replay options


def test_window_selects_half_open_interval_and_rebases():
    trace = load_trace(FIXTURES / "normalised.csv")
    wl, report = replay_workload(trace, ReplayOptions(start_s=4.4, end_s=6.0))
    # [4.4, 6.0) keeps the requests at 4.54 and 4.71 only; the two at 6.0 belong to the next window.
    np.testing.assert_allclose(wl.arrival_s, [4.541877 - 4.4, 4.710427 - 4.4])
    np.testing.assert_array_equal(wl.prompt_tokens, [879, 91])
    assert report.num_requests == 2 and report.num_requests_in_file == 6
    assert report.window_duration_s == pytest.approx(1.6)
    assert report.base_rate_rps == pytest.approx(2 / 1.6)


def test_window_reaching_the_end_keeps_the_last_requests():
    trace = load_trace(FIXTURES / "normalised.csv")
    wl, _ = replay_workload(trace, ReplayOptions(start_s=4.4))
    np.testing.assert_array_equal(wl.prompt_tokens, [879, 91, 5000, 120])


def test_empty_or_out_of_range_window_is_an_error():
    trace = load_trace(FIXTURES / "normalised.csv")
    with pytest.raises(TraceError, match="no requests arrive in the window"):
        replay_workload(trace, ReplayOptions(start_s=0.5, end_s=4.0))
    with pytest.raises(TraceError, match="after the last arrival"):
        replay_workload(trace, ReplayOptions(start_s=100.0))
    with pytest.raises(TraceError, match="window end"):
        ReplayOptions(start_s=3.0, end_s=2.0)


def test_rate_scale_divides_arrivals_keeping_the_burst_structure():
    trace = load_trace(FIXTURES / "normalised.csv")
    slow, r1 = replay_workload(trace, ReplayOptions())
    fast, r4 = replay_workload(trace, ReplayOptions(rate_scale=4.0))
    np.testing.assert_allclose(fast.arrival_s * 4.0, slow.arrival_s)
    assert r4.offered_rate_rps == pytest.approx(4.0 * r1.offered_rate_rps)
    with pytest.raises(TraceError, match="rate scale"):
        ReplayOptions(rate_scale=0.0)


def test_prompt_cap_counts_capped_requests():
    trace = load_trace(FIXTURES / "normalised.csv")
    wl, report = replay_workload(trace, ReplayOptions(max_prompt_tokens=400))
    np.testing.assert_array_equal(wl.prompt_tokens, [374, 396, 400, 91, 400, 120])
    assert report.num_prompts_capped == 2
    assert any("2 prompt(s) longer than 400 tokens were capped" in note for note in report.notes)
    _, uncapped = replay_workload(trace, ReplayOptions(max_prompt_tokens=5000))
    assert uncapped.num_prompts_capped == 0


def test_max_requests_keeps_the_first_requests_and_an_honest_rate():
    trace = load_trace(FIXTURES / "normalised.csv")
    wl, report = replay_workload(trace, ReplayOptions(max_requests=3))
    np.testing.assert_array_equal(wl.prompt_tokens, [374, 396, 879])
    assert report.base_rate_rps == pytest.approx(3 / 4.541877)


def test_split_windows_partition_every_request_once():
    trace = load_trace(FIXTURES / "normalised.csv")
    windows = split_windows(trace, 3)
    assert windows[0][0] == 0.0 and windows[-1][1] is None
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert end == start  # contiguous, no float gap between windows
    # windows [0,2), [2,4), [4,6]: the middle one is empty, which replay rightly refuses.
    first, _ = replay_workload(trace, ReplayOptions(start_s=windows[0][0], end_s=windows[0][1]))
    assert len(first) == 1
    with pytest.raises(TraceError, match="no requests"):
        replay_workload(trace, ReplayOptions(start_s=windows[1][0], end_s=windows[1][1]))
    last, _ = replay_workload(trace, ReplayOptions(start_s=windows[2][0], end_s=windows[2][1]))
    assert len(last) == 5


def test_split_windows_with_a_length_spreads_them_and_refuses_overlap():
    trace = load_trace(FIXTURES / "mooncake.jsonl")
    windows = split_windows(trace, 2, window_s=4.0)
    assert windows == [(0.0, 4.0), (pytest.approx(5.167), None)]
    last, report = replay_workload(trace, ReplayOptions(start_s=windows[1][0], end_s=windows[1][1]))
    np.testing.assert_array_equal(last.prompt_tokens, [1300])
    assert report.window_duration_s == pytest.approx(4.0)
    with pytest.raises(TraceError, match="do not fit"):
        split_windows(trace, 3, window_s=4.0)


def test_shared_azure_trace_both_forms_agree():
    """The real trace (CI has shared/ beside the repository): 19,366 requests over about an hour."""
    normalised = load_trace(SHARED_TRACES / "azure2023_conv.csv")
    original = load_trace(SHARED_TRACES / "orig" / "AzureLLMInferenceTrace_conv.csv")
    assert len(normalised) == len(original) == 19366
    np.testing.assert_allclose(normalised.arrival_s, original.arrival_s, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(normalised.prompt_tokens, original.prompt_tokens)
    assert normalised.mean_rate_rps == pytest.approx(5.53, abs=0.01)
    windows = split_windows(normalised, 5)
    total = sum(replay_workload(normalised, ReplayOptions(start_s=s, end_s=e))[1].num_requests for s, e in windows)
    assert total == 19366
    lengths = load_trace(SHARED_TRACES / "lengths_only" / "arxiv_summarization_vidur.csv")
    assert not lengths.has_arrivals and len(lengths) == 28257
