"""The step log: every step a real engine planned and ran, one JSON object a line.

A ``StepLogWriter`` is a ``DecisionRecorder`` (``sloweave.core.decision_metrics``): the vLLM
plug-in writes one when its configuration names a ``step_log`` file. The first line is a
header (format, version, the engine's settings, the clock); each later line is one step that
came back: what was planned (decodes, chunk, token budget, time budget, prediction and its
margin), what the engine really scheduled, the KV context, the prompts on offer (each one's
tokens on offer and tokens already computed), and the measured time. The file is bounded:
after ``max_steps`` steps one last line says the log stopped, so a long-running server cannot
fill its disk. ``read_step_log`` reads it back for ``sloweave served-run`` (pictures of a served
run, beside the simulator's), and
``profile_rows`` turns it into a step-time profile (``sloweave fit`` and ``--cost`` read a
``.jsonl`` step log as one), so a profile can be taken while serving, not only in isolation.

Times are the engine's monotonic clock in milliseconds (``start_ms``); the header's
``unix_s_at_clock_0_ms`` turns them into wall-clock time.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sloweave.core.validate import (
    CLOCK_MS,
    MARGIN_MS,
    REQUEST_COUNT,
    SEED,
    TOKEN_COUNT,
    Range,
    RepeatedKeyError,
    one_value_per_key,
)

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: each step's ``offer``, prompt by prompt; format 1 logs (without it) still read
READS_FORMATS = (1, 2)
DEFAULT_MAX_STEPS = 1_000_000  # about 400 MB of log; a served hour at 250 steps/s
# the columns of a step line, in order (the reader checks every line has exactly these)
STEP_FIELDS = (
    "step",
    "start_ms",
    "measured_ms",
    "decode_tokens",
    "chunk_tokens",
    "token_budget",
    "ran_decode_tokens",
    "ran_prefill_tokens",
    "decode_kv_tokens",
    "prefill_prefix_tokens",
    "pending_prompt_tokens",
    "prompts_on_offer",
    "offer",  # [[prompt tokens on offer, tokens of it already computed], ...] in the engine's order
    "budget_ms",
    "predicted_ms",
    "margin_ms",
    "base_predicted_ms",
    "infeasible",
    "aged",
    "late_requests",
)


# The range of each numeric field (``None`` allowed where the writer writes null: no deadline,
# no base model); the clock is monotonic milliseconds since boot, so up to MAX_SECONDS of them.
_TOKENS = (
    "decode_tokens",
    "chunk_tokens",
    "token_budget",
    "ran_decode_tokens",
    "ran_prefill_tokens",
    "decode_kv_tokens",
    "prefill_prefix_tokens",
    "pending_prompt_tokens",
)
FIELD_RANGES = {
    "step": (SEED, False),
    "start_ms": (CLOCK_MS, False),
    **{name: (TOKEN_COUNT, False) for name in _TOKENS},
    **{name: (MARGIN_MS, False) for name in ("measured_ms", "predicted_ms", "margin_ms")},
    **{name: (MARGIN_MS, True) for name in ("budget_ms", "base_predicted_ms")},
    **{name: (REQUEST_COUNT, False) for name in ("prompts_on_offer", "late_requests")},
}
FLAG_FIELDS = ("infeasible", "aged")
OFFER_FIELD = "offer"
# the step times a profile can be made of (``profile_rows``)
STEP_TIMES = ("measured", "cycle")
# a format 1 step: no offer
_FORMAT_1_FIELDS = tuple(name for name in STEP_FIELDS if name != OFFER_FIELD)


class StepLogError(ValueError):
    """A step log that cannot be read as one (names the file and line)."""


def _number_or_null(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no inf/NaN: +inf budget, no base model


class StepLogWriter:
    """Writes the step log of one engine (a ``DecisionRecorder``); bounded at ``max_steps``.

    A failure to write (a full disk) stops the log with one warning; serving goes on.
    """

    def __init__(self, path: str | Path, header: dict, max_steps: int = DEFAULT_MAX_STEPS, clock_ms=None) -> None:
        self.path = Path(path)
        self.max_steps = max_steps
        self.steps = 0
        self._planned: deque = deque()  # (plan, late, ran) of steps scheduled and not back yet
        clock_ms = clock_ms or (lambda: time.monotonic() * 1000.0)
        first = {
            "kind": "header",
            "format": FORMAT,
            "sloweave_version": _version(),
            "unix_s_at_clock_0_ms": time.time() - clock_ms() / 1000.0,
            **header,
        }
        # line-buffered: every finished step is on disk, a crash loses at most the step in flight
        self._file = open(self.path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the server's life
        self._write(first)

    @property
    def open(self) -> bool:
        return self._file is not None

    def on_plan(self, plan, late_requests: int, ran_tokens: tuple[int, int] | None = None) -> None:
        if self._file is not None:
            self._planned.append((plan, late_requests, ran_tokens))

    def on_step_done(self, plan, measured_ms: float, started_ms: float = math.nan) -> None:
        if self._file is None:
            return
        while self._planned and self._planned[0][0] is not plan:  # a step the engine never returned
            self._planned.popleft()
        if not self._planned:
            return
        _, late, ran = self._planned.popleft()
        ran_decode, ran_prefill = ran if ran is not None else (plan.decode_tokens, plan.chunk_tokens)
        line = dict(
            zip(
                STEP_FIELDS,
                (
                    self.steps,
                    started_ms,
                    measured_ms,
                    plan.decode_tokens,
                    plan.chunk_tokens,
                    plan.token_budget,
                    int(ran_decode),
                    int(ran_prefill),
                    plan.decode_kv_tokens,
                    plan.prefill_prefix_tokens,
                    plan.pending_prompt_tokens,
                    plan.prompts_on_offer,
                    [[int(tokens), int(computed)] for tokens, computed in plan.offer],
                    _number_or_null(plan.budget_ms),
                    plan.predicted_ms,
                    plan.margin_ms,
                    _number_or_null(plan.base_predicted_ms),
                    plan.infeasible,
                    plan.aged,
                    late,
                ),
            )
        )
        self._write({"kind": "step", **line})
        self.steps += 1
        if self.steps >= self.max_steps:
            self._write({"kind": "stopped", "steps": self.steps, "why": f"max_steps ({self.max_steps}) reached"})
            logger.warning("sloweave step log %s: stopped after %d steps (step_log_max_steps)", self.path, self.steps)
            self.close()

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:  # the buffered rest could not be written either (a full disk): already warned
                pass

    def _write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
        except (OSError, ValueError) as err:  # a full disk; a non-finite number is a bug, not a reason to stop serving
            logger.warning("sloweave step log %s: stopped, cannot write (%s)", self.path, err)
            self.close()


def _version() -> str:
    try:
        return metadata.version("sloweave")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class StepLog:
    header: dict
    steps: "pd.DataFrame"  # one row per step, STEP_FIELDS columns (+inf budget: nothing decoding)
    stopped: str | None  # why the log stopped before the run ended, or None


def read_step_log(path: str | Path) -> StepLog:
    """A step log written by ``StepLogWriter``; a line that is not one raises ``StepLogError``."""
    import pandas as pd  # here, not at the top: the writer runs inside the engine

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise StepLogError(f"step log {path}: cannot read it ({err})") from None
    records = []
    for number, text in enumerate(lines, start=1):
        try:
            records.append(json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=one_value_per_key))
        except RepeatedKeyError as err:
            raise StepLogError(f"step log {path}, line {number}: {err}") from None
        except ValueError as err:
            raise StepLogError(f"step log {path}, line {number}: not a JSON object ({err})") from None
        if not isinstance(records[-1], dict):
            raise StepLogError(f"step log {path}, line {number}: not a JSON object")
    if not records or records[0].get("kind") != "header":
        raise StepLogError(f"step log {path}: the first line must be its header (is this a sloweave step log?)")
    header = records[0]
    if header.get("format") not in READS_FORMATS:
        raise StepLogError(
            f"step log {path}: format {header.get('format')!r}, this sloweave reads formats "
            f"{', '.join(map(str, READS_FORMATS))}"
        )
    expected = STEP_FIELDS if header["format"] == FORMAT else _FORMAT_1_FIELDS
    rows, stopped = [], None
    for number, record in enumerate(records[1:], start=2):
        kind = record.get("kind")
        if kind == "step" and stopped is None:
            fields = tuple(k for k in record if k != "kind")
            if fields != expected:
                raise StepLogError(f"step log {path}, line {number}: a step needs the fields {', '.join(expected)}")
            rows.append(tuple(record.get(k) for k in STEP_FIELDS))  # a format 1 step's offer: None
        elif kind == "stopped" and stopped is None:
            stopped = str(record.get("why", "stopped"))
        else:
            raise StepLogError(f"step log {path}, line {number}: unexpected {kind!r} line")
    _check_fields(path, rows)
    steps = pd.DataFrame(rows, columns=list(STEP_FIELDS))
    for column in ("budget_ms", "base_predicted_ms"):
        steps[column] = steps[column].astype("float64")
    steps["budget_ms"] = steps["budget_ms"].fillna(math.inf)
    return StepLog(header, steps, stopped)


def _in_range(value, limits: Range, nullable: bool) -> bool:
    if value is None:
        return nullable
    kind = type(value)  # a boolean is no count; JSON has no NaN or inf (the reader refuses them)
    if kind is not int and (kind is not float or limits.whole):
        return False
    return limits.low <= value <= limits.high


def _check_fields(path: Path, rows: list[tuple]) -> None:
    """Every field of every step in its range (a boolean is no count, 1e20 no token count):
    the first bad value is named with its line (steps start on line 2)."""
    for index, column in enumerate(STEP_FIELDS):
        if column == OFFER_FIELD:
            _check_offers(path, rows, index, STEP_FIELDS.index("prompts_on_offer"))
            continue
        if column in FLAG_FIELDS:
            bad = next((i for i, row in enumerate(rows) if type(row[index]) is not bool), None)
            expected = "true or false"
        else:
            limits, nullable = FIELD_RANGES[column]
            bad = next((i for i, row in enumerate(rows) if not _in_range(row[index], limits, nullable)), None)
            expected = limits.describe() + (" or null" if nullable else "")
        if bad is not None:
            raise StepLogError(
                f"step log {path}, line {bad + 2}: {column} must be {expected}, got {rows[bad][index]!r}"
            )


def _check_offers(path: Path, rows: list[tuple], index: int, count_index: int) -> None:
    """Each step's offer (format 2; None in format 1) is a list of [tokens >= 1, computed >= 0]
    pairs, one per prompt the step's ``prompts_on_offer`` counts."""
    for line, row in enumerate(rows, start=2):
        offer = row[index]
        if offer is None:
            continue
        if not isinstance(offer, list) or len(offer) != row[count_index]:
            raise StepLogError(
                f"step log {path}, line {line}: offer must be a list of {row[count_index]!r} prompts "
                f"(prompts_on_offer), got {offer!r}"
            )
        for prompt in offer:
            if not (
                isinstance(prompt, list)
                and len(prompt) == 2
                and _in_range(prompt[0], TOKEN_COUNT, False)
                and prompt[0] >= 1
                and _in_range(prompt[1], TOKEN_COUNT, False)
            ):
                raise StepLogError(
                    f"step log {path}, line {line}: each prompt on offer must be [tokens >= 1, computed tokens >= 0], "
                    f"got {prompt!r}"
                )


