"""Shared by the drivers that run inside Vidur's environment: time Vidur's output writing apart
from its event loop, by wrapping (not replacing) the simulator's own output step."""

from __future__ import annotations

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
