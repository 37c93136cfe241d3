"""Shared by the drivers that run inside Vidur's environment: time Vidur's output writing apart
from its event loop, by wrapping (not replacing) the simulator's own output step."""

from __future__ import annotations

import json
import time


def time_output_writing(simulator) -> dict:
    """After ``simulator.run()``, the returned dict holds ``"write"``: seconds spent writing outputs."""
    seconds: dict = {}
    write_output = simulator._write_output

    def timed_write_output() -> None:
        start = time.perf_counter()
        write_output()
        seconds["write"] = time.perf_counter() - start

    simulator._write_output = timed_write_output
    return seconds


def phase_seconds(
    t_start: float, t_imported: float, t_config: float, t_setup: float, t_done: float, write_seconds: dict
) -> dict:
    """Seconds per phase of one Vidur process: imports, config, simulator set-up, loop, output writing."""
    write_s = write_seconds.get("write", 0.0)
    return {
        "import_s": t_imported - t_start,
        "config_s": t_config - t_imported,
        "setup_s": t_setup - t_config,
        "loop_s": (t_done - t_setup) - write_s,
        "write_s": write_s,
        "total_s": t_done - t_start,
    }


def report(result: dict, output_dir: str) -> None:
    """Write the run's result beside Vidur's outputs and hand it to the benchmark on stdout."""
    with open(f"{output_dir}/timing.json", "w") as f:
        json.dump(result, f, indent=1)
    print("VIDUR_RESULT " + json.dumps(result), flush=True)
