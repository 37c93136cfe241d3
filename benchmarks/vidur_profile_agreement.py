"""sloweave's operator-profile cost model against Vidur's own profiled predictors.

(a) Per-iteration agreement. One of our simulations (the first ``--requests`` of the Azure
    2023 conversation trace, arrival times x ``--time-scale``; policy ``sarathi-512``, batch cap
    128; iteration time = ``ProfileCost`` of the Llama-2-70B TP2 A100 preset with
    ``cpu_overhead=False``, as Vidur models no CPU time) is taken apart into its iterations:
    each decode with its KV context, each prefill piece with its chunk and prefix (from
    ``SimResult`` and the workload). Every iteration is written as the ``Batch`` Vidur's own
    Sarathi scheduler would build (``num_q_tokens``: 1 per decode, the chunk per piece;
    ``num_kv_tokens``: tokens processed + q tokens) and priced by Vidur's sklearn predictors
    (random forest, and linear regression), trained by Vidur's own code on the full original
    profile CSVs in ``/work/shared/profiles/vidur-a100/`` (``benchmarks/vidur/profile_driver.py``
    runs in Vidur's venv and makes them read local files instead of downloading). Reported:
    the per-iteration relative difference (Vidur - ours) / ours of the whole iteration and of
    each operator group (token-parallel ops, the two all-reduces, decode attention, prefill
    attention), overall and by iteration kind and profile range, plus a decomposition: our
    model asked Vidur's rounded inputs (``ours @ Vidur's inputs``) separates Vidur's input
    conventions from its regression fit.
(b) Speed. Our ``simulate()`` with ``ProfileCost`` against Vidur's simulator with its
    random-forest predictor (from its cache) on the same trace, scheduler and profiles: whole
    simulation loop, ``--runs`` interleaved runs, medians, load average recorded. Vidur's
    schedule differs from ours (its iteration times differ), so its iteration count and
    latencies are reported beside ours.

    .venv/bin/python benchmarks/vidur_profile_agreement.py               # results/vidur_profile/
    .venv/bin/python benchmarks/vidur_profile_agreement.py --runs 3 --predictors rf,lr

The first run trains Vidur's random forest with Vidur's default grid search (27 settings x
10-fold cross validation per operator model; about 40 minutes on 2 shared cores, under
``nice``) and caches it under ``--cache`` (default ``results/.vidur-cache``: ``results/`` is
git-ignored); later runs load it in seconds. Outputs under ``--out``: ``iterations.csv``
(every iteration, both sides, per operator), ``agreement.csv``, ``speed.csv``, ``runs.csv``,
``summary.json`` (strict JSON with the settings and the sloweave version).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_validation import isolated_cost, source_state, strict  # noqa: E402
from vidur_side_by_side import (  # noqa: E402
    ensure_vidur,
    format_table,
    output_args,
    load_requests,
    our_workload,
    p99_gap,
    read_vidur_outputs,
    trace_replay_args,
    venv_python,
    write_vidur_trace,
)

from sloweave.core.costs.operator_profiles import load_profiles  # noqa: E402
from sloweave.core.policy import make_policy  # noqa: E402
from sloweave.core.costs.profile import ProfileCost  # noqa: E402
from sloweave.sim.engine import SimResult, simulate  # noqa: E402
from sloweave.sim.metrics import per_request_frame  # noqa: E402
from sloweave.sim.workloads import Workload  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "benchmarks" / "vidur" / "profile_driver.py"
DEFAULT_TRACE = Path("/work/shared/traces/azure2023_conv.csv")
DEFAULT_VENV = REPO / "benchmarks" / ".vidur-venv"
DEFAULT_ORIGINALS = Path("/work/shared/profiles/vidur-a100")
PRESET = "llama2-70b-tp2-a100"
VIDUR_MODEL = "meta-llama/Llama-2-70b-hf"
# the full original files Vidur trains on, under the names Vidur's predictor opens
ORIGINAL_FILES = {
    ("compute", "mlp.csv"): "mlp_llama2_70b.csv",
    ("compute", "attention.csv"): "attention_llama2_70b_tp2.csv",
    ("network", "all_reduce.csv"): "all_reduce_a100_pairwise_nvlink.csv",
}
# the preset's reduced copies, checked against the originals (the columns our model reads)
PRESET_COPIES = {
    "mlp.csv": "mlp_llama2_70b.csv",
    "attention.csv": "attention_llama2_70b_tp2.csv",
    "all_reduce.csv": "all_reduce_a100_pairwise_nvlink.csv",
}
BATCH_CAP = 128
SARATHI_BUDGET = 512
PREDICTION_MAX_TOKENS = 16384  # Vidur's prediction_max_tokens_per_request (default 2M: a 2M-row grid per operator)
OPERATORS = ("token_ops", "all_reduce", "decode", "prefill")


# ---------------------------------------------------------------------------------------
# Profiles for Vidur
# ---------------------------------------------------------------------------------------


def stage_profiles(originals: Path, cache: Path) -> tuple[Path, Path]:
    """Folders holding the original CSVs under Vidur's file names (symbolic links)."""
    root = (cache / "profiles" / PRESET).resolve()
    for (kind, name), source in ORIGINAL_FILES.items():
        target = root / kind / name
        target.parent.mkdir(parents=True, exist_ok=True)
        src = (originals / source).resolve()
        if not src.exists():
            raise SystemExit(f"{src}: missing (the original Vidur profile files)")
        if target.is_symlink() or target.exists():
            if target.resolve() == src:
                continue
            target.unlink()
        target.symlink_to(src)
    return root / "compute", root / "network"


