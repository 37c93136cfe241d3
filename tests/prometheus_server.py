"""A real Prometheus for the tests (Debian's package, installed by ``make setup``), on a free
loopback port, stopped on exit. Shared by the dashboard's tests and the served plug-in's."""

import contextlib
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

READY_TIMEOUT_S = 60


def tool(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``; missing is a failure, not a skip."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make setup` installs it (Debian's package prometheus)")
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_prometheus(folder: Path, config: str, data_dir: Path, *options: str):
    """Prometheus with the configuration text ``config`` and its data in ``data_dir``; yields its URL."""
    (folder / "prometheus.yml").write_text(config)
    url = f"http://127.0.0.1:{free_port()}"
    command = [
        tool("prometheus"), f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address={url.removeprefix('http://')}", *options,
    ]  # fmt: skip
    log_path = folder / "prometheus.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, server, log_path)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


def _wait_ready(url: str, server: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"prometheus exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"prometheus not ready after {READY_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
