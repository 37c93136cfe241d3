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
- the step kinds apart, as the margin keeps them (``step_residuals.STEP_KINDS``): a decode-only
  step draws from the decode-only steps, a step with a chunk from the steps with one, wherever
  the source holds 50 of each (else one set for both). A served plug-in's few small chunk steps
  would otherwise share a bucket with its decode-only steps, whose noise is a fraction of theirs;
- the buckets, by predicted step time, within each kind: first the sizes the source ran, split
  where no step lies within a factor sqrt(2) of the next (``SIZE_GAP_RATIO``, the margin's bucket
  width; a size group of under 20 steps joins its nearer neighbour), so that no bucket mixes
  steps of sizes the machine never ran between (a plug-in's 13 ms steps and its 50 ms prefills
  without decodes, whose larger noise would land on the 13 ms ones); then, in each size group,
  k = min(16, steps // 50) buckets with edges at the 1/k, ..., (k-1)/k quantiles of its predicted
  times, any with under 50 steps (ties at an edge) merged into its smaller neighbour. A step
  predicted between two groups draws from the nearer (the edge at their geometric mean), one
  outside the file's range from the nearest end bucket;
- each simulated iteration (``EmpiricalNoiseCost``) takes its predicted time p, draws one
  residual of p's bucket uniformly (a bootstrap, from a seeded numpy Generator built fresh per
  run, so the same seed gives the same times, bit for bit) and lasts max(p + residual, floor);