def check_preset_copies(originals: Path) -> dict:
    """Are the preset's reduced CSVs the originals' rows and columns (for the columns they keep)?"""
    folder = Path(load_profiles(PRESET).where)
    out = {}
    for copy_name, original_name in PRESET_COPIES.items():
        copy = pd.read_csv(folder / copy_name)
        original = pd.read_csv(originals / original_name)
        same_shape = len(copy) == len(original) and set(copy.columns) <= set(original.columns)
        equal = same_shape
        if same_shape:
            for column in copy.columns:
                a, b = copy[column], original[column]
                if a.dtype.kind in "fi" and b.dtype.kind in "fi":
                    equal &= bool(np.allclose(a.to_numpy(float), b.to_numpy(float), rtol=1e-12, atol=0, equal_nan=True))
                else:
                    equal &= bool((a.astype(str) == b.astype(str)).all())
        out[copy_name] = {
            "rows": len(copy),
            "columns_kept": len(copy.columns),
            "original_columns": len(original.columns),
            "identical_on_kept_columns": bool(equal),
        }
    return out


# ---------------------------------------------------------------------------------------
# Our iterations, taken apart
# ---------------------------------------------------------------------------------------


def take_apart(result: SimResult, workload: Workload) -> dict:
    """Every iteration's decodes (KV each) and prefill pieces (chunk, prefix), from SimResult.

    Request r emits its first token at the end of iteration first_r (its prefill's last) and
    decodes in iterations first_r + k, k = 1 .. out_r - 1. Our KV ledger gives that decode
    prompt + k tokens of context (the prompt, and the k tokens emitted so far); Vidur's Batch
    has num_kv_tokens = tokens processed + 1 = prompt + k + 1 (it counts the token being made).
    A prefill piece attends to its prefix (the request's earlier pieces); Vidur's Batch has
    num_kv_tokens = prefix + chunk.
    """
    if result.preemptions or result.token_segments:
        raise SystemExit("preemptions are not modelled here (run without a KV capacity)")
    prompt = np.asarray(workload.prompt_tokens, dtype=np.int64)
    output = np.asarray(workload.output_tokens, dtype=np.int64)
    first = result.first_token_iter
    num = result.num_iterations
    reqs = np.flatnonzero(first >= 0)
    counts = np.maximum(output[reqs] - 1, 0)
    rep = np.repeat(reqs, counts)
    k = np.arange(rep.size) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    dec_iter = first[rep] + k
    if dec_iter.size and dec_iter.max() >= num:
        raise SystemExit("a request decodes past the last iteration (a horizon?)")
    dec_kv = prompt[rep] + k
    n = np.bincount(dec_iter, minlength=num)
    if not np.array_equal(n, result.iter_decodes):
        raise SystemExit("decode counts rebuilt from first-token iterations differ from the simulator's")
    kv_sum = np.bincount(dec_iter, weights=dec_kv, minlength=num).astype(np.int64)
    pieces = pd.DataFrame({"it": result.prefill_iter, "req": result.prefill_request, "tokens": result.prefill_tokens})
    pieces["prefix"] = pieces.groupby("req")["tokens"].cumsum() - pieces["tokens"]
    if not np.array_equal(
        np.bincount(pieces["it"], weights=pieces["tokens"], minlength=num).astype(np.int64), result.iter_chunk_tokens
    ):
        raise SystemExit("prefill pieces do not add up to the simulator's chunks")
    return {
        "num": num,
        "n": n,
        "kv_sum": kv_sum,
        "dec_iter": dec_iter,
        "dec_kv": dec_kv,
        "dec_req": rep,
        "pieces": pieces,
    }


