"""sloweave's simulator side by side with Vidur: same answers, much faster.

Runs one trace through both simulators with the same analytic iteration cost and the same
scheduler, checks that they agree iteration by iteration and request by request, and times
both on this machine in the same run.

- Vidur (Microsoft's LLM-serving simulator, ``vidur==0.0.26`` from the package registry) is
  installed into its own virtual environment (default ``benchmarks/.vidur-venv``); it is not
  a dependency of sloweave. ``benchmarks/vidur/analytic_driver.py`` runs inside that venv,
  registers an analytic execution-time predictor in Vidur's
  ``ExecutionTimePredictorRegistry`` (so nothing is downloaded) and runs Vidur's own
  simulator with Vidur's own command line.
- Trace: the first ``--requests`` rows of the Azure 2023 conversation trace, arrival times
  multiplied by ``--time-scale`` on both sides (Vidur: its trace generator's
  ``time_scale_factor``).
- Schedulers: Vidur ``sarathi`` (chunk_size 512, batch_size_cap 128) vs
  ``make_policy("sarathi-512")``; Vidur ``orca`` (batch_size_cap 128) vs ``make_policy("orca")``;
  both with ``max_batch_size=128``, KV-cache limits disabled on Vidur's side (a billion
  blocks, no watermark, a memory plan that allows more than 128 requests), one replica,
  one pipeline stage.
- Agreement is computed from Vidur's raw outputs (``request_metrics.csv`` for TTFT, end-to-end
  time and scheduling delay; ``chrome_trace.json`` for every iteration's batch, from which
  each request's token emission times and its P99 inter-token gap are rebuilt), never from
  Vidur's aggregate metrics, whose definitions differ (see docs/vidur.md).
- Speed: ``--runs`` repetitions, interleaved (ours, Vidur, ours, Vidur, ...) so both see the
  same machine load; medians. Also a "lean" Vidur configuration (no metrics, no chrome trace)
  as the fastest Vidur can go.

    .venv/bin/python benchmarks/vidur_side_by_side.py            # results/vidur/
    .venv/bin/python benchmarks/vidur_side_by_side.py --runs 5 --out results/vidur

Outputs under ``--out``: ``agreement.csv``, ``speed.csv``, ``runs.csv``, ``summary.json``,
``per_request_<scheduler>.csv``, the Vidur-format trace, and Vidur's raw output of the
agreement run under ``vidur/<scheduler>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.sim.metrics import per_request_frame
from sloweave.core.policy import make_policy
from sloweave.sim.engine import SimResult, simulate
from sloweave.sim.workloads import Workload
from sloweave.studies.outputs import write_result_json

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "benchmarks" / "vidur" / "analytic_driver.py"
DEFAULT_TRACE = Path("/work/shared/traces/azure2023_conv.csv")
DEFAULT_VENV = REPO / "benchmarks" / ".vidur-venv"
VIDUR_VERSION = "0.0.26"
INSTALL_RECORD = "sloweave-vidur-install.json"
BATCH_CAP = 128
SARATHI_BUDGET = 512
TRACE_DATE = "2023-08-21"  # Vidur's trace replay keeps the rows of one "Date"
# Both clocks are float sums of the same iteration times, Vidur's in seconds, ours in
# milliseconds: equal up to rounding. 1e-6 ms (1 ns) is sloweave.sim.metrics.TIME_TOLERANCE_MS.
TOLERANCE_MS = 1e-6

# scheduler name -> (our policy, Vidur's scheduler flags)
SCHEDULERS = {
    "sarathi": (
        f"sarathi-{SARATHI_BUDGET}",
        [
            "--replica_scheduler_config_type",
            "sarathi",
            "--sarathi_scheduler_config_chunk_size",
            str(SARATHI_BUDGET),
            "--sarathi_scheduler_config_batch_size_cap",
            str(BATCH_CAP),
        ],
    ),
    "orca": (
        "orca",
        [
            "--replica_scheduler_config_type",
            "orca",
            "--orca_scheduler_config_batch_size_cap",
            str(BATCH_CAP),
        ],
    ),
}


# ---------------------------------------------------------------------------------------
# Vidur's environment
# ---------------------------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_vidur_version(venv: Path) -> str | None:
    python = venv_python(venv)
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vidur'))"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def ensure_vidur(venv: Path) -> dict:
    """Create ``venv`` and ``pip install vidur==VIDUR_VERSION`` into it unless already there.

    Returns the install record (seconds taken, when), written the first time.
    """
    record_path = venv / INSTALL_RECORD
    if installed_vidur_version(venv) == VIDUR_VERSION:
        if record_path.exists():
            return json.loads(record_path.read_text())
        return {"vidur": VIDUR_VERSION, "install_s": None, "note": "installed before this script recorded it"}
    print(f"installing vidur=={VIDUR_VERSION} into {venv} (its own venv; about 100 packages, 1.3 GB) ...", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run(
        [str(venv_python(venv)), "-m", "pip", "install", "--quiet", f"vidur=={VIDUR_VERSION}"],
        check=True,
    )
    seconds = time.perf_counter() - start
    du = subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True)
    record = {
        "vidur": VIDUR_VERSION,
        "install_s": round(seconds, 1),
        "size_mb": int(du.stdout.split()[0]) if du.returncode == 0 else None,
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
    }
    record_path.write_text(json.dumps(record, indent=1))
    print(f"installed in {seconds:.0f} s", flush=True)
    return record


# ---------------------------------------------------------------------------------------
# The workload, on both sides
# ---------------------------------------------------------------------------------------


def load_requests(trace: Path, num_requests: int) -> pd.DataFrame:
    frame = pd.read_csv(trace).head(num_requests)
    missing = {"arrival_s", "prompt_tokens", "output_tokens"} - set(frame.columns)
    if missing:
        raise SystemExit(f"{trace}: missing columns {sorted(missing)}")
    return frame


def our_workload(frame: pd.DataFrame, time_scale: float) -> Workload:
    # The same float product Vidur's trace generator forms (Time * time_scale_factor).
    return Workload(
        "azure2023_conv",
        frame["arrival_s"].to_numpy(dtype=np.float64) * time_scale,
        frame["prompt_tokens"].to_numpy(),
        frame["output_tokens"].to_numpy(),
    )


def write_vidur_trace(frame: pd.DataFrame, path: Path) -> None:
    """Vidur's trace-replay format (splitwise columns); unscaled times, full float precision."""
    pd.DataFrame(
        {
            "Date": TRACE_DATE,
            "Time": frame["arrival_s"].to_numpy(dtype=np.float64),
            "PromptTokenCount": frame["prompt_tokens"].to_numpy(),
            "CompletionTokenCount": frame["output_tokens"].to_numpy(),
        }
    ).to_csv(path, index=False)


