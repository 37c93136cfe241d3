"""Iteration cost from measured GPU operator profiles (no engine imports), in milliseconds.

For an iteration with n decodes (together reading D KV tokens) and prefill pieces (chunk c_k
on top of a prefix p_k already in the cache):

    T = L x [ ops(N) + decode_attention(n, D / n) + sum_k prefill_attention(c_k, p_k) ] + cpu(n + pieces)

with N = n + sum_k c_k tokens and L layers; ``ops`` is the per-layer sum of the token-parallel
operators (norms, QKV and output projections, rope, gated MLP, residual add) plus, with tensor
parallelism, two all-reduces of the layer's activations (each with a launch overhead); ``cpu``
is the engine's per-iteration CPU work (schedule, prepare inputs, sampler, process outputs).
Every table is the profiled medians, linearly interpolated between profiled points and made
non-decreasing (a running maximum), so T is monotone in the chunk by construction, and the
constructor checks it on a grid of contexts as well.

Outside the profiled range (more tokens, longer contexts, larger batches than measured) each
operator is extrapolated linearly from its profiled end, with a fitted slope (prefill attention
by its fitted work, chunk x (prefix + chunk / 2) query-key pairs); every such query is counted
per operator (``out_of_range``) and warned about once, so no result silently rests on it.
"""

from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager
from collections.abc import Callable, Sequence

import numpy as np

from sloweave.core.costs.protocols import check_monotone_in_chunk, offer_pieces
from sloweave.core.costs.fitted import ContextualCost, nnls
from sloweave.core.costs.step_profiles import ProfileError
from sloweave.core.costs.operator_profiles import PRESETS, OperatorProfiles, load_profiles

# Vidur's modelling constant for each all-reduce's launch (not measured).
NCCL_LAUNCH_MS = 0.02
DECODE_KV_STEP = 32  # the dense decode table's KV step (tokens per request)
CHUNK_STEP = 16  # the dense prefill table's chunk step
PREFIX_STEP = 32  # and its prefix step


def isotonic(values: np.ndarray) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool adjacent violators).

    Measured medians wobble (a 2 kB all-reduce can time slower than a 20 kB one); a running
    maximum would keep every upward wobble, this averages it out.
    """
    blocks: list[list[float]] = []  # [mean, weight]
    for v in np.asarray(values, dtype=float):
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return np.concatenate([np.full(int(w), m) for m, w in blocks])


def _dense(grid: np.ndarray, values: np.ndarray, upto: int, step: int = 1) -> np.ndarray:
    """Values on 0, step, 2 step, ... upto: made non-decreasing over the grid, interpolated between
    profiled points, constant before the first one."""
    order = np.argsort(grid)
    points = np.arange(0, upto + 1, step, dtype=float)
    return np.interp(points, grid[order], isotonic(values[order]))


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _end_slope(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope over the last quarter of the profiled range, >= 0 (for extrapolation)."""
    tail = x >= x.min() + 0.75 * (x.max() - x.min())
    if tail.sum() < 2:
        tail = np.ones_like(x, dtype=bool)
    if np.ptp(x[tail]) == 0:
        return 0.0
    return max(0.0, float(np.polyfit(x[tail], y[tail], 1)[0]))  # plain float: the hot path adds it