def pieces_per_iteration(parts: dict) -> list[list[tuple[int, int]]]:
    out: list[list[tuple[int, int]]] = [[] for _ in range(parts["num"])]
    p = parts["pieces"]
    for it, c, prefix in zip(p["it"].tolist(), p["tokens"].tolist(), p["prefix"].tolist()):
        out[it].append((c, prefix))
    return out


def vidur_batches(parts: dict, path: Path) -> None:
    """The Batch contents Vidur's Sarathi would form: decodes (q 1), then prefill pieces."""
    num = parts["num"]
    order = np.argsort(parts["dec_iter"], kind="stable")
    d_it, d_kv = parts["dec_iter"][order], parts["dec_kv"][order] + 1
    p = parts["pieces"]
    it = np.concatenate([d_it, p["it"].to_numpy()])
    kind = np.concatenate([np.zeros(d_it.size, dtype=np.int64), np.ones(len(p), dtype=np.int64)])
    q = np.concatenate([np.ones(d_it.size, dtype=np.int64), p["tokens"].to_numpy()])
    kv = np.concatenate([d_kv, (p["prefix"] + p["tokens"]).to_numpy()])
    order = np.lexsort((kind, it))  # by iteration, decodes first, pieces in their order
    it, q, kv = it[order], q[order], kv[order]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(it, minlength=num))])
    np.savez(path, q=q, kv=kv, offsets=offsets)


def our_terms(profiles, parts: dict, pieces: list[list[tuple[int, int]]]) -> pd.DataFrame:
    """Our model per iteration: the whole iteration and each operator group alone."""
    full = ProfileCost(profiles, cpu_overhead=False)
    isolated = {
        op: isolated_cost(profiles, op) for op in OPERATORS if op != "all_reduce" or profiles.all_reduce is not None
    }
    rows = {"total_ms": [], **{f"{op}_ms": [] for op in OPERATORS}}
    n, kv = parts["n"].tolist(), parts["kv_sum"].tolist()
    for i in range(parts["num"]):
        rows["total_ms"].append(full.predict_pieces(n[i], kv[i], pieces[i]))
        for op in OPERATORS:
            rows[f"{op}_ms"].append(isolated[op].predict_pieces(n[i], kv[i], pieces[i]) if op in isolated else 0.0)
    frame = pd.DataFrame(rows)
    frame.attrs["out_of_range"] = dict(full.out_of_range)
    return frame


