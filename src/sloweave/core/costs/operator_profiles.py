"""Measured GPU operator profiles in Vidur's public CSV format: reading and checking a folder.

A profile folder holds (file names as Vidur's profiler writes them):

| file | what | needed |
|---|---|---|
| ``model.json`` | what the CSVs do not say: ``name``, ``num_layers``, ``tensor_parallel``; optionally ``attention`` (``"measured"``, or ``{"derived_from": PRESET_OR_FOLDER}``), ``device``, ``notes``, and the memory figures that size the KV cache (``parameters``, ``gpu_memory_gib`` and ``activation_reserve_gib`` per GPU, ``memory_notes``: ``sloweave.core.costs.kv_memory``) | always |
| ``mlp.csv`` | per-layer token-parallel operators by ``num_tokens`` and ``num_tensor_parallel_workers`` | always |
| ``attention.csv`` | FlashAttention decode by (``batch_size``, ``kv_cache_size``) and prefill by (``prefill_chunk_size``, ``kv_cache_size``) | unless derived |
| ``all_reduce.csv`` | all-reduce time by message ``size`` (bytes) and ``num_workers`` | with tensor parallelism |
| ``cpu_overheads.csv`` | the engine's per-iteration CPU work by ``batch_size`` | optional (0 without it, and said so) |

Times are milliseconds, per layer (per operation); the median of each measurement is used.
Every table is read along its counts (tokens, batch size, KV size, chunk, message size), so each
needs two profiled values of each at least (``_enough_points``): with one, interpolation holds
it and extrapolation has no slope, so every other count is priced like that one.
Every problem is a ``ProfileError`` naming the file, the line and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.csv_shape import check_csv_shape, located
from sloweave.core.cells import numbers, show
from sloweave.core.costs.kv_memory import ModelMemory, read_model_memory
from sloweave.core.costs.step_profiles import ProfileError
from sloweave.core.validate import MARGIN_MS, MAX_TOKENS, REPEATS, Range, RepeatedKeyError, one_value_per_key

# Per-layer token-parallel operators that make up a decoder layer besides attention (Vidur's set:
# the embedding and the LM head run once per iteration and are not profiled per layer).
TOKEN_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
CPU_OPS = ("schedule_median", "sampler_e2e_median", "prepare_inputs_e2e_median", "process_model_outputs_median")


def median(op: str) -> str:
    return f"time_stats.{op}.median"


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    n_embd: int
    n_q_heads: int
    n_kv_heads: int
    tensor_parallel: int
    dtype_bytes: int = 2  # fp16 / bf16

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_q_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer, all GPUs together."""
        return 2 * self.num_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    def kv_tokens_in(self, gib: float) -> int:
        """How many tokens of KV cache ``gib`` GiB (all GPUs together) hold."""
        return int(gib * 2**30 // self.kv_bytes_per_token)


@dataclass
class OperatorProfiles:
    """The checked contents of a profile folder (times in ms per layer)."""

    where: str
    shape: ModelShape
    mlp: pd.DataFrame  # num_tokens, the TOKEN_OPS medians, at the model's tensor parallelism
    decode: pd.DataFrame  # batch_size, kv_cache_size, attn_ms
    prefill: pd.DataFrame  # prefill_chunk_size, kv_cache_size, attn_ms
    all_reduce: pd.DataFrame | None  # num_tokens, all_reduce_ms (None: no tensor parallelism)
    cpu: pd.DataFrame | None  # batch_size, cpu_ms
    attention_note: str = "measured"
    notes: list[str] = field(default_factory=list)
    memory: ModelMemory | None = None  # the weights and GPU memory (model.json), None: no default KV capacity
    device: str | None = None


PRESETS = ("llama2-70b-tp2-a100", "llama3-8b-tp1-a100")


def preset_folder(name: str) -> Path:
    if name not in PRESETS:
        raise ProfileError(f"unknown profile preset {name!r}; presets: {', '.join(PRESETS)} (or give a profile folder)")
    return Path(str(resources.files("sloweave.data").joinpath("profiles", name)))


def load_profiles(spec: str | Path) -> OperatorProfiles:
    """A preset name or a profile folder, read and checked."""
    folder = preset_folder(str(spec)) if str(spec) in PRESETS else Path(spec)
    if not folder.is_dir():
        raise ProfileError(f"profile folder {folder} does not exist (presets: {', '.join(PRESETS)})")
    shape, model, mlp_rows = _read_model(folder)
    mlp = _read_mlp(mlp_rows, folder / "mlp.csv", shape)
    attention = model.get("attention", "measured")
    if attention == "measured":
        decode, prefill = _read_attention(folder / "attention.csv", shape)
        note = "measured"
    elif isinstance(attention, dict) and set(attention) == {"derived_from"}:
        decode, prefill, note = _derived_attention(str(attention["derived_from"]), folder, shape)
    else:
        raise ProfileError(
            f'{folder / "model.json"}: attention must be "measured" or {{"derived_from": PRESET_OR_FOLDER}}, got {attention!r}'
        )
    all_reduce = _read_all_reduce(folder / "all_reduce.csv", shape) if shape.tensor_parallel > 1 else None
    cpu_file = folder / "cpu_overheads.csv"
    cpu = _read_cpu(cpu_file) if cpu_file.exists() else None
    notes = [str(model["notes"])] if model.get("notes") else []
    if cpu is None:
        notes.append("no cpu_overheads.csv: the engine's per-iteration CPU time is taken as 0")
    memory = read_model_memory(model, folder / "model.json")
    device = model.get("device")
    if device is not None and not isinstance(device, str):
        raise ProfileError(f"{folder / 'model.json'}: device must be a string (the GPU's name), got {device!r}")
    return OperatorProfiles(str(folder), shape, mlp, decode, prefill, all_reduce, cpu, note, notes, memory, device)


# ----------------------------------------------------------------------------- the files


def _read_model(folder: Path) -> tuple[ModelShape, dict, pd.DataFrame]:
    """The model's shape (model.json and the shape columns of mlp.csv), model.json, and mlp.csv's rows."""
    path = folder / "model.json"
    if not path.exists():
        raise ProfileError(f"{folder}: no model.json (it names the model and gives num_layers and tensor_parallel)")
    try:
        model = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=one_value_per_key)
    except RepeatedKeyError as err:
        raise ProfileError(f"{path}: {err}") from None
    except ValueError as err:
        raise ProfileError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:  # nested a few thousand deep
        raise ProfileError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(model, dict):
        raise ProfileError(f"{path}: must be a JSON object")
    for key in ("num_layers", "tensor_parallel"):  # 10**400 layers made the KV bytes per token overflow
        try:
            REPEATS.check(model.get(key), key)
        except ValueError as err:
            raise ProfileError(f"{path}: {err}") from None
    shape_columns = ("n_head", "n_kv_head", "n_embd", "num_tokens", "num_tensor_parallel_workers")
    mlp = _read_csv(folder / "mlp.csv", shape_columns + tuple(median(op) for op in TOKEN_OPS), counts=shape_columns)
    for column in ("n_head", "n_kv_head", "n_embd"):
        # a model without heads (or narrower than its heads) has a head size of 0: a division by zero later
        none = np.flatnonzero(mlp[column].to_numpy() < 1)
        if none.size:
            raise ProfileError(
                f"{folder / 'mlp.csv'}, line {_line(mlp, none[0])}: {column}={mlp[column].iloc[none[0]]:g}; "
                "expected a whole number >= 1"
            )
        if mlp[column].nunique() != 1:
            raise ProfileError(f"{folder / 'mlp.csv'}: {column} takes several values; one model per folder")
    if mlp["n_embd"].iloc[0] < mlp["n_head"].iloc[0]:
        raise ProfileError(
            f"{folder / 'mlp.csv'}: n_embd={mlp['n_embd'].iloc[0]:g} is less than n_head={mlp['n_head'].iloc[0]:g} "
            "(a head size below 1)"
        )
    shape = ModelShape(
        str(model.get("name", folder.name)),
        model["num_layers"],
        int(mlp["n_embd"].iloc[0]),
        int(mlp["n_head"].iloc[0]),
        int(mlp["n_kv_head"].iloc[0]),
        model["tensor_parallel"],
    )
    return shape, model, mlp


