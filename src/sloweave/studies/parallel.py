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
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


# The shared context of the tasks of a forked pool (inherited, never pickled).
_FORK_CONTEXT = None


def run_tasks(fn: Callable, tasks: Sequence[tuple], context=None, runner: Runner = SERIAL, desc: str = "tasks", progress: bool = False) -> list:
    """``[fn(context, *task) for task in tasks]``, computed where ``runner`` says."""
    from tqdm import tqdm

    tasks = list(tasks)
    bar = tqdm(total=len(tasks), desc=desc, unit="task", disable=not progress, file=sys.stderr)
    try:
        if runner.ray is not None:
            return _on_ray(fn, tasks, context, runner, bar)
        if runner.jobs == 1 or len(tasks) < 2:
            return [_serial(fn, context, task, bar) for task in tasks]
        return _on_pool(fn, tasks, context, runner.jobs, bar)
    finally:
        bar.close()


def _failed(fn: Callable, task: tuple, err: BaseException) -> TaskFailed:
    return TaskFailed(f"{fn.__name__}{task!r} failed: {type(err).__name__}: {err}")


def _serial(fn, context, task, bar):
    result = fn(context, *task)
    bar.update()
    return result


def _in_fork(fn, task):
    return fn(_FORK_CONTEXT, *task)


def _on_pool(fn, tasks, context, jobs, bar) -> list:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    global _FORK_CONTEXT
    _FORK_CONTEXT = context
    try:
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_in_fork, fn, task) for task in tasks]
            for future in futures:
                future.add_done_callback(lambda _: bar.update())
            wait(futures)
            results = []
            for task, future in zip(tasks, futures):
                try:
                    results.append(future.result())
                except BrokenProcessPool:
                    unfinished = [t for t, f in zip(tasks, futures) if f.exception() is not None]
                    raise TaskFailed(
                        f"a worker process died (killed, or out of memory); {len(unfinished)} task(s) did not finish: "
                        + "; ".join(f"{fn.__name__}{t!r}" for t in unfinished[:5]) + ("; ..." if len(unfinished) > 5 else "")
                    ) from None
                except Exception as err:
                    raise _failed(fn, task, err) from err
            return results
    finally:
        _FORK_CONTEXT = None


def _ray_module():
    try:
        import ray
    except ImportError as err:
        raise TaskFailed(f"--ray needs Ray, which cannot be imported ({err}); {RAY_EXTRA_HINT}") from None
    return ray


def _on_ray(fn, tasks, context, runner: Runner, bar) -> list:
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
                raise TaskFailed(f"{fn.__name__}{tasks[i]!r}: its worker died {runner.retries + 1} time(s) ({type(err).__name__})") from None
            bar.update()
        return results
    finally:
        if started_here:
            ray.shutdown()


def _ray_call(fn, context, task):
    return fn(context, *task)
