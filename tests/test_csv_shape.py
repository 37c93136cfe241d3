"""CSV files the project reads are refused, naming file and line, where pandas would misread them."""

import gzip

import pytest

from sloweave.core.costs.step_profiles import ProfileError, read_profile
from sloweave.sim.traces import TraceError, load_trace

HEADER = "arrival_s,prompt_tokens,output_tokens\n"


@pytest.mark.parametrize(
    "text, message",
    [
        # one more field on every row: pandas made the first column an index, shifting every
        # column (prompt lengths read as arrival times), and the run exited 0
        (HEADER + "0.0,100,20,7\n0.5,200,30,8\n", r"line 2: 4 fields where the header has 3"),
        # a trailing comma on every line, header included: the error used to blame a column
        ("arrival_s,prompt_tokens,output_tokens,\n0.0,100,20,\n", r"line 1: header field 4 is empty"),
        # a duplicated column was silently renamed (prompt_tokens.1)
        (
            "arrival_s,prompt_tokens,prompt_tokens\n0.0,100,20\n",
            r"line 1: column\(s\) named more than once in the header: prompt_tokens",
        ),
        # one short row in the middle
        (HEADER + "0.0,100,20\n0.5,200\n1.0,300,10\n", r"line 3: 2 fields where the header has 3"),
    ],
)
def test_misshapen_trace_csv_is_refused_with_file_and_line(tmp_path, text, message):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=message) as err:
        load_trace(path)
    assert str(path) in str(err.value)


def test_a_well_formed_trace_still_loads_exactly(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(HEADER + "0.0,100,20\n0.5,200,30\n")
    trace = load_trace(path)
    assert trace.prompt_tokens.tolist() == [100, 200] and trace.output_tokens.tolist() == [20, 30]


@pytest.mark.parametrize("name", ["trace.csv", "trace.jsonl"])
def test_a_compressed_trace_is_refused_with_its_path(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(gzip.compress((HEADER + "0.0,100,20\n").encode()))
    with pytest.raises(TraceError, match=r"not a UTF-8 text file \(byte 1 is 0x8b; compressed or binary\?\)") as err:
        load_trace(path)
    assert str(path) in str(err.value)


def test_a_step_time_profile_with_shifted_rows_is_refused(tmp_path):
    path = tmp_path / "profile.csv"
    path.write_text("n_decodes,chunk_tokens,decode_kv_tokens,prefill_prefix_tokens,step_ms\n1,0,10,0,3.0,9\n")
    with pytest.raises(ProfileError, match=rf"profile {path}, line 2: 6 fields where the header has 5"):
        read_profile(path)
