"""A pytest plug-in for vLLM's own scheduler tests: they build the plug-in instead of vLLM's scheduler.

Loaded with ``-p swap_scheduler`` by test_vllm_scheduler_suite.py when UPSTREAM_SCHEDULER_UNDER_TEST
is ``plugin``. vLLM's ``tests/v1/core/utils.create_scheduler`` builds ``AsyncScheduler`` or
``Scheduler`` (names it imports) unless a test passes its own class; swapping those two names
for ``SLOWeaveAsyncScheduler`` / ``SLOWeaveScheduler`` is the only change: same arguments, the
tests' files untouched. The plug-in's settings come from ``SLOWEAVE_*`` (e.g. SLOWEAVE_TPOT_MS).
"""

import os


def pytest_configure(config):
    if os.environ.get("UPSTREAM_SCHEDULER_UNDER_TEST") != "plugin":
        return
    import tests.v1.core.utils as upstream  # vLLM's helpers (the rootdir is their tree)

    from sloweave.vllm_plugin import SLOWeaveAsyncScheduler, SLOWeaveScheduler

    upstream.Scheduler, upstream.AsyncScheduler = SLOWeaveScheduler, SLOWeaveAsyncScheduler


def pytest_report_header(config):
    import tests.v1.core.utils as upstream

    return f"scheduler under test: {upstream.Scheduler.__module__}.{upstream.Scheduler.__name__}"