def profile_rows(log: StepLog, step_time: str = "measured") -> "pd.DataFrame":
    """The steps as a step-time profile (``sloweave.core.costs.step_profiles``' columns): what vLLM ran and its time.

    ``step_time`` is which time: ``measured``, the step as the plug-in times it (from its
    ``schedule()`` to its ``update_from_output()``: what its deadlines are planned against), or
    ``cycle``, the step and the engine loop's work after it (``cycle_ms``: a simulator's
    iteration, whose clock has no loop of its own), the steps without a known cycle left out.

    The KV context was recorded for the decodes the plan counted; where vLLM ran fewer (a cap
    on running requests, KV blocks) it is scaled to the decodes that ran, an estimate (each
    decode's context is taken as the mean). Decode tokens are tokens: with speculative
    decoding a request's drafts count too. A chunk that reaches past its first prompt keeps the
    prompts it was taken from (the profile's ``offer`` column; a format 1 log has none): its
    attention is paid piece by piece, and a fit that took it for one piece would price a large
    chunk's attention low (on vLLM's CPU build a third to a half of the chunks span two prompts,
    with a quarter fewer attention pairs within their pieces than one piece of their size).
    """
    import pandas as pd

    from sloweave.core.costs.step_profiles import format_offer

    if step_time not in STEP_TIMES:
        raise ValueError(f"step_time must be one of {', '.join(STEP_TIMES)}, got {step_time!r}")
    steps = log.steps
    if step_time == "cycle":
        cycles = cycle_ms(steps)
        steps = steps.assign(measured_ms=cycles)[~np.isnan(cycles)]
        if steps.empty:
            raise StepLogError("no step with a known cycle (each needs the next step logged, with decodes running)")
    planned = steps["decode_tokens"].to_numpy()
    ran = steps["ran_decode_tokens"].to_numpy()
    kv = steps["decode_kv_tokens"].to_numpy()
    scaled = np.where(planned > 0, np.round(kv * ran / np.maximum(planned, 1)), 0).astype(np.int64)
    return pd.DataFrame(
        {
            "n_decodes": ran,
            "chunk_tokens": steps["ran_prefill_tokens"].to_numpy(),
            "decode_kv_tokens": np.where(ran == planned, kv, scaled),
            "prefill_prefix_tokens": steps["prefill_prefix_tokens"].to_numpy(),
            "step_ms": steps["measured_ms"].to_numpy(),
            "start_ms": steps["start_ms"].to_numpy(dtype=np.float64),
            "offer": [
                format_offer(_chunk_prompts(chunk, offer))
                for chunk, offer in zip(steps["ran_prefill_tokens"].tolist(), steps[OFFER_FIELD])
            ],
        }
    )


