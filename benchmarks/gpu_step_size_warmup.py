"""What a forward of a token count the process has not run before costs, and whether sizes on a grid are cheaper.

On vLLM's CPU build a step of a size the engine had not run took about 6 ms more the first
time (`step_size_warmup.py`); rounding the plug-in's budgets to a grid of 32 tokens removed
that. This asks the same of a model's eager forward on any torch device: ``--sizes`` distinct
token counts (half multiples of ``--grid``, half not), each run ``--occurrences`` times in one
shuffled order, every forward timed alone (wall clock, the device synchronised before and
after). Each forward's residual is its time less the median of its size's later runs (the
4th and on), grouped by occurrence; the later medians, fitted by a quadratic in the size, say
whether sizes on the grid run below the curve and sizes off it above. ``--engine runtime``
times a step of the CPU runtime's engine instead (transformers' continuous batching, paged KV:
a fresh prompt prefilled whole, as ``sloweave profile`` times one).

    python3 benchmarks/gpu_step_size_warmup.py --out results/gpu/warmup

Writes ``steps.csv`` (every forward in order), ``warmup.csv`` (the table by occurrence),
``grid.csv`` (by grid class) and ``summary.json`` (strict JSON: settings, versions, tables).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_size_warmup import OCCURRENCES, occurrence  # noqa: E402

from sloweave.runtime.model import load_model  # noqa: E402
from sloweave.studies.outputs import write_result_json  # noqa: E402

# A size outside every drawn set, run first so the device's and the libraries' one-off
# start-up costs are not charged to the first drawn size.
PRIMING_TOKENS, PRIMING_RUNS = 1000, 10


def draw_sizes(count: int, low: int, high: int, grid: int, seed: int) -> np.ndarray:
    """``count`` distinct token counts in [low, high]: half multiples of ``grid``, half not, never the priming size."""
    rng = np.random.default_rng(seed)
    on_grid = np.arange(-(-low // grid) * grid, high + 1, grid)
    off_grid = np.setdiff1d(np.arange(low, high + 1), on_grid)
    on_grid, off_grid = (np.setdiff1d(pool, [PRIMING_TOKENS]) for pool in (on_grid, off_grid))
    if on_grid.size < count // 2 or off_grid.size < count - count // 2:
        raise ValueError(
            f"[{low}, {high}] holds {on_grid.size} multiples of {grid}: too few for {count} sizes, half of them on it"
        )
    pick = lambda pool, k: rng.choice(pool, size=k, replace=False)  # noqa: E731
    return np.sort(np.concatenate([pick(on_grid, count // 2), pick(off_grid, count - count // 2)]))


def run_order(sizes: np.ndarray, occurrences: int, seed: int) -> np.ndarray:
    """Every size ``occurrences`` times, shuffled, so that a size's first run is not always early."""
    order = np.repeat(sizes, occurrences)
    np.random.default_rng(seed + 1).shuffle(order)
    return order


