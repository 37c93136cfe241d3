"""Build src/sloweave/data/length_quantiles.csv from the shared real traces.

The workload generators draw prompt and output lengths by inverse-CDF sampling from these
quantiles, so the synthetic workloads keep the shapes of real data without shipping the
traces inside the package. Run from the repository root:

    python scripts/make_length_data.py ../shared/traces
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd

QUANTILES = np.linspace(0.0, 1.0, 1001)


def main(traces_dir: str) -> None:
    root = Path(traces_dir)
    azure = pd.read_csv(root / "azure2023_conv.csv")
    arxiv = pd.read_csv(root / "lengths_only" / "arxiv_summarization_vidur.csv")
    table = pd.DataFrame(
        {
            "quantile": QUANTILES,
            "azure_conv_prompt": np.quantile(azure["prompt_tokens"], QUANTILES),
            "azure_conv_output": np.quantile(azure["output_tokens"], QUANTILES),
            "arxiv_prompt": np.quantile(arxiv["prompt_tokens"], QUANTILES),
            "arxiv_output": np.quantile(arxiv["output_tokens"], QUANTILES),
        }
    )
    out = Path(__file__).resolve().parents[1] / "src" / "sloweave" / "data" / "length_quantiles.csv"
    table.to_csv(out, index=False, float_format="%.3f")
    print(f"wrote {out} ({len(table)} quantiles)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/traces")
