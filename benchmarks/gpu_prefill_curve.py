"""Time one prompt's prefill alone on the GPU, by chunk size: the model's own cost per token.

transformers' continuous batching adds its Python bookkeeping and an attention over the
whole batch's keys to every step; a single causal forward of ``c`` tokens has neither, so
it is the part of a serving engine's step that the model's kernels set. Whether the cost per
prompt token rises with the chunk decides whether the fastest chunk is the largest:

    python3 benchmarks/gpu_prefill_curve.py --out results/gpu/prefill_curve.csv
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from sloweave.runtime.model import load_model


WARMUP = 3


def timed_ms(run, repeats: int) -> list[float]:
    """``run()`` timed with CUDA events, ``WARMUP`` times unrecorded, then ``repeats`` times."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(WARMUP + repeats):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end))
    return times


def forward(model, chunk_tokens: int):
    """One prompt's forward of ``chunk_tokens`` random tokens, as a call."""
    ids = torch.randint(0, model.config.vocab_size, (1, chunk_tokens), device="cuda")
    return lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)


def time_forward_ms(model, chunk_tokens: int, repeats: int) -> list[float]:
    return timed_ms(forward(model, chunk_tokens), repeats)


def time_graph_ms(model, chunk_tokens: int, repeats: int) -> list[float]:
    """The same forward captured once in a CUDA graph and replayed: no host launch cost, as a
    serving engine's CUDA graphs run it."""
    run = forward(model, chunk_tokens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return timed_ms(graph.replay, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(Path(__file__).parent / "models" / "llama-3.1-8b"))
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("results/gpu/prefill_curve.csv"))
    parser.add_argument("--cuda-graph", action="store_true", help="replay each forward from a CUDA graph")
    args = parser.parse_args()
    model = load_model(args.model, seed=0, dtype="bfloat16", device="cuda")
    timer = time_graph_ms if args.cuda_graph else time_forward_ms
    rows = []
    for chunk in sorted(args.chunks):
        with torch.no_grad():
            times = pd.Series(timer(model, chunk, args.repeats))
        rows.append({"chunk_tokens": chunk, "median_ms": times.median(), "min_ms": times.min(), "max_ms": times.max()})
    frame = pd.DataFrame(rows)
    frame["ms_per_token"] = frame.median_ms / frame.chunk_tokens
    frame["marginal_ms_per_token"] = frame.median_ms.diff() / frame.chunk_tokens.diff()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False)
    meta = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": "bfloat16",
    }
    timed = "one CUDA graph replay" if args.cuda_graph else "one eager forward"
    meta.update(repeats=args.repeats, warmup=WARMUP, timer=f"CUDA events around {timed}")
    args.out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
