"""Make the profile presets shipped in the package from the measured A100 profiles in shared/.

    python scripts/make_profile_data.py ../shared/profiles/vidur-a100

Each preset is a folder in Vidur's public CSV format, reduced to the columns the cost model
reads (the shape columns, the keys and each operator's median; rows unchanged), plus a
``model.json`` with what the CSVs do not say (layers, tensor parallelism, where attention
comes from, the parameter count and GPU memory that size the KV cache). Source files: Vidur's profiling data (MIT licence, LICENSE.vidur copied along).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd

OUT = Path(__file__).resolve().parents[1] / "src" / "sloweave" / "data" / "profiles"
MLP_KEYS = [
    "n_head",
    "n_kv_head",
    "n_embd",
    "n_expanded_embd",
    "vocab_size",
    "use_gated_mlp",
    "num_tokens",
    "num_tensor_parallel_workers",
]
ATTENTION_KEYS = [
    "n_embd",
    "n_q_head",
    "n_kv_head",
    "block_size",
    "num_tensor_parallel_workers",
    "batch_size",
    "prefill_chunk_size",
    "kv_cache_size",
    "is_prefill",
]
ALL_REDUCE_KEYS = ["rank", "num_workers", "size", "collective", "devices_per_node", "max_devices_per_node"]
CPU_KEYS = ["model_name", "batch_size", "tensor_parallel_degree"]
# The memory figures that size the KV cache (sloweave.core.costs.kv_memory): the parameter
# count from each model's Hugging Face config (untied LM head), an A100-80GB's memory as CUDA
# reports it, and vLLM's activation reserve (an estimate).
A100_80GB_GIB = 79.15
ACTIVATION_RESERVE_GIB = 2.0
MEMORY_NOTES = (
    "parameters: {params}. gpu_memory_gib: an A100-80GB's memory as CUDA reports it "
    "(torch.cuda.get_device_properties().total_memory; PyTorch's out-of-memory message reads "
    "'79.15 GiB total capacity', less than the 80 GiB on the label). "
    "activation_reserve_gib: an estimate of the peak activation memory vLLM's profiling run reserves "
    "per GPU (not measured here)."
)
PRESETS = {
    "llama2-70b-tp2-a100": {
        "model": {
            "name": "meta-llama/Llama-2-70b-hf",
            "num_layers": 80,
            "tensor_parallel": 2,
            "device": "A100-80GB",
            "attention": "measured",
            "cpu_overheads_of": {"model_name": "meta-llama/Llama-2-70b-hf", "tensor_parallel_degree": 4},
            "notes": "CPU overheads were measured for this model at TP4 only; they are used for TP2.",
            "parameters": 68_976_648_192,
            "gpu_memory_gib": A100_80GB_GIB,
            "activation_reserve_gib": ACTIVATION_RESERVE_GIB,
            "memory_notes": MEMORY_NOTES.format(
                params="Llama-2-70B's config (vocab 32000, hidden 8192, intermediate 28672, 80 layers, "
                "64 query / 8 KV heads of 128, untied LM head)"
            ),
        },
        "files": {
            "mlp.csv": ("mlp_llama2_70b.csv", MLP_KEYS),
            "attention.csv": ("attention_llama2_70b_tp2.csv", ATTENTION_KEYS),
            "all_reduce.csv": ("all_reduce_a100_pairwise_nvlink.csv", ALL_REDUCE_KEYS),
            "cpu_overheads.csv": ("cpu_overheads.csv", CPU_KEYS),
        },
    },
    "llama3-8b-tp1-a100": {
        "model": {
            "name": "meta-llama/Meta-Llama-3-8B",
            "num_layers": 32,
            "tensor_parallel": 1,
            "device": "A100-80GB",
            "attention": {"derived_from": "llama2-70b-tp2-a100"},
            "cpu_overheads_of": {"model_name": "meta-llama/Llama-2-7b-hf", "tensor_parallel_degree": 1},
            "notes": "No attention profile of Llama-3-8B exists here: attention is derived from the measured Llama-2-70B TP2 one. "
            "CPU overheads are Llama-2-7B's at TP1 (the nearest measured model).",
            "parameters": 8_030_261_248,
            "gpu_memory_gib": A100_80GB_GIB,
            "activation_reserve_gib": ACTIVATION_RESERVE_GIB,
            "memory_notes": MEMORY_NOTES.format(
                params="Llama-3-8B's config (vocab 128256, hidden 4096, intermediate 14336, 32 layers, "
                "32 query / 8 KV heads of 128, untied LM head)"
            ),
        },
        "files": {"mlp.csv": ("mlp_llama3_8b.csv", MLP_KEYS), "cpu_overheads.csv": ("cpu_overheads.csv", CPU_KEYS)},
    },
}


def reduce(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    medians = [c for c in frame.columns if c.startswith("time_stats.") and c.endswith(".median")]
    cpu_medians = [c for c in frame.columns if c.endswith("_median")]
    return frame[keys + medians + cpu_medians]


def main(source: Path) -> None:
    for name, preset in PRESETS.items():
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        for target, (file, keys) in preset["files"].items():
            frame = pd.read_csv(source / file)
            if file == "cpu_overheads.csv":
                wanted = preset["model"]["cpu_overheads_of"]
                frame = frame[
                    (frame.model_name == wanted["model_name"])
                    & (frame.tensor_parallel_degree == wanted["tensor_parallel_degree"])
                ]
            reduce(frame, keys).to_csv(folder / target, index=False)
        model = dict(preset["model"], source={t: f for t, (f, _) in preset["files"].items()})
        (folder / "model.json").write_text(json.dumps(model, indent=2) + "\n")
    shutil.copy(source / "LICENSE.vidur", OUT / "LICENSE.vidur")
    print(f"wrote {', '.join(PRESETS)} under {OUT}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/profiles/vidur-a100"))
