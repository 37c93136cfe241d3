"""Leave-out validation of the operator-profile cost model (``sloweave.core.costs.profile``).

For each operator table of each preset, a seeded 20 % of the profiled points is held out (the
smallest and largest grid values always stay in the fit set, so this measures interpolation,
not extrapolation), a ``ProfileCost`` is built from the rest (an ``OperatorProfiles`` with
the filtered frames) and asked for the held-out points; the absolute relative error
|predicted - measured| / measured is reported per operator and preset (median, P90, max), with
the error at the points it was fitted on as a reference (the smoothing costs something there:
every table is made non-decreasing).

One operator at a time is read through the public ``predict``: the model is built with every
other table set to zero (and no all-reduce, no CPU term), so ``predict`` returns that
operator alone, times the layers:

| table | profiled points | query | held out among |
|---|---|---|---|
| token-parallel ops (mlp.csv, the 9 per-layer ops summed) | num_tokens | ``predict(0, N, 0, 0) / L`` | all but the smallest and largest N |
| all-reduce (all_reduce.csv, TP > 1) | num_tokens = bytes / (2 n_embd) | ``predict(0, N, 0, 0) / (2 L) - launch`` | whole token counts only (the model is only asked whole counts; the other sizes, 0.125-63.6 tokens and some above 8,192, stay in the fit set) |
| decode attention | (batch, KV per request) | ``predict(b, 0, b kv, 0) / L`` | all but batch 1 / 128 and the smallest / largest KV |
| prefill attention | (chunk, prefix) | ``predict(0, c, 0, p) / L`` | all but the smallest / largest chunk and prefix and each prefix row's smallest and largest chunk (the profile is a triangle, chunk + prefix <= 4096: a row's end is an edge) |
| CPU overhead (cpu_overheads.csv) | batch | ``predict(b, 0, 0, 0)`` (CPU term only) | all but batch 8 and 128 (10 interior points: 2 held out per seed) |

Whole iterations: an iteration can be checked against measurements only if every one of its
terms is a profiled point: the token-parallel ops and the all-reduce at N = decodes + chunk,
decode attention at (batch, KV), prefill attention at (chunk, prefix). Such iterations are
drawn (decode-only, prefill-only, decode + one chunk), in groups; for each group all the
points its iterations use are removed from every table at once, the model is built from the
rest (CPU term off, as Vidur), and its ``predict(n, c, n kv, p)`` is compared with the sum of
the measured medians, L x (ops(N) + 2 (all-reduce(N) + launch) + decode(b, kv) + prefill(c, p)).
The launch constant (0.02 ms per all-reduce) is a modelling constant, not a measurement; it is
on both sides.

Llama-3-8B's attention is derived from the Llama-2-70B TP2 measurement (scaled per GPU): its
attention rows validate interpolation of scaled 70B data, not a measurement of the 8B, and with
the same seeds they come out identical to the 70B rows (relative errors are scale-free).

    .venv/bin/python benchmarks/profile_validation.py              # results/profile_validation/
    .venv/bin/python benchmarks/profile_validation.py --seeds 0 --out /tmp/pv

Writes ``operators.csv``, ``bands.csv`` (errors by measured time), ``iterations.csv``, ``points.csv`` (every held-out point) and
``summary.json`` (strict JSON: settings, sloweave version, the tables) under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import time
import warnings
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.costs.operator_profiles import PRESETS, OperatorProfiles, load_profiles
from sloweave.core.costs.profile import NCCL_LAUNCH_MS, ProfileCost

REPO = Path(__file__).resolve().parent.parent
OPERATORS = ("token_ops", "all_reduce", "decode", "prefill", "cpu")
VALUE = {
    "token_ops": "token_ops_ms",
    "all_reduce": "all_reduce_ms",
    "decode": "attn_ms",
    "prefill": "attn_ms",
    "cpu": "cpu_ms",
}
KEYS = {
    "token_ops": ["num_tokens"],
    "all_reduce": ["num_tokens"],
    "decode": ["batch_size", "kv_cache_size"],
    "prefill": ["prefill_chunk_size", "kv_cache_size"],
    "cpu": ["batch_size"],
}
TABLE = {"token_ops": "mlp", "all_reduce": "all_reduce", "decode": "decode", "prefill": "prefill", "cpu": "cpu"}


# ---------------------------------------------------------------------------------------
# One operator at a time (also used by benchmarks/vidur_profile_agreement.py)
# ---------------------------------------------------------------------------------------


def _zeroed(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    out = frame.copy()
    out[column] = 0.0
    return out


def isolated_cost(profiles: OperatorProfiles, keep: str) -> ProfileCost:
    """A ProfileCost in which only ``keep``'s table is non-zero: predict() returns that operator
    alone (times the layers for the GPU operators; two all-reduces per layer with their launch)."""
    if keep not in OPERATORS:
        raise ValueError(f"unknown operator {keep!r}")
    p = profiles
    isolated = replace(
        p,
        mlp=p.mlp if keep == "token_ops" else _zeroed(p.mlp, "token_ops_ms"),
        all_reduce=p.all_reduce if keep == "all_reduce" else None,
        decode=p.decode if keep == "decode" else _zeroed(p.decode, "attn_ms"),
        prefill=p.prefill if keep == "prefill" else _zeroed(p.prefill, "attn_ms"),
        cpu=p.cpu if keep == "cpu" else None,
    )
    return ProfileCost(isolated, cpu_overhead=keep == "cpu")


def query(cost: ProfileCost, operator: str, point: tuple) -> float:
    """The isolated cost's answer for one profiled point, in the table's own unit (ms per layer
    and operation; the CPU term per iteration)."""
    layers = cost.layers
    if operator == "token_ops":
        return cost.predict(0, int(point[0]), 0, 0) / layers
    if operator == "all_reduce":
        return cost.predict(0, int(point[0]), 0, 0) / (2 * layers) - NCCL_LAUNCH_MS
    if operator == "decode":
        b, kv = int(point[0]), int(point[1])
        return cost.predict(b, 0, b * kv, 0) / layers
    if operator == "prefill":
        return cost.predict(0, int(point[0]), 0, int(point[1])) / layers
    return cost.predict(int(point[0]), 0, 0, 0)  # cpu


# ---------------------------------------------------------------------------------------
# Which points may be held out
# ---------------------------------------------------------------------------------------


def table(profiles: OperatorProfiles, operator: str) -> pd.DataFrame | None:
    frame = getattr(profiles, TABLE[operator])
    return None if frame is None else frame.reset_index(drop=True)


def eligible(frame: pd.DataFrame, operator: str) -> np.ndarray:
    """Points that may be held out: not on the grid's extremes (see the module docstring)."""
    ok = np.ones(len(frame), dtype=bool)
    for key in KEYS[operator]:
        values = frame[key].to_numpy(float)
        ok &= (values > values.min()) & (values < values.max())
    if operator == "all_reduce":
        tokens = frame["num_tokens"].to_numpy(float)
        ok &= tokens == np.round(tokens)
    if operator == "prefill":
        row_min = frame.groupby("kv_cache_size")["prefill_chunk_size"].transform("min").to_numpy()
        row_max = frame.groupby("kv_cache_size")["prefill_chunk_size"].transform("max").to_numpy()
        chunk = frame["prefill_chunk_size"].to_numpy()
        ok &= (chunk > row_min) & (chunk < row_max)
    return ok


