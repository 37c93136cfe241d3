"""Vidur's own profiled execution-time predictors, trained offline on local profile CSVs.

This file runs INSIDE Vidur's virtual environment (``benchmarks/.vidur-venv``); it is not
importable from the project's venv and contains no Vidur code. It is driven by
``benchmarks/vidur_profile_agreement.py``.

Vidur 0.0.26's sklearn predictors (``RandomForrestExecutionTimePredictor``,
``LinearRegressionExecutionTimePredictor``) first try to download ready-made predictions from
the Hugging Face hub and then download the profiling data to train on
(``SklearnExecutionTimePredictor._load_predictions_from_hf`` and ``_get_input_files``, both
calling ``snapshot_download``). Neither can work offline. The subclasses below change only
those two steps:

- ``_load_predictions_from_hf`` fails at once (Vidur catches the failure, logs it at error
  level and trains instead: its normal fallback);
- ``_get_input_files`` reads the two "dataset" settings that Vidur already has as local
  folders: ``model_profiling_dataset`` holds ``mlp.csv`` and ``attention.csv``,
  ``network_profiling_dataset`` holds ``all_reduce.csv`` (and ``send_recv.csv``, which Vidur
  reads only with pipeline parallelism, i.e. never here: one stage).

Everything else (feature columns, grid search with k-fold cross validation, the prediction
grids, the caching of trained models and predictions under ``cache_dir``, the per-batch
rounding rules, the composition of the iteration time) is Vidur's code, unchanged. They are
registered in ``ExecutionTimePredictorRegistry`` under Vidur's own keys (``random_forrest``,
``linear_regression``) in place of the downloading classes, so Vidur's command line and
simulator use them as they are.

Modes (``python profile_driver.py MODE ...``):

- ``train``: build the predictor (trains and caches what is not cached yet); prints
  ``VIDUR_TRAIN {json}`` with the seconds taken and, per model, Vidur's chosen grid
  parameters and its in-sample MAPE (from Vidur's own log line).
- ``predict``: build the predictor from its cache and price given batches (an ``.npz`` with,
  per batch entry, ``q`` = num_q_tokens and ``kv`` = num_kv_tokens, as Vidur's schedulers
  fill ``Batch``, and ``offsets`` delimiting iterations); writes per-iteration components
  (ms per iteration, all layers) to ``--out`` and prints ``VIDUR_PREDICT {json}``.
- ``simulate``: Vidur's ``Simulator`` with its own command line (the arguments after
  ``--``), timed like ``analytic_driver.py``; prints ``VIDUR_RESULT {json}``.
"""

# No `from __future__ import annotations`: Vidur's command-line builder reads dataclass types.
import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched, and failures are immediate

import numpy as np  # noqa: E402

from vidur.config import (  # noqa: E402
    CacheConfig,
    LinearRegressionExecutionTimePredictorConfig,
    RandomForrestExecutionTimePredictorConfig,
    ReplicaConfig,
    SimulationConfig,
)
from vidur.entities import Batch  # noqa: E402
from vidur.execution_time_predictor import ExecutionTimePredictorRegistry  # noqa: E402
from vidur.execution_time_predictor.linear_regression_execution_time_predictor import (  # noqa: E402
    LinearRegressionExecutionTimePredictor,
)
from vidur.execution_time_predictor.random_forrest_execution_time_predictor import (  # noqa: E402
    RandomForrestExecutionTimePredictor,
)
from vidur.execution_time_predictor.sklearn_execution_time_predictor import ModelType  # noqa: E402
from vidur.simulator import Simulator  # noqa: E402
from vidur.types import ExecutionTimePredictorType  # noqa: E402
from vidur.utils.random import set_seeds  # noqa: E402
from vidur_timing import phase_seconds, report, time_output_writing  # noqa: E402 (beside this driver)

_T_IMPORTED = time.perf_counter()


class LocalProfiles:
    """Mixin: train on local CSV folders instead of downloading (see the module docstring)."""

    def _load_predictions_from_hf(self):
        raise RuntimeError("offline run: no ready-made predictions are fetched; training on local profile files")

    def _get_input_files(self):
        compute = Path(self._config.model_profiling_dataset)
        network = Path(self._config.network_profiling_dataset)
        files = (compute / "mlp.csv", compute / "attention.csv", network / "all_reduce.csv", network / "send_recv.csv")
        for path in files[:3]:
            if not path.exists():
                raise FileNotFoundError(
                    f"{path}: missing (the profile folders are given as model/network_profiling_dataset)"
                )
        if self._replica_config.num_pipeline_stages > 1 and not files[3].exists():
            raise FileNotFoundError(
                f"{files[3]}: Vidur reads send_recv only with pipeline parallelism; none is profiled here"
            )
        return tuple(str(path) for path in files)