- or, with ``block_steps``, in the source's time order: a real machine's slow minute is a run
  of slow steps, which independent draws scatter. Iteration k reads the source's timeline at
  t = start + (k mod block_steps) (wrapping at its end; ``start`` drawn uniformly, seeded, at each
  block's first iteration) and takes the residual of the step of p's bucket nearest to t;
- or, with a pace (``pace_window_ms``, a source with start times): the machine's drift over
  seconds kept apart from the step-to-step noise (``machine_pace``). The residuals are taken
  against the paced prediction (p x the pace at the step's time), and an iteration at t ms on the
  simulated clock lasts p x pace(t) + a residual drawn as above: a twin of a run is slow when the
  run was, and its policy's online correction can follow the drift as the real one did;
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
from sloweave.core.costs.step_residuals import STEP_KINDS
from sloweave.core.costs.machine_pace import MachinePace
from sloweave.core.costs.step_profiles import START_COLUMN, ProfileError, offers_of, read_profile
from sloweave.core.validate import STEP_COUNT

MIN_STEPS_PER_BUCKET = 50
MAX_NOISE_BUCKETS = 16
# Predicted step times further apart than this factor, with no step between, are sizes of their own.
SIZE_GAP_RATIO = 2.0**0.5
MIN_STEPS_PER_GROUP = 20
_UNIFORM_BLOCK = 4096  # uniforms drawn at once: one Generator call per block, not per iteration
_CACHED_FILES = 4
_CACHED_NOISES = 8
BUCKET_RULE = (
    f"per step kind (decode-only, with a chunk; one set for both unless each has {MIN_STEPS_PER_BUCKET} steps), "
    f"the predicted step times split at gaps wider than a factor {SIZE_GAP_RATIO:.4g} (a group under "
    f"{MIN_STEPS_PER_GROUP} steps joins its nearer neighbour), then in each group k = min({MAX_NOISE_BUCKETS}, "
    f"steps // {MIN_STEPS_PER_BUCKET}) buckets by predicted step time, edges at its quantiles 1/k .. (k-1)/k; "
    f"a bucket under {MIN_STEPS_PER_BUCKET} steps merged into its smaller neighbour"
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
    start_ms: np.ndarray | None = None  # per step, its start on the engine's clock, where the source has it

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
        frame[START_COLUMN].to_numpy(np.float64) if START_COLUMN in frame.columns else None,
    )
    _files[key] = samples
    while len(_files) > _CACHED_FILES:
        _files.popitem(last=False)
    return samples


def start_times(samples: StepSamples) -> np.ndarray:
    """The steps' start times, which the machine's pace reads; refused where the source has none."""
    if samples.start_ms is None:
        raise StepNoiseError(
            f"step noise source {samples.source}: no step start times ({START_COLUMN}), which a pace reads: "
            "give a step log, or a profile written from one"
        )
    return samples.start_ms


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
    """Upper edges of the buckets (``BUCKET_RULE``, within one step kind): a step of prediction p is
    in bucket ``searchsorted(edges, p, side="right")``; the last bucket is open."""
    ordered = np.sort(np.asarray(predicted_ms, dtype=np.float64))
    groups = _size_groups(ordered)
    edges = [_quantile_edges(ordered[start:end]) for start, end in groups]
    for (_, end), (start, _) in zip(groups, groups[1:]):  # between two groups: the nearer draws
        low, high = ordered[end - 1], ordered[start]
        edges.append(np.array([(low * high) ** 0.5 if low > 0 else (low + high) / 2]))
    return np.unique(np.concatenate(edges)) if edges else np.empty(0)


def _size_groups(ordered_ms: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index ranges of sorted predicted times, cut where the next is more than
    ``SIZE_GAP_RATIO`` times the last; a group of under ``MIN_STEPS_PER_GROUP`` steps joins the
    neighbour nearer in log time (the smallest first)."""
    cuts = np.flatnonzero(ordered_ms[1:] > SIZE_GAP_RATIO * ordered_ms[:-1]) + 1
    bounds = [0, *cuts.tolist(), ordered_ms.size]
    groups = list(zip(bounds[:-1], bounds[1:]))
    while len(groups) > 1:
        sizes = [end - start for start, end in groups]
        g = int(np.argmin(sizes))
        if sizes[g] >= MIN_STEPS_PER_GROUP:
            break
        into_lower = g == len(groups) - 1 or (
            g > 0 and _log_gap(ordered_ms, groups[g - 1], groups[g]) <= _log_gap(ordered_ms, groups[g], groups[g + 1])
        )
        first = g - 1 if into_lower else g
        groups[first : first + 2] = [(groups[first][0], groups[first + 1][1])]
    return groups


def _log_gap(ordered_ms: np.ndarray, lower: tuple[int, int], upper: tuple[int, int]) -> float:
    """How far apart two neighbouring size groups lie in log time, between their nearest steps."""
    return float(np.log(max(ordered_ms[upper[0]], 1e-9) / max(ordered_ms[lower[1] - 1], 1e-9)))


def _quantile_edges(predicted_ms: np.ndarray) -> np.ndarray:
    """One size group's edges: k quantile buckets, a thin one merged into its smaller neighbour."""
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


def residual_buckets(
    predicted_ms,
    measured_ms,
    source: str = "given steps",
    positions=None,
    floor_ms: float | None = None,
    expected_ms=None,
) -> EmpiricalStepNoise:
    """The residuals measured - predicted of these steps in buckets of predicted time (``BUCKET_RULE``,
    one step kind). ``positions``: each step's index on the source's timeline (by default its order
    here); ``floor_ms``: the source's fastest step (by default these steps'); ``expected_ms``: what
    each residual is taken against, where not the prediction itself (the paced prediction)."""
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
    positions = np.arange(predicted_ms.size) if positions is None else np.asarray(positions, dtype=np.int64)
    edges = bucket_edges(predicted_ms)
    bucket = np.searchsorted(edges, predicted_ms, side="right")
    residuals = measured_ms - (predicted_ms if expected_ms is None else np.asarray(expected_ms, dtype=np.float64))
    members = [np.flatnonzero(bucket == b) for b in range(edges.size + 1)]
    return EmpiricalStepNoise(
        source,
        int(predicted_ms.size),
        tuple(edges.tolist()),
        tuple(tuple(residuals[m].tolist()) for m in members),
        tuple(tuple(positions[m].tolist()) for m in members),
        tuple((float(predicted_ms[m].min()), float(predicted_ms[m].max())) for m in members),
        float(measured_ms.min()) if floor_ms is None else float(floor_ms),
    )


@dataclass(frozen=True)
class StepNoise:
    """A source's residuals by step kind: ``kinds[0]`` for decode-only steps, ``kinds[1]`` for steps
    with a chunk (the same buckets twice where the source holds too few of a kind to keep them apart)."""

    source: str
    steps: int
    kinds: tuple[EmpiricalStepNoise, EmpiricalStepNoise]
    floor_ms: float
    pace: MachinePace | None = None  # the machine's drift, kept apart from the residuals

    @classmethod
    def of_steps(
        cls, predicted_ms, measured_ms, with_chunk, source: str = "given steps", pace: MachinePace | None = None,
        start_ms=None,
    ) -> StepNoise:  # fmt: skip
        """The residual buckets of these steps, each kind apart when both have ``MIN_STEPS_PER_BUCKET``;
        with a ``pace`` (and each step's ``start_ms``) taken against the paced prediction."""
        predicted_ms, measured_ms = np.asarray(predicted_ms, dtype=np.float64), np.asarray(measured_ms, np.float64)
        with_chunk = np.asarray(with_chunk, dtype=bool)
        expected = None if pace is None else predicted_ms * pace.of_source_steps(start_ms)
        together = residual_buckets(predicted_ms, measured_ms, source, expected_ms=expected)
        members = [np.flatnonzero(~with_chunk), np.flatnonzero(with_chunk)]
        if min(m.size for m in members) < MIN_STEPS_PER_BUCKET:
            return cls(source, together.steps, (together, together), together.floor_ms, pace)
        kinds = tuple(
            residual_buckets(
                predicted_ms[m], measured_ms[m], source, positions=m, floor_ms=together.floor_ms,
                expected_ms=None if expected is None else expected[m],
            )
            for m in members
        )  # fmt: skip
        return cls(source, together.steps, kinds, together.floor_ms, pace)

    @property
    def kinds_apart(self) -> bool:
        return self.kinds[0] is not self.kinds[1]

    def describe(self) -> dict:
        """The source, the rules, and per kind its buckets (``EmpiricalStepNoise.describe``)."""
        described = self.kinds[0].describe()
        buckets = {name: kind.describe()["buckets"] for name, kind in zip(STEP_KINDS, self.kinds)}
        del described["buckets"]
        pace = {"pace": self.pace.describe()} if self.pace is not None else {}
        return described | {"steps": self.steps, "kinds_apart": self.kinds_apart, "buckets_by_kind": buckets} | pace


_noises: OrderedDict = OrderedDict()


def step_noise_from_file(path: str | Path, cost: CostModel, pace_window_ms: float = 0.0) -> StepNoise:
    """The residual buckets of the steps in ``path`` against ``cost``, by step kind, with the machine's
    pace over ``pace_window_ms`` kept apart where it is not 0; built once per file, cost object and
    window in a process (the cache keeps the cost, so its id is not reused while it is kept)."""
    samples = read_step_samples(path)
    key = (samples.source, samples.sha256, id(cost), pace_window_ms)
    if key in _noises:
        _noises.move_to_end(key)
        return _noises[key][1]
    predicted = predicted_times(samples, cost)
    pace = None
    if pace_window_ms:
        pace = MachinePace.of_steps(
            start_times(samples), predicted, samples.measured_ms, pace_window_ms, samples.source
        )
    noise = StepNoise.of_steps(
        predicted, samples.measured_ms, samples.chunk_tokens > 0, samples.source, pace, samples.start_ms
    )
    _noises[key] = (cost, noise)
    while len(_noises) > _CACHED_NOISES:
        _noises.popitem(last=False)
    return noise


class EmpiricalNoiseCost:
    """The simulator's "actual" iteration time: the cost's prediction plus a residual the machine
    showed for a step of that kind at that predicted time (a seeded bootstrap, or with
    ``block_steps`` > 0 blocks of the source's timeline), never below the floor. ``noise``: a
    ``StepNoise``, or one ``EmpiricalStepNoise`` for both kinds. Stateful: build one per run
    (``sloweave.sim.options.EngineOptions.actual_cost`` does)."""

    __slots__ = ("cost", "noise", "seed", "block_steps", "_rng", "_uniform", "_next", "_kinds", "_floor", "_step",
                 "_start", "_pace", "_now_ms")  # fmt: skip

    def __init__(self, cost: CostModel, noise: StepNoise | EmpiricalStepNoise, seed: int, block_steps: int = 0) -> None:
        if isinstance(noise, EmpiricalStepNoise):
            noise = StepNoise(noise.source, noise.steps, (noise, noise), noise.floor_ms)
        if not isinstance(noise, StepNoise):
            raise StepNoiseError(f"noise must be a StepNoise or an EmpiricalStepNoise, got {type(noise).__name__}")
        STEP_COUNT.check(block_steps, "block_steps")
        if block_steps and noise.pace is not None:
            raise StepNoiseError(
                "a paced noise draws its residuals independently: blocks of the timeline would replay its drift twice"
            )
        self.cost, self.noise, self.seed, self.block_steps = cost, noise, seed, block_steps
        self._pace = noise.pace.at if noise.pace is not None else None
        self._now_ms = 0.0
        self._rng = np.random.default_rng(seed)
        self._uniform: list[float] = []
        self._next = 0
        # per kind: (upper edges, residuals per bucket, source positions per bucket)
        self._kinds = tuple((kind.upper_edges_ms, kind.residuals_ms, kind.positions) for kind in noise.kinds)
        self._floor = noise.floor_ms
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
        edges, by_bucket, positions = self._kinds[chunk_tokens > 0]
        bucket = bisect.bisect_right(edges, predicted_ms)
        residuals = by_bucket[bucket]
        if self.block_steps:
            residual_ms = residuals[self._nearest_in_time(positions[bucket])]
        else:
            residual_ms = residuals[int(self._draw() * len(residuals))]
        if self._pace is not None:
            predicted_ms *= self._pace(self._now_ms)
        actual_ms = predicted_ms + residual_ms
        return actual_ms if actual_ms > self._floor else self._floor

    def set_time_ms(self, now_ms: float) -> None:
        """The simulated clock at the next iteration's start (the engine tells it each iteration
        when the noise is paced; ``reads_clock``)."""
        self._now_ms = now_ms

    @property
    def reads_clock(self) -> bool:
        return self._pace is not None

    def _nearest_in_time(self, positions: tuple[int, ...]) -> int:
        """The index, among a bucket's source steps (``positions``), of the one nearest to this
        iteration's place on the timeline."""
        if self._step % self.block_steps == 0:
            self._start = int(self._draw() * self.noise.steps)
        t = (self._start + self._step % self.block_steps) % self.noise.steps
        self._step += 1
        j = bisect.bisect_left(positions, t)
        if j == len(positions) or (j > 0 and t - positions[j - 1] <= positions[j] - t):
            return j - 1
        return j

    def describe(self) -> dict:
        return self.noise.describe()
