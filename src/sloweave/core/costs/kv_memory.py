"""The KV cache a served model leaves room for: its capacity in tokens from the model and the GPU.

vLLM sizes its KV cache the same way (``--gpu-memory-utilization``, default 0.9): of each GPU's
memory it takes that share, less the model's weights on that GPU and the peak activation memory
its profiling run measured; what is left holds the KV cache, whose tokens are split over the
tensor-parallel GPUs (each holds its share of the KV heads)::

    tokens = floor((gpu_memory_gib x utilisation - weights_gib_per_gpu - activation_reserve_gib)
                   x 2**30 / (kv_bytes_per_token / tensor_parallel))
    weights_gib_per_gpu = parameters x dtype_bytes / tensor_parallel / 2**30

The model's figures come from a profile folder's ``model.json`` (``parameters``,
``gpu_memory_gib`` per GPU, optionally ``activation_reserve_gib`` per GPU and ``memory_notes``);
a folder without them has no default KV capacity. ``KVMemory`` is the capacity a run used and
how it was obtained: from the model, given by the user, or unlimited (and why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sloweave.core.costs.step_profiles import ProfileError
from sloweave.core.validate import MAX_TOKENS, Range

if TYPE_CHECKING:
    from sloweave.core.costs.operator_profiles import ModelShape

BYTES_PER_GIB = 2**30
# vLLM's --gpu-memory-utilization default: the share of each GPU's memory the engine may use.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# What vLLM's profiling run reserves for activations at its default batch (a forward pass of
# max_num_batched_tokens): about 1-3 GiB per GPU for 8B-70B models; an estimate, not a measurement.
DEFAULT_ACTIVATION_RESERVE_GIB = 2.0
GPU_MEMORY_UTILIZATION = Range(0, 1, low_open=True)
PARAMETER_COUNT = Range(1, 10**15, " of parameters", whole=True)
GPU_MEMORY_GIB = Range(0, 1e6, " of GiB", low_open=True)
ACTIVATION_RESERVE_GIB = Range(0, 1e6, " of GiB")
MEMORY_KEYS = ("parameters", "gpu_memory_gib", "activation_reserve_gib", "memory_notes")
# How a run's KV capacity was obtained.
FROM_MODEL, GIVEN, UNLIMITED = "model", "given", "unlimited"


@dataclass(frozen=True)
class ModelMemory:
    """A profile folder's memory figures (model.json): the weights and each GPU's memory."""

    parameters: int
    gpu_memory_gib: float  # per GPU, as CUDA reports it
    activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB  # per GPU
    note: str = ""  # where the figures come from


def read_model_memory(model: dict, path: Path) -> ModelMemory | None:
    """``model.json``'s memory figures, checked (``ProfileError`` naming the file); None without them."""
    required = ("parameters", "gpu_memory_gib")
    present = [key for key in required if key in model]
    if not present:
        extra = [key for key in MEMORY_KEYS if key in model]
        if extra:
            raise ProfileError(
                f"{path}: {', '.join(extra)} given without parameters and gpu_memory_gib "
                "(the KV capacity needs the weights and the GPU's memory)"
            )
        return None
    if len(present) == 1:
        missing = next(key for key in required if key not in model)
        raise ProfileError(
            f"{path}: {present[0]} without {missing}: give both for a default KV capacity (or neither: no KV limit)"
        )
    try:
        parameters = PARAMETER_COUNT.check(model["parameters"], "parameters")
        gpu_memory_gib = GPU_MEMORY_GIB.check(model["gpu_memory_gib"], "gpu_memory_gib (per GPU)")
        reserve_gib = ACTIVATION_RESERVE_GIB.check(
            model.get("activation_reserve_gib", DEFAULT_ACTIVATION_RESERVE_GIB), "activation_reserve_gib (per GPU)"
        )
    except ValueError as err:
        raise ProfileError(f"{path}: {err}") from None
    note = model.get("memory_notes", "")
    if not isinstance(note, str):
        raise ProfileError(f"{path}: memory_notes must be a string, got {note!r}")
    return ModelMemory(parameters, gpu_memory_gib, reserve_gib, note)


