"""GPU benchmark: vLLM's fixed chunked-prefill budget against the SLOWeave plug-in.

One prepared script for a machine with one GPU (it must finish within 10 minutes):
vLLM with random weights of Llama-3.1-8B's shape (``benchmarks/models/llama-3.1-8b``,
``load_format="dummy"``, no hub access), the ``mixed`` workload at a rate that loads the
GPU, and three engines in turn: vLLM's default chunked prefill with
``--max-num-batched-tokens`` 2048 and 8192, and the plug-in at a 25 ms TPOT target
(budget 8192 as its upper bound; ``online_correction``, no hand-set margin; with
``--profile`` the profile's fitted cost as its prior). Per-request TTFT and inter-token gaps
come from the streamed outputs; goodput and attainment are computed as SPEC.md defines them by
``sloweave.sim.metrics.summarize``. Energy as the paper reports it: the GPU's own energy
counter (NVML ``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver loaded,
read through ``pynvml`` from ``nvidia-ml-py``) before and after each engine's run, and joules
per SLO-meeting request. Prints a table with ratios against vLLM's default (2048) measured in
the same run and writes CSV/JSON under ``--out``.

    .venv-vllm/bin/python benchmarks/vllm_gpu_bench.py --out results/vllm_gpu

Needs a GPU (vLLM's CUDA wheel has no CPU kernels). Until it has run on one, the README
says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import pandas as pd

from sloweave.sim.metrics import summarize
from sloweave.sim.workloads import WORKLOADS
from sloweave.studies.outputs import write_result_json

MODEL_DIR = Path(__file__).parent / "models" / "llama-3.1-8b"
PLUGIN = "sloweave.vllm_plugin.SLOWeaveAsyncScheduler"


class EnergyCounter:
    """GPU 0's cumulative energy counter through NVML (joules)."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.name = str(pynvml.nvmlDeviceGetName(self._handle))

    def read_j(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/vllm_gpu"))
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=12.0, help="mean arrival rate, req/s (mixed workload)")
    parser.add_argument("--tpot-ms", type=float, default=25.0)
    parser.add_argument("--ttft-ms", type=float, default=WORKLOADS["mixed"].ttft_ms)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", type=str, default=None, help="a step-time profile from vllm_gpu_profile.py (default: analytic)"
    )
    args = parser.parse_args()

    from sloweave.vllm_plugin.engine_driver import make_engine, run_workload

    spec = WORKLOADS["mixed"]
    workload = spec.generate(args.requests, args.seed, rate_scale=args.rate / spec.rate_rps)
    vocab = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    sloweave_config = {"tpot_ms": args.tpot_ms, "online_correction": True}
    if args.profile:
        sloweave_config.update(cost=args.profile)
    engines = [
        ("vllm-2048", dict(max_num_batched_tokens=2048)),
        ("vllm-8192", dict(max_num_batched_tokens=8192)),
        (
            "sloweave",
            dict(max_num_batched_tokens=8192, scheduler_cls=PLUGIN, additional_config={"sloweave": sloweave_config}),
        ),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    energy = EnergyCounter()
    for name, engine_kwargs in engines:
        started = time.perf_counter()
        engine = make_engine(str(MODEL_DIR), **engine_kwargs)
        load_s = time.perf_counter() - started
        joules_before = energy.read_j()
        run = run_workload(engine, workload, vocab, seed=args.seed)
        energy_j = energy.read_j() - joules_before
        duration_ms = run.steps["end_ms"].max() - workload.arrival_s[0] * 1000.0
        metrics = summarize(run.requests, duration_ms, args.ttft_ms, args.tpot_ms)
        run.requests.to_csv(args.out / f"requests_{name}.csv", index=False)
        run.steps.to_csv(args.out / f"steps_{name}.csv", index=False)
        per_met = energy_j / metrics.slo_met if metrics.slo_met else float("nan")
        rows.append(
            {
                "engine": name,
                "load_s": load_s,
                "run_s": run.wall_s,
                "energy_j": energy_j,
                "joules_per_slo_met": per_met,
                **metrics.as_dict(),
            }
        )
        print(rows[-1], flush=True)
        del engine
        gc.collect()
    table = pd.DataFrame(rows)
    base = table.loc[table["engine"] == "vllm-2048", "goodput_rps"].iloc[0]
    table["goodput_vs_vllm_2048"] = table["goodput_rps"] / base if base > 0 else float("nan")
    table.to_csv(args.out / "summary.csv", index=False)
    write_result_json(
        args.out / "summary.json",
        {"settings": {k: str(v) for k, v in vars(args).items()}, "gpu": energy.name, "rows": rows},
    )
    print(
        table[
            [
                "engine",
                "goodput_rps",
                "attainment",
                "p99_ttft_ms",
                "p99_tpot_ms",
                "joules_per_slo_met",
                "goodput_vs_vllm_2048",
            ]
        ].to_string(index=False)
    )


if __name__ == "__main__":
    main()
