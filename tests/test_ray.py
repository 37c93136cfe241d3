"""Studies on Ray (issue 16): a local Ray instance started by the tests, on loopback, bounded.

Every study command with ``--ray`` gives the serial run's files byte for byte; a task that
raises is reported with its inputs; a worker that dies is retried, and reported with the
task's inputs when it keeps dying. The first test starts its own instance through
``--ray local`` (and stops it); the others share one instance of this module.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray  # the ray extra, installed by `make setup`
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.studies.parallel import Runner, TaskFailed, run_tasks

HERE = Path(__file__).parent
TRACE = HERE / "fixtures" / "traces" / "azure_conv_first150.csv"

# Small studies, each a few seconds serially: (command, the files that must match byte for byte)
STUDIES = {
    "capacity": (
        [
            "capacity",
            "--workload",
            "mixed",
            "--requests",
            "150",
            "--seeds",
            "2",
            "--quick",
            "--no-curves",
            "--policy",
            "sloweave",
            "--policy",
            "fixed-512",
            "--tpot-ms",
            "25",
        ],
        ["capacity.csv", "capacity_detail.csv", "capacity_seeds.csv", "relative.csv"],
    ),
    "tune": (
        ["tune", "--workload", "mixed", "--requests", "150", "--seeds", "2", "--quick", "--no-refine"],
        ["tune.csv"],
    ),
    "reproduce": (
        ["reproduce", "--workload", "chat", "--seeds", "2", "--requests", "120"],
        ["runs.csv", "table3.csv", "table4.csv"],
    ),
    "ablate": (
        ["ablate", "--workload", "mixed", "--seeds", "2", "--requests", "80", "--no-trace", "--config", "greedy"],
        ["runs.csv", "ablation.csv", "tiers.csv"],
    ),
    # several traces: one folder per trace, all their runs one batch of tasks
    "replay": (
        [
            "replay",
            str(TRACE),
            str(HERE / "fixtures" / "traces" / "azure_orig.csv"),
            "--policy",
            "sloweave",
            "--policy",
            "fixed-512",
            "--policy",
            "full",
        ],
        [
            f"{trace}/{name}"
            for trace in ("azure_conv_first150", "azure_orig")
            for name in ("requests.csv", "metrics.csv")
        ],
    ),
}


def invoke(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output


def same_files(a: Path, b: Path, names: list[str]) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_capacity_with_a_private_local_instance_equals_the_serial_run(tmp_path):
    assert not ray.is_initialized()
    args, files = STUDIES["capacity"]
    invoke([*args, "--jobs", "1", "--out", str(tmp_path / "serial")])
    # (how long Ray takes to start is the machine's load, not this behaviour: not asserted)
    invoke([*args, "--ray", "local", "--jobs", "2", "--out", str(tmp_path / "ray")])
    assert not ray.is_initialized()  # started for the run, stopped after it
    same_files(tmp_path / "serial", tmp_path / "ray", files)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance, loopback only, two CPUs; this folder importable by its workers."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}},
    )
    yield
    ray.shutdown()


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_every_study_on_ray_equals_the_serial_run(cluster, tmp_path, study):
    args, files = STUDIES[study]
    invoke([*args, "--jobs", "1", "--out", str(tmp_path / "serial")])
    invoke([*args, "--ray", "auto", "--out", str(tmp_path / "ray")])
    same_files(tmp_path / "serial", tmp_path / "ray", files)


def plus_one(context, x):
    return x + context


def raises_on(context, x):
    if x == context:
        raise ArithmeticError(f"no {x}")
    return x


def dies_once(marker_folder, x):
    """Kills its worker the first time it runs for x == 1 (the marker remembers it did)."""
    marker = Path(marker_folder) / f"died-{x}"
    if x == 1 and not marker.exists():
        marker.write_text("once")
        os._exit(9)
    return x


def always_dies(context, x):
    os._exit(9)


def test_ray_results_in_task_order_and_failures_with_inputs(cluster):
    runner = Runner(2, "auto")
    assert run_tasks(plus_one, [(x,) for x in range(6)], 100, runner) == [100 + x for x in range(6)]
    with pytest.raises(TaskFailed, match=r"raises_on\(4,\) failed: ArithmeticError: no 4"):
        run_tasks(raises_on, [(x,) for x in range(6)], 4, runner)


def test_a_dead_worker_is_retried_then_reported(cluster, tmp_path):
    assert run_tasks(dies_once, [(x,) for x in range(3)], str(tmp_path), Runner(2, "auto")) == [0, 1, 2]
    assert (tmp_path / "died-1").exists()  # it did die once, and the retry completed the task
    with pytest.raises(TaskFailed, match=r"always_dies\(0,\): its worker died 2 time\(s\)"):
        run_tasks(always_dies, [(0,)], None, Runner(1, "auto", retries=1))