def vidur_args(
    scheduler: str, trace_csv: Path, time_scale: float, max_tokens: int, out_dir: Path, lean: bool
) -> list[str]:
    args = [
        # one replica, one pipeline stage (Vidur's default is 2 stages: two micro-batches in flight)
        "--cluster_config_num_replicas",
        "1",
        "--global_scheduler_config_type",
        "round_robin",
        "--replica_config_num_pipeline_stages",
        "1",
        # Model, device and TP feed only Vidur's memory planner here (the analytic predictor
        # ignores them); TP 8 makes the planner's bound on Orca's batch (KV capacity in
        # tokens // max_tokens) exceed the batch cap so the cap is what binds.
        "--replica_config_model_name",
        "meta-llama/Llama-3-8B",
        "--replica_config_device",
        "h100",
        "--replica_config_tensor_parallel_size",
        "8",
        *trace_replay_args(trace_csv, time_scale, max_tokens),
        # the analytic predictor (registered by the driver under Vidur's DUMMY key)
        "--execution_time_predictor_config_type",
        "dummy",
    ]
    return args + SCHEDULERS[scheduler][1] + output_args(out_dir, lean)


def trace_replay_args(trace_csv: Path, time_scale: float, max_tokens: int) -> list[str]:
    """Vidur replaying our trace as is, with its KV-cache limits off."""
    return [
        # KV-cache limits off: a billion blocks and no watermark, so no admission stalls and
        # no preemption/restarts.
        "--cache_config_num_blocks",
        str(10**9),
        "--cache_config_watermark_blocks_fraction",
        "0",
        # the trace as is: Vidur's trace generator scales prompts by 0.3 by default and trims
        # prompts so that prompt + output <= max_tokens (default 4096)
        "--request_generator_config_type",
        "trace_replay",
        "--trace_request_generator_config_trace_file",
        str(trace_csv),
        "--trace_request_generator_config_date",
        TRACE_DATE,
        "--trace_request_generator_config_prefill_scale_factor",
        "1",
        "--trace_request_generator_config_decode_scale_factor",
        "1",
        "--trace_request_generator_config_time_scale_factor",
        repr(time_scale),
        "--trace_request_generator_config_max_tokens",
        str(max_tokens),
    ]


