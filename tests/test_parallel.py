"""Where a study's tasks run (serial, local pool): same results in task order, failures reported.

The Ray runner is tested in test_ray.py (one local Ray instance for that module: a forked
pool must not run in a process that holds Ray's threads).
"""

from __future__ import annotations

import os

import pytest

from sloweave.studies.parallel import Runner, TaskFailed, run_tasks


def square_plus(context, x):
    return x * x + context


def fails_on_three(context, x):
    if x == 3:
        raise ValueError(f"three is bad ({context})")
    return x


def dies_on_two(context, x):
    if x == 2:
        os._exit(7)  # the worker process dies (as when the OS kills it)
    return x


TASKS = [(x,) for x in range(8)]


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_results_come_back_in_task_order_whatever_the_workers(jobs):
    assert run_tasks(square_plus, TASKS, 10, Runner(jobs)) == [x * x + 10 for x in range(8)]


def test_a_failing_task_is_reported_with_its_inputs():
    with pytest.raises(ValueError, match="three is bad"):  # in this process: the task's own exception
        run_tasks(fails_on_three, TASKS, "ctx", Runner(1))
    with pytest.raises(TaskFailed, match=r"fails_on_three\(3,\) failed: ValueError: three is bad \(ctx\)"):
        run_tasks(fails_on_three, TASKS, "ctx", Runner(2))


def test_a_dead_worker_is_reported_with_the_unfinished_tasks():
    with pytest.raises(TaskFailed, match=r"a worker process died .* did not finish: .*dies_on_two\(2,\)"):
        run_tasks(dies_on_two, TASKS, None, Runner(2))


@pytest.mark.parametrize("bad", [{"jobs": 0}, {"jobs": True}, {"ray": ""}, {"ray": 5}])
def test_bad_runner_settings_are_refused(bad):
    with pytest.raises(ValueError, match="jobs must be|ray must be"):
        Runner(**bad)


def test_the_progress_bar_counts_every_task(capsys):
    run_tasks(square_plus, TASKS, 0, Runner(2), desc="squares", progress=True)
    err = capsys.readouterr().err
    assert "squares: 100%" in err and "8/8" in err


def test_ray_asked_for_without_ray_says_how_to_install_it(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ray'] = None; from sloweave.cli import main; "
        f"main(['capacity', '--workload', 'mixed', '--quick', '--ray', 'local', '--out', {str(tmp_path / 'c')!r}])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert (
        "Invalid value for '--ray': Ray cannot be imported" in done.stderr
        and "pip install 'sloweave[ray]'" in done.stderr
    )
    assert not (tmp_path / "c").exists()


def test_ray_auto_without_a_cluster_says_how_to_start_one(tmp_path, monkeypatch):
    import ray

    from click.testing import CliRunner

    from sloweave.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    result = CliRunner().invoke(
        main,
        [
            "capacity",
            "--workload",
            "mixed",
            "--quick",
            "--requests",
            "50",
            "--seeds",
            "1",
            "--ray",
            "auto",
            "--out",
            str(tmp_path / "c"),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "cannot join the Ray cluster at 'auto'" in result.output and "--ray local" in result.output


@pytest.mark.parametrize(
    "args, files",
    [
        (["reproduce", "--workload", "chat", "--seeds", "2", "--requests", "120"], ["runs.csv", "table4.csv"]),
        (
            ["ablate", "--workload", "mixed", "--seeds", "2", "--requests", "80", "--no-trace", "--config", "greedy"],
            ["runs.csv", "tiers.csv"],
        ),
        (
            ["replay", "tests/fixtures/traces/azure_conv_first150.csv", "--policy", "sloweave", "--policy", "full"],
            ["requests.csv", "metrics.csv"],
        ),
    ],
)
def test_studies_on_the_local_pool_equal_the_serial_run(tmp_path, args, files):
    from pathlib import Path

    from click.testing import CliRunner

    from sloweave.cli import main

    here = Path(__file__).resolve().parents[1]
    args = [str(here / a) if a.startswith("tests/") else a for a in args]
    for jobs in ("1", "2"):
        result = CliRunner().invoke(main, [*args, "--jobs", jobs, "--out", str(tmp_path / jobs)])
        assert result.exit_code == 0, result.output
    for name in files:
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name
