"""The machine's own step-time noise: a real engine's measured minus predicted step times, replayed.

``NoisyCost`` multiplies the model's time by a lognormal factor. On the real CPU engine the
noise is mostly additive (decode-only 5 ms steps spread by 3-4 ms, 2,048-token 50 ms steps by
about 5 ms), which no single lognormal sigma has. Here the noise is the machine's own:

- the steps: a step log (``.jsonl``, ``sloweave.core.step_log``: the steps vLLM ran, their KV
  context and measured time, through ``step_log.profile_rows``) or a step-time profile with
  measured times (CSV/JSON), read by ``step_profiles.read_profile`` (``read_step_samples``);
- the residuals: measured_ms - predicted_ms, the prediction the run's cost model makes for the
  step's decodes, chunk and KV context (``predict(n, c, decode_kv, prefix)`` for a cost that
  reads the context, ``T(n, c)`` otherwise), not the margin-inclusive plan of the log. The cost
  is normally the one fitted to the same file (``--cost LOG``), so the residuals are the fit's;
- the buckets, by predicted step time: k = min(16, steps // 50) buckets with edges at the
  1/k, ..., (k-1)/k quantiles of the predicted times, then any bucket with under 50 steps
  (ties at an edge) merged into its smaller neighbour: every bucket holds at least 50 steps,
  and a step predicted outside the file's range draws from the nearest end bucket;
- each simulated iteration (``EmpiricalNoiseCost``) takes its predicted time p, draws one
  residual of p's bucket uniformly (a bootstrap, from a seeded numpy Generator built fresh per
  run, so the same seed gives the same times, bit for bit) and lasts max(p + residual, floor);
- or, with ``block_steps``, in the source's time order: a real machine's slow minute is a run
  of slow steps, which independent draws scatter. Iteration k reads the source's timeline at
  t = start + (k mod block_steps) (wrapping at its end; ``start`` drawn uniformly, seeded, at each
  block's first iteration) and takes the residual of the step of p's bucket nearest to t;
- the floor is the smallest step time measured in the file: the machine never ran a faster
  step, and a residual drawn from a bucket's slower steps onto a prediction at the bucket's
  low end cannot make a step faster than that (or negative). A relative floor (0.1 p) would let
  a small step run several times faster than the machine ever did.

``step_noise_from_file`` reads a file once per process (cached by path, size and modification
time) and its residuals once per cost model object, so a study's simulations share them.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sloweave.core.costs.protocols import ContextAware, CostModel, predict_each, uncounted
from sloweave.core.costs.step_profiles import ProfileError, offers_of, read_profile
from sloweave.core.validate import STEP_COUNT

MIN_STEPS_PER_BUCKET = 50
MAX_NOISE_BUCKETS = 16
_UNIFORM_BLOCK = 4096  # uniforms drawn at once: one Generator call per block, not per iteration
_CACHED_FILES = 4
_CACHED_NOISES = 8
BUCKET_RULE = (
    f"k = min({MAX_NOISE_BUCKETS}, steps // {MIN_STEPS_PER_BUCKET}) buckets by predicted step time, edges at its "
    f"quantiles 1/k .. (k-1)/k; a bucket under {MIN_STEPS_PER_BUCKET} steps merged into its smaller neighbour"
)
FLOOR_RULE = "the smallest step time measured in the source: the machine never ran a faster step"
PREDICTOR = (
    "the run's cost model (recorded under cost), with each step's decodes, chunk and KV context, and the prompts "
    "a chunk spans where the source names them"
)


class StepNoiseError(ValueError):
    """A source of step-time noise that cannot be used (names the file and the problem)."""


@dataclass(frozen=True)
class StepSamples:
    """The measured steps of one file, as a step-time profile's columns (``read_step_samples``)."""

    source: str
    sha256: str
    n_decodes: np.ndarray
    chunk_tokens: np.ndarray
    decode_kv_tokens: np.ndarray
    prefill_prefix_tokens: np.ndarray
    measured_ms: np.ndarray
    offers: tuple  # per step, the prompts its chunk spans ((tokens, computed), ...), or None: one

    @property
    def steps(self) -> int:
        return int(self.measured_ms.size)

    def describe(self) -> dict:
        """What a result file records about the source, whatever cost model the run uses."""
        p50, p99 = np.percentile(self.measured_ms, [50, 99])
        return {
            "source": self.source,
            "sha256": self.sha256,
            "steps": self.steps,
            "measured_ms": {
                "min": float(self.measured_ms.min()),
                "p50": float(p50),
                "p99": float(p99),
                "max": float(self.measured_ms.max()),
            },
            "residual_of": PREDICTOR,
            "buckets": BUCKET_RULE,
            "floor": FLOOR_RULE,
        }


_files: OrderedDict = OrderedDict()


