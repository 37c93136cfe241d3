"""Result folders (issue 25): complete or absent, never mixed with an earlier run, one writer at a time.

Every command that writes an --out folder goes through ``sloweave.studies.result_folders.result_folder``.
The interrupted runs are real processes sent SIGINT (to the whole process group, as Ctrl-C in a
terminal does); they are held at a known point (a patched function that waits once it has run)
and signalled only once a marker file says they got there, so nothing depends on the machine's
speed.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
TRACE = FIXTURES / "azure_conv_first150.csv"

CAPACITY = [
    "capacity", "--trace", str(TRACE), "--seeds", "2", "--policy", "sloweave", "--policy", "full", "--policy", "fixed-256",
    "--tpot-ms", "10", "--tpot-ms", "50", "--steps-per-doubling", "4", "--whole-trace", "--max-scale", "16",
]  # fmt: skip

# cheap runs of every command that writes a folder (profile/run need the CPU model: tested in test_runtime.py)
COMMANDS = {
    "simulate": ["simulate", "--requests", "40", "--policy", "fixed-512"],
    "capacity": [*CAPACITY, "--jobs", "1", "--no-curves"],
    "replay": ["replay", str(TRACE), "--max-requests", "40", "--policy", "full", "--jobs", "1"],
    "reproduce": ["reproduce", "--workload", "chat", "--seeds", "1", "--requests", "40", "--jobs", "1"],
    "ablate": [
        "ablate",
        "--workload",
        "chat",
        "--seeds",
        "1",
        "--requests",
        "40",
        "--no-trace",
        "--config",
        "greedy",
        "--jobs",
        "1",
    ],
    "tune": [
        "tune",
        "--workload",
        "chat",
        "--quick",
        "--seeds",
        "1",
        "--requests",
        "40",
        "--no-refine",
        "--budget",
        "512",
        "--jobs",
        "1",
    ],
}
WRITES = {
    "simulate": "metrics.json", "capacity": "capacity.json", "replay": "replay.json",
    "reproduce": "summary.json", "ablate": "ablation.json", "tune": "tune.json",
}  # fmt: skip

# Runs the command line with one function patched: it runs, writes MARKER, then waits (for the
# signal the test sends). TARGET is module:attribute (a method as module:Class.method).
HOLD = r"""
import importlib, signal, sys, time
from pathlib import Path
# Ctrl-C as a terminal delivers it, even when the test runner started with SIGINT ignored (a
# background job of a shell without job control): Python would then keep ignoring it
signal.signal(signal.SIGINT, signal.default_int_handler)
marker, target, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
module_name, _, attr = target.partition(":")
owner = importlib.import_module(module_name)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
original = getattr(owner, name)
def held(*args, **kwargs):
    result = original(*args, **kwargs)
    marker.write_text("held")
    time.sleep(600)
    return result
setattr(owner, name, held)
from sloweave.cli import main
main(argv, prog_name="sloweave")
"""


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def held_run(tmp_path: Path, target: str, args: list) -> subprocess.Popen:
    """Start the command in its own process group; return once it waits at ``target``."""
    marker = tmp_path / f"held-{time.monotonic_ns()}"
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(marker), target, *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not marker.exists():
        if process.poll() is not None:
            pytest.fail(f"the run ended before it got to {target}: {process.communicate()[1]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the run never got to {target}")
        time.sleep(0.05)
    return process


def ctrl_c(process: subprocess.Popen) -> tuple[int, str]:
    """SIGINT to the run's whole process group (its pool workers too), as Ctrl-C in a terminal."""
    os.killpg(process.pid, signal.SIGINT)
    try:
        _, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("the run did not stop on Ctrl-C")
    return process.returncode, err


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def beside(out: Path) -> list[str]:
    """What lies beside ``out`` in its folder (a lock, staging or old folder left there shows)."""
    return sorted(p.name for p in out.parent.iterdir() if not p.name.startswith("held-"))


# --------------------------------------------------------------------------- an earlier result


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_earlier_result_is_refused_without_force_and_replaced_whole_with_it(tmp_path, command):
    out = tmp_path / "out"
    first = invoke(*COMMANDS[command], "--out", out)
    assert first.exit_code == 0, first.output
    (out / "from-an-earlier-study.csv").write_text("stale\n")
    refused = invoke(*COMMANDS[command], "--out", out)
    assert refused.exit_code == 2, refused.output
    assert "Invalid value for '--out'" in refused.output or "Invalid value for --out" in refused.output
    assert "not empty" in refused.output and "--force" in refused.output
    assert (out / "from-an-earlier-study.csv").exists()
    forced = invoke(*COMMANDS[command], "--out", out, "--force")
    assert forced.exit_code == 0, forced.output
    assert not (out / "from-an-earlier-study.csv").exists()  # replaced whole: nothing of the earlier run is left
    assert (out / WRITES[command]).exists()
    assert beside(out) == ["out"]  # no lock, staging, old or incomplete folder left