def forward_timer(model, device: str):
    """``tokens -> ms``: one prompt's eager forward, timed alone (the device synchronised around it)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed_ms(tokens: int) -> float:
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
        sync()
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync()
        return (time.perf_counter() - start) * 1e3

    return timed_ms


def runtime_timer(model, high_tokens: int, seed: int):
    """``tokens -> ms``: one step of the CPU runtime's engine (transformers' continuous batching,
    paged KV) prefilling a fresh prompt of that many tokens whole, as ``sloweave profile`` times it."""
    from sloweave.runtime.engine import TransformersEngine, blocks_needed
    from sloweave.runtime.runner import synthetic_prompt

    most = max(high_tokens, PRIMING_TOKENS)
    engine = TransformersEngine(model, max_batch_tokens=most, num_blocks=blocks_needed(2 * most, 4))
    rng, ids = np.random.default_rng(seed), iter(range(1 << 30))

    def timed_ms(tokens: int) -> float:
        engine.add(f"p{next(ids)}", synthetic_prompt(rng, tokens, engine.vocab_size), 1)
        record = engine.step(lambda shape, start_ms: min(tokens, shape.waiting_tokens))
        if record is None or record.ran_chunk_tokens != tokens:
            raise RuntimeError(f"the runtime's step did not prefill the {tokens}-token prompt whole: {record}")
        return record.step_ms

    return timed_ms


def tables(steps: pd.DataFrame, grid: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The residual by occurrence, and the later runs' medians against a quadratic in the size by grid class."""
    steps = steps.assign(which=occurrence(steps.tokens.to_numpy()))
    later = steps[steps.which == len(OCCURRENCES) - 1].groupby("tokens").ms.median()
    residual = steps.ms - steps.tokens.map(later)
    by_run = [
        {
            "occurrence": name,
            "forwards": int((steps.which == k).sum()),
            "median_residual_ms": float(residual[steps.which == k].median()),
            "mean_residual_ms": float(residual[steps.which == k].mean()),
        }
        for k, name in enumerate(OCCURRENCES)
    ]
    curve = np.polyval(np.polyfit(later.index, later.to_numpy(), 2), later.index)
    off_curve = pd.Series(later.to_numpy() - curve, index=later.index)
    on_grid = later.index % grid == 0
    by_grid = [
        {
            "sizes": label,
            "count": int(mask.sum()),
            "median_ms_off_curve": float(off_curve[mask].median()),
            "median_relative_off_curve": float((off_curve[mask] / later[mask]).median()),
        }
        for label, mask in ((f"multiple of {grid}", on_grid), (f"not a multiple of {grid}", ~on_grid))
    ]
    return pd.DataFrame(by_run), pd.DataFrame(by_grid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path(__file__).parent / "models" / "llama-3.1-8b"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sizes", type=int, default=120, help="distinct token counts")
    parser.add_argument("--occurrences", type=int, default=5, help="runs of each size (the 4th and on are 'later')")
    parser.add_argument("--low", type=int, default=64)
    parser.add_argument("--high", type=int, default=4096)
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cudnn-attention", action="store_true", help="keep SDPA off its cuDNN backend")
    parser.add_argument(
        "--engine",
        choices=("forward", "runtime"),
        default="forward",
        help="forward: the model's eager forward alone; runtime: a step of the CPU runtime's engine (continuous batching)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/gpu/warmup"))
    args = parser.parse_args(argv)
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.occurrences < len(OCCURRENCES) or args.sizes < 4 or not 0 < args.low < args.high:
        parser.error("needs --occurrences >= 4, --sizes >= 4 and 0 < --low < --high")
    try:
        sizes = draw_sizes(args.sizes, args.low, args.high, args.grid, args.seed)
    except ValueError as error:
        parser.error(str(error))
    order = run_order(sizes, args.occurrences, args.seed)
    model = load_model(args.model, seed=args.seed, dtype=args.dtype, device=args.device)
    timed_ms = (
        forward_timer(model, args.device) if args.engine == "forward" else runtime_timer(model, args.high, args.seed)
    )
    started = time.perf_counter()
    with torch.no_grad():
        for _ in range(PRIMING_RUNS):
            timed_ms(PRIMING_TOKENS)
        times = []
        for i, tokens in enumerate(order.tolist()):
            times.append(timed_ms(tokens))
            if (i + 1) % 100 == 0:
                print(f"{i + 1}/{order.size} forwards, {time.perf_counter() - started:.0f} s", flush=True)
    steps = pd.DataFrame({"tokens": order, "ms": times})
    by_run, by_grid = tables(steps, args.grid)
    args.out.mkdir(parents=True, exist_ok=True)
    steps.to_csv(args.out / "steps.csv", index_label="order")
    by_run.to_csv(args.out / "warmup.csv", index=False)
    by_grid.to_csv(args.out / "grid.csv", index=False)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    settings = vars(args) | {"out": str(args.out), "device_name": device, "torch": torch.__version__}
    settings |= {"priming": f"{PRIMING_RUNS} forwards of {PRIMING_TOKENS} tokens, untimed"}
    tables_json = {"by_occurrence": by_run.to_dict("records"), "by_grid": by_grid.to_dict("records")}
    write_result_json(args.out / "summary.json", {"settings": settings} | tables_json)
    print(by_run.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(by_grid.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