def read_step_samples(path: str | Path) -> StepSamples:
    """The measured steps of a step log or a step-time profile; ``StepNoiseError`` names what is wrong
    (no such file, not a log or profile, no measured times, a non-finite value, under 50 steps)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as err:
        raise StepNoiseError(f"step noise source {path}: cannot read it ({err.strerror or err})") from None
    if not path.is_file():
        raise StepNoiseError(f"step noise source {path}: not a file (give a step log or a step-time profile)")
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _files:
        _files.move_to_end(key)
        return _files[key]
    try:
        frame = read_profile(path)
    except ProfileError as err:
        raise StepNoiseError(
            f"step noise source {path}: not a step log or a step-time profile with measured step times ({err})"
        ) from None
    if len(frame) < MIN_STEPS_PER_BUCKET:
        raise StepNoiseError(
            f"step noise source {path}: {len(frame)} measured step(s), too few: one bucket of residuals "
            f"needs at least {MIN_STEPS_PER_BUCKET}"
        )
    columns = ("n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens")
    samples = StepSamples(
        str(path),
        hashlib.sha256(path.read_bytes()).hexdigest(),
        *(frame[c].to_numpy(np.int64) for c in columns),
        frame["step_ms"].to_numpy(np.float64),
        tuple(offers_of(frame)),
    )
    _files[key] = samples
    while len(_files) > _CACHED_FILES:
        _files.popitem(last=False)
    return samples


def predicted_times(samples: StepSamples, cost: CostModel) -> np.ndarray:
    """``cost``'s prediction for every step of ``samples``, with the step's KV context when it reads one."""
    steps = zip(
        samples.n_decodes.tolist(),
        samples.chunk_tokens.tolist(),
        samples.decode_kv_tokens.tolist(),
        samples.prefill_prefix_tokens.tolist(),
    )
    with uncounted(cost):  # the residuals are no queries of a run
        if isinstance(cost, ContextAware):  # a chunk over several prompts priced as the run priced it
            predicted = predict_each(cost, steps, samples.offers)
        else:
            predicted = [cost(n, c) for n, c, _, _ in steps]
    predicted_ms = np.asarray(predicted, dtype=np.float64)
    bad = np.flatnonzero(~(np.isfinite(predicted_ms) & (predicted_ms >= 0)))
    if bad.size:
        i = int(bad[0])
        raise StepNoiseError(
            f"step noise source {samples.source}: the cost model predicts {float(predicted_ms[i])} ms for step {i} "
            f"(n_decodes={samples.n_decodes[i]}, chunk_tokens={samples.chunk_tokens[i]}): not a finite time >= 0"
        )
    return predicted_ms


def bucket_edges(predicted_ms: np.ndarray) -> np.ndarray:
    """Upper edges of the buckets (``BUCKET_RULE``): a step of prediction p is in bucket
    ``searchsorted(edges, p, side="right")``; the last bucket is open."""
    k = min(MAX_NOISE_BUCKETS, predicted_ms.size // MIN_STEPS_PER_BUCKET)
    edges = np.unique(np.quantile(predicted_ms, np.arange(1, k) / k)) if k > 1 else np.empty(0)
    while edges.size:
        counts = np.bincount(np.searchsorted(edges, predicted_ms, side="right"), minlength=edges.size + 1)
        thin = np.flatnonzero(counts < MIN_STEPS_PER_BUCKET)
        if not thin.size:
            break
        b = int(thin[np.argmin(counts[thin])])  # the thinnest first
        lower_is_smaller = b == edges.size or (b > 0 and counts[b - 1] <= counts[b + 1])
        edges = np.delete(edges, b - 1 if lower_is_smaller else b)
    return edges


@dataclass(frozen=True)
class EmpiricalStepNoise:
    """Residuals in ms (measured - predicted) of one source's steps, by predicted step time."""

    source: str
    steps: int
    upper_edges_ms: tuple[float, ...]  # bucket i: predicted below upper_edges_ms[i]; the last is open
    residuals_ms: tuple[tuple[float, ...], ...]  # per bucket, in the source's step order
    positions: tuple[tuple[int, ...], ...]  # per bucket, each residual's step index in the source
    predicted_seen_ms: tuple[tuple[float, float], ...]  # per bucket: the smallest and largest prediction in it
    floor_ms: float

    def bucket_of(self, predicted_ms: float) -> int:
        return bisect.bisect_right(self.upper_edges_ms, predicted_ms)

    def describe(self) -> dict:
        """The source, the rules, and per bucket its range, steps and P1/P50/P99 residuals."""
        lower = (0.0, *self.upper_edges_ms)
        upper = (*self.upper_edges_ms, None)
        buckets = []
        for i, residuals in enumerate(self.residuals_ms):
            p1, p50, p99 = np.percentile(residuals, [1, 50, 99])
            low_seen, high_seen = self.predicted_seen_ms[i]
            buckets.append(
                {
                    "predicted_ms_from": lower[i],
                    "predicted_ms_to": upper[i],
                    "predicted_ms_seen": [low_seen, high_seen],
                    "steps": len(residuals),
                    "residual_ms_p1": float(p1),
                    "residual_ms_p50": float(p50),
                    "residual_ms_p99": float(p99),
                }
            )
        return {
            "source": self.source,
            "steps": self.steps,
            "residual_of": PREDICTOR,
            "bucket_rule": BUCKET_RULE,
            "floor_ms": self.floor_ms,
            "floor": FLOOR_RULE,
            "buckets": buckets,
        }