def _read_csv(path: Path, columns: tuple[str, ...], counts: tuple[str, ...] = ()) -> pd.DataFrame:
    """The file with ``columns`` present; ``counts`` checked as whole numbers >= 0."""
    if not path.exists():
        raise ProfileError(f"{path}: missing (a profile folder needs it)")
    # not UTF-8 text, rows of the wrong width, a repeated column: refused here, with the line
    lines = check_csv_shape(path, lambda line, problem: ProfileError(f"{located(path, line)}: {problem}"))
    try:
        frame = pd.read_csv(path, index_col=False)
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise ProfileError(f"{path}: cannot be read as CSV ({err})") from None
    if len(lines) == len(frame):
        # Each row's index is its line in the file: pandas skips blank lines, so "row + 2" would drift.
        frame.index = pd.Index(lines, name="line")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ProfileError(f"{path}: missing column(s) {', '.join(missing)}")
    if frame.empty:
        raise ProfileError(f"{path}: no rows")
    for column in counts:
        _check_numbers(frame, column, path, kind="bytes" if column in BYTE_COLUMNS else "count")
    return frame


# What a cell may hold: counts (tokens, heads, workers, batch sizes) up to MAX_TOKENS, message
# sizes in bytes up to 2**53 (exact in float64), times in ms up to MAX_MS. Past these a profile
# row is no measurement (num_tokens=1e13) and the sums built from it lose their exactness.
CELL_RANGES = {
    "count": Range(0, MAX_TOKENS, whole=True),
    "bytes": Range(0, 2**53, " of bytes", whole=True),
    "time": MARGIN_MS,
}
BYTE_COLUMNS = ("size",)


