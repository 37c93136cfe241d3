"""Options that travel together are one config object whose fields carry their help and their
values (``core.validate.setting``); the command line builds its options from those fields, so
a field added to ``EngineOptions`` with help is an option of every study command, named and
checked as the field says."""

from dataclasses import dataclass, fields

import click
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.cli.options import described_fields, option_of_field
from sloweave.core.validate import DURATION_MS, TOKENS, setting
from sloweave.sim.options import EngineOptions

STUDIES = ["simulate", "capacity", "tune", "replay"]


def test_the_capacity_commands_option_groups_are_described_on_their_fields():
    from sloweave.cli.capacity import Lattice, Targets

    for config in (Targets, Lattice):
        assert [spec.name for spec in described_fields(config)] == [spec.name for spec in fields(config)]


def test_every_engine_option_but_two_is_described_on_its_field():
    # kv_memory says how kv_capacity_tokens was obtained: the command line sets it, no flag does
    described = {spec.name for spec in described_fields(EngineOptions)}
    assert described == {spec.name for spec in fields(EngineOptions)} - {"aging_chunk_tokens", "kv_memory"}


@pytest.mark.parametrize("command", STUDIES)
def test_each_study_command_sizes_the_kv_cache_from_the_model(command):
    text = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=10_000).output.split())
    assert "--gpu-memory-utilization" in text and "--unlimited-kv" in text and "[default: 0.9]" in text


@pytest.mark.parametrize("command", STUDIES)
def test_each_study_command_shows_every_engine_option_with_the_fields_help(command):
    text = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=10_000).output.split())
    for spec in described_fields(EngineOptions):
        flag = spec.metadata["flag"] or "--" + spec.name.replace("_", "-")
        assert flag in text and " ".join(spec.metadata["help"].split()) in text, spec.name


def test_a_field_becomes_a_typed_option_named_by_it():
    @dataclass(frozen=True)
    class Knobs:
        chunk_tokens: int | None = setting(None, "the chunk", values=TOKENS)
        form: str = setting("a", "the form", values=("a", "b"))
        exact: bool = setting(False, "exact or not", flag="--exact")
        targets_ms: tuple[float, ...] = setting((), "targets", values=DURATION_MS, flag="--target-ms", repeat=True)

    @click.command()
    def show(**given):
        click.echo(repr(Knobs(**given)))

    for spec in reversed(described_fields(Knobs)):
        show = option_of_field(spec)(show)
    runner = CliRunner()
    out = runner.invoke(
        show, ["--chunk-tokens", "64", "--form", "b", "--exact", "--target-ms", "10", "--target-ms", "5"]
    )
    assert out.output.strip().endswith("Knobs(chunk_tokens=64, form='b', exact=True, targets_ms=(10.0, 5.0))")
    assert (
        runner.invoke(show, [])
        .output.strip()
        .endswith("Knobs(chunk_tokens=None, form='a', exact=False, targets_ms=())")
    )
    assert runner.invoke(show, ["--target-ms", "10", "--target-ms", "10"]).exit_code == 2  # each value once
    assert runner.invoke(show, ["--no-exact"]).exit_code == 0
    refused = runner.invoke(show, ["--chunk-tokens", "-1"])
    assert refused.exit_code == 2 and "--chunk-tokens" in refused.output
    assert runner.invoke(show, ["--form", "c"]).exit_code == 2
