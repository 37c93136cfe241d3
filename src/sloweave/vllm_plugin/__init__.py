"""vLLM V1 plug-in: ``--scheduler-cls sloweave.vllm_plugin.SLOWeaveAsyncScheduler``.

The scheduler classes import vLLM, so they load on first use; ``config`` does not need vLLM.
"""

__all__ = ["SLOWeaveAsyncScheduler", "SLOWeaveScheduler"]


def __getattr__(name: str):
    if name in __all__:
        from sloweave.vllm_plugin import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
