"""Refuse a request with a bad per-request target at the API, before it reaches the engine.

    vllm serve MODEL --scheduler-cls sloweave.vllm_plugin.SLOWeaveScheduler \\
        --logits-processors sloweave.vllm_plugin.request_check:RequestTargetCheck

vLLM runs every custom logits processor's ``validate_params`` in the front end when a request
arrives (``vllm.v1.sample.logits_processor.validate_logits_processors_parameters``); a
``ValueError`` there becomes HTTP 400 with its message for that client alone (and a
``ValueError`` from ``LLM.generate`` offline). This is the only hook vLLM offers for checking a
request's extra arguments in the front end, so the check is a logits processor that leaves the
logits alone: argmax-invariant, nothing to track per step.

Without it a bad target still cannot hurt anyone else: the scheduler serves that request with
the default target and says so in the log and in ``sloweave_request_target_errors_total``
(``SLOWeaveSchedulerMixin.add_request``).
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from sloweave.vllm_plugin.config import request_tpot_ms

# What to pass to --logits-processors (vLLM's '<module>:<class>' form).
REQUEST_TARGET_CHECK = "sloweave.vllm_plugin.request_check:RequestTargetCheck"


class RequestTargetCheck(LogitsProcessor):
    """Validates ``extra_args['sloweave_tpot_ms']`` of each new request (the plug-in's rule)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        request_tpot_ms(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