def _check_numbers(frame: pd.DataFrame, column: str, path: Path, kind: str, rows=None) -> None:
    """Every value in ``CELL_RANGES[kind]``; names the first bad line."""
    limits = CELL_RANGES[kind]
    values = numbers(frame[column])
    index = np.arange(len(frame)) if rows is None else np.flatnonzero(rows)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values[index]) | (values[index] < limits.low) | (values[index] > limits.high)
        if limits.whole:
            bad |= values[index] != np.round(values[index])
    if bad.any():
        row = int(index[np.flatnonzero(bad)[0]])
        raise ProfileError(
            f"{path}, line {_line(frame, row)}: {column}={show(frame[column].iloc[row])}; expected {limits.describe()}"
        )
    frame[column] = values


def _enough_points(frame: pd.DataFrame, column: str, path: Path, rows: str) -> None:
    """Two distinct values of ``column`` at least in ``frame`` (``rows`` says which rows, for the message)."""
    values = np.unique(frame[column].to_numpy(dtype=float))
    if len(values) < 2:
        found = f"only {column}={values[0]:g}" if len(values) else f"no {column}"
        raise ProfileError(
            f"{path}: {rows} have {found}; a table read along {column} needs two values of it or more "
            f"(with one, every other {column} is priced like that one)"
        )


def _line(frame: pd.DataFrame, row: int) -> int:
    """The file line of the frame's ``row``-th row (its index, set by ``_read_csv``)."""
    return int(frame.index[row]) if frame.index.name == "line" else int(row) + 2


def _read_mlp(frame: pd.DataFrame, path: Path, shape: ModelShape) -> pd.DataFrame:
    """Per-layer token-parallel time by token count at the model's tensor parallelism (``frame``: mlp.csv)."""
    columns = tuple(median(op) for op in TOKEN_OPS)
    for column in columns:
        _check_numbers(frame, column, path, kind="time")
    mine = frame[frame["num_tensor_parallel_workers"] == shape.tensor_parallel]
    if mine.empty:
        have = sorted(int(v) for v in frame["num_tensor_parallel_workers"].unique())
        raise ProfileError(
            f"{path}: no rows for tensor parallelism {shape.tensor_parallel} (model.json); profiled: {have}"
        )
    _enough_points(mine, "num_tokens", path, f"the rows at tensor parallelism {shape.tensor_parallel}")
    out = mine.groupby("num_tokens")[list(columns)].median().reset_index()
    out["token_ops_ms"] = out[list(columns)].sum(axis=1)
    return out[["num_tokens", "token_ops_ms"]]