def rng_for(seed: int, *names: str) -> np.random.Generator:
    return np.random.default_rng([seed] + [zlib.crc32(n.encode()) for n in names])


def held_out_mask(frame: pd.DataFrame, operator: str, fraction: float, seed: int) -> np.ndarray:
    ok = np.flatnonzero(eligible(frame, operator))
    count = min(len(ok), int(round(fraction * len(frame))))
    chosen = rng_for(seed, operator).choice(ok, size=count, replace=False)
    mask = np.zeros(len(frame), dtype=bool)
    mask[chosen] = True
    return mask


def rel_err(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    """|pred - meas| / meas; NaN where the measurement is 0 (counted, not used)."""
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(meas > 0, np.abs(pred - meas) / meas, np.nan)


def stats(errors: np.ndarray) -> dict:
    e = errors[np.isfinite(errors)]
    if e.size == 0:
        return {"n": 0, "median": None, "p90": None, "max": None}
    return {"n": int(e.size), "median": float(np.median(e)), "p90": float(np.percentile(e, 90)), "max": float(e.max())}


# ---------------------------------------------------------------------------------------
# Per operator
# ---------------------------------------------------------------------------------------


def validate_operator(profiles: OperatorProfiles, preset: str, operator: str, fraction: float, seeds: list[int]):
    frame = table(profiles, operator)
    if frame is None:
        return [], []
    value = VALUE[operator]
    points_rows, per_seed = [], []
    for seed in seeds:
        mask = held_out_mask(frame, operator, fraction, seed)
        fit = frame[~mask].reset_index(drop=True)
        cost = isolated_cost(replace(profiles, **{TABLE[operator]: fit}), operator)
        keys = KEYS[operator]
        held = frame[mask]
        pred = np.array([query(cost, operator, tuple(row)) for row in held[keys].itertuples(index=False)])
        meas = held[value].to_numpy(float)
        fit_pred = np.array([query(cost, operator, tuple(row)) for row in fit[keys].itertuples(index=False)])
        if operator == "all_reduce":  # the model is asked whole token counts only
            whole = fit["num_tokens"].to_numpy() == np.round(fit["num_tokens"].to_numpy())
            fit_err = rel_err(fit_pred[whole], fit[value].to_numpy(float)[whole])
        else:
            fit_err = rel_err(fit_pred, fit[value].to_numpy(float))
        err = rel_err(pred, meas)
        with np.errstate(divide="ignore", invalid="ignore"):
            signed = np.where(meas > 0, (pred - meas) / meas, np.nan)
        per_seed.append(
            {
                "seed": seed,
                "held_out": int(mask.sum()),
                "fit": int((~mask).sum()),
                "errors": err,
                "signed": signed,
                "abs_err_ms": np.abs(pred - meas),
                "fit_errors": fit_err,
                "beyond": (held["num_tokens"].to_numpy() > cost.tokens_max) if operator == "all_reduce" else None,
                "fit_beyond": (fit["num_tokens"].to_numpy()[whole] > cost.tokens_max)
                if operator == "all_reduce"
                else None,
                "zero_measurements": int(np.sum(meas <= 0)),
            }
        )
        labels = [operator] * len(held)
        if operator == "all_reduce":
            labels = [
                f"all_reduce (N > {cost.tokens_max})" if b else f"all_reduce (N <= {cost.tokens_max})"
                for b in per_seed[-1]["beyond"]
            ]
        for row, p, m, e, label in zip(held[keys].itertuples(index=False), pred, meas, err, labels):
            points_rows.append(
                {
                    "preset": preset,
                    "operator": label,
                    "seed": seed,
                    "point": "/".join(f"{v:g}" for v in row),
                    "measured_ms": m,
                    "predicted_ms": p,
                    "rel_err": e,
                }
            )
    return per_seed, points_rows


def operator_rows(
    preset: str, operator: str, per_seed: list[dict], profiles: OperatorProfiles, points: int
) -> list[dict]:
    if not per_seed:
        return []
    groups = [("", None)]
    if operator == "all_reduce":
        limit = int(profiles.mlp["num_tokens"].max())
        groups = [
            (f" (N <= {limit}: interpolated)", False),
            (f" (N > {limit}: past mlp.csv, extrapolated by design)", True),
        ]
    rows = []
    for suffix, beyond in groups:
        errs, signed, abs_errs, fit_errs, seed_medians = [], [], [], [], []
        for s in per_seed:
            pick = np.ones(len(s["errors"]), dtype=bool) if beyond is None else (s["beyond"] == beyond)
            errs.append(s["errors"][pick])
            signed.append(s["signed"][pick])
            abs_errs.append(s["abs_err_ms"][pick])
            fit_errs.append(s["fit_errors"] if beyond is None else s["fit_errors"][s["fit_beyond"] == beyond])
            finite = s["errors"][pick][np.isfinite(s["errors"][pick])]
            if finite.size:
                seed_medians.append(float(np.median(finite)))
        e = np.concatenate(errs)
        st = stats(e)
        fit_st = stats(np.concatenate(fit_errs))
        note = ""
        if operator in ("decode", "prefill") and profiles.attention_note != "measured":
            note = "derived attention (scaled 70B TP2 data), not measured for this model"
        if operator == "cpu" and profiles.notes:
            note = "; ".join(profiles.notes)
        rows.append(
            {
                "preset": preset,
                "operator": operator + suffix,
                "profiled_points": points,
                "held_out_per_seed": int(per_seed[0]["held_out"]),
                "seeds": len(per_seed),
                "evaluated": st["n"],
                "median_rel_err": st["median"],
                "p90_rel_err": st["p90"],
                "max_rel_err": st["max"],
                "median_signed_rel_err": float(np.nanmedian(np.concatenate(signed))) if st["n"] else None,
                "median_abs_err_ms": float(np.median(np.concatenate(abs_errs))) if st["n"] else None,
                "per_seed_median_min": min(seed_medians) if seed_medians else None,
                "per_seed_median_max": max(seed_medians) if seed_medians else None,
                "fit_points_median_rel_err": fit_st["median"],
                "fit_points_p90_rel_err": fit_st["p90"],
                "zero_measurements_skipped": int(sum(s["zero_measurements"] for s in per_seed)),
                "note": note,
            }
        )
    return rows


BANDS = ((0.0, 0.05, "< 0.05"), (0.05, 0.5, "0.05-0.5"), (0.5, math.inf, ">= 0.5"))


def error_bands(points: pd.DataFrame) -> pd.DataFrame:
    """Held-out errors split by the size of the measured time (per operator and preset)."""
    rows = []
    for (preset, operator), group in points.groupby(["preset", "operator"], sort=False):
        for lo, hi, label in BANDS:
            sub = group[(group.measured_ms >= lo) & (group.measured_ms < hi)]
            st = stats(sub["rel_err"].to_numpy(float))
            if st["n"]:
                rows.append(
                    {
                        "preset": preset,
                        "operator": operator,
                        "measured_ms": label,
                        "points": st["n"],
                        "median_rel_err": st["median"],
                        "p90_rel_err": st["p90"],
                    }
                )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------
# Whole iterations
# ---------------------------------------------------------------------------------------


def iteration_candidates(profiles: OperatorProfiles):
    """Interior profiled points of each table, as lookups (key -> measured median)."""

    def lookup(operator):
        frame = table(profiles, operator)
        if frame is None:
            return None, {}
        ok = eligible(frame, operator)
        keys = KEYS[operator]
        sub = frame[ok]
        return sub, {
            tuple(int(v) for v in row[:-1]): float(row[-1])
            for row in sub[keys + [VALUE[operator]]].itertuples(index=False)
        }

    mlp_sub, mlp = lookup("token_ops")
    _, ar = lookup("all_reduce")
    dec_sub, dec = lookup("decode")
    pre_sub, pre = lookup("prefill")
    return mlp, ar, dec, pre, dec_sub, pre_sub


def draw_iterations(profiles: OperatorProfiles, kind: str, count: int, seed: int) -> list[tuple[int, int, int, int]]:
    """``count`` iterations (b, kv, c, p) whose every term is an interior profiled point."""
    mlp, ar, dec, pre, dec_sub, pre_sub = iteration_candidates(profiles)
    tp = profiles.all_reduce is not None
    tokens_ok = sorted(n for (n,) in mlp if (not tp or (n,) in ar))
    rng = rng_for(seed, "iterations", kind)
    dec_keys = sorted(dec)
    pre_keys = sorted(pre)
    by_batch: dict[int, list[int]] = {}
    for b, kv in dec_keys:
        by_batch.setdefault(b, []).append(kv)
    out: list[tuple[int, int, int, int]] = []
    attempts = 0
    while len(out) < count and attempts < 200 * count:
        attempts += 1
        if kind == "decode-only":
            n = int(rng.choice(tokens_ok))
            if n not in by_batch:
                continue
            out.append((n, int(rng.choice(by_batch[n])), 0, 0))
        elif kind == "prefill-only":
            c, p = pre_keys[rng.integers(len(pre_keys))]
            if (c,) in mlp and (not tp or (c,) in ar):
                out.append((0, 0, c, p))
        else:  # decode + one chunk
            c, p = pre_keys[rng.integers(len(pre_keys))]
            choices = [n for n in tokens_ok if (n - c) in by_batch]
            if not choices:
                continue
            n = int(rng.choice(choices))
            b = n - c
            out.append((b, int(rng.choice(by_batch[b])), c, p))
    return out


def validate_iterations(
    profiles: OperatorProfiles, preset: str, kinds: list[str], groups: int, group_size: int, seed: int
):
    mlp, ar, dec, pre, _, _ = iteration_candidates(profiles)
    layers, tp = profiles.shape.num_layers, profiles.all_reduce is not None
    rows, points = [], []
    for kind in kinds:
        drawn = draw_iterations(profiles, kind, groups * group_size, seed)
        errors, signed = [], []
        for g in range(groups):
            group = drawn[g * group_size : (g + 1) * group_size]
            if not group:
                continue
            tokens = {b + c for b, _, c, _ in group}
            dec_out = {(b, kv) for b, kv, _, _ in group if b}
            pre_out = {(c, p) for _, _, c, p in group if c}
            frames = {
                "mlp": profiles.mlp[~profiles.mlp["num_tokens"].isin(tokens)].reset_index(drop=True),
                "decode": profiles.decode[
                    ~pd.Series(
                        list(zip(profiles.decode.batch_size.astype(int), profiles.decode.kv_cache_size.astype(int)))
                    )
                    .isin(dec_out)
                    .to_numpy()
                ].reset_index(drop=True),
                "prefill": profiles.prefill[
                    ~pd.Series(
                        list(
                            zip(
                                profiles.prefill.prefill_chunk_size.astype(int),
                                profiles.prefill.kv_cache_size.astype(int),
                            )
                        )
                    )
                    .isin(pre_out)
                    .to_numpy()
                ].reset_index(drop=True),
            }
            if tp:
                frames["all_reduce"] = profiles.all_reduce[~profiles.all_reduce["num_tokens"].isin(tokens)].reset_index(
                    drop=True
                )
            cost = ProfileCost(replace(profiles, **frames), cpu_overhead=False)
            for b, kv, c, p in group:
                n_tok = b + c
                measured = mlp[(n_tok,)] + (2 * (ar[(n_tok,)] + NCCL_LAUNCH_MS) if tp else 0.0)
                measured += (dec[(b, kv)] if b else 0.0) + (pre[(c, p)] if c else 0.0)
                measured *= layers
                predicted = cost.predict(b, c, b * kv, p)
                errors.append(abs(predicted - measured) / measured)
                signed.append((predicted - measured) / measured)
                points.append(
                    {
                        "preset": preset,
                        "kind": kind,
                        "group": g,
                        "decodes": b,
                        "kv_per_decode": kv,
                        "chunk": c,
                        "prefix": p,
                        "measured_ms": measured,
                        "predicted_ms": predicted,
                        "rel_err": errors[-1],
                    }
                )
        st = stats(np.array(errors))
        rows.append(
            {
                "preset": preset,
                "kind": kind,
                "iterations": st["n"],
                "groups": groups,
                "group_size": group_size,
                "median_rel_err": st["median"],
                "p90_rel_err": st["p90"],
                "max_rel_err": st["max"],
                "median_signed_rel_err": float(np.median(signed)) if signed else None,
                "note": "attention derived from 70B TP2 (not measured)"
                if profiles.attention_note != "measured"
                else "",
            }
        )
    return rows, points


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


def source_state() -> dict:
    """Which sloweave source the figures come from (``sloweave.studies.outputs.code_source``)."""
    from sloweave.studies.outputs import code_source

    code = code_source()
    return {"commit": code["git_commit"], "src_files_changed_since_commit": code["files_changed_since_commit"]}


def strict(value):
    """JSON without NaN/inf (None instead), numpy scalars as Python numbers."""
    if isinstance(value, dict):
        return {str(k): strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def pct(v) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{100 * v:.2f}%"


def print_table(frame: pd.DataFrame, columns: list[str], percent: set[str]) -> None:
    shown = frame[columns].copy().astype(object)
    for c in columns:
        if c in percent:
            shown[c] = [pct(v) for v in frame[c]]
        elif frame[c].dtype.kind == "f":
            shown[c] = [("-" if pd.isna(v) else f"{v:.4g}") for v in frame[c]]
    widths = {c: max(len(c), *(len(str(v)) for v in shown[c])) for c in columns}
    print("  ".join(f"{c:<{widths[c]}}" for c in columns))
    for _, row in shown.iterrows():
        print("  ".join(f"{str(row[c]):<{widths[c]}}" for c in columns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "profile_validation")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), help="presets or profile folders")
    parser.add_argument("--holdout", type=float, default=0.2, help="fraction of each table's points held out")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="one hold-out draw per seed (results pooled)"
    )
    parser.add_argument("--iteration-groups", type=int, default=10, help="joint leave-out groups per iteration kind")
    parser.add_argument(
        "--group-size", type=int, default=10, help="iterations per group (their points are removed together)"
    )
    args = parser.parse_args()
    if not 0 < args.holdout < 1:
        parser.error("--holdout must be between 0 and 1")
    start = time.perf_counter()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    kinds = ["decode-only", "prefill-only", "decode + one chunk"]
    op_rows, it_rows, point_rows, it_points, described = [], [], [], [], {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extrapolation warnings: none expected (extremes are kept)
        for preset in args.presets:
            profiles = load_profiles(preset)
            described[preset] = ProfileCost(profiles).describe()
            for operator in OPERATORS:
                frame = table(profiles, operator)
                per_seed, points = validate_operator(profiles, preset, operator, args.holdout, args.seeds)
                op_rows += operator_rows(preset, operator, per_seed, profiles, 0 if frame is None else len(frame))
                point_rows += points
            rows, points = validate_iterations(
                profiles, preset, kinds, args.iteration_groups, args.group_size, args.seeds[0]
            )
            it_rows += rows
            it_points += points
    operators = pd.DataFrame(op_rows)
    iterations = pd.DataFrame(it_rows)
    bands = error_bands(pd.DataFrame(point_rows))
    operators.to_csv(out / "operators.csv", index=False)
    bands.to_csv(out / "bands.csv", index=False)
    iterations.to_csv(out / "iterations.csv", index=False)
    pd.DataFrame(point_rows + it_points).to_csv(out / "points.csv", index=False)
    summary = {
        "what": "leave-out validation of sloweave.core.costs.profile.ProfileCost",
        "sloweave_version": importlib.metadata.version("sloweave"),
        "sloweave_source": source_state(),
        "settings": {
            "presets": args.presets,
            "holdout_fraction": args.holdout,
            "seeds": args.seeds,
            "iteration_groups": args.iteration_groups,
            "group_size": args.group_size,
            "iteration_seed": args.seeds[0],
            "nccl_launch_ms": NCCL_LAUNCH_MS,
            "error": "|predicted - measured| / measured (measured = the profile's median)",
            "kept_in_fit": "each grid's smallest and largest values (prefill: also each prefix row's smallest and "
            "largest chunk); all-reduce: sizes that are not a whole number of tokens",
        },
        "models": described,
        "operators": op_rows,
        "error_by_measured_time": bands.to_dict(orient="records"),
        "iterations": it_rows,
        "seconds": time.perf_counter() - start,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
    (out / "summary.json").write_text(json.dumps(strict(summary), indent=1, allow_nan=False))

    print(f"Leave-out validation: {args.holdout:.0%} of each table held out, seeds {args.seeds} (pooled)\n")
    print_table(
        operators,
        [
            "preset",
            "operator",
            "profiled_points",
            "held_out_per_seed",
            "evaluated",
            "median_rel_err",
            "p90_rel_err",
            "max_rel_err",
            "median_signed_rel_err",
            "median_abs_err_ms",
            "fit_points_median_rel_err",
        ],
        {"median_rel_err", "p90_rel_err", "max_rel_err", "median_signed_rel_err", "fit_points_median_rel_err"},
    )
    print(
        "(signed: (predicted - measured) / measured; > 0 is an over-prediction. fit points: the error where the model was fitted)"
    )
    print("\nHeld-out error by the measured time (the profile's resolution is 1 us; small kernels are noisy):\n")
    print_table(
        bands,
        ["preset", "operator", "measured_ms", "points", "median_rel_err", "p90_rel_err"],
        {"median_rel_err", "p90_rel_err"},
    )
    print(
        f"\nWhole iterations (every term a profiled point, all of them left out together; CPU term off; "
        f"{args.iteration_groups} groups x {args.group_size}):\n"
    )
    print_table(
        iterations,
        [
            "preset",
            "kind",
            "iterations",
            "median_rel_err",
            "p90_rel_err",
            "max_rel_err",
            "median_signed_rel_err",
            "note",
        ],
        {"median_rel_err", "p90_rel_err", "max_rel_err", "median_signed_rel_err"},
    )
    print(f"\n{time.perf_counter() - start:.1f} s; results in {out}")


if __name__ == "__main__":
    main()
