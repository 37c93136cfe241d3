"""What every ``sloweave`` command does around its body.

The layers below the command line raise plain exceptions (``OptionError`` naming the option,
``Interrupted``, ``TaskFailed``, ...); a command turns them into click's own, so each prints
the one line it always has, with its exit status. While a command runs, what it was given is
recorded (``sloweave.studies.outputs.running_command``) for the result files it writes.
"""

from __future__ import annotations

import click

from sloweave.core.validate import OptionError
from sloweave.studies.outputs import CommandRun, running_command
from sloweave.studies.parallel import TaskFailed
from sloweave.studies.result_folders import Interrupted, NotPublished


class InterruptedExit(click.ClickException):
    """Ctrl-C (SIGINT) during a command: one line on stderr, exit status 130 (128 + SIGINT), no traceback."""

    exit_code = Interrupted.exit_code

    def show(self, file=None) -> None:
        click.echo(self.format_message(), err=True)


def _label(param: click.Parameter) -> str:
    """How the command line names a parameter: its first flag, or an argument's metavar."""
    return param.opts[0] if isinstance(param, click.Option) else param.human_readable_name.rstrip(".")


def command_run(ctx: click.Context) -> CommandRun:
    return CommandRun(
        name=ctx.command.name,
        path=ctx.command_path,
        params=ctx.params,
        labels={param.name: _label(param) for param in ctx.command.params},
    )


class Command(click.Command):
    """A click command that records what it runs with and shows the lower layers' errors as click's."""

    def invoke(self, ctx: click.Context):
        try:
            with running_command(command_run(ctx)):
                return super().invoke(ctx)
        except OptionError as err:
            raise click.BadParameter(str(err), ctx=ctx, param_hint=err.option) from None
        except Interrupted as err:
            raise InterruptedExit(str(err)) from None
        except (NotPublished, TaskFailed) as err:  # a study task failed in a worker: its inputs and cause
            raise click.ClickException(str(err)) from err


def command(name: str | None = None, **settings):
    """``click.command`` for a sloweave command (a ``Command``)."""
    return click.command(name, cls=Command, **settings)
