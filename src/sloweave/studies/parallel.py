"""Where a study's independent tasks run: this process, a local process pool, or a Ray cluster.

A study is many independent simulations. Each study hands ``run_tasks`` a module-level
function, the tasks (tuples of its arguments) and one read-only context shared by all of
them (the study, or what every task reads); ``run_tasks`` returns the results in task
order, whatever ran where, so results are the serial run's bit for bit as long as every
task depends only on its own inputs (each study's tests check that).

- ``Runner(jobs=1)``: serial, in this process.
- ``Runner(jobs=N)``: a pool of N forked processes on this machine (the context is
  inherited at fork, not shipped).
- ``Runner(ray="local" | "auto" | ADDRESS)``: Ray tasks. ``local`` starts a private Ray
  instance on loopback with ``jobs`` CPUs for the run and stops it after; ``auto`` joins the
  cluster Ray finds (``RAY_ADDRESS`` or one started with ``ray start``); an address
  (``host:port``, ``ray://host:10001``) joins that one. The context is put into Ray's object
  store once and every task reads it from there; a task's result comes back to this
  process. An already initialised Ray (a test's, a notebook's) is used as it is.

Failures are never dropped: serially a task's exception propagates as it is; from a
worker it arrives as ``TaskFailed`` naming the task's inputs and the cause. A worker
process that dies is retried by Ray (``retries`` times); in the local pool the tasks it
left unfinished are reported with their inputs.

Ctrl-C stops the run: the pool's workers leave SIGINT to this process (no traceback from
each of them when the whole process group gets it), which stops them. With a ``TaskStore``
every finished task's result is kept in a file as it completes, and a later run with the same
store reads it back instead of computing it again (``--resume``).
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

RAY_EXTRA_HINT = "Ray is an optional extra: pip install 'sloweave[ray]' (`make setup` installs it)"


class TaskFailed(RuntimeError):
    """A study task failed; the message names its inputs and the cause."""


@dataclass(frozen=True)
class Runner:
    jobs: int = 1
    ray: str | None = None
    # Ray re-runs a task whose worker died this many times (a task that raises is not
    # re-run: simulations are deterministic, it would raise again).
    retries: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise ValueError(f"jobs must be a whole number >= 1, got {self.jobs!r}")
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray.strip()):
            raise ValueError(f"ray must be 'local', 'auto' or a cluster address, got {self.ray!r}")

    def describe(self) -> dict:
        return {"jobs": self.jobs, "ray": self.ray}


SERIAL = Runner()


def local_cores() -> int:
    """The cores this process may run on (the default number of local workers)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class TaskStore:
    """The finished tasks of a resumable study, one file each, in ``folder``.

    A task's result is pickled into its file as soon as it completes (written beside, then
    renamed: a file is whole or absent), so an interrupted run keeps every finished task. A
    file's name is the study's ``fingerprint`` (what its results depend on) and a digest of
    the batch (the n-th ``run_tasks`` call of the run: a deterministic study makes the same
    batches in every run with the same inputs), the task's position, its function and its
    plain arguments; a file of other settings or inputs is never read as this study's.
    """

    def __init__(self, folder: Path, fingerprint: str) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.batches = 0
        self.reused = 0

    @property
    def prefix(self) -> str:
        return self.fingerprint[:16]

    def paths(self, fn: Callable, tasks: list[tuple]) -> list[Path]:
        """The file of each task of the next batch."""
        batch, self.batches = self.batches, self.batches + 1
        names = []
        for i, task in enumerate(tasks):
            described = f"{self.fingerprint}|{batch}|{i}|{fn.__module__}.{fn.__qualname__}|{_plain(task)}"
            names.append(self.folder / f"{self.prefix}-{hashlib.sha256(described.encode()).hexdigest()[:32]}.pickle")
        return names

    def load(self, path: Path) -> tuple[bool, object]:
        try:
            with open(path, "rb") as f:
                return True, pickle.load(f)
        except FileNotFoundError:
            return False, None
        except Exception:  # unreadable (another version's classes): computed again
            return False, None

    def save(self, path: Path, value) -> None:
        from sloweave.core.atomic import atomic_path

        with atomic_path(path) as temporary:
            with open(temporary, "wb") as f:
                pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)

    def finished(self) -> int:
        return sum(1 for _ in self.folder.glob(f"{self.prefix}-*.pickle"))

    def drop_others(self) -> int:
        """Delete the files of other fingerprints (other settings or inputs); returns how many."""
        others = [p for p in self.folder.glob("*.pickle") if not p.name.startswith(f"{self.prefix}-")]
        for path in others:
            path.unlink(missing_ok=True)
        return len(others)


def _plain(task: tuple) -> str:
    """The task's arguments where they print the same in every run (numbers, strings, tuples
    of them), else their types (the position and batch identify the task then)."""

    def plain(value) -> bool:
        if isinstance(value, (tuple, list)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (bool, int, float, str))

    return repr(task) if plain(task) else repr(tuple(type(v).__name__ for v in task))


# The shared context of the tasks of a forked pool (inherited, never pickled).
_FORK_CONTEXT = None


