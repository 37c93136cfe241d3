"""The folders results go in: complete or absent, never a mix of two runs.

Every command that writes a folder of results does it through ``result_folder``: the folder
is complete or absent (written beside ``--out``, then renamed into place), an earlier result
is refused unless ``--force`` (and then replaced only once the new one is complete), two runs
cannot write one folder at once (a lock beside it), and an interrupted run leaves nothing, or,
for a resumable study, its finished tasks in ``OUT.incomplete`` for ``--resume``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sloweave.core.atomic import sibling_name, write_text_atomic
from sloweave.core.validate import OptionError
from sloweave.studies.outputs import (
    WRITING_OPTIONS,
    check_writable,
    command_settings,
    current_command,
    package_version,
    strict_json,
)

INCOMPLETE_NOTE = "INCOMPLETE"


class Interrupted(Exception):
    """Ctrl-C (SIGINT) during a command; the command line prints its message as one line on
    stderr and exits with this status (128 + SIGINT), without a traceback."""

    exit_code = 130


class NotPublished(Exception):
    """The results are complete but could not be moved into place (the message says where they are)."""


@dataclass(frozen=True)
class ResultFolder:
    out: Path  # where the results end up
    path: Path  # where the command writes them: a new folder beside ``out``, renamed onto it at the end
    store: object | None  # a resumable study's finished tasks (``sloweave.studies.parallel.TaskStore``), else None

    @property
    def incomplete(self) -> Path:
        return incomplete_folder(self.out)


def incomplete_folder(out: Path) -> Path:
    """Where a resumable study keeps its finished tasks until its results are complete."""
    return out.parent / f"{out.name}.incomplete"


@contextmanager
def result_folder(
    out: Path,
    force: bool = False,
    resume: bool = False,
    resumable: bool = False,
    label: str = "--out",
    inputs: dict[str, Path] | None = None,
    fingerprint: str | None = None,
) -> Iterator[ResultFolder]:
    """The one way a command writes a folder of results; enter it before the work starts.

    - checks ``out`` can be written (a one-line error naming the option, never a traceback);
    - locks it (``OUT.lock`` beside it): a second run into the same folder is refused at once,
      naming the pid of the one writing it;
    - refuses an ``out`` that exists and is not empty, unless ``force``; with ``force`` it is
      replaced only when the new results are complete (never a folder that holds the working
      directory or an input of the command: ``inputs``, by default the command's path options);
    - yields a ``ResultFolder`` whose ``path`` is a new folder beside ``out`` (same file system);
      when the block ends, that folder is renamed onto ``out`` (the old one moved aside first
      and deleted after);
    - if the block raises or is interrupted, its folder is deleted; nothing is written to
      ``out``. Ctrl-C becomes ``Interrupted`` (one line, exit status 130).
    - ``resumable``: ``store`` keeps every finished task in ``OUT.incomplete`` as it completes
      (``fingerprint``: what the tasks depend on; by default the command's settings and the
      contents of its input files). An interrupted or failed run leaves that folder, with an
      ``INCOMPLETE`` note; ``resume`` reuses its tasks, ``force`` starts over, and without either
      the run is refused. It is deleted once the results are in place.
    """
    out = Path(out)
    if force and resume:  # one would silently win over the other
        raise OptionError("--force starts over and --resume goes on with an interrupted run: give one", label)
    _make_parent(out, label)
    lock = _FolderLock.take(out, label)
    try:
        _refuse_existing(out, force, label, inputs)
        _remove_leftovers(out)
        incomplete = incomplete_folder(out)
        store = _open_store(out, incomplete, force, resume, label, fingerprint) if resumable else None
        staged = _new_folder(out)
        try:
            yield ResultFolder(out, staged, store)
        except BaseException as err:
            _tell_what_was_kept(out, incomplete, _abandon(staged, store, incomplete, err), err)
            raise
        _publish(staged, out)
        if store is not None:
            shutil.rmtree(incomplete, ignore_errors=True)
    finally:
        lock.release()


def _make_parent(out: Path, label: str) -> None:
    """Check ``out`` can be written and make the folder it goes in."""
    check_writable(out, label)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OptionError(f"cannot make {out.parent} ({err.strerror or err})", label) from None


def _tell_what_was_kept(out: Path, incomplete: Path, kept: int, err: BaseException) -> None:
    """After a run stopped by ``err``: Ctrl-C becomes ``Interrupted``; an error is told where
    the ``kept`` finished tasks are, if any (the caller re-raises it)."""
    where = (
        f"; {kept} finished task(s) kept in {incomplete}: run the same command with --resume to go on" if kept else ""
    )
    if isinstance(err, KeyboardInterrupt):
        raise Interrupted(f"interrupted: nothing written to {out}{where}") from None
    if kept:
        print(f"nothing written to {out}{where}", file=sys.stderr, flush=True)


class _FolderLock:
    """An exclusive ``flock`` on ``OUT.lock``, held for the whole run; the file holds the pid.

    The file is deleted on release while still locked; a run that opened it just before checks,
    once it holds the lock, that the file it locked is still the one at that name (else it tries
    again), so two runs never both hold "the" lock."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def take(cls, out: Path, label: str) -> _FolderLock:
        import fcntl

        path = out.parent / f"{out.name}.lock"
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise OptionError(f"cannot lock {out} ({path}: {err.strerror or err})", label) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OptionError(
                    f"another run is writing {out} (pid {holder}, lock {path}); wait for it to end or choose another folder",
                    label,
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return cls(fd, path)
            os.close(fd)  # released and deleted by its holder meanwhile: lock the new one

    def release(self) -> None:
        try:
            self.path.unlink(missing_ok=True)  # still locked: nobody can hold a lock on a deleted file
        finally:
            os.close(self.fd)


def _refuse_existing(out: Path, force: bool, label: str, inputs: dict[str, Path] | None) -> None:
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise OptionError(
            f"{out} exists and is not empty (an earlier result?); --force replaces it once this run is complete",
            label,
        )
    # --force deletes the old folder: never one that holds what the run reads or where it runs
    target = out.resolve()
    if target == Path.home().resolve() or target == Path(target.anchor):
        raise OptionError(f"{out} is not a result folder --force may replace; name a new folder", label)
    guarded = {"the working directory": Path.cwd(), **(_path_inputs(label) if inputs is None else inputs)}
    for what, path in guarded.items():
        if Path(path).resolve().is_relative_to(target):
            raise OptionError(f"{out} holds {what} ({path}), which --force would delete; name a new folder", label)


def _path_inputs(label: str) -> dict[str, Path]:
    """The running command's path options and arguments (what ``--force`` must never delete)."""
    run = current_command()
    found: dict[str, Path] = {}
    if run is None:
        return found
    for key, name in run.labels.items():
        if name == label:
            continue
        value = run.params.get(key)
        for i, item in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
            spec = getattr(item, "spec", None)  # a resolved --cost that names a file or folder
            path = (
                item
                if isinstance(item, Path)
                else Path(spec)
                if isinstance(spec, str) and Path(spec).exists()
                else None
            )
            if path is not None:
                found[f"{name} {path}" if i else name] = path
    return found


def _new_folder(out: Path) -> Path:
    """A new, empty folder beside ``out`` (the usual permissions: mkdtemp's are the owner's alone)."""
    while True:
        staged = sibling_name(out, "tmp")
        try:
            staged.mkdir()
            return staged
        except FileExistsError:
            continue


def _remove_leftovers(out: Path) -> None:
    """Folders a killed run left beside ``out`` (we hold the lock: no live run owns them)."""
    for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*"):
        for left in out.parent.glob(pattern):
            _delete(left)


def _delete(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _publish(staged: Path, out: Path) -> None:
    """Rename the finished folder onto ``out``; an old folder there is moved aside first, deleted after."""
    old = None
    if out.is_dir() and any(out.iterdir()):  # refused earlier unless --force
        old = sibling_name(out, "old")
        out.rename(old)
    try:
        os.rename(staged, out)  # replaces an empty folder too
    except OSError as err:
        if old is not None:
            old.rename(out)
        raise NotPublished(
            f"cannot move the results into {out} ({err.strerror or err}); they are in {staged}"
        ) from None
    if old is not None:
        _delete(old)  # a symlink given as --out: the link is replaced, never what it pointed to


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """A second Ctrl-C while cleaning up would leave half a cleanup and a traceback."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _abandon(staged: Path, store, incomplete: Path, err: BaseException) -> int:
    """Delete the unfinished results; keep a resumable study's finished tasks. Returns how many were kept."""
    with _sigint_ignored():
        shutil.rmtree(staged, ignore_errors=True)
        if store is None:
            return 0
        kept = store.finished()
        if kept:
            why = (
                "interrupted (Ctrl-C)"
                if isinstance(err, KeyboardInterrupt)
                else f"stopped by an error ({type(err).__name__}: {err})"
            )
            _write_note(
                incomplete, f"{why} at {time.strftime('%Y-%m-%d %H:%M:%S')}, after {kept} task(s) had finished", store
            )
        else:
            shutil.rmtree(incomplete, ignore_errors=True)
        return kept


def _open_store(out: Path, incomplete: Path, force: bool, resume: bool, label: str, fingerprint: str | None):
    from sloweave.studies.parallel import TaskStore

    tasks = incomplete / "tasks"
    found = incomplete.exists()
    if found and not resume:
        if not force:
            kept = len(list(tasks.glob("*.pickle"))) if tasks.is_dir() else 0
            raise OptionError(
                f"{incomplete} holds an interrupted run ({kept} finished task(s)): --resume goes on with it, --force starts over",
                label,
            )
        shutil.rmtree(incomplete)
    tasks.mkdir(parents=True, exist_ok=True)
    store = TaskStore(tasks, fingerprint or command_fingerprint())
    dropped = store.drop_others()
    if resume:
        note = (
            f"resuming: {store.finished()} finished task(s) in {incomplete} are reused"
            if found
            else f"nothing to resume ({incomplete} does not exist): starting from the beginning"
        )
        if dropped:
            note += f"; {dropped} made with other settings or inputs were deleted"
        print(note, file=sys.stderr, flush=True)
    _write_note(
        incomplete,
        f"in progress (pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}); "
        "if that process is gone, the run was killed",
        store,
    )
    return store


def _write_note(incomplete: Path, state: str, store) -> None:
    run = current_command()
    command = run.path if run is not None else "the command"
    write_text_atomic(
        incomplete / INCOMPLETE_NOTE,
        f"This is not a result: it holds the finished tasks of a `{command}` run that has not completed.\n"
        f"State: {state}.\n"
        f"Finished tasks: {store.finished()} (in tasks/); the rest are missing.\n"
        "To go on, run the same command again with --resume: only the missing tasks are computed, and the\n"
        "results (written to the --out folder beside this one) are an uninterrupted run's, byte for byte.\n"
        "To start over, run it with --force (this folder is deleted); it is deleted too once the results are complete.\n",
    )


def command_fingerprint(ignore: tuple[str, ...] = ("jobs", "ray_address")) -> str:
    """What a study's results depend on: the package version, the command and its settings
    (without ``ignore``: where the tasks run changes nothing), and the contents of the files
    its path options name (a trace rewritten in place is another input)."""
    run = current_command()
    params = {} if run is None else run.params
    digest = hashlib.sha256()
    settings = {k: v for k, v in command_settings().items() if k not in ignore}
    digest.update(
        strict_json(
            {"version": package_version(), "command": None if run is None else run.name, "settings": settings}
        ).encode()
    )
    for key in sorted(params):
        if key in WRITING_OPTIONS or key in ignore:
            continue
        value = params[key]
        for item in value if isinstance(value, (tuple, list)) else (value,):
            spec = getattr(item, "spec", None)  # a resolved --cost names its file or folder
            path = item if isinstance(item, Path) else Path(spec) if isinstance(spec, str) else None
            if path is not None and path.exists():
                _hash_path(digest, path)
    return digest.hexdigest()


def _hash_path(digest, path: Path) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
