"""The top-level API: the names a user needs first, each the very object of its home module."""

import importlib
import subprocess
import sys

import numpy as np
import pytest

import sloweave


@pytest.mark.parametrize("name", sloweave.__all__)
def test_each_top_level_name_is_its_home_modules_object(name):
    home = importlib.import_module(sloweave._API[name])
    assert getattr(sloweave, name) is getattr(home, name)
    assert name in dir(sloweave)


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no attribute 'Sloweave'"):
        sloweave.Sloweave  # noqa: B018


def test_importing_sloweave_loads_no_simulator_and_no_engine():
    code = "import sys, sloweave; print(sorted(m for m in ('sloweave.sim', 'pandas', 'torch', 'vllm') if m in sys.modules))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


def test_the_readme_example_runs_on_the_top_level_names():
    workload = sloweave.get_workload_spec("chat").generate(50, seed=0)
    result = sloweave.simulate(workload, sloweave.make_policy("sloweave"), tpot_ms=25.0)
    metrics = sloweave.evaluate(result, ttft_ms=1000.0)
    assert result.finished.all() and metrics.num_finished == 50
    assert sloweave.SLOWeave().decide(4, 1000, 20.0).chunk_tokens > 0
    assert np.isfinite(sloweave.AnalyticCost()(4, 256))