def run_tasks(
    fn: Callable,
    tasks: Sequence[tuple],
    context=None,
    runner: Runner = SERIAL,
    desc: str = "tasks",
    progress: bool = False,
    store: TaskStore | None = None,
) -> list:
    """``[fn(context, *task) for task in tasks]``, computed where ``runner`` says.

    With ``store``, the tasks it holds are read back instead of computed, and every task
    computed is kept there as it completes."""
    from tqdm import tqdm

    tasks = list(tasks)
    results: list = [None] * len(tasks)
    todo = list(range(len(tasks)))
    on_result = None
    if store is not None:
        paths = store.paths(fn, tasks)
        todo = []
        for i, path in enumerate(paths):
            found, results[i] = store.load(path)
            if not found:
                todo.append(i)
        store.reused += len(tasks) - len(todo)

        def on_result(j: int, result) -> None:
            store.save(paths[todo[j]], result)

    pending = [tasks[i] for i in todo]
    bar = tqdm(
        total=len(tasks), initial=len(tasks) - len(todo), desc=desc, unit="task", disable=not progress, file=sys.stderr
    )
    try:
        if runner.ray is not None:
            computed = _on_ray(fn, pending, context, runner, bar, on_result)
        elif runner.jobs == 1 or len(pending) < 2:
            computed = [_serial(fn, context, task, bar, j, on_result) for j, task in enumerate(pending)]
        else:
            computed = _on_pool(fn, pending, context, runner.jobs, bar, on_result)
    finally:
        bar.close()
    for i, result in zip(todo, computed):
        results[i] = result
    return results


def _failed(fn: Callable, task: tuple, err: BaseException) -> TaskFailed:
    return TaskFailed(f"{fn.__name__}{task!r} failed: {type(err).__name__}: {err}")


def _serial(fn, context, task, bar, index, on_result):
    result = fn(context, *task)
    if on_result is not None:
        on_result(index, result)
    bar.update()
    return result


def _in_fork(fn, task):
    return fn(_FORK_CONTEXT, *task)


def _leave_sigint_to_the_parent() -> None:
    """A pool worker ignores Ctrl-C: the parent stops the pool (each worker would print a traceback)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop(pool) -> None:
    """Stop a pool now: cancel what has not started, end the workers (the running tasks too)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(10)


def _on_pool(fn, tasks, context, jobs, bar, on_result=None) -> list:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    global _FORK_CONTEXT
    _FORK_CONTEXT = context
    pool = ProcessPoolExecutor(
        min(jobs, len(tasks)), mp_context=multiprocessing.get_context("fork"), initializer=_leave_sigint_to_the_parent
    )
    try:
        futures = [pool.submit(_in_fork, fn, task) for task in tasks]
        index = {future: i for i, future in enumerate(futures)}
        for future in as_completed(futures):
            if on_result is not None and future.exception() is None:
                on_result(index[future], future.result())
            bar.update()
        results = []
        for task, future in zip(tasks, futures):
            try:
                results.append(future.result())
            except BrokenProcessPool:
                unfinished = [t for t, f in zip(tasks, futures) if f.exception() is not None]
                raise TaskFailed(
                    f"a worker process died (killed, or out of memory); {len(unfinished)} task(s) did not finish: "
                    + "; ".join(f"{fn.__name__}{t!r}" for t in unfinished[:5])
                    + ("; ..." if len(unfinished) > 5 else "")
                ) from None
            except Exception as err:
                raise _failed(fn, task, err) from err
        return results
    except BaseException:  # Ctrl-C too: stopped now, not after every queued task has run
        _stop(pool)
        raise
    finally:
        pool.shutdown(wait=True)  # every task is done or stopped by now
        _FORK_CONTEXT = None


def _ray_module():
    try:
        import ray
    except ImportError as err:
        raise TaskFailed(f"--ray needs Ray, which cannot be imported ({err}); {RAY_EXTRA_HINT}") from None
    return ray


def _on_ray(fn, tasks, context, runner: Runner, bar, on_result=None) -> list:
    ray = _ray_module()
    started_here = not ray.is_initialized()
    if started_here:
        if runner.ray == "local":
            # a private instance on loopback for this run, with the CPUs --jobs grants
            ray.init(num_cpus=runner.jobs, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        else:
            try:
                ray.init(address=runner.ray, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise TaskFailed(
                    f"cannot join the Ray cluster at {runner.ray!r} ({err}); start one (`ray start --head`) "
                    "or use --ray local for a private instance on this machine"
                ) from None
    try:
        remote = ray.remote(max_retries=runner.retries, retry_exceptions=False)(_ray_call)
        shared = ray.put(context)
        pending = {remote.remote(fn, shared, task): i for i, task in enumerate(tasks)}
        results: list = [None] * len(tasks)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
            try:
                results[i] = ray.get(done[0])
            except ray.exceptions.RayTaskError as err:
                raise _failed(fn, tasks[i], err.cause if err.cause is not None else err) from None
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as err:
                raise TaskFailed(
                    f"{fn.__name__}{tasks[i]!r}: its worker died {runner.retries + 1} time(s) ({type(err).__name__})"
                ) from None
            if on_result is not None:
                on_result(i, results[i])
            bar.update()
        return results
    finally:
        if started_here:
            ray.shutdown()


def _ray_call(fn, context, task):
    return fn(context, *task)
