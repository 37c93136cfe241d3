"""benchmarks/step_size_warmup.py: step residuals grouped by how often the engine had run the step's size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_size_warmup  # noqa: E402

SERVED = ROOT / "benchmarks/results-vllm-cpu/tight-epyc/scaled-40ms/step-grid/warmup/tuned768-served-seed0.jsonl"


def test_occurrence_counts_earlier_steps_of_the_same_size_up_to_the_fourth():
    sizes = np.array([5, 7, 5, 5, 7, 5, 5, 9])
    assert step_size_warmup.occurrence(sizes).tolist() == [0, 0, 1, 2, 1, 3, 3, 0]


def test_a_first_step_of_a_size_made_slower_shows_in_its_row(tmp_path):
    lines = SERVED.read_text().splitlines()
    seen, slowed = set(), [lines[0]]
    for line in lines[1:]:
        step = json.loads(line)
        size = step["ran_decode_tokens"] + step["ran_prefill_tokens"]
        if size not in seen:
            step["measured_ms"] += 50.0
        seen.add(size)
        slowed.append(json.dumps(step))
    log = tmp_path / "slowed.jsonl"
    log.write_text("\n".join(slowed) + "\n")
    out = tmp_path / "out"
    assert step_size_warmup.main(["--cost", str(SERVED), "--out", str(out), str(SERVED), str(log)]) == 0
    rows = {(r["log"], r["occurrence"]): r for r in json.loads((out / "summary.json").read_text())["table"]}
    plain, first = rows[(SERVED.name, "1st")], rows[("slowed.jsonl", "1st")]
    assert first["steps"] == plain["steps"] == first["distinct_sizes"] == len(seen)
    assert abs(first["median_residual_ms"] - plain["median_residual_ms"] - 50.0) < 1e-6
    later, later_plain = rows[("slowed.jsonl", "4th+")], rows[(SERVED.name, "4th+")]
    assert (later["steps"], later["median_residual_ms"]) == (later_plain["steps"], later_plain["median_residual_ms"])
    assert (out / "warmup.csv").read_text().count("\n") == 9
