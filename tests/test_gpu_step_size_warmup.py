"""benchmarks/gpu_step_size_warmup.py: a forward's residual by how often its token count had run, and the grid's classes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_step_size_warmup as warmup  # noqa: E402


def test_sizes_are_distinct_half_on_the_grid_in_range_and_never_the_priming_size():
    sizes = warmup.draw_sizes(40, 900, 1100, 8, seed=3)
    assert len(set(sizes.tolist())) == 40 and sizes.min() >= 900 and sizes.max() <= 1100
    assert (sizes % 8 == 0).sum() == 20 and warmup.PRIMING_TOKENS not in sizes
    with pytest.raises(ValueError, match="holds 24 multiples of 8: too few for 60"):
        warmup.draw_sizes(60, 900, 1100, 8, seed=3)


def test_every_size_runs_as_often_as_asked_in_a_shuffled_order():
    order = warmup.run_order(np.array([10, 20, 30]), 5, seed=0)
    assert sorted(order.tolist()) == sorted([10, 20, 30] * 5) and order.tolist() != sorted(order.tolist())


def test_a_first_run_made_slower_and_sizes_on_the_grid_made_cheaper_show_in_their_rows():
    order = warmup.run_order(warmup.draw_sizes(40, 64, 2048, 64, seed=1), 5, seed=1)
    ms = 0.03 * order * np.where(order % 64 == 0, 0.9, 1.0)
    first = ~pd.Series(order).duplicated().to_numpy()
    by_run, by_grid = warmup.tables(pd.DataFrame({"tokens": order, "ms": ms + 50.0 * first}), 64)
    assert by_run.median_residual_ms.tolist() == pytest.approx([50.0, 0.0, 0.0, 0.0])
    on, off = by_grid.median_relative_off_curve
    assert on < -0.03 and off > 0.03


@pytest.mark.parametrize("engine", ["forward", "runtime"])
def test_it_runs_a_model_on_the_cpu_and_writes_its_tables(tmp_path, engine):
    out = tmp_path / "out"
    argv = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--sizes", "8", "--occurrences", "4"]
    argv += ["--engine", engine, "--low", "16", "--high", "128", "--grid", "16", "--out", str(out)]
    assert warmup.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [row["forwards"] for row in summary["by_occurrence"]] == [8, 8, 8, 8]
    assert summary["settings"]["device_name"] == "cpu" and summary["settings"]["engine"] == engine
    steps = pd.read_csv(out / "steps.csv")
    assert len(steps) == 32 and (steps.ms > 0).all()