def ours_at_vidur_inputs(profiles, parts: dict, pieces, vidur: dict, settings: dict) -> pd.DataFrame:
    """Our tables asked what Vidur's predictor asks its regressions: tokens rounded up to 8;
    decode at (Vidur's decode count, ceil-256 of the mean of prompt + k + 1) times (1 + 0.1) for
    batches > 1; each prefill piece of more than one token at (chunk rounded up to 32,
    prefix + chunk rounded up to 256); 1-token pieces are decodes to Vidur."""
    isolated = {
        op: isolated_cost(profiles, op) for op in OPERATORS if op != "all_reduce" or profiles.all_reduce is not None
    }
    gran = settings["kv_cache_prediction_granularity"]
    overhead = settings["attention_decode_batching_overhead_fraction"]
    n, chunks = parts["n"], np.array([sum(c for c, _ in ps) for ps in pieces])
    out = {f"{op}_ms": np.zeros(parts["num"]) for op in OPERATORS}
    for i in range(parts["num"]):
        tokens8 = (int(n[i] + chunks[i]) + 7) // 8 * 8
        out["token_ops_ms"][i] = isolated["token_ops"].predict(0, tokens8, 0, 0)
        if "all_reduce" in isolated:
            out["all_reduce_ms"][i] = isolated["all_reduce"].predict(0, tokens8, 0, 0)
        b, kv = int(vidur["decode_batch"][i]), int(vidur["decode_kv"][i])
        if b:
            out["decode_ms"][i] = isolated["decode"].predict(b, 0, b * kv, 0) * (1 + overhead * (b > 1))
        vpieces = [((c + 31) // 32 * 32, (p + c + gran - 1) // gran * gran) for c, p in pieces[i] if c > 1]
        if vpieces:
            out["prefill_ms"][i] = isolated["prefill"].predict_pieces(0, 0, vpieces)
    frame = pd.DataFrame(out)
    frame["total_ms"] = frame[[f"{op}_ms" for op in OPERATORS]].sum(axis=1)
    return frame


# ---------------------------------------------------------------------------------------
# Vidur
# ---------------------------------------------------------------------------------------


def driver(venv: Path, args: list[str], log: Path, tag: str, nice: int | None = None) -> dict:
    cmd = [str(venv_python(venv)), str(DRIVER), *args]
    if nice is not None:
        cmd = ["nice", "-n", str(nice)] + cmd
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"Vidur driver failed (exit {proc.returncode}); log: {log}\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines()[::-1] if l.startswith(tag + " "))
    result = json.loads(line[len(tag) + 1 :])
    result["process_s"] = wall
    return result


def predictor_args(predictor: str, compute: Path, network: Path, cache: Path, threads: int) -> list[str]:
    return [
        "--predictor",
        predictor,
        "--compute",
        str(compute),
        "--network",
        str(network),
        "--cache-dir",
        str(cache),
        "--model",
        VIDUR_MODEL,
        "--device",
        "a100",
        "--network-device",
        "a100_pairwise_nvlink",
        "--tp",
        "2",
        "--max-tokens",
        str(PREDICTION_MAX_TOKENS),
        "--threads",
        str(threads),
    ]


def vidur_sim_args(
    trace_csv: Path,
    time_scale: float,
    max_tokens: int,
    compute: Path,
    network: Path,
    cache: Path,
    out_dir: Path,
    lean: bool,
) -> list[str]:
    rf = "--random_forrest_execution_time_predictor_config_"
    args = [
        "--cluster_config_num_replicas",
        "1",
        "--global_scheduler_config_type",
        "round_robin",
        "--replica_config_num_pipeline_stages",
        "1",
        "--replica_config_model_name",
        VIDUR_MODEL,
        "--replica_config_device",
        "a100",
        "--replica_config_network_device",
        "a100_pairwise_nvlink",
        "--replica_config_tensor_parallel_size",
        "2",
        *trace_replay_args(trace_csv, time_scale, max_tokens),
        "--execution_time_predictor_config_type",
        "random_forrest",
        rf + "model_profiling_dataset",
        str(compute),
        rf + "network_profiling_dataset",
        str(network),
        rf + "cache_dir",
        str(cache),
        rf + "prediction_max_tokens_per_request",
        str(PREDICTION_MAX_TOKENS),
        "--replica_scheduler_config_type",
        "sarathi",
        "--sarathi_scheduler_config_chunk_size",
        str(SARATHI_BUDGET),
        "--sarathi_scheduler_config_batch_size_cap",
        str(BATCH_CAP),
    ]
    return ["simulate", "--"] + args + output_args(out_dir, lean)


# ---------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------


def diff_stats(ours: np.ndarray, theirs: np.ndarray, mask: np.ndarray | None = None) -> dict:
    ours, theirs = np.asarray(ours, float), np.asarray(theirs, float)
    if mask is not None:
        ours, theirs = ours[mask], theirs[mask]
    keep = ours > 0
    rel = (theirs[keep] - ours[keep]) / ours[keep]
    if rel.size == 0:
        return {"iterations": 0}
    a = np.abs(rel)
    return {
        "iterations": int(rel.size),
        "median_abs": float(np.median(a)),
        "p90_abs": float(np.percentile(a, 90)),
        "max_abs": float(a.max()),
        "median_signed": float(np.median(rel)),
        "sum_ratio": float(theirs[keep].sum() / ours[keep].sum()),
    }


def agreement_rows(
    predictor: str, ours: pd.DataFrame, vidur: pd.DataFrame, at_inputs: pd.DataFrame, classes: dict
) -> list[dict]:
    rows = []
    for comparison, a, b in (
        ("Vidur vs ours", ours, vidur),
        ("Vidur vs ours @ Vidur's inputs (the regression fit)", at_inputs, vidur),
        ("ours @ Vidur's inputs vs ours (Vidur's input conventions)", ours, at_inputs),
    ):
        for what in ("total",) + OPERATORS:
            for cls, mask in classes.items():
                m = mask & (a[f"{what}_ms"].to_numpy() > 0) if what != "total" else mask
                st = diff_stats(a[f"{what}_ms"].to_numpy(), b[f"{what}_ms"].to_numpy(), m)
                if st["iterations"]:
                    rows.append(
                        {"predictor": predictor, "comparison": comparison, "term": what, "iterations_class": cls, **st}
                    )
    return rows


def schedule_summary(label: str, iter_start, iter_end, ttft, p99, e2e) -> dict:
    dur = np.asarray(iter_end) - np.asarray(iter_start)
    return {
        "simulator": label,
        "iterations": int(len(dur)),
        "makespan_s": float(np.max(iter_end) / 1e3),
        "iteration_ms_median": float(np.median(dur)),
        "iteration_ms_mean": float(np.mean(dur)),
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "p99_gap_ms_p50": float(np.percentile(p99, 50)),
        "p99_gap_ms_p99": float(np.percentile(p99, 99)),
        "e2e_ms_p50": float(np.percentile(e2e, 50)),
    }


def fmt(frame: pd.DataFrame, columns: list[str], percent: set[str] = frozenset()) -> str:
    """The side-by-side benchmark's table, with ``percent`` columns shown as percentages."""
    shown = frame[columns].copy()
    for c in percent & set(columns):
        shown[c] = [
            ("-" if pd.isna(v) else f"{100 * v:+.2f}%" if "signed" in c else f"{100 * v:.2f}%") for v in frame[c]
        ]
    return format_table(shown, columns)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "vidur_profile")
    parser.add_argument(
        "--cache",
        type=Path,
        default=REPO / "results" / ".vidur-cache",
        help="Vidur's trained models and predictions (kept between runs)",
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="arrival times x this (4.0: a quarter of the trace's rate, which loads a 70B on two A100s)",
    )
    parser.add_argument(
        "--originals", type=Path, default=DEFAULT_ORIGINALS, help="the full original Vidur profile CSVs"
    )
    parser.add_argument(
        "--predictors", default="rf,lr", help="Vidur predictors for (a): rf (random forest), lr (linear regression)"
    )
    parser.add_argument("--runs", type=int, default=3, help="interleaved timed runs for (b); 0 skips (b)")
    parser.add_argument(
        "--train-threads", type=int, default=2, help="Vidur's num_training_job_threads (training runs under nice 19)"
    )
    parser.add_argument(
        "--no-lean", action="store_true", help="(b) without the lean Vidur variant (no metrics, no chrome trace)"
    )
    parser.add_argument("--vidur-venv", type=Path, default=DEFAULT_VENV)
    args = parser.parse_args()
    predictors = [p.strip() for p in args.predictors.split(",") if p.strip()]
    if set(predictors) - {"rf", "lr"}:
        parser.error("--predictors: rf and/or lr")
    started = time.perf_counter()
    install = ensure_vidur(args.vidur_venv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = args.cache.resolve()
    (cache / "vidur").mkdir(parents=True, exist_ok=True)
    compute, network = stage_profiles(args.originals, cache)
    copies = check_preset_copies(args.originals)
    load_start = os.getloadavg()

    # ---- our simulation -------------------------------------------------------------------
    frame = load_requests(args.trace, args.requests)
    workload = our_workload(frame, args.time_scale)
    profiles = load_profiles(PRESET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cost = ProfileCost(profiles, cpu_overhead=False)
        result = simulate(
            workload, make_policy(f"sarathi-{SARATHI_BUDGET}"), actual_cost=cost, max_batch_size=BATCH_CAP
        )
    sim_out_of_range = dict(cost.out_of_range)
    parts = take_apart(result, workload)
    pieces = pieces_per_iteration(parts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same extrapolation warnings as in the simulation
        ours = our_terms(profiles, parts, pieces)
    charged = result.iter_end_ms - result.iter_start_ms
    recompute_diff = np.abs(charged - ours["total_ms"].to_numpy())
    multi = np.array([len(ps) > 1 for ps in pieces])
    print(
        f"ours: {result.num_iterations} iterations, {int(multi.sum())} with several prompts; the simulator charged "
        f"predict_pieces to within {recompute_diff.max():.3g} ms (multi-prompt max {recompute_diff[multi].max() if multi.any() else 0:.3g} ms)",
        flush=True,
    )
    batches = out / "batches.npz"
    vidur_batches(parts, batches)

    # iteration classes
    n, chunk = parts["n"], result.iter_chunk_tokens
    mean_kv = np.divide(parts["kv_sum"], np.maximum(n, 1))
    max_reach = np.zeros(parts["num"])  # largest prefix + chunk of a piece in the iteration
    p = parts["pieces"]
    np.maximum.at(max_reach, p["it"].to_numpy(), (p["prefix"] + p["tokens"]).to_numpy())
    reach_max = float(
        (profiles.prefill["prefill_chunk_size"] + profiles.prefill["kv_cache_size"]).max()
    )  # the triangle's edge
    in_range = (mean_kv <= cost.decode_kv_max) & (max_reach <= reach_max)
    classes = {
        "all": np.ones(parts["num"], dtype=bool),
        "decode-only": (n > 0) & (chunk == 0),
        "decodes + prefill": (n > 0) & (chunk > 0),
        "prefill-only": (n == 0) & (chunk > 0),
        "< 64 tokens (all-reduce profiled at fractional sizes only)": (n + chunk) < 64,
        ">= 64 tokens": (n + chunk) >= 64,
        "within the profiled range": in_range,
        "past the profiled KV / prefix": ~in_range,
    }

    # ---- (a) Vidur's predictors on our iterations ----------------------------------------------
    all_rows, predict_info = [], {}
    per_iteration = {
        "iteration": np.arange(parts["num"]),
        "decodes": n,
        "chunk": chunk,
        "pieces": [len(ps) for ps in pieces],
        "mean_kv_per_decode": mean_kv,
        "max_prefix_plus_chunk": max_reach,
        "in_profiled_range": in_range,
        "charged_ms": charged,
    }
    for op in ("total",) + OPERATORS:
        per_iteration[f"ours_{op}_ms"] = ours[f"{op}_ms"].to_numpy()
    for predictor in predictors:
        print(
            f"Vidur {predictor}: building the predictor (training it first if {cache / 'vidur'} has no cached models) ...",
            flush=True,
        )
        info = driver(
            args.vidur_venv,
            [
                "predict",
                *predictor_args(predictor, compute, network, cache / "vidur", args.train_threads),
                "--batches",
                str(batches),
                "--out",
                str(out / f"vidur_{predictor}.npz"),
            ],
            out / f"vidur_{predictor}_predict.log",
            "VIDUR_PREDICT",
            nice=19,
        )
        predict_info[predictor] = info
        v = dict(np.load(out / f"vidur_{predictor}.npz"))
        vidur = pd.DataFrame({k: v[k] for k in ("total_ms",) + tuple(f"{op}_ms" for op in OPERATORS)})
        parts_sum = vidur[[f"{op}_ms" for op in OPERATORS]].sum(axis=1).to_numpy()
        info["components_vs_total_max_abs_ms"] = float(np.max(np.abs(parts_sum - vidur["total_ms"].to_numpy())))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            at_inputs = ours_at_vidur_inputs(profiles, parts, pieces, v, info["settings"])
        all_rows += agreement_rows(predictor, ours, vidur, at_inputs, classes)
        for op in ("total",) + OPERATORS:
            per_iteration[f"vidur_{predictor}_{op}_ms"] = vidur[f"{op}_ms"].to_numpy()
            per_iteration[f"ours_at_vidur_inputs_{op}_ms"] = at_inputs[f"{op}_ms"].to_numpy()
        per_iteration["vidur_decode_batch"] = v["decode_batch"]
        per_iteration["vidur_decode_kv"] = v["decode_kv"]
    agreement = pd.DataFrame(all_rows)
    agreement.to_csv(out / "agreement.csv", index=False)
    pd.DataFrame(per_iteration).to_csv(out / "iterations.csv", index=False)

    # ---- (b) speed --------------------------------------------------------------------------
    runs, speed_rows, schedules = [], [], []
    longest = int((frame["prompt_tokens"] + frame["output_tokens"]).max())
    max_tokens = 1 << max(longest - 1, 1).bit_length()
    if args.runs > 0:
        trace_csv = out / "trace_vidur_format.csv"
        write_vidur_trace(frame, trace_csv)
        vidur_root = out / "vidur_sim"
        if vidur_root.exists():
            shutil.rmtree(vidur_root)
        vidur_root.mkdir(parents=True)
        # warm Vidur's cache for this configuration once (untimed): trains if needed
        driver(
            args.vidur_venv,
            ["train", *predictor_args("rf", compute, network, cache / "vidur", args.train_threads)],
            out / "vidur_rf_train.log",
            "VIDUR_TRAIN",
            nice=19,
        )
        kept = None
        for run in range(args.runs):
            load = os.getloadavg()[0]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                run_cost = ProfileCost(profiles, cpu_overhead=False)
                t1 = time.perf_counter()
                ours_result = simulate(
                    workload, make_policy(f"sarathi-{SARATHI_BUDGET}"), actual_cost=run_cost, max_batch_size=BATCH_CAP
                )
                t2 = time.perf_counter()
            requests = per_request_frame(ours_result)
            t3 = time.perf_counter()
            runs.append(
                {
                    "simulator": "sloweave",
                    "variant": "simulate() + ProfileCost",
                    "run": run,
                    "load_avg_1m": load,
                    "iterations": ours_result.num_iterations,
                    "setup_s": t1 - t0,
                    "loop_s": t2 - t1,
                    "outputs_s": t3 - t2,
                }
            )
            # the same schedule with the durations replayed: what the engine costs without the cost model
            durations = iter((ours_result.iter_end_ms - ours_result.iter_start_ms).tolist())
            t4 = time.perf_counter()
            replayed = simulate(
                workload,
                make_policy(f"sarathi-{SARATHI_BUDGET}"),
                actual_cost=lambda n_, c_: next(durations),
                max_batch_size=BATCH_CAP,
            )
            t5 = time.perf_counter()
            if not np.array_equal(replayed.iter_end_ms, ours_result.iter_end_ms):
                raise SystemExit("replaying our durations did not give the same schedule")
            runs.append(
                {
                    "simulator": "sloweave",
                    "variant": "engine only (same durations replayed, no cost model)",
                    "run": run,
                    "load_avg_1m": load,
                    "iterations": replayed.num_iterations,
                    "setup_s": 0.0,
                    "loop_s": t5 - t4,
                    "outputs_s": float("nan"),
                }
            )
            variants = [("as configured (metrics + chrome trace)", False)] + (
                [] if args.no_lean else [("lean (no metrics, no chrome trace)", True)]
            )
            for variant, lean in variants:
                load = os.getloadavg()[0]
                run_dir = vidur_root / f"{'lean' if lean else 'full'}{run}"
                vr = driver(
                    args.vidur_venv,
                    vidur_sim_args(
                        trace_csv, args.time_scale, max_tokens, compute, network, cache / "vidur", run_dir, lean
                    ),
                    vidur_root / f"{'lean' if lean else 'full'}{run}.log",
                    "VIDUR_RESULT",
                )
                runs.append(
                    {
                        "simulator": "vidur",
                        "variant": variant,
                        "run": run,
                        "load_avg_1m": load,
                        "iterations": vr["iterations"],
                        "setup_s": vr["setup_s"],
                        "loop_s": vr["loop_s"],
                        "outputs_s": vr["write_s"],
                        "import_s": vr["import_s"],
                        "process_s": vr["process_s"],
                    }
                )
                if not lean and kept is None:
                    kept = (ours_result, requests, Path(vr["output_dir"]))
                elif run_dir.exists():
                    shutil.rmtree(run_dir)
            print(
                f"  run {run + 1}/{args.runs}: ours {runs[-2 - len(variants)]['loop_s']:.3f} s, Vidur loop "
                + ", ".join(f"{r['loop_s']:.2f} s" for r in runs[-len(variants) :])
                + f" (load {load:.2f})",
                flush=True,
            )
        runs_frame = pd.DataFrame(runs)
        runs_frame.to_csv(out / "runs.csv", index=False)
        ours_runs = runs_frame[
            (runs_frame.simulator == "sloweave") & (runs_frame.variant == "simulate() + ProfileCost")
        ]
        ours_loop = statistics.median(ours_runs.loop_s)
        ours_setup_loop = statistics.median(ours_runs.setup_s + ours_runs.loop_s)
        ours_rate = ours_runs.iterations.iloc[0] / ours_loop
        speed_rows.append(
            {
                "simulator": "sloweave",
                "variant": "simulate() + ProfileCost",
                "runs": len(ours_runs),
                "iterations": int(ours_runs.iterations.iloc[0]),
                "loop_s": ours_loop,
                "setup_plus_loop_s": ours_setup_loop,
                "iterations_per_s": ours_rate,
                "vidur_over_ours_loop": 1.0,
                "vidur_over_ours_setup_plus_loop": 1.0,
                "vidur_over_ours_per_iteration": 1.0,
                "load_avg_1m_median": statistics.median(ours_runs.load_avg_1m),
            }
        )
        engine = runs_frame[runs_frame.variant.str.startswith("engine only")]
        speed_rows.append(
            {
                "simulator": "sloweave",
                "variant": "engine only (same durations replayed, no cost model)",
                "runs": len(engine),
                "iterations": int(engine.iterations.iloc[0]),
                "loop_s": statistics.median(engine.loop_s),
                "setup_plus_loop_s": float("nan"),
                "iterations_per_s": engine.iterations.iloc[0] / statistics.median(engine.loop_s),
                "vidur_over_ours_loop": float("nan"),
                "vidur_over_ours_setup_plus_loop": float("nan"),
                "vidur_over_ours_per_iteration": float("nan"),
                "load_avg_1m_median": statistics.median(engine.load_avg_1m),
            }
        )
        for variant in runs_frame[runs_frame.simulator == "vidur"].variant.unique():
            vr = runs_frame[(runs_frame.simulator == "vidur") & (runs_frame.variant == variant)]
            loop = statistics.median(vr.loop_s)
            setup_loop = statistics.median(vr.setup_s + vr.loop_s)
            speed_rows.append(
                {
                    "simulator": "vidur",
                    "variant": variant,
                    "runs": len(vr),
                    "iterations": int(vr.iterations.iloc[0]),
                    "loop_s": loop,
                    "setup_plus_loop_s": setup_loop,
                    "iterations_per_s": vr.iterations.iloc[0] / loop,
                    "vidur_over_ours_loop": loop / ours_loop,
                    "vidur_over_ours_setup_plus_loop": setup_loop / ours_setup_loop,
                    "vidur_over_ours_per_iteration": ours_rate / (vr.iterations.iloc[0] / loop),
                    "load_avg_1m_median": statistics.median(vr.load_avg_1m),
                }
            )
        pd.DataFrame(speed_rows).to_csv(out / "speed.csv", index=False)
        ours_result, requests, vidur_dir = kept
        schedules.append(
            schedule_summary(
                "sloweave (ProfileCost)",
                ours_result.iter_start_ms,
                ours_result.iter_end_ms,
                requests["ttft_ms"],
                requests["p99_tpot_ms"],
                requests["finish_ms"] - requests["arrival_ms"],
            )
        )
        vrun = read_vidur_outputs(vidur_dir, workload.prompt_tokens)
        metrics = vrun.request_metrics
        vidur_p99 = np.array([p99_gap(t) for t in vrun.token_times_ms])
        schedules.append(
            schedule_summary(
                "Vidur (random forest)",
                vrun.iter_start_ms,
                vrun.iter_end_ms,
                metrics["prefill_e2e_time"].to_numpy() * 1e3,
                vidur_p99,
                metrics["request_e2e_time"].to_numpy() * 1e3,
            )
        )
        pd.DataFrame(schedules).to_csv(out / "schedules.csv", index=False)

    summary = {
        "what": "sloweave ProfileCost vs Vidur's profiled predictors: per-iteration agreement and simulation speed",
        "sloweave_version": importlib.metadata.version("sloweave"),
        "sloweave_source": source_state(),
        "vidur_install": install,
        "settings": {
            "trace": str(args.trace),
            "requests": args.requests,
            "time_scale": args.time_scale,
            "mean_rate_rps": (len(frame) - 1) / workload.span_s,
            "policy": f"sarathi-{SARATHI_BUDGET}",
            "batch_cap": BATCH_CAP,
            "preset": PRESET,
            "cpu_overhead": False,
            "vidur_model": VIDUR_MODEL,
            "vidur_trace_max_tokens": max_tokens,
            "vidur_prediction_max_tokens_per_request": PREDICTION_MAX_TOKENS,
            "vidur_profiles": {
                "compute": str(compute),
                "network": str(network),
                "files": {f"{k[0]}/{k[1]}": v for k, v in ORIGINAL_FILES.items()},
            },
            "cache": str(cache),
            "runs": args.runs,
        },
        "preset_copies_vs_originals": copies,
        "our_model": cost.describe(),
        "our_simulation": {
            "iterations": result.num_iterations,
            "multi_prompt_iterations": int(multi.sum()),
            "charged_vs_predict_pieces_max_abs_ms": float(recompute_diff.max()),
            "out_of_range_queries": sim_out_of_range,
            "warnings": sorted({str(w.message) for w in caught}),
        },
        "iteration_classes": {k: int(v.sum()) for k, v in classes.items()},
        "vidur_predict": predict_info,
        "agreement": all_rows,
        "speed": speed_rows,
        "runs": runs,
        "schedules": schedules,
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(strict(summary), indent=1, allow_nan=False))

    # ---- print ----------------------------------------------------------------------------
    pct = {"median_abs", "p90_abs", "max_abs", "median_signed"}
    print(
        f"\n(a) per-iteration relative difference (Vidur - ours) / ours, {result.num_iterations} iterations of "
        f"{args.requests} requests x{args.time_scale}"
    )
    main_rows = agreement[(agreement.iterations_class == "all")]
    print(
        fmt(
            main_rows,
            [
                "predictor",
                "comparison",
                "term",
                "iterations",
                "median_abs",
                "p90_abs",
                "max_abs",
                "median_signed",
                "sum_ratio",
            ],
            pct,
        )
    )
    total_rows = agreement[(agreement.term == "total") & (agreement.comparison == "Vidur vs ours")]
    print("\nwhole iteration, by class:")
    print(
        fmt(
            total_rows,
            ["predictor", "iterations_class", "iterations", "median_abs", "p90_abs", "max_abs", "median_signed"],
            pct,
        )
    )
    if speed_rows:
        print("\n(b) speed (medians of interleaved runs):")
        print(
            fmt(
                pd.DataFrame(speed_rows),
                [
                    "simulator",
                    "variant",
                    "runs",
                    "iterations",
                    "loop_s",
                    "setup_plus_loop_s",
                    "iterations_per_s",
                    "vidur_over_ours_loop",
                    "vidur_over_ours_setup_plus_loop",
                    "vidur_over_ours_per_iteration",
                    "load_avg_1m_median",
                ],
            )
        )
        print("\nthe two schedules (each simulator with its own iteration times):")
        print(fmt(pd.DataFrame(schedules), list(schedules[0])))
    print(
        f"\nload average start {load_start}, end {os.getloadavg()}; {time.perf_counter() - started:.0f} s; results in {out}"
    )


if __name__ == "__main__":
    main()