class ProfileCost(ContextualCost):
    """T(n, c) of a profiled GPU configuration, with the KV context set before each decision."""

    def __init__(
        self, profiles: OperatorProfiles, cpu_overhead: bool = True, nccl_launch_ms: float = NCCL_LAUNCH_MS
    ) -> None:
        self.profiles = profiles
        self.shape = profiles.shape
        self.layers = profiles.shape.num_layers
        self.cpu_overhead = cpu_overhead and profiles.cpu is not None
        self.out_of_range: Counter = Counter()
        self._counting = True
        self._build_token_ops(nccl_launch_ms)
        self._build_decode()
        self._build_prefill()
        self._build_cpu()
        self._decode_n = self._decode_kv = -1  # the last decode term's (n, KV), none yet
        self._decode_ms = 0.0
        self._offer: list[tuple[int, int]] | None = None
        self.prefill_prefix_tokens = -1  # forces the first set_context to place the prefix
        self._check_monotone()

    def _check_monotone(self) -> None:
        """Monotone in the chunk by construction; checked anyway, in and beyond the profiled range."""
        with self.uncounted():
            for kv, prefix in ((0, 0), (200_000, 1000), (2_000_000, 10_000), (0, 100_000)):
                try:  # the context as arguments (``predict``), not set on the model before each query
                    check_monotone_in_chunk(
                        lambda n, c: self.predict(n, c, kv, prefix), 8192, decode_counts=(0, 1, 8, 64, 256)
                    )
                except ValueError as err:
                    raise ProfileError(f"{self.profiles.where}: {err}") from None
        self.set_context(0, 0)  # the first context: places the head prompt's prefix rows
        self._decode_n = self._decode_kv = -1

    # ---- tables ---------------------------------------------------------------------------

    def _build_token_ops(self, nccl_launch_ms: float) -> None:
        mlp = self.profiles.mlp
        grid, values = mlp["num_tokens"].to_numpy(float), mlp["token_ops_ms"].to_numpy(float)
        self.tokens_max = int(grid.max())
        per_layer = _dense(grid, values, self.tokens_max)
        slope = _end_slope(grid, values)
        reduce = self.profiles.all_reduce
        if reduce is not None:
            r_grid, r_values = reduce["num_tokens"].to_numpy(float), reduce["all_reduce_ms"].to_numpy(float)
            if r_grid.max() < self.tokens_max:
                raise ProfileError(
                    f"{self.profiles.where}: all_reduce.csv stops at {r_grid.max():.0f} tokens, mlp.csv goes to {self.tokens_max}"
                )
            # Two all-reduces per layer (after attention and after the MLP), as Megatron-style TP does.
            per_layer += 2 * (_dense(r_grid, r_values, self.tokens_max) + nccl_launch_ms)
            slope += 2 * _end_slope(r_grid, r_values)
        per_layer[0] = 0.0  # no tokens, no work
        self._tokens = per_layer.tolist()
        self._tokens_slope = slope
        # Tile edges: profiled token counts after which the per-token time rises (kernels run in
        # tiles, so the time jumps just past each edge); the policy weighs chunks ending there.
        points = [int(t) for t in grid if t >= 1]
        per_token = [self._tokens[t] / t for t in points]
        self.tile_edges = [t for t, here, after in zip(points, per_token, per_token[1:]) if after > here]

    def _build_decode(self) -> None:
        decode = self.profiles.decode
        table = decode.pivot_table(index="batch_size", columns="kv_cache_size", values="attn_ms")
        kv_grid = table.columns.to_numpy(float)
        self.decode_kv_max = int(kv_grid.max())
        rows = []
        for _, row in table.iterrows():
            ok = row.notna().to_numpy()
            rows.append(
                _dense(
                    kv_grid[ok], row.to_numpy(float)[ok], _round_up(self.decode_kv_max, DECODE_KV_STEP), DECODE_KV_STEP
                )
            )
        batch_grid = table.index.to_numpy(float)
        self.decode_batch_max = int(batch_grid.max())
        matrix = np.array(rows)
        # one row per whole batch size 1..max, interpolated across the profiled batch sizes
        dense = np.array(
            [
                [np.interp(b, batch_grid, matrix[:, k]) for k in range(matrix.shape[1])]
                for b in range(1, self.decode_batch_max + 1)
            ]
        )
        dense = np.array([isotonic(column) for column in dense.T]).T  # more requests never read faster
        kv_points = np.arange(0, _round_up(self.decode_kv_max, DECODE_KV_STEP) + 1, DECODE_KV_STEP, dtype=float)
        self._decode_kv_slope = [0.0] + [_end_slope(kv_points, r) for r in dense]
        self._decode_rows = [None] + [[float(v) for v in r] for r in dense]

    def _build_prefill(self) -> None:
        prefill = self.profiles.prefill
        c, p, t = (prefill[k].to_numpy(float) for k in ("prefill_chunk_size", "kv_cache_size", "attn_ms"))
        # t = a + b c + g c (p + c / 2): a fitted slope for extrapolating past the profiled triangle
        _, b, g = nnls(np.column_stack([np.ones_like(c), c, c * (p + c / 2)]), t)
        self._prefill_b, self._prefill_g = float(b), float(g)
        self.chunk_max = int(c.max())
        self.prefix_max = int(p.max())
        rows, self._prefill_row_end = [], []
        for prefix in np.arange(0, _round_up(self.prefix_max, PREFIX_STEP) + 1, PREFIX_STEP, dtype=float):
            row, end = self._prefill_row(prefill, prefix)
            rows.append(row)
            self._prefill_row_end.append(end)
        self._prefill_rows = [r.tolist() for r in rows]

    def _prefill_row(self, prefill, prefix: float) -> tuple[np.ndarray, float]:
        """Attention over chunks 0..chunk_max at one prefix: the profiled points (interpolated between
        the two nearest profiled prefixes), continued by the fitted slope where the profile stops;
        and the largest chunk profiled there."""
        prefixes = np.sort(prefill["kv_cache_size"].unique().astype(float))
        lower = prefixes[prefixes <= prefix].max()
        upper = prefixes[prefixes >= prefix].min() if (prefixes >= prefix).any() else lower
        chunks = np.arange(0, _round_up(self.chunk_max, CHUNK_STEP) + 1, CHUNK_STEP, dtype=float)
        values, ends = [], []
        for q in sorted({lower, upper}):
            mine = prefill[prefill["kv_cache_size"] == q].sort_values("prefill_chunk_size")
            grid = np.concatenate([[0.0], mine["prefill_chunk_size"].to_numpy(float)])
            times = np.concatenate([[0.0], mine["attn_ms"].to_numpy(float)])
            row = np.interp(chunks, grid, isotonic(times))
            beyond = chunks > grid.max()
            row[beyond] = (
                times[-1]
                + self._prefill_b * (chunks[beyond] - grid.max())
                + self._prefill_g * (self._pairs(chunks[beyond], q) - self._pairs(grid.max(), q))
            )
            values.append(row)
            ends.append(float(grid.max()))
        if len(values) == 1:
            return values[0], ends[0]
        w = (prefix - lower) / (upper - lower)
        return (1 - w) * values[0] + w * values[1], min(ends)

    @staticmethod
    def _pairs(chunk, prefix):
        return chunk * (prefix + chunk / 2)

    def _build_cpu(self) -> None:
        cpu = self.profiles.cpu
        if not self.cpu_overhead:
            self._cpu = [0.0]
            self._cpu_slope = 0.0
            return
        grid, values = cpu["batch_size"].to_numpy(float), cpu["cpu_ms"].to_numpy(float)
        self._cpu = _dense(grid, values, int(grid.max())).tolist()
        self._cpu[0] = 0.0
        self._cpu_slope = _end_slope(grid, values)

    # ---- queries --------------------------------------------------------------------------

    def set_context(self, decode_kv_tokens: int, prefill_prefix_tokens: int) -> None:
        self.decode_kv_tokens = int(decode_kv_tokens)
        if prefill_prefix_tokens != self.prefill_prefix_tokens:  # most iterations keep the head's prefix
            self._set_prefix(int(prefill_prefix_tokens))

    def _set_prefix(self, prefix: int) -> None:
        """Place the prefill rows of ``prefix``: the two profiled-prefix rows around it, its weight
        between them, and the longest chunk ``__call__`` may read off them without counting."""
        self.prefill_prefix_tokens = prefix
        rows, ends = self._prefill_rows, self._prefill_row_end
        if prefix < self.prefix_max:
            # on whole tokens, exactly divmod(prefix / PREFIX_STEP, 1.0) (a power of two divides
            # exactly); the row after it is there, the rows running to prefix_max rounded up
            row_a = prefix // PREFIX_STEP
            w = self._row_w = prefix % PREFIX_STEP / PREFIX_STEP
            self._row_a_values, self._row_b_values = rows[row_a], rows[row_a + 1]
            end = self._row_end = ends[row_a + 1] if w else ends[row_a]  # the longest chunk profiled
        else:
            self._row_w = 0.0
            self._row_a_values = self._row_b_values = rows[-1]
            end = self._row_end = ends[-1]
        self._chunk_end = -1 if prefix > self.prefix_max else end if end < self.chunk_max else self.chunk_max

    def set_offer(self, offered: list[tuple[int, int]] | None) -> None:
        """The prompts a chunk is taken from, FCFS: (remaining tokens, prefix) each, the first being
        the one ``set_context``'s prefix belongs to. A chunk longer than the first is priced piece by
        piece (each its own attention and a request of the batch). None: one piece."""
        self._offer = offered

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        # Once per simulated iteration (and a dozen times per decision): the in-range lookups are
        # spelled out here rather than called, the rare cases go to the methods that count them.
        tokens = n_decodes + chunk_tokens
        per_layer = self._tokens[tokens] if tokens <= self.tokens_max else self._token_ops(tokens)
        if n_decodes:
            decode_kv = self.decode_kv_tokens
            # on whole tokens: kv / n <= the profiled KV exactly when kv <= it x n; and the row's
            # point and weight (kv / n) / step in whole and fraction, as ``_decode`` takes them
            # (a power of two scales a rounded quotient exactly; no quotient comes near a whole one)
            if decode_kv <= self.decode_kv_max * n_decodes and n_decodes <= self.decode_batch_max:
                row = self._decode_rows[n_decodes]
                per_step = n_decodes * DECODE_KV_STEP
                i = decode_kv // per_step
                w = decode_kv / per_step - i
                value = row[i] if w == 0.0 else row[i] + w * (row[i + 1] - row[i])
                self._decode_n, self._decode_kv, self._decode_ms = n_decodes, decode_kv, value
                per_layer += value
            else:
                per_layer += self._decode(n_decodes, decode_kv)
        pieces = 0
        if chunk_tokens:
            offer = self._offer
            if not offer or chunk_tokens <= offer[0][0] or len(offer) == 1:
                if chunk_tokens <= self._chunk_end:
                    k = chunk_tokens // CHUNK_STEP
                    u = chunk_tokens / CHUNK_STEP - k
                    a = self._row_a_values
                    at_a = a[k] if u == 0.0 else a[k] + u * (a[k + 1] - a[k])
                    w = self._row_w
                    if w:
                        b = self._row_b_values
                        at_b = b[k] if u == 0.0 else b[k] + u * (b[k + 1] - b[k])
                        at_a += w * (at_b - at_a)
                    per_layer += at_a
                else:
                    per_layer += self._prefill(chunk_tokens, self.prefill_prefix_tokens)
                pieces = 1
            else:
                attention, pieces = self._spread(chunk_tokens, offer)
                per_layer += attention
        if self.cpu_overhead:
            return self.layers * per_layer + self._cpu_ms(n_decodes + pieces)
        return self.layers * per_layer

    def chunk_pricer(self, n_decodes: int) -> Callable[[int, int], float]:
        """T(n_decodes, c) as a function of (n, c), for the context and offer set now: the same
        floats as ``self(n, c)``, faster for a chunk search, which asks one n about 16 chunks.

        The decode term, both CPU terms and the prefix's prefill rows are looked up once here;
        any query outside the profiled range (counted, warned), spread over several prompts,
        or for another n is answered by ``self`` itself. The decode term is looked up (and, past
        the profile, counted) here as the search's first query, decode-only, would.
        """
        n = n_decodes
        if n <= 0 or n >= self.tokens_max or not self.cpu_overhead or self.prefill_prefix_tokens > self.prefix_max:
            return self
        decode_ms = self._decode(n, self.decode_kv_tokens)
        layers, tokens = self.layers, self._tokens
        decode_only_ms = layers * (tokens[n] + decode_ms) + self._cpu_ms(n)
        one_piece_cpu_ms = self._cpu_ms(n + 1)
        row_a, row_b, row_w = self._row_a_values, self._row_b_values, self._row_w
        # past it a query is priced by ``self``: counted past the profile, or spread over the offer
        chunk_limit = min(self._chunk_end, self.tokens_max - n)
        offer = self._offer
        if offer and len(offer) > 1:
            chunk_limit = min(chunk_limit, offer[0][0])
        general, step = self, CHUNK_STEP

        def price(n_decodes: int, chunk_tokens: int) -> float:
            if n_decodes != n or chunk_tokens > chunk_limit:
                return general(n_decodes, chunk_tokens)
            if not chunk_tokens:
                return decode_only_ms
            k, rest = chunk_tokens // step, chunk_tokens % step
            at_a = row_a[k]
            if rest:
                at_a += rest / step * (row_a[k + 1] - at_a)
            if row_w:
                at_b = row_b[k] if not rest else row_b[k] + rest / step * (row_b[k + 1] - row_b[k])
                at_a += row_w * (at_b - at_a)
            return layers * (tokens[n + chunk_tokens] + decode_ms + at_a) + one_piece_cpu_ms

        return price

    def _spread(self, chunk_tokens: int, offer: list[tuple[int, int]]) -> tuple[float, int]:
        """Attention of a chunk spread FCFS over the prompts on offer, and how many it touches."""
        attention, pieces = 0.0, 0
        for take, prefix in offer_pieces(chunk_tokens, self.prefill_prefix_tokens, offer):
            attention += self._prefill(take, prefix) if not pieces else self._prefill_at(take, prefix)
            pieces += 1
        return attention, pieces

    def _prefill_at(self, chunk: int, prefix: int) -> float:
        """Prefill attention at another prefix than the context's (the head's)."""
        saved = self.prefill_prefix_tokens
        self._set_prefix(prefix)
        try:
            return self._prefill(chunk, prefix)
        finally:
            self._set_prefix(saved)  # the context's rows again (a function of the prefix alone)

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        """T with an explicit context, the chunk as one piece (the ``ContextualCost`` interface)."""
        saved = self.decode_kv_tokens, self.prefill_prefix_tokens, self._offer
        self.set_context(decode_kv_tokens, prefill_prefix_tokens)
        self._offer = None
        try:
            return self(n_decodes, chunk_tokens)
        finally:
            self.set_context(*saved[:2])
            self._offer = saved[2]

    def predict_pieces(self, n_decodes: int, decode_kv_tokens: int, pieces: Sequence[tuple[int, int]]) -> float:
        """T for decodes plus several prefill pieces, each (chunk tokens, prefix tokens)."""
        chunk = sum(c for c, _ in pieces)
        per_layer = self._token_ops(n_decodes + chunk)
        if n_decodes:
            per_layer += self._decode(n_decodes, decode_kv_tokens)
        for c, prefix in pieces:
            per_layer += self._prefill_at(c, prefix)
        return self.layers * per_layer + self._cpu_ms(n_decodes + len(pieces))

    def _token_ops(self, tokens: int) -> float:
        if tokens <= self.tokens_max:
            return self._tokens[tokens]
        self._beyond("tokens", f"{tokens} tokens in one iteration > {self.tokens_max} profiled")
        return self._tokens[-1] + self._tokens_slope * (tokens - self.tokens_max)

    def _decode(self, n: int, decode_kv_tokens: int) -> float:
        if n == self._decode_n and decode_kv_tokens == self._decode_kv:
            return self._decode_ms
        batch = n if n < self.decode_batch_max else self.decode_batch_max
        kv = decode_kv_tokens / n
        row = self._decode_rows[batch]
        if kv <= self.decode_kv_max:
            # x - int(x) is divmod(x, 1.0)'s remainder, exactly, for the x >= 0 here
            x = kv / DECODE_KV_STEP
            i = int(x)
            w = x - i
            value = row[i] if w == 0.0 else row[i] + w * (row[i + 1] - row[i])
        else:
            self._beyond("decode_kv", f"{kv:.0f} KV tokens per decode > {self.decode_kv_max} profiled")
            value = row[-1] + self._decode_kv_slope[batch] * (kv - self.decode_kv_max)
        if n > self.decode_batch_max:
            self._beyond("decode_batch", f"{n} decodes > {self.decode_batch_max} profiled")
            value *= n / self.decode_batch_max  # memory-bound: linear in the KV read
        self._decode_n, self._decode_kv, self._decode_ms = n, decode_kv_tokens, value
        return value

    def _prefill(self, chunk: int, prefix: int) -> float:
        if chunk > self.chunk_max:
            self._beyond("prefill_chunk", f"a {chunk}-token chunk > {self.chunk_max} profiled")
            base = self._prefill(self.chunk_max, prefix)
            return (
                base
                + self._prefill_b * (chunk - self.chunk_max)
                + self._prefill_g * (self._pairs(chunk, prefix) - self._pairs(self.chunk_max, prefix))
            )
        if chunk > self._row_end:
            self._beyond(
                "prefill_chunk_at_prefix",
                f"a {chunk}-token chunk on a {prefix}-token prefix, past the profiled chunk + prefix",
            )
        x = chunk / CHUNK_STEP  # read as ``__call__`` reads it in range
        k = int(x)
        u = x - k
        a, b = self._row_a_values, self._row_b_values
        at_a = a[k] if u == 0.0 else a[k] + u * (a[k + 1] - a[k])
        at_b = b[k] if u == 0.0 else b[k] + u * (b[k + 1] - b[k])
        value = at_a + self._row_w * (at_b - at_a) if self._row_w else at_a
        if prefix > self.prefix_max:
            self._beyond("prefill_prefix", f"a {prefix}-token prefix > {self.prefix_max} profiled")
            value += self._prefill_g * chunk * (prefix - self.prefix_max)
        return value

    def _cpu_ms(self, batch: int) -> float:
        if batch < len(self._cpu):
            return self._cpu[batch] if batch else 0.0
        return self._cpu[-1] + self._cpu_slope * (batch - len(self._cpu) + 1)

    @contextmanager
    def uncounted(self):
        """Queries inside this block (a policy's own monotonicity check) are neither counted nor warned."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True

    def _beyond(self, what: str, detail: str) -> None:
        if not self._counting:
            return
        if not self.out_of_range[what]:
            warnings.warn(
                f"{self.profiles.where}: {detail}: extrapolated linearly (counted in out_of_range)", stacklevel=3
            )
        self.out_of_range[what] += 1

    # ---- what outputs say about the model ---------------------------------------------------

    def describe(self) -> dict:
        """The settings a result file records: which profiles, what was derived or extrapolated."""
        shape = self.shape
        return {
            "cost_model": "operator-profile",
            "profiles": self.profiles.where,
            "model": shape.name,
            "num_layers": shape.num_layers,
            "tensor_parallel": shape.tensor_parallel,
            "attention": self.profiles.attention_note,
            "cpu_overhead": self.cpu_overhead,
            "kv_bytes_per_token": shape.kv_bytes_per_token,
            "profiled_range": {
                "tokens": self.tokens_max,
                "decode_batch": self.decode_batch_max,
                "decode_kv_per_request": self.decode_kv_max,
                "prefill_chunk": self.chunk_max,
                "prefill_prefix": self.prefix_max,
            },
            "out_of_range_queries": dict(self.out_of_range),
            "notes": list(self.profiles.notes),
            "units": "milliseconds per iteration",
        }


def profile_cost(spec: str, cpu_overhead: bool = True) -> ProfileCost:
    """The cost model of a preset (see ``PRESETS``) or a profile folder."""
    return ProfileCost(load_profiles(spec), cpu_overhead=cpu_overhead)


__all__ = ["PRESETS", "ProfileCost", "profile_cost"]
