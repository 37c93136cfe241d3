import importlib.util

# The vLLM plug-in tests (tests/vllm_plugin) need vLLM, which lives in its own environment (.venv-vllm,
# `make setup-vllm`); `make test` runs them there. Elsewhere they are not collected.
HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if HAS_VLLM else ["vllm_plugin"]


def pytest_report_header(config):
    return None if HAS_VLLM else "vLLM not installed here: tests/vllm_plugin run in .venv-vllm (make test runs both)"
