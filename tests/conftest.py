import importlib.util

import pytest

# The vLLM plug-in tests (tests/vllm_plugin) need vLLM, which lives in its own environment (.venv-vllm,
# `make setup-vllm`); `make test` runs them there. Elsewhere they are not collected.
HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if HAS_VLLM else ["vllm_plugin"]


def pytest_report_header(config):
    return None if HAS_VLLM else "vLLM not installed here: tests/vllm_plugin run in .venv-vllm (make test runs both)"


@pytest.fixture
def analytic_step_profile(tmp_path):
    """A small step-time profile (the format `sloweave profile` writes) timed by the analytic model."""
    import pandas as pd

    from sloweave.core.cost import AnalyticCost
    from sloweave.core.fit import write_profile

    analytic = AnalyticCost()
    rows = [
        dict(n_decodes=n, chunk_tokens=c, decode_kv_tokens=n * 300, prefill_prefix_tokens=0, step_ms=analytic(n, c), split="fit")
        for n in (0, 1, 4, 16, 64)
        for c in (0, 64, 256, 1024, 4096)
        if n or c
    ]
    return write_profile(pd.DataFrame(rows), tmp_path / "profile.csv")