@dataclass(frozen=True)
class KVMemory:
    """The KV capacity a run used (``tokens``; None: unlimited) and how it was obtained.

    ``source``: ``model`` (computed from the model's figures, the other fields filled),
    ``given`` (by the user: ``reason`` says how) or ``unlimited`` (``reason`` says why)."""

    tokens: int | None
    source: str
    reason: str = ""
    model: str | None = None
    device: str | None = None
    gpus: int | None = None  # tensor-parallel GPUs the model and its KV cache are split over
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float | None = None
    weights_gib_per_gpu: float | None = None
    activation_reserve_gib: float | None = None
    kv_gib_per_gpu: float | None = None
    kv_bytes_per_token: int | None = None  # all GPUs together
    note: str = ""

    @property
    def limited(self) -> bool:
        return self.tokens is not None

    def describe(self) -> dict:
        """What result files record (strict JSON: numbers, strings and nulls)."""
        return {
            "kv_capacity_tokens": self.tokens,
            "source": self.source,
            "reason": self.reason,
            "model": self.model,
            "device": self.device,
            "gpus": self.gpus,
            "gpu_memory_gib": self.gpu_memory_gib,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "weights_gib_per_gpu": self.weights_gib_per_gpu,
            "activation_reserve_gib": self.activation_reserve_gib,
            "kv_gib_per_gpu": self.kv_gib_per_gpu,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "note": self.note,
        }

    def summary(self) -> str:
        """One line for a command's output."""
        if self.tokens is None:
            return f"KV cache: unlimited ({self.reason})"
        if self.source != FROM_MODEL:
            return f"KV cache: {self.tokens:,} tokens ({self.reason})"
        return (
            f"KV cache: {self.tokens:,} tokens ({self.gpus} x {self.device or 'GPU'}: {self.gpu_memory_gib:g} GiB "
            f"x {self.gpu_memory_utilization:g} - {self.weights_gib_per_gpu:.1f} GiB weights - "
            f"{self.activation_reserve_gib:g} GiB activations = {self.kv_gib_per_gpu:.2f} GiB per GPU, "
            f"{self.kv_bytes_per_token / 1024:g} KiB per token)"
        )


def model_kv_memory(
    shape: ModelShape,
    memory: ModelMemory,
    device: str | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> KVMemory:
    """The KV capacity ``memory`` leaves for ``shape`` (the module's formula); ``ValueError``
    naming the numbers when the weights and activations leave nothing for the KV cache."""
    utilisation = GPU_MEMORY_UTILIZATION.check(gpu_memory_utilization, "gpu_memory_utilization")
    gpus = shape.tensor_parallel
    weights_gib = memory.parameters * shape.dtype_bytes / gpus / BYTES_PER_GIB
    usable_gib = memory.gpu_memory_gib * utilisation
    kv_gib = usable_gib - weights_gib - memory.activation_reserve_gib
    bytes_per_token_per_gpu = shape.kv_bytes_per_token / gpus
    tokens = math.floor(kv_gib * BYTES_PER_GIB / bytes_per_token_per_gpu) if kv_gib > 0 else 0
    if tokens < 1:
        raise ValueError(
            f"{shape.name}: nothing is left for the KV cache at GPU memory utilisation {utilisation:g}: "
            f"{memory.gpu_memory_gib:g} GiB x {utilisation:g} = {usable_gib:.2f} GiB per GPU, less "
            f"{weights_gib:.2f} GiB of weights and {memory.activation_reserve_gib:g} GiB of activations, "
            f"leaves {kv_gib:.2f} GiB ({bytes_per_token_per_gpu:,.0f} bytes per token per GPU); raise the "
            "utilisation, give --kv-capacity-tokens, or --unlimited-kv"
        )
    if tokens > MAX_TOKENS:
        raise ValueError(f"{shape.name}: a KV capacity of {tokens:,} tokens is past the {MAX_TOKENS:,} tokens allowed")
    return KVMemory(
        tokens,
        FROM_MODEL,
        "from the model's weights and the GPU's memory",
        shape.name,
        device,
        gpus,
        memory.gpu_memory_gib,
        utilisation,
        weights_gib,
        memory.activation_reserve_gib,
        kv_gib,
        shape.kv_bytes_per_token,
        memory.note,
    )


def given_kv_memory(tokens: int, reason: str) -> KVMemory:
    """A KV capacity the user gave (``reason``: how, e.g. ``--kv-capacity-tokens``)."""
    return KVMemory(tokens, GIVEN, reason)


def unlimited_kv_memory(reason: str) -> KVMemory:
    """No KV limit, and why."""
    return KVMemory(None, UNLIMITED, reason)