def cycle_ms(steps: "pd.DataFrame") -> np.ndarray:
    """Each step's cycle: from its start to the next step's start, in milliseconds; NaN where
    that is not known.

    Between two steps the engine loop does work no step time counts (on vLLM's CPU build,
    in-process: handing each request's tokens to the client, adding the requests that arrived),
    about 0.15 ms plus 10-15 us a decode; a simulator's clock has no loop, so a twin of the
    engine prices a step with it. It is known where the next step is the next one logged and
    has decodes running: the engine went straight on, with no idle wait for work in between (the
    last step, one before a gap in the numbering, one before a step with nothing decoding, and
    one whose next step starts before it ended, as across the runs of a combined log: NaN).
    """
    start = steps["start_ms"].to_numpy(dtype=np.float64)
    cycles = np.full(len(start), np.nan)
    if len(start) < 2:
        return cycles
    to_next = np.diff(start)
    straight_on = (
        (np.diff(steps["step"].to_numpy()) == 1)
        & (steps["decode_tokens"].to_numpy()[1:] > 0)
        & (to_next >= steps["measured_ms"].to_numpy()[:-1])
    )
    cycles[:-1] = np.where(straight_on, to_next, np.nan)
    return cycles


def _chunk_prompts(chunk_tokens: int, offer: list | None) -> list[tuple[int, int]] | None:
    """The prompts on offer a chunk of ``chunk_tokens`` was taken from, FCFS (as vLLM spends its
    budget), when it reaches past the first; None for one prompt (or no offer logged). Tokens past
    the offer are taken as one more prompt on an empty prefix (``offer_pieces`` prices them so)."""
    if not offer or chunk_tokens <= offer[0][0]:
        return None
    from sloweave.core.costs.protocols import offer_pieces

    pieces = list(offer_pieces(chunk_tokens, offer[0][1], offer))
    # the prompts the pieces came from, and the rest past the offer as a prompt of its own
    return [tuple(prompt) for prompt in offer[: len(pieces)]] + pieces[len(offer) :]


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")
