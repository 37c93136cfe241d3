"""Profile vLLM step times on the user's GPU into sloweave's profile format.

Measures steps of n decodes (at a given KV context each) plus one c-token prefill chunk, a
prompt's first or one that starts p tokens into it (``--prefixes``: its attention over the
prefix, which the fit prices only from such steps), repeated, with vLLM's own scheduler and
random weights of the model's shape, and writes
the same profile format as the CPU runtime's ``sloweave profile`` (see
``sloweave.core.costs.step_profiles``), so the same fitting code gives the plug-in its cost model:

    .venv-vllm/bin/python benchmarks/vllm_gpu_profile.py --model benchmarks/models/llama-3.1-8b --out gpu_profile.csv
    vllm serve ... --scheduler-cls sloweave.vllm_plugin.SLOWeaveAsyncScheduler \\
        --additional-config '{"sloweave": {"cost": "gpu_profile.csv", "online_correction": true}}'

Needs a GPU. Not yet run on one (see README).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sloweave.core.costs.profile_fit import fit_profile
from sloweave.core.costs.step_profiles import write_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(__file__).parent / "models" / "llama-3.1-8b")
    parser.add_argument("--out", type=Path, default=Path("gpu_profile.csv"))
    parser.add_argument("--decodes", type=int, nargs="+", default=[0, 8, 32, 128])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 1024, 2048, 4096])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[0, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if min(args.prefixes) < 0:
        parser.error(f"--prefixes: token counts >= 0, got {args.prefixes}")

    from sloweave.vllm_plugin.engine_driver import make_engine, profile_steps

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prefixes = sorted(set(args.prefixes))
    engine = make_engine(str(args.model), max_num_batched_tokens=16384, enable_prefix_caching=prefixes != [0])
    frame = profile_steps(engine, vocab, args.decodes, args.chunks, args.contexts, args.repeats, prefixes=prefixes)
    write_profile(frame, args.out, meta={"engine": "vllm", "model": str(args.model)})
    fitted = fit_profile(frame)
    print(json.dumps(fitted.report, indent=2, default=str))
    print(f"wrote {args.out} ({len(frame)} steps)")


if __name__ == "__main__":
    main()
