"""The ``sloweave`` command line: every command and option, over the plain functions of the layers below.

This module assembles the group; each command lives in the module named for what it drives.
"""

from __future__ import annotations

import click

from sloweave.cli.command import InterruptedExit


class _Commands(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # Ctrl-C outside a result folder (inside one, result_folder says what is left)
            raise InterruptedExit("interrupted") from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sloweave")
def main() -> None:
    """sloweave: deadline-aware adaptive chunked prefill for LLM serving."""


def _register_commands() -> None:
    from sloweave.cli.ablate import ablate
    from sloweave.cli.capacity import capacity
    from sloweave.cli.observability import dashboard, served_run
    from sloweave.cli.replay import replay
    from sloweave.cli.reproduce import reproduce
    from sloweave.cli.runtime import fit, profile, run
    from sloweave.cli.simulate import decide, simulate_command
    from sloweave.cli.tune import tune_command

    for each in (
        decide,
        simulate_command,
        reproduce,
        replay,
        capacity,
        tune_command,
        profile,
        fit,
        run,
        ablate,
        served_run,
        dashboard,
    ):
        main.add_command(each)


_register_commands()