def _read_attention(path: Path, shape: ModelShape) -> tuple[pd.DataFrame, pd.DataFrame]:
    keys = (
        "n_embd",
        "n_q_head",
        "n_kv_head",
        "num_tensor_parallel_workers",
        "batch_size",
        "prefill_chunk_size",
        "kv_cache_size",
        "is_prefill",
    )
    frame = _read_csv(path, keys + (median("attn_decode"), median("attn_prefill")), counts=keys[:-1])
    for column, expected in (
        ("n_embd", shape.n_embd),
        ("n_q_head", shape.n_q_heads),
        ("n_kv_head", shape.n_kv_heads),
        ("num_tensor_parallel_workers", shape.tensor_parallel),
    ):
        wrong = np.flatnonzero(frame[column].to_numpy() != expected)
        if wrong.size:
            raise ProfileError(
                f"{path}, line {_line(frame, wrong[0])}: {column}={frame[column].iloc[wrong[0]]:g} does not match the model "
                f"({shape.name}: {expected})"
            )
    is_prefill = frame["is_prefill"].astype(str).str.lower().map({"true": True, "false": False})
    if is_prefill.isna().any():
        row = int(np.flatnonzero(is_prefill.isna())[0])
        raise ProfileError(
            f"{path}, line {_line(frame, row)}: is_prefill={frame['is_prefill'].iloc[row]!r}; expected True or False"
        )
    _check_numbers(frame, median("attn_decode"), path, "time", rows=~is_prefill.to_numpy())
    _check_numbers(frame, median("attn_prefill"), path, "time", rows=is_prefill.to_numpy())
    decode = (
        frame[~is_prefill]
        .groupby(["batch_size", "kv_cache_size"])[median("attn_decode")]
        .median()
        .rename("attn_ms")
        .reset_index()
    )
    prefill = (
        frame[is_prefill]
        .groupby(["prefill_chunk_size", "kv_cache_size"])[median("attn_prefill")]
        .median()
        .rename("attn_ms")
        .reset_index()
    )
    if decode.empty or prefill.empty:
        raise ProfileError(f"{path}: needs both decode rows (is_prefill False) and prefill rows (is_prefill True)")
    _enough_points(decode, "batch_size", path, "the decode rows")
    for batch, rows in decode.groupby("batch_size"):  # each batch size is its own row along the KV size
        _enough_points(rows, "kv_cache_size", path, f"the decode rows at batch_size={batch:g}")
    # A prefill row starts at (0 tokens, 0 ms), so one chunk per prefix is a row; the fitted work
    # that carries it past the profile needs two chunk sizes and two prefixes.
    _enough_points(prefill, "prefill_chunk_size", path, "the prefill rows")
    _enough_points(prefill, "kv_cache_size", path, "the prefill rows")
    return decode, prefill


def _derived_attention(source: str, folder: Path, shape: ModelShape) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """Attention of another profiled shape, scaled to this one per GPU.

    Decode attention reads the KV cache (memory-bound): time x (KV heads per GPU x head size).
    Prefill attention is compute-bound: time x (query heads per GPU x head size).
    """
    if "\0" in source:  # no path holds a NUL byte (resolving one raises ValueError)
        raise ProfileError(
            f"{folder / 'model.json'}: attention derived_from {source!r} is neither a preset nor a folder"
        )
    source_folder = preset_folder(source) if source in PRESETS else (folder / source).resolve()
    source_shape, _, _ = _read_model(source_folder)
    decode, prefill = _read_attention(source_folder / "attention.csv", source_shape)

    def per_gpu(heads: int, s: ModelShape) -> float:
        return heads / s.tensor_parallel * s.head_dim

    decode_factor = per_gpu(shape.n_kv_heads, shape) / per_gpu(source_shape.n_kv_heads, source_shape)
    prefill_factor = per_gpu(shape.n_q_heads, shape) / per_gpu(source_shape.n_q_heads, source_shape)
    decode = decode.assign(attn_ms=decode["attn_ms"] * decode_factor)
    prefill = prefill.assign(attn_ms=prefill["attn_ms"] * prefill_factor)
    note = (
        f"derived from {source_shape.name} TP{source_shape.tensor_parallel} (not measured for this model): "
        f"decode x{decode_factor:g} (KV heads per GPU x head size), prefill x{prefill_factor:g} (query heads per GPU x head size)"
    )
    return decode, prefill, note


def _read_all_reduce(path: Path, shape: ModelShape) -> pd.DataFrame:
    frame = _read_csv(path, ("num_workers", "size", median("all_reduce")), counts=("num_workers", "size"))
    _check_numbers(frame, median("all_reduce"), path, "time")
    mine = frame[frame["num_workers"] == shape.tensor_parallel]
    if mine.empty:
        raise ProfileError(f"{path}: no rows for {shape.tensor_parallel} workers (the model's tensor parallelism)")
    _enough_points(mine, "size", path, f"the rows for {shape.tensor_parallel} workers")
    # An all-reduce of a layer's output moves every token's hidden state: 2 bytes x n_embd each.
    out = mine.groupby("size")[median("all_reduce")].median().rename("all_reduce_ms").reset_index()
    out["num_tokens"] = out["size"] / (shape.dtype_bytes * shape.n_embd)
    return out[["num_tokens", "all_reduce_ms"]]


def _read_cpu(path: Path) -> pd.DataFrame:
    frame = _read_csv(path, ("batch_size",) + CPU_OPS, counts=("batch_size",))
    for column in CPU_OPS:
        _check_numbers(frame, column, path, "time")
    frame["cpu_ms"] = frame[list(CPU_OPS)].sum(axis=1)
    _enough_points(frame, "batch_size", path, "the rows")
    return frame.groupby("batch_size")["cpu_ms"].median().reset_index()