def residual_buckets(predicted_ms, measured_ms, source: str = "given steps") -> EmpiricalStepNoise:
    """The residuals measured - predicted of these steps in buckets of predicted time (``BUCKET_RULE``)."""
    predicted_ms = np.asarray(predicted_ms, dtype=np.float64)
    measured_ms = np.asarray(measured_ms, dtype=np.float64)
    if predicted_ms.shape != measured_ms.shape or predicted_ms.ndim != 1:
        raise StepNoiseError(f"step noise source {source}: one predicted and one measured time per step")
    for name, values in (("predicted", predicted_ms), ("measured", measured_ms)):
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
        if bad.size:
            raise StepNoiseError(
                f"step noise source {source}: step {bad[0]}'s {name} time is {float(values[bad[0]])} ms"
            )
    if predicted_ms.size < MIN_STEPS_PER_BUCKET:
        raise StepNoiseError(f"step noise source {source}: {predicted_ms.size} steps, at least {MIN_STEPS_PER_BUCKET}")
    edges = bucket_edges(predicted_ms)
    bucket = np.searchsorted(edges, predicted_ms, side="right")
    residuals = measured_ms - predicted_ms
    members = [np.flatnonzero(bucket == b) for b in range(edges.size + 1)]
    return EmpiricalStepNoise(
        source,
        int(predicted_ms.size),
        tuple(edges.tolist()),
        tuple(tuple(residuals[m].tolist()) for m in members),
        tuple(tuple(m.tolist()) for m in members),
        tuple((float(predicted_ms[m].min()), float(predicted_ms[m].max())) for m in members),
        float(measured_ms.min()),
    )


_noises: OrderedDict = OrderedDict()


def step_noise_from_file(path: str | Path, cost: CostModel) -> EmpiricalStepNoise:
    """The residual buckets of the steps in ``path`` against ``cost``; built once per file and cost
    object in a process (the cache keeps the cost, so its id is not reused while it is kept)."""
    samples = read_step_samples(path)
    key = (samples.source, samples.sha256, id(cost))
    if key in _noises:
        _noises.move_to_end(key)
        return _noises[key][1]
    noise = residual_buckets(predicted_times(samples, cost), samples.measured_ms, samples.source)
    _noises[key] = (cost, noise)
    while len(_noises) > _CACHED_NOISES:
        _noises.popitem(last=False)
    return noise


class EmpiricalNoiseCost:
    """The simulator's "actual" iteration time: the cost's prediction plus a residual the machine
    showed at that predicted time (a seeded bootstrap, or with ``block_steps`` > 0 blocks of the
    source's timeline), never below the floor. Stateful: build one per run
    (``sloweave.sim.options.EngineOptions.actual_cost`` does)."""

    __slots__ = (
        "cost", "noise", "seed", "block_steps", "_rng", "_uniform", "_next", "_edges", "_residuals", "_floor",
        "_step", "_start",
    )  # fmt: skip

    def __init__(self, cost: CostModel, noise: EmpiricalStepNoise, seed: int, block_steps: int = 0) -> None:
        if not isinstance(noise, EmpiricalStepNoise):
            raise StepNoiseError(f"noise must be an EmpiricalStepNoise, got {type(noise).__name__}")
        STEP_COUNT.check(block_steps, "block_steps")
        self.cost, self.noise, self.seed, self.block_steps = cost, noise, seed, block_steps
        self._rng = np.random.default_rng(seed)
        self._uniform: list[float] = []
        self._next = 0
        self._edges, self._residuals, self._floor = noise.upper_edges_ms, noise.residuals_ms, noise.floor_ms
        self._step = self._start = 0

    def _draw(self) -> float:
        """The next seeded uniform in [0, 1)."""
        i = self._next
        if i == len(self._uniform):
            self._uniform, i = self._rng.random(_UNIFORM_BLOCK).tolist(), 0
        self._next = i + 1
        return self._uniform[i]

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        predicted_ms = self.cost(n_decodes, chunk_tokens)
        bucket = bisect.bisect_right(self._edges, predicted_ms)
        residuals = self._residuals[bucket]
        if self.block_steps:
            residual_ms = residuals[self._nearest_in_time(bucket)]
        else:
            residual_ms = residuals[int(self._draw() * len(residuals))]
        actual_ms = predicted_ms + residual_ms
        return actual_ms if actual_ms > self._floor else self._floor

    def _nearest_in_time(self, bucket: int) -> int:
        """The index, in ``bucket``, of its source step nearest to this iteration's place on the timeline."""
        if self._step % self.block_steps == 0:
            self._start = int(self._draw() * self.noise.steps)
        t = (self._start + self._step % self.block_steps) % self.noise.steps
        self._step += 1
        positions = self.noise.positions[bucket]
        j = bisect.bisect_left(positions, t)
        if j == len(positions) or (j > 0 and t - positions[j - 1] <= positions[j] - t):
            return j - 1
        return j

    def describe(self) -> dict:
        return self.noise.describe()