def test_an_empty_folder_is_written_into_and_a_file_is_refused(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert invoke(*COMMANDS["simulate"], "--out", out).exit_code == 0
    assert (out / "metrics.json").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    result = invoke(*COMMANDS["simulate"], "--out", a_file)
    assert result.exit_code == 2 and "is a file" in result.output  # click's own check of a folder option


def test_force_never_deletes_the_working_directory_or_an_input(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    trace = out / "trace.csv"
    trace.write_bytes(TRACE.read_bytes())
    result = invoke("replay", trace, "--max-requests", "40", "--policy", "full", "--out", out, "--force")
    assert result.exit_code == 2 and "holds TRACE (" in result.output and "name a new folder" in result.output
    assert trace.exists()
    monkeypatch.chdir(out)
    result = invoke(*COMMANDS["simulate"], "--out", out, "--force")
    assert result.exit_code == 2 and "holds the working directory" in result.output
    assert trace.exists()


def test_what_a_killed_run_left_does_not_stop_the_next_one(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "out.lock").write_text("99999999\n")  # a lock file nobody holds
    (tmp_path / ".out.tmp-deadbeef").mkdir()  # a killed run's staging folder
    (tmp_path / ".out.tmp-deadbeef" / "requests.csv").write_text("half\n")
    result = invoke(*COMMANDS["simulate"], "--out", out)
    assert result.exit_code == 0, result.output
    assert beside(out) == ["out"]


# --------------------------------------------------------------------------- unwritable destinations


@pytest.mark.parametrize("command", ["simulate", "capacity", "reproduce"])
def test_an_out_under_proc_is_one_line_before_any_work(command):
    result = invoke(*COMMANDS[command], "--out", "/proc/x")
    assert result.exit_code == 2, result.output
    assert "cannot write results under /proc/x (/proc is not a writable folder" in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, OSError)
    assert [line for line in result.output.splitlines() if line.startswith("Error")] == [result.output.splitlines()[-1]]


def test_a_single_file_is_replaced_whole_or_left_as_it_was(tmp_path):
    from sloweave.core.atomic import atomic_path
    from sloweave.studies.outputs import write_result_json

    path = tmp_path / "fit.json"
    write_result_json(path, {"a": 1})
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        with atomic_path(path) as temporary:
            temporary.write_text('{"half')
            raise RuntimeError("stopped while writing")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["fit.json"]


# --------------------------------------------------------------------------- one writer at a time


def test_a_second_run_into_the_same_folder_is_refused_at_once(tmp_path):
    out = tmp_path / "cap"
    first = held_run(tmp_path, "sloweave.studies.parallel:TaskStore.save", [*CAPACITY, "--jobs", "1", "--out", out])
    try:
        second = invoke(*COMMANDS["simulate"], "--out", out)
        assert second.exit_code == 2, second.output
        assert f"another run is writing {out} (pid {first.pid}" in second.output
        also = invoke(*CAPACITY, "--jobs", "1", "--out", out, "--resume")  # not even to go on with it
        assert also.exit_code == 2 and "another run is writing" in also.output
    finally:
        code, err = ctrl_c(first)
    assert code == 130, err
    assert not out.exists()


# --------------------------------------------------------------------------- Ctrl-C, and --resume


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_during_the_search_keeps_the_finished_tasks_and_resume_gives_the_same_bytes(tmp_path, jobs):
    args = [*CAPACITY, "--jobs", jobs]
    reference = tmp_path / "reference"
    assert invoke(*args, "--out", reference).exit_code == 0
    out = tmp_path / "cap"
    # held once the first search task has been kept: the pool's workers are alive and get SIGINT too
    code, err = ctrl_c(held_run(tmp_path, "sloweave.studies.parallel:TaskStore.save", [*args, "--out", out]))
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err  # nor from a worker
    assert f"interrupted: nothing written to {out}; 1 finished task(s) kept in {out}.incomplete" in err
    assert "--resume" in err
    incomplete = tmp_path / "cap.incomplete"
    assert not out.exists() and beside(out) == ["cap.incomplete", "reference"]
    assert len(list((incomplete / "tasks").glob("*.pickle"))) == 1
    note = (incomplete / "INCOMPLETE").read_text()
    assert "interrupted (Ctrl-C)" in note and "--resume" in note and "--force" in note
    # without --resume (or --force) the kept tasks are neither reused silently nor deleted
    refused = invoke(*args, "--out", out)
    assert refused.exit_code == 2 and "holds an interrupted run (1 finished task(s)): --resume" in refused.output
    resumed = invoke(*args, "--out", out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "resuming: 1 finished task(s)" in resumed.output
    assert files_of(out) == files_of(reference)  # every CSV, PNG and capacity.json, byte for byte
    assert beside(out) == ["cap", "reference"]


def test_ctrl_c_after_the_search_keeps_every_task_and_resume_computes_none(tmp_path, monkeypatch):
    from sloweave.studies import search

    args = [*CAPACITY, "--jobs", "1"]
    reference = tmp_path / "reference"
    assert invoke(*args, "--out", reference).exit_code == 0
    out = tmp_path / "cap"
    # held once capacity.json is written, the last file: every search and curve task is done
    code, err = ctrl_c(held_run(tmp_path, "sloweave.studies.capacity:write_result_json", [*args, "--out", out]))
    assert code == 130 and "Traceback" not in err, err
    assert not out.exists() and "finished task(s) kept in" in err
    ran = []
    task = search._study_task

    @functools.wraps(task)
    def counted(*a):
        ran.append(a[1:])
        return task(*a)

    monkeypatch.setattr(search, "_study_task", counted)
    resumed = invoke(*args, "--out", out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert ran == []  # every task read back
    assert files_of(out) == files_of(reference)


def test_force_starts_an_interrupted_run_over(tmp_path):
    args = [*CAPACITY, "--jobs", "1", "--no-curves"]
    out = tmp_path / "cap"
    code, err = ctrl_c(held_run(tmp_path, "sloweave.studies.parallel:TaskStore.save", [*args, "--out", out]))
    assert code == 130, err
    result = invoke(*args, "--out", out, "--force")
    assert result.exit_code == 0, result.output
    assert (out / "capacity.json").exists() and beside(out) == ["cap"]


def test_ctrl_c_in_a_command_that_is_not_resumable_leaves_nothing(tmp_path):
    out = tmp_path / "sim"
    # held once requests.csv, iterations.csv, prefills.csv and metrics.json are written, before decision_metrics.json
    code, err = ctrl_c(
        held_run(tmp_path, "sloweave.studies.reproduce:write_single_run", [*COMMANDS["simulate"], "--out", out])
    )
    assert code == 130, err
    assert err.strip().splitlines()[-1] == f"interrupted: nothing written to {out}" and "Traceback" not in err
    assert beside(out) == []  # no folder, no staging folder, no lock


def test_ctrl_c_replacing_an_earlier_result_keeps_it(tmp_path):
    out = tmp_path / "sim"
    assert invoke(*COMMANDS["simulate"], "--out", out).exit_code == 0
    before = files_of(out)
    code, err = ctrl_c(
        held_run(
            tmp_path, "sloweave.studies.reproduce:write_single_run", [*COMMANDS["simulate"], "--out", out, "--force"]
        )
    )
    assert code == 130, err
    assert files_of(out) == before and beside(out) == ["sim"]


# ------------------------------------------- every state of a destination, generated (in process)

FOLDER_STATES = st.fixed_dictionaries(
    {
        "out": st.sampled_from(["absent", "empty", "earlier result", "a file"]),
        "incomplete_tasks": st.sampled_from([None, 0, 2]),  # an interrupted run's folder (None: none)
        "locked": st.booleans(),  # another run holds OUT.lock
        "force": st.booleans(),
        "resume": st.booleans(),
        "resumable": st.booleans(),
        "block": st.sampled_from(["completes", "ctrl-c", "error"]),
        "tasks_done": st.sampled_from([0, 1]),  # tasks this run finished before the block ended
    }
)


def _prepare(root: Path, state: dict) -> Path:
    out = root / "out"
    if state["out"] == "empty":
        out.mkdir()
    elif state["out"] == "earlier result":
        out.mkdir()
        (out / "old.csv").write_text("earlier\n")
    elif state["out"] == "a file":
        out.write_text("not a folder\n")
    if state["incomplete_tasks"] is not None:
        tasks = root / "out.incomplete" / "tasks"
        tasks.mkdir(parents=True)
        for i in range(state["incomplete_tasks"]):
            (tasks / f"{'f' * 16}-{i}.pickle").write_bytes(b"")
    return out


def _expected_refusal(state: dict) -> str | None:
    if state["force"] and state["resume"]:
        return "give one"
    if state["out"] == "a file":
        return "is a file, not a folder"
    if state["locked"]:
        return "another run is writing"
    if state["out"] == "earlier result" and not state["force"]:
        return "exists and is not empty"
    if state["resumable"] and state["incomplete_tasks"] is not None and not (state["resume"] or state["force"]):
        return "holds an interrupted run"
    return None


def _run(out: Path, state: dict) -> BaseException | None:
    """The block of a command writing ``out``; what it raised (None: it completed)."""
    from sloweave.studies.result_folders import result_folder

    try:
        with result_folder(out, state["force"], state["resume"], state["resumable"], fingerprint="f" * 64) as folder:
            (folder.path / "new.csv").write_text("this run\n")
            for i in range(state["tasks_done"] if folder.store is not None else 0):
                folder.store.save(folder.store.folder / f"{'f' * 16}-new{i}.pickle", i)
            if state["block"] == "ctrl-c":
                raise KeyboardInterrupt
            if state["block"] == "error":
                raise ValueError("the study failed")
    except BaseException as err:  # noqa: BLE001 - the outcome is what is checked
        return err
    return None


def _names(path: Path) -> list[str] | None:
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else None


@settings(derandomize=True, max_examples=150, deadline=None, database=None)
@given(state=FOLDER_STATES)
def test_every_destination_state_ends_complete_refused_or_untouched(tmp_path_factory, state):
    """Generated over what a destination can hold and how a run ends: a refusal before any work
    leaves everything as it was; a run that completes leaves exactly its own files; an interrupted
    or failed one leaves the destination as it was, and a resumable study's finished tasks with an
    INCOMPLETE note; never a temporary folder, a set-aside old result or a stale lock."""
    import fcntl

    from sloweave.core.validate import OptionError
    from sloweave.studies.result_folders import Interrupted

    root = tmp_path_factory.mktemp("dest")
    out = _prepare(root, state)
    before = _names(out)
    holder = None
    if state["locked"]:
        holder = os.open(root / "out.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        error = _run(out, state)
    finally:
        if holder is not None:
            os.close(holder)
    refusal = _expected_refusal(state)
    if refusal is not None:
        assert isinstance(error, OptionError) and refusal in str(error), error
        assert _names(out) == before
        return
    assert [p.name for p in root.iterdir() if p.name.startswith(".out.")] == []
    assert not (root / "out.lock").exists()
    # OUT.incomplete is a resumable study's: any other command leaves it as it was
    untouched = not state["resumable"] and state["incomplete_tasks"] is not None
    if state["block"] == "completes":
        assert error is None and _names(out) == ["new.csv"]  # the earlier result is gone, whole
        assert (root / "out.incomplete").exists() == untouched
        return
    if state["block"] == "ctrl-c":
        assert isinstance(error, Interrupted) and error.exit_code == 130
    else:
        assert isinstance(error, ValueError)
    assert _names(out) == before  # nothing written to the destination
    reused = (state["incomplete_tasks"] or 0) if state["resume"] and not state["force"] else 0
    kept = state["resumable"] and state["tasks_done"] + reused > 0
    assert (root / "out.incomplete").exists() == (kept or untouched)
    if kept:
        assert "INCOMPLETE" in _names(root / "out.incomplete")


def test_a_result_file_says_which_code_made_it(tmp_path):
    """The package version does not tell two trees apart (a result predicted by an earlier tree put
    first on the path, to set it against this one): every result file names the code's folder and,
    in a git work tree, its commit."""
    import json

    import sloweave
    from sloweave.studies.outputs import write_result_json

    write_result_json(tmp_path / "result.json", {"settings": {"seed": 0}})
    code = json.loads((tmp_path / "result.json").read_text())["sloweave_code"]
    package = Path(sloweave.__file__).resolve().parent
    assert code["path"] == str(package)
    head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a work tree (a clone, as CI runs it): its commit, and how many files differ
        assert code["git_commit"] == head.stdout.strip() and isinstance(code["files_changed_since_commit"], int)
    else:
        assert code["git_commit"] is None
