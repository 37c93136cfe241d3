"""Pictures drawn from plain per-step arrays, so a simulated and a served run look alike.

The simulator (``sloweave reproduce``) and a served run's step log (``sloweave served-run``)
both call ``plot_step_timeline``; neither passes its own objects in, only arrays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# The window skips the start of a run (warm-up: empty batches, the first prompts arriving),
# at most this long and at most a third of the run.
WARMUP_SKIP_S = 5.0


def pyplot():
    """matplotlib's pyplot without a display (imported late: only the commands that draw pay for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_window(t_s: np.ndarray, window_s: float, skip_warmup: bool = True) -> np.ndarray:
    """The steps drawn: ``window_s`` seconds after the warm-up skip (from the first step without it)."""
    start_s = t_s[0] + (min(WARMUP_SKIP_S, max(0.0, (t_s[-1] - t_s[0]) / 3)) if skip_warmup else 0.0)
    return (t_s >= start_s) & (t_s < start_s + window_s)


def plot_step_timeline(
    t_s,
    chunk_tokens,
    step_ms,
    budget_ms,
    title: str,
    path: Path,
    xlabel: str = "simulated time (s)",
    window_s: float = 5.0,
    skip_warmup: bool = True,
) -> None:
    """Chunk per step (top) and step time against the time budget (bottom) over a window.

    A simulated run skips its warm-up; a served run (``skip_warmup=False``) is drawn from its first step.
    ``budget_ms`` is +inf where nothing decodes (no deadline): those steps leave a gap in
    the budget line rather than an infinite value.
    """
    plt = pyplot()
    t_s = np.asarray(t_s, dtype=np.float64)
    chunk_tokens = np.asarray(chunk_tokens)
    step_ms = np.asarray(step_ms, dtype=np.float64)
    budget_ms = np.asarray(budget_ms, dtype=np.float64)
    keep = timeline_window(t_s, window_s, skip_warmup)
    fig, (ax_chunk, ax_time) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    ax_chunk.step(t_s[keep], chunk_tokens[keep], where="post", linewidth=0.8)
    ax_chunk.set_ylabel("prefill chunk (tokens)")
    ax_chunk.set_title(title)
    budget = np.where(np.isinf(budget_ms[keep]), np.nan, budget_ms[keep])
    ax_time.plot(t_s[keep], step_ms[keep], linewidth=0.8, label="iteration time")
    ax_time.plot(t_s[keep], budget, linewidth=1.2, linestyle="--", label="budget B_t")
    ax_time.set_ylabel("ms")
    ax_time.set_xlabel(xlabel)
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