class LocalRandomForest(LocalProfiles, RandomForrestExecutionTimePredictor):
    pass


class LocalLinearRegression(LocalProfiles, LinearRegressionExecutionTimePredictor):
    # Vidur 0.0.26's LinearRegressionExecutionTimePredictor leaves this abstract method of its
    # base class unimplemented, so Vidur cannot instantiate it at all ("Can't instantiate
    # abstract class"); the random forest answers it with the base implementation, as here.
    # With kv_parallel_size 1 it is never called.
    def _get_kv_parallel_communication_time(self, batch):
        return super()._get_kv_parallel_communication_time(batch)


# Vidur's registry ignores a second registration of a key: replace the downloading classes.
for _key, _cls in (
    (ExecutionTimePredictorType.RANDOM_FORREST, LocalRandomForest),
    (ExecutionTimePredictorType.LINEAR_REGRESSION, LocalLinearRegression),
):
    ExecutionTimePredictorRegistry.unregister(_key)
    ExecutionTimePredictorRegistry.register(_key, _cls)

PREDICTORS = {
    "rf": (RandomForrestExecutionTimePredictorConfig, LocalRandomForest),
    "lr": (LinearRegressionExecutionTimePredictorConfig, LocalLinearRegression),
}


class _TrainLog(logging.Handler):
    """Keeps Vidur's "Trained model X and found best parameters ..." lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record) -> None:
        message = record.getMessage()
        if message.startswith("Trained model") or message.startswith("Failed to load predictions"):
            self.lines.append(message)


def build_predictor(args):
    config_cls, predictor_cls = PREDICTORS[args.predictor]
    predictor_config = config_cls(
        model_profiling_dataset=str(args.compute),
        network_profiling_dataset=str(args.network),
        cache_dir=str(args.cache_dir),
        prediction_max_tokens_per_request=args.max_tokens,
        num_training_job_threads=args.threads,
    )
    replica_config = ReplicaConfig(
        model_name=args.model,
        device=args.device,
        network_device=args.network_device,
        tensor_parallel_size=args.tp,
        num_pipeline_stages=1,
    )
    cache_config = CacheConfig()
    log = _TrainLog()
    logging.getLogger("vidur").addHandler(log)
    start = time.perf_counter()
    predictor = predictor_cls(
        predictor_config=predictor_config, replica_config=replica_config, cache_config=cache_config
    )
    seconds = time.perf_counter() - start
    logging.getLogger("vidur").removeHandler(log)
    return predictor, seconds, log.lines, replica_config


def settings(predictor, replica_config) -> dict:
    c = predictor._config
    grid = predictor._get_grid_search_params()
    return {
        "predictor": type(predictor).__mro__[2].__name__,  # the Vidur class under the offline mixin
        "model": replica_config.model_name,
        "tensor_parallel": replica_config.tensor_parallel_size,
        "num_layers": replica_config.model_config.num_layers,
        "grid": {k: list(v) for k, v in grid.items()},
        "k_fold_cv_splits": c.k_fold_cv_splits,
        "kv_cache_prediction_granularity": c.kv_cache_prediction_granularity,
        "prediction_max_tokens_per_request": c.prediction_max_tokens_per_request,
        "prediction_max_batch_size": c.prediction_max_batch_size,
        "prediction_max_prefill_chunk_size": c.prediction_max_prefill_chunk_size,
        "attention_decode_batching_overhead_fraction": predictor._attention_decode_batching_overhead_fraction,
        "nccl_cpu_launch_overhead_ms": c.nccl_cpu_launch_overhead_ms,
        "nccl_cpu_skew_overhead_per_device_ms": c.nccl_cpu_skew_overhead_per_device_ms,
        "cache_hashes": {
            "compute": predictor._get_hash(ModelType.COMPUTE),
            "network": predictor._get_hash(ModelType.NETWORK),
        },
    }


def train(args) -> None:
    predictor, seconds, lines, replica_config = build_predictor(args)
    result = {"seconds": seconds, "log": lines, "settings": settings(predictor, replica_config)}
    print("VIDUR_TRAIN " + json.dumps(result), flush=True)


# Vidur's per-layer components, grouped as sloweave's model groups them.
TOKEN_OPS = (
    "_get_attention_layer_pre_proj_execution_time",
    "_get_attention_layer_post_proj_execution_time",
    "_get_attention_rope_execution_time",
    "_get_mlp_layer_up_proj_execution_time",
    "_get_mlp_layer_down_proj_execution_time",
    "_get_mlp_layer_act_execution_time",
    "_get_attn_norm_layer_act_execution_time",
    "_get_mlp_norm_layer_act_execution_time",
    "_get_add_layer_act_execution_time",
)


def predict(args) -> None:
    predictor, seconds, lines, replica_config = build_predictor(args)
    data = np.load(args.batches)
    q, kv, offsets = data["q"], data["kv"], data["offsets"]
    layers = replica_config.num_layers_per_pipeline_stage
    tp = replica_config.tensor_parallel_size
    num = len(offsets) - 1
    out = {k: np.zeros(num) for k in ("total_ms", "token_ops_ms", "all_reduce_ms", "decode_ms", "prefill_ms")}
    out["decode_batch"] = np.zeros(num, dtype=np.int64)
    out["decode_kv"] = np.zeros(num, dtype=np.int64)
    token_ops = [getattr(predictor, name) for name in TOKEN_OPS]
    start = time.perf_counter()
    for i in range(num):
        a, b = offsets[i], offsets[i + 1]
        qs, kvs = q[a:b].tolist(), kv[a:b].tolist()
        batch = Batch(0, [None] * len(qs), qs, kvs)
        total = predictor.get_execution_time(batch, 0).total_time * 1e3
        ops = sum(f(batch) for f in token_ops)
        reduce = 2 * predictor._get_tensor_parallel_communication_time(batch) if tp > 1 else 0.0
        decode = predictor._get_attention_decode_execution_time(batch)
        prefill = predictor._get_attention_prefill_execution_time(batch)
        out["total_ms"][i] = total
        out["token_ops_ms"][i] = layers * ops
        out["all_reduce_ms"][i] = layers * reduce
        out["decode_ms"][i] = layers * decode
        out["prefill_ms"][i] = layers * prefill
        out["decode_batch"][i], out["decode_kv"][i] = predictor._get_batch_decode_attention_params(batch)
    priced_s = time.perf_counter() - start
    np.savez(args.out, **out)
    result = {
        "iterations": num,
        "build_s": seconds,
        "price_s": priced_s,
        "log": lines,
        "settings": settings(predictor, replica_config),
    }
    print("VIDUR_PREDICT " + json.dumps(result), flush=True)


def simulate(vidur_args) -> None:
    sys.argv = [sys.argv[0]] + vidur_args
    config = SimulationConfig.create_from_cli_args()
    if config.execution_time_predictor_config.get_type() not in (
        ExecutionTimePredictorType.RANDOM_FORREST,
        ExecutionTimePredictorType.LINEAR_REGRESSION,
    ):
        sys.exit("pass --execution_time_predictor_config_type random_forrest or linear_regression")
    set_seeds(config.seed)
    t_config = time.perf_counter()
    simulator = Simulator(config)  # builds the predictor: from its cache when trained before
    t_setup = time.perf_counter()
    write_seconds = time_output_writing(simulator)  # the event loop and the output writing, apart
    calls = {"n": 0}
    schedulers = list(simulator.scheduler._replica_schedulers.values())
    predictor = schedulers[0]._execution_time_predictor
    get_execution_time = predictor.get_execution_time

    def counted(batch, stage):
        calls["n"] += 1
        return get_execution_time(batch, stage)

    predictor.get_execution_time = counted  # counts iterations (one attribute lookup more per batch)
    simulator.run()
    t_done = time.perf_counter()
    result = {
        "output_dir": config.metrics_config.output_dir,
        "iterations": calls["n"],
        **phase_seconds(_T_START, _T_IMPORTED, t_config, t_setup, t_done, write_seconds),
        "end_time_s": simulator._time,
        "replicas": [
            {
                "batch_size_cap": s._config.batch_size_cap,
                "num_blocks": s._cache_config.num_blocks,
                "num_stages": s._num_stages,
            }
            for s in schedulers
        ],
    }
    report(result, config.metrics_config.output_dir)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "simulate":
        rest = sys.argv[2:]
        simulate(rest[1:] if rest[:1] == ["--"] else rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("train", "predict"))
    parser.add_argument("--predictor", choices=sorted(PREDICTORS), default="rf")
    parser.add_argument("--compute", type=Path, required=True, help="folder with mlp.csv and attention.csv")
    parser.add_argument("--network", type=Path, required=True, help="folder with all_reduce.csv")
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--model", default="meta-llama/Llama-2-70b-hf")
    parser.add_argument("--device", default="a100")
    parser.add_argument("--network-device", default="a100_pairwise_nvlink")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16384, help="Vidur's prediction_max_tokens_per_request")
    parser.add_argument("--threads", type=int, default=1, help="Vidur's num_training_job_threads")
    parser.add_argument("--batches", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode == "train":
        train(args)
    else:
        if args.batches is None or args.out is None:
            parser.error("predict needs --batches and --out")
        predict(args)


if __name__ == "__main__":
    main()
