"""Load sources for the capacity search: a workload per (seed, load scale).

Load is an arrival-rate scale s: every seed's base workload is replayed with its arrival
times divided by s (same requests, same burst structure, s times the rate).

What a "seed" is depends on the source:
- a synthetic workload: the generator seed (new arrivals and lengths);
- a timed trace: a disjoint time window of the trace. Different windows are different
  samples of the real arrival process (its rate and burstiness drift over the hour), so
  their spread is the uncertainty a user of the trace actually faces; jittering arrivals
  of one window would keep the same requests and understate it;
- a length-only file with generated arrivals: a random subsample of the lengths and a
  Poisson arrival stream, both drawn from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from sloweave.sim.trace_replay import ReplayOptions, replay_workload, split_windows
from sloweave.sim.traces import Trace
from sloweave.sim.workloads import Workload, WorkloadError, WorkloadSpec, back_to_back_workloads

DEFAULT_WINDOW_S = 300.0


class LoadSource(Protocol):
    """Something that yields a workload per (seed, load scale)."""

    name: str

    @property
    def num_seeds(self) -> int: ...

    def workload(self, seed: int, rate_scale: float) -> Workload: ...

    def base_rate_rps(self, seed: int) -> float: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class ScaledWorkloads:
    """One base workload per seed; load scale s divides its arrival times by s."""

    name: str
    base: tuple[Workload, ...]
    base_rates_rps: tuple[float, ...]  # request rate of each base workload at scale 1
    seed_labels: tuple[str, ...] = ()
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base:
            raise WorkloadError(f"{self.name}: need at least one seed workload")
        if len(self.base_rates_rps) != len(self.base):
            raise WorkloadError(f"{self.name}: one base rate per seed workload")

    @property
    def num_seeds(self) -> int:
        return len(self.base)

    def workload(self, seed: int, rate_scale: float) -> Workload:
        wl = self.base[seed]
        return replace(wl, arrival_s=wl.arrival_s / rate_scale, params={**wl.params, "rate_scale": rate_scale})

    def base_rate_rps(self, seed: int) -> float:
        return self.base_rates_rps[seed]

    def describe(self) -> dict:
        seeds = [
            {
                "seed": i,
                "label": self.seed_labels[i] if self.seed_labels else str(i),
                "requests": len(wl),
                "base_rate_rps": rate,
            }
            for i, (wl, rate) in enumerate(zip(self.base, self.base_rates_rps))
        ]
        return {"name": self.name, **self.info, "seeds": seeds}


@dataclass(frozen=True)
class SpecSource:
    """A synthetic workload family; seed i is generator seed ``seeds[i]``, load scales its rate."""

    spec: WorkloadSpec
    num_requests: int
    seeds: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_seeds(self) -> int:
        return len(self.seeds)

    def workload(self, seed: int, rate_scale: float) -> Workload:
        return self.spec.generate(self.num_requests, self.seeds[seed], rate_scale)

    def base_rate_rps(self, seed: int) -> float:
        return self.spec.rate_rps

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": "synthetic workload",
            "requests_per_seed": self.num_requests,
            "generator_seeds": list(self.seeds),
            "base_rate_rps": self.spec.rate_rps,
        }


def trace_source(
    trace: Trace,
    num_seeds: int,
    window_s: float | None = None,
    max_prompt_tokens: int | None = None,
    arrivals: str = "trace",
    rate_rps: float | None = None,
    requests_per_seed: int | None = None,
) -> ScaledWorkloads:
    """Seeds of a trace: disjoint time windows, or (length-only files) subsamples with Poisson arrivals."""
    base, rates, labels = [], [], []
    capped = 0
    if arrivals == "trace":
        if not trace.has_arrivals:
            # Same refusal as replay_workload, raised before any window is cut.
            replay_workload(trace, ReplayOptions())
        for start_s, end_s in split_windows(trace, num_seeds, window_s):
            options = ReplayOptions(
                start_s=start_s, end_s=end_s, max_prompt_tokens=max_prompt_tokens, max_requests=requests_per_seed
            )
            wl, report = replay_workload(trace, options)
            base.append(wl)
            rates.append(report.base_rate_rps)
            capped += report.num_prompts_capped
            labels.append(f"window [{report.window_start_s:.1f}, {report.window_end_s:.1f}) s")
        info = {"kind": "trace, seeds are disjoint time windows", "path": trace.path, "format": trace.fmt}
    else:
        n = min(requests_per_seed or 2000, len(trace))
        for seed in range(num_seeds):
            rng = np.random.default_rng(seed)
            rows = np.sort(rng.choice(len(trace), size=n, replace=False))
            sub = replace(
                trace, arrival_s=None, prompt_tokens=trace.prompt_tokens[rows], output_tokens=trace.output_tokens[rows]
            )
            options = ReplayOptions(
                arrivals="poisson", poisson_rate_rps=rate_rps, seed=seed, max_prompt_tokens=max_prompt_tokens
            )
            wl, report = replay_workload(sub, options)
            base.append(wl)
            rates.append(report.base_rate_rps)
            capped += report.num_prompts_capped
            labels.append(f"subsample seed {seed}: {report.arrivals}")
        info = {
            "kind": "GENERATED Poisson arrivals on the file's lengths (it has none, or they were replaced); seeds are random subsamples",
            "path": trace.path,
            "format": trace.fmt,
        }
    info["max_prompt_tokens"] = max_prompt_tokens
    info["num_prompts_capped"] = capped
    return ScaledWorkloads(trace.name, tuple(base), tuple(rates), tuple(labels), info)


def back_to_back(sources: list[ScaledWorkloads]) -> ScaledWorkloads:
    """Several traces replayed one after another: seed i is window i of each, in order.

    Load scale s divides every arrival time, so the whole sequence runs s times faster.
    The base rate is the joined workload's own (requests over its span).
    """
    if len({s.num_seeds for s in sources}) != 1:
        raise WorkloadError("back-to-back traces need the same number of seeds (windows) each")
    name = "+".join(s.name for s in sources)
    base, rates = [], []
    for seed in range(sources[0].num_seeds):
        wl = back_to_back_workloads([s.base[seed] for s in sources], name)
        base.append(wl)
        rates.append(len(wl) / wl.span_s if wl.span_s > 0 else float("nan"))
    labels = tuple(
        " then ".join(s.seed_labels[i] if s.seed_labels else str(i) for s in sources) for i in range(len(base))
    )
    info = {"kind": "traces back to back; seed i is window i of each", "parts": [s.describe() for s in sources]}
    return ScaledWorkloads(name, tuple(base), tuple(rates), labels, info)


def check_scalable(source: LoadSource) -> None:
    """A load scale divides arrival times: with every request at one instant it changes nothing."""
    for seed in range(source.num_seeds):
        workload = source.workload(seed, 1.0)
        if workload.span_s <= 0:
            raise ValueError(
                f"{source.name}, seed {seed}: all {len(workload)} request(s) arrive at the same instant, so scaling "
                "the load (which divides arrival times) cannot change it and capacity is undefined; use a trace "
                "(window) whose arrivals are spread in time, more requests, or generated arrivals (--arrivals poisson)"
            )
