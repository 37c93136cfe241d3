"""Models for the CPU runtime: random-weight Llamas built from packaged configs, or a local model.

No hub access is assumed: a packaged name (``tiny``, ``small``) builds a model from the
JSON config under ``runtime/models`` with seeded random weights; a directory with a
``config.json`` loads its weights when it has them, and random weights otherwise.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

PACKAGED_MODELS = ("tiny", "small")
WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)


def packaged_config(name: str) -> dict:
    if name not in PACKAGED_MODELS:
        raise ValueError(
            f"unknown packaged model {name!r}: choose one of {', '.join(PACKAGED_MODELS)} or a local directory"
        )
    with resources.files("sloweave.runtime.models").joinpath(f"{name}.json").open() as f:
        config = json.load(f)
    config.pop("_comment", None)
    return config


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(name_or_path: str, seed: int = 0, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """A causal LM in eval mode with the SDPA attention that continuous batching accepts.

    Random weights are made on ``device`` itself: an 8B model's float32 initialisation on the
    host would take minutes and 32 GB before it moved to a GPU.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    torch.manual_seed(seed)
    path = Path(name_or_path)
    with torch.device(device):
        if name_or_path in PACKAGED_MODELS:
            config = LlamaConfig(**packaged_config(name_or_path), attn_implementation="sdpa")
            model = LlamaForCausalLM(config)
        elif path.is_dir() and (path / "config.json").exists():
            if any((path / f).exists() for f in WEIGHT_FILES):
                model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", local_files_only=True)
            else:
                config = AutoConfig.from_pretrained(path, local_files_only=True)
                config._attn_implementation = "sdpa"
                model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=DTYPES[dtype])
        else:
            raise ValueError(
                f"model {name_or_path!r} is neither a packaged model ({', '.join(PACKAGED_MODELS)}) nor a directory with a config.json"
            )
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def model_label(name_or_path: str) -> str:
    return name_or_path if name_or_path in PACKAGED_MODELS else str(Path(name_or_path).resolve())