def output_args(out_dir: Path, lean: bool) -> list[str]:
    """Vidur's outputs (no plots); ``lean``: no metrics and no chrome trace either."""
    args = ["--metrics_config_output_dir", str(out_dir), "--no-metrics_config_store_plots"]
    if lean:
        args += ["--no-metrics_config_write_metrics", "--no-metrics_config_enable_chrome_trace"]
    return args


def run_vidur(venv: Path, args: list[str], log_path: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([str(venv_python(venv)), str(DRIVER), *args], capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    log_path.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"Vidur failed (exit {proc.returncode}); log: {log_path}\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines()[::-1] if l.startswith("VIDUR_RESULT "))
    result = json.loads(line[len("VIDUR_RESULT ") :])
    result["process_s"] = wall
    return result


# ---------------------------------------------------------------------------------------
# Our side
# ---------------------------------------------------------------------------------------


def run_ours(workload: Workload, policy_name: str) -> tuple[SimResult, pd.DataFrame, float, float]:
    policy = make_policy(policy_name)
    start = time.perf_counter()
    result = simulate(workload, policy, actual_cost=AnalyticCost(), max_batch_size=BATCH_CAP)
    sim_s = time.perf_counter() - start
    start = time.perf_counter()
    frame = per_request_frame(result)
    metrics_s = time.perf_counter() - start
    return result, frame, sim_s, metrics_s


def ours_worker(args: argparse.Namespace) -> None:
    """A fresh process doing what a user's script would: import, load, simulate, metrics."""
    frame = load_requests(args.trace, args.requests)
    result, requests, _, _ = run_ours(our_workload(frame, args.time_scale), SCHEDULERS[args.worker][0])
    print("OURS_RESULT " + json.dumps({"iterations": result.num_iterations, "requests": len(requests)}))


def run_ours_process(args: argparse.Namespace, scheduler: str) -> float:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        scheduler,
        "--trace",
        str(args.trace),
        "--requests",
        str(args.requests),
        "--time-scale",
        repr(args.time_scale),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or "OURS_RESULT" not in proc.stdout:
        raise SystemExit(f"our worker failed: {proc.stderr[-2000:]}")
    return wall


# ---------------------------------------------------------------------------------------
# Agreement
# ---------------------------------------------------------------------------------------


@dataclass
class VidurRun:
    iter_start_ms: np.ndarray
    iter_end_ms: np.ndarray
    iter_decodes: np.ndarray
    iter_prefill_tokens: np.ndarray
    pieces: list[list[tuple[int, int]]]  # per iteration: (request, prefill tokens)
    token_times_ms: list[np.ndarray]  # per request
    request_metrics: pd.DataFrame  # indexed by request id


def read_vidur_outputs(out_dir: Path, prompt_tokens: np.ndarray) -> VidurRun:
    events = json.loads((out_dir / "chrome_trace.json").read_text())["traceEvents"]
    events = [e for e in events if e.get("ph") == "X"]
    events.sort(key=lambda e: e["ts"])
    num_requests = len(prompt_tokens)
    processed = np.zeros(num_requests, dtype=np.int64)
    prefill_done = np.zeros(num_requests, dtype=bool)
    token_iters: list[list[int]] = [[] for _ in range(num_requests)]
    starts, ends, decodes, prefill_tokens, pieces = [], [], [], [], []
    for k, event in enumerate(events):
        # Vidur writes ts = (end - duration) * 1e6 and dur = duration * 1e6 (microseconds).
        starts.append(event["ts"] / 1e3)
        ends.append((event["ts"] + event["dur"]) / 1e3)
        n = c = 0
        these = []
        for rid, q in zip(event["args"]["request_ids"], event["args"]["num_q_tokens"]):
            if prefill_done[rid]:
                n += 1  # a decode: one token out of this iteration
                token_iters[rid].append(k)
                continue
            # a prefill piece (possibly of 1 token: counted by position, not by size)
            c += q
            these.append((rid, q))
            processed[rid] += q
            if processed[rid] == prompt_tokens[rid]:
                prefill_done[rid] = True
                token_iters[rid].append(k)  # first token comes out of the prefill's last iteration
        decodes.append(n)
        prefill_tokens.append(c)
        pieces.append(these)
    ends_arr = np.asarray(ends)
    metrics = pd.read_csv(out_dir / "request_metrics.csv").set_index("Request Id").sort_index()
    return VidurRun(
        iter_start_ms=np.asarray(starts),
        iter_end_ms=ends_arr,
        iter_decodes=np.asarray(decodes, dtype=np.int64),
        iter_prefill_tokens=np.asarray(prefill_tokens, dtype=np.int64),
        pieces=pieces,
        token_times_ms=[ends_arr[np.asarray(t, dtype=np.int64)] for t in token_iters],
        request_metrics=metrics,
    )


def p99_gap(times: np.ndarray) -> float:
    # as sloweave.sim.metrics.per_request_frame: P99 (numpy's default linear interpolation) of
    # the request's own consecutive gaps; 0 for a single-token request
    return float(np.percentile(np.diff(times), 99)) if times.size > 1 else 0.0


def diff_row(quantity: str, ours: np.ndarray, theirs: np.ndarray, unit: str, tol: float) -> dict:
    ours = np.asarray(ours, dtype=np.float64)
    theirs = np.asarray(theirs, dtype=np.float64)
    delta = np.abs(ours - theirs)
    return {
        "quantity": quantity,
        "unit": unit,
        "compared": int(delta.size),
        "identical": int(np.sum(ours == theirs)),
        "within_tolerance": int(np.sum(delta <= tol)),
        "beyond_tolerance": int(np.sum(delta > tol)),
        "max_abs_diff": float(delta.max()) if delta.size else 0.0,
        "ours_example": float(np.median(ours)) if ours.size else float("nan"),
        "vidur_example": float(np.median(theirs)) if theirs.size else float("nan"),
    }


def count_row(quantity: str, ours: float, theirs: float) -> dict:
    return {
        "quantity": quantity,
        "unit": "count",
        "compared": 1,
        "identical": int(ours == theirs),
        "within_tolerance": int(ours == theirs),
        "beyond_tolerance": int(ours != theirs),
        "max_abs_diff": float(abs(ours - theirs)),
        "ours_example": float(ours),
        "vidur_example": float(theirs),
    }


def compare(
    scheduler: str, ours: SimResult, our_requests: pd.DataFrame, vidur: VidurRun
) -> tuple[list[dict], pd.DataFrame]:
    rows = [count_row("iterations", ours.num_iterations, len(vidur.iter_end_ms))]
    rows.append(
        diff_row("makespan (last iteration end)", [ours.makespan_ms], [vidur.iter_end_ms[-1]], "ms", TOLERANCE_MS)
    )
    same_length = ours.num_iterations == len(vidur.iter_end_ms)
    if same_length:
        rows.append(diff_row("per-iteration decode tokens n", ours.iter_decodes, vidur.iter_decodes, "tokens", 0))
        rows.append(
            diff_row("per-iteration prefill tokens c", ours.iter_chunk_tokens, vidur.iter_prefill_tokens, "tokens", 0)
        )
        our_pieces: list[list[tuple[int, int]]] = [[] for _ in range(ours.num_iterations)]
        for it, req, tok in zip(
            ours.prefill_iter.tolist(), ours.prefill_request.tolist(), ours.prefill_tokens.tolist()
        ):
            our_pieces[it].append((req, tok))
        same = np.array([sorted(a) == sorted(b) for a, b in zip(our_pieces, vidur.pieces)])
        rows.append(
            {
                "quantity": "per-iteration prefill pieces (request, tokens)",
                "unit": "iterations",
                "compared": int(same.size),
                "identical": int(same.sum()),
                "within_tolerance": int(same.sum()),
                "beyond_tolerance": int((~same).sum()),
                "max_abs_diff": float(np.nan),
                "ours_example": float(len(ours.prefill_iter)),
                "vidur_example": float(sum(map(len, vidur.pieces))),
            }
        )
        rows.append(diff_row("per-iteration start", ours.iter_start_ms, vidur.iter_start_ms, "ms", TOLERANCE_MS))
        rows.append(diff_row("per-iteration end", ours.iter_end_ms, vidur.iter_end_ms, "ms", TOLERANCE_MS))
    num = len(our_requests)
    metrics = vidur.request_metrics.reindex(range(num))
    arrival_ms = our_requests["arrival_ms"].to_numpy()
    vidur_ttft = metrics["prefill_e2e_time"].to_numpy() * 1e3
    vidur_e2e = metrics["request_e2e_time"].to_numpy() * 1e3
    vidur_delay = metrics["request_scheduling_delay"].to_numpy() * 1e3
    vidur_tokens = np.array([t.size for t in vidur.token_times_ms])
    vidur_ttft_trace = np.array([t[0] if t.size else np.nan for t in vidur.token_times_ms]) - arrival_ms
    vidur_p99 = np.array([p99_gap(t) for t in vidur.token_times_ms])
    our_first_start = np.full(num, np.nan)
    first_piece = np.unique(ours.prefill_request, return_index=True)
    our_first_start[first_piece[0]] = ours.iter_start_ms[ours.prefill_iter[first_piece[1]]]
    our_tokens = np.array([ours.token_times_ms(i).size for i in range(num)])
    rows.append(
        diff_row(
            "prompt tokens as Vidur read them",
            our_requests["prompt_tokens"],
            metrics["request_num_prefill_tokens"].to_numpy(),
            "tokens",
            0,
        )
    )
    rows.append(
        diff_row(
            "output tokens as Vidur read them",
            our_requests["output_tokens"],
            metrics["request_num_decode_tokens"].to_numpy(),
            "tokens",
            0,
        )
    )
    rows.append(
        count_row("requests finished", int(ours.finished.sum()), int(metrics["request_e2e_time"].notna().sum()))
    )
    rows.append(count_row("requests restarted/preempted by Vidur", 0, int(metrics["request_num_restarts"].sum())))
    rows.append(diff_row("tokens emitted per request", our_tokens, vidur_tokens, "tokens", 0))
    rows.append(
        diff_row("TTFT (request_metrics.csv prefill_e2e_time)", our_requests["ttft_ms"], vidur_ttft, "ms", TOLERANCE_MS)
    )
    rows.append(
        diff_row(
            "TTFT (first token time from chrome_trace.json)",
            our_requests["ttft_ms"],
            vidur_ttft_trace,
            "ms",
            TOLERANCE_MS,
        )
    )
    rows.append(
        diff_row("P99 inter-token gap (chrome_trace.json)", our_requests["p99_tpot_ms"], vidur_p99, "ms", TOLERANCE_MS)
    )
    rows.append(
        diff_row(
            "end-to-end latency (request_e2e_time)",
            our_requests["finish_ms"] - arrival_ms,
            vidur_e2e,
            "ms",
            TOLERANCE_MS,
        )
    )
    rows.append(
        diff_row(
            "scheduling delay (request_scheduling_delay)", our_first_start - arrival_ms, vidur_delay, "ms", TOLERANCE_MS
        )
    )
    for row in rows:
        row["scheduler"] = scheduler
    per_request = pd.DataFrame(
        {
            "request": np.arange(num),
            "arrival_ms": arrival_ms,
            "prompt_tokens": our_requests["prompt_tokens"],
            "output_tokens": our_requests["output_tokens"],
            "ttft_ms_ours": our_requests["ttft_ms"],
            "ttft_ms_vidur": vidur_ttft,
            "p99_gap_ms_ours": our_requests["p99_tpot_ms"],
            "p99_gap_ms_vidur": vidur_p99,
            "e2e_ms_ours": our_requests["finish_ms"] - arrival_ms,
            "e2e_ms_vidur": vidur_e2e,
            # Vidur's own per-request decode metric: (completion - prefill completion) / decode tokens
            "vidur_decode_time_normalized_ms": metrics["decode_time_execution_plus_preemption_normalized"].to_numpy()
            * 1e3,
        }
    )
    return rows, per_request


def metric_definition_notes(per_request: pd.DataFrame) -> dict:
    """How Vidur's own per-request decode metric relates to the mean and P99 gap (numbers)."""
    out = per_request["output_tokens"].to_numpy()
    multi = out > 1
    mean_gap = (per_request["e2e_ms_ours"] - per_request["ttft_ms_ours"]).to_numpy()[multi] / (out[multi] - 1)
    vidur_norm = per_request["vidur_decode_time_normalized_ms"].to_numpy()[multi]
    p99 = per_request["p99_gap_ms_ours"].to_numpy()[multi]
    return {
        "vidur_decode_normalized_over_mean_gap_median": float(np.median(vidur_norm / mean_gap)),
        "vidur_decode_normalized_over_mean_gap_min": float(np.min(vidur_norm / mean_gap)),
        "p99_gap_over_vidur_decode_normalized_median": float(np.median(p99 / vidur_norm)),
        "p99_gap_over_vidur_decode_normalized_max": float(np.max(p99 / vidur_norm)),
    }


def boundary_probe(args: argparse.Namespace, out: Path) -> dict:
    """Which iteration takes a request that arrives exactly when an iteration ends?

    Request 0 arrives at 0 (prompt 100, 3 output tokens); its prefill-only iteration lasts
    T(0, 100) ms. Request 1 (prompt 10, 2 output tokens) arrives exactly then: the same float
    in Vidur's seconds (T * 1e-3) and in our milliseconds (T * 1e-3 * 1000 == T for this
    prompt). Both simulators are run with Sarathi-512 and their iterations listed.
    """
    cost = AnalyticCost()
    t0_ms = cost(0, 100)
    tie_s = t0_ms * 1e-3
    assert tie_s * 1000.0 == t0_ms, "pick a prompt whose iteration time round-trips through seconds"
    frame = pd.DataFrame({"arrival_s": [0.0, tie_s], "prompt_tokens": [100, 10], "output_tokens": [3, 2]})
    probe_dir = out / "boundary_probe"
    if probe_dir.exists():
        shutil.rmtree(probe_dir)
    probe_dir.mkdir(parents=True)
    trace_csv = probe_dir / "trace_vidur_format.csv"
    write_vidur_trace(frame, trace_csv)
    workload = our_workload(frame, 1.0)
    ours, _, _, _ = run_ours(workload, SCHEDULERS["sarathi"][0])
    v = run_vidur(
        args.vidur_venv,
        vidur_args("sarathi", trace_csv, 1.0, 128, probe_dir / "vidur", lean=False),
        probe_dir / "vidur.log",
    )
    vidur = read_vidur_outputs(Path(v["output_dir"]), workload.prompt_tokens)

    def listing(starts, decodes, pieces):
        return [
            {"start_ms": float(s), "decodes": int(n), "prefill": [list(p) for p in ps]}
            for s, n, ps in zip(starts, decodes, pieces)
        ]

    our_pieces: list[list[tuple[int, int]]] = [[] for _ in range(ours.num_iterations)]
    for it, req, tok in zip(ours.prefill_iter.tolist(), ours.prefill_request.tolist(), ours.prefill_tokens.tolist()):
        our_pieces[it].append((req, tok))
    result = {
        "request_1_arrival_ms": tie_s * 1000.0,
        "iteration_0_end_ms_ours": float(ours.iter_end_ms[0]),
        "iteration_0_end_ms_vidur": float(vidur.iter_end_ms[0]),
        "ours": listing(ours.iter_start_ms, ours.iter_decodes, our_pieces),
        "vidur": listing(vidur.iter_start_ms, vidur.iter_decodes, vidur.pieces),
    }
    result["request_1_prefilled_in_iteration"] = {
        "ours": next(k for k, ps in enumerate(our_pieces) if any(r == 1 for r, _ in ps)),
        "vidur": next(k for k, ps in enumerate(vidur.pieces) if any(r == 1 for r, _ in ps)),
    }
    (probe_dir / "probe.json").write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def format_table(frame: pd.DataFrame, columns: list[str]) -> str:
    shown = frame[columns].copy()
    for column in shown.columns:
        if shown[column].dtype.kind == "f":
            shown[column] = shown[column].map(lambda v: f"{v:.4g}")
    widths = {c: max(len(c), *(len(str(v)) for v in shown[c])) for c in columns}
    lines = ["  ".join(f"{c:<{widths[c]}}" for c in columns)]
    for _, row in shown.iterrows():
        lines.append("  ".join(f"{str(row[c]):<{widths[c]}}" for c in columns))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "vidur")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.125,
        help="arrival times are multiplied by this (0.125: 8x the trace's rate)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="timed repetitions per simulator and scheduler (medians are reported)"
    )
    parser.add_argument("--schedulers", default="sarathi,orca")
    parser.add_argument("--vidur-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument(
        "--no-lean", action="store_true", help="skip the lean Vidur timing (no metrics, no chrome trace)"
    )
    parser.add_argument("--worker", choices=sorted(SCHEDULERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        ours_worker(args)
        return
    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    unknown = set(schedulers) - set(SCHEDULERS)
    if unknown:
        raise SystemExit(f"unknown scheduler(s) {sorted(unknown)}; choose from {sorted(SCHEDULERS)}")

    install = ensure_vidur(args.vidur_venv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    frame = load_requests(args.trace, args.requests)
    workload = our_workload(frame, args.time_scale)
    trace_csv = (out / "trace_vidur_format.csv").resolve()
    write_vidur_trace(frame, trace_csv)
    # Vidur's trace generator trims prompts so that prompt + output <= max_tokens; the
    # smallest power of two above the longest request keeps every request whole.
    longest = int((frame["prompt_tokens"] + frame["output_tokens"]).max())
    max_tokens = 1 << max(longest - 1, 1).bit_length()
    load = {
        "requests": len(frame),
        "time_scale": args.time_scale,
        "arrival_span_s": workload.span_s,
        "mean_rate_rps": (len(frame) - 1) / workload.span_s,
        "longest_request_tokens": longest,
        "vidur_max_tokens": max_tokens,
    }
    print(
        f"trace {args.trace} first {len(frame)} requests, times x{args.time_scale} "
        f"({load['mean_rate_rps']:.1f} req/s over {workload.span_s:.1f} s); cpus {os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    agreement_rows: list[dict] = []
    runs: list[dict] = []
    notes: dict = {}
    vidur_limits: dict = {}
    for scheduler in schedulers:
        policy_name = SCHEDULERS[scheduler][0]
        vidur_root = out / "vidur" / scheduler
        if vidur_root.exists():
            shutil.rmtree(vidur_root)
        vidur_root.mkdir(parents=True)
        kept = None
        for run in range(args.runs):
            result, requests, sim_s, metrics_s = run_ours(workload, policy_name)
            runs.append(
                {
                    "simulator": "sloweave",
                    "variant": "in-process",
                    "scheduler": scheduler,
                    "run": run,
                    "iterations": result.num_iterations,
                    "sim_s": sim_s,
                    "metrics_s": metrics_s,
                    "process_s": float("nan"),
                }
            )
            runs.append(
                {
                    "simulator": "sloweave",
                    "variant": "process",
                    "scheduler": scheduler,
                    "run": run,
                    "iterations": result.num_iterations,
                    "sim_s": float("nan"),
                    "metrics_s": float("nan"),
                    "process_s": run_ours_process(args, scheduler),
                }
            )
            full_dir = vidur_root / f"run{run}"
            v = run_vidur(
                args.vidur_venv,
                vidur_args(scheduler, trace_csv, args.time_scale, max_tokens, full_dir, lean=False),
                vidur_root / f"run{run}.log",
            )
            vidur_limits[scheduler] = v["replicas"]
            runs.append(
                {
                    "simulator": "vidur",
                    "variant": "as configured (metrics + chrome trace)",
                    "scheduler": scheduler,
                    "run": run,
                    "iterations": v["iterations"],
                    "sim_s": v["loop_s"],
                    "metrics_s": v["write_s"],
                    "process_s": v["process_s"],
                    "import_s": v["import_s"],
                    "setup_s": v["setup_s"],
                }
            )
            if kept is None:
                kept = (result, requests, Path(v["output_dir"]))  # absolute: out is resolved
            else:  # keep timings only; the agreement uses the first run's raw outputs
                shutil.rmtree(full_dir)
            if not args.no_lean:
                lean_dir = vidur_root / f"lean{run}"
                lv = run_vidur(
                    args.vidur_venv,
                    vidur_args(scheduler, trace_csv, args.time_scale, max_tokens, lean_dir, lean=True),
                    vidur_root / f"lean{run}.log",
                )
                runs.append(
                    {
                        "simulator": "vidur",
                        "variant": "lean (no metrics, no chrome trace)",
                        "scheduler": scheduler,
                        "run": run,
                        "iterations": lv["iterations"],
                        "sim_s": lv["loop_s"],
                        "metrics_s": lv["write_s"],
                        "process_s": lv["process_s"],
                        "import_s": lv["import_s"],
                        "setup_s": lv["setup_s"],
                    }
                )
                shutil.rmtree(lean_dir)
            print(
                f"  {scheduler} run {run + 1}/{args.runs}: ours {sim_s:.3f} s, Vidur loop {v['loop_s']:.2f} s "
                f"(process {v['process_s']:.1f} s)",
                flush=True,
            )
        result, requests, vidur_dir = kept
        vidur = read_vidur_outputs(vidur_dir, workload.prompt_tokens)
        rows, per_request = compare(scheduler, result, requests, vidur)
        agreement_rows += rows
        per_request.to_csv(out / f"per_request_{scheduler}.csv", index=False)
        notes[scheduler] = metric_definition_notes(per_request)

    probe = boundary_probe(args, out)

    agreement = pd.DataFrame(agreement_rows)
    agreement.to_csv(out / "agreement.csv", index=False)
    runs_frame = pd.DataFrame(runs)
    runs_frame.to_csv(out / "runs.csv", index=False)

    speed_rows = []
    for scheduler in schedulers:
        ours_runs = runs_frame[(runs_frame.simulator == "sloweave") & (runs_frame.scheduler == scheduler)]
        ours_sim = ours_runs[ours_runs.variant == "in-process"]
        ours_proc = ours_runs[ours_runs.variant == "process"]
        iterations = int(ours_sim.iterations.iloc[0])
        ours_sim_s = statistics.median(ours_sim.sim_s)
        ours_with_metrics_s = statistics.median(ours_sim.sim_s + ours_sim.metrics_s)
        ours_proc_s = statistics.median(ours_proc.process_s)
        speed_rows.append(
            {
                "scheduler": scheduler,
                "simulator": "sloweave",
                "variant": "simulate()",
                "iterations": iterations,
                "runs": len(ours_sim),
                "loop_s": ours_sim_s,
                "loop_plus_outputs_s": ours_with_metrics_s,
                "process_s": ours_proc_s,
                "iter_per_s": iterations / ours_sim_s,
                "vidur_over_ours_loop": 1.0,
                "vidur_over_ours_loop_plus_outputs": 1.0,
                "vidur_over_ours_process": 1.0,
            }
        )
        for variant in runs_frame[(runs_frame.simulator == "vidur")].variant.unique():
            vr = runs_frame[
                (runs_frame.simulator == "vidur")
                & (runs_frame.scheduler == scheduler)
                & (runs_frame.variant == variant)
            ]
            if vr.empty:
                continue
            loop_s = statistics.median(vr.sim_s)
            with_outputs_s = statistics.median(vr.sim_s + vr.metrics_s)
            speed_rows.append(
                {
                    "scheduler": scheduler,
                    "simulator": "vidur",
                    "variant": variant,
                    "iterations": int(vr.iterations.iloc[0]),
                    "runs": len(vr),
                    "loop_s": loop_s,
                    "loop_plus_outputs_s": with_outputs_s,
                    "process_s": statistics.median(vr.process_s),
                    "iter_per_s": int(vr.iterations.iloc[0]) / loop_s,
                    "vidur_over_ours_loop": loop_s / ours_sim_s,
                    "vidur_over_ours_loop_plus_outputs": with_outputs_s / ours_with_metrics_s,
                    "vidur_over_ours_process": statistics.median(vr.process_s) / ours_proc_s,
                }
            )
    speed = pd.DataFrame(speed_rows)
    speed.to_csv(out / "speed.csv", index=False)

    summary = {
        "vidur_install": install,
        "workload": load,
        "vidur_replica_limits": vidur_limits,
        "tolerance_ms": TOLERANCE_MS,
        "machine": {"cpus": os.cpu_count(), "load_average_end": os.getloadavg()},
        "agreement": agreement_rows,
        "speed": speed_rows,
        "vidur_metric_definitions": notes,
        "boundary_probe": probe,
    }
    write_result_json(out / "summary.json", summary)

    print("\nAgreement (ours vs Vidur, same trace, same analytic cost):")
    print(
        format_table(
            agreement, ["scheduler", "quantity", "unit", "compared", "identical", "beyond_tolerance", "max_abs_diff"]
        )
    )
    print(
        f"(tolerance {TOLERANCE_MS} ms: both clocks are float sums of the same iteration times, Vidur's in s, ours in ms)"
    )
    print("\nSpeed (medians; this machine, shared):")
    print(
        format_table(
            speed,
            [
                "scheduler",
                "simulator",
                "variant",
                "iterations",
                "runs",
                "loop_s",
                "loop_plus_outputs_s",
                "process_s",
                "iter_per_s",
                "vidur_over_ours_loop",
                "vidur_over_ours_loop_plus_outputs",
                "vidur_over_ours_process",
            ],
        )
    )
    print(
        "loop: ours simulate() vs Vidur's event loop; outputs: ours + per_request_frame (TTFT, P99 gap per request), "
        "Vidur + writing request_metrics.csv, chrome_trace.json and its other CSVs; process: a fresh interpreter, "
        "imports included"
    )
    print(
        f"\nBoundary probe (request 1 arrives exactly when iteration 0 ends, at {probe['request_1_arrival_ms']} ms): "
        f"prefilled in iteration {probe['request_1_prefilled_in_iteration']['ours']} (ours), "
        f"{probe['request_1_prefilled_in_iteration']['vidur']} (Vidur)"
    )
    print(f"\nVidur install: {install}")
    print(f"results in {out}")


if __name__ == "__main__":
    main()
