"""The ``durastack`` command."""

from __future__ import annotations

import functools
import importlib
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand, TyperGroup

from cli.console import FileOption, err, out, print_errors
from models.loader import file_type, load_config_file, load_volume_file
from models.service import ServiceConfiguration

# Each command group's commands, in the order of `durastack --help`; its module (one per group, with a
# ``register(app)``) is imported only when one of them runs (or for --help). Importing every group cost each command
# about 0.15 s of CPU more: aiohttp for the codec server, the store's code for db, … (tests/test_cli_commands.py
# keeps this table and the modules in step).
GROUPS = {
    "cli.service": ("apply", "rollback", "stop", "scale", "config"),
    "cli.inspect": ("ps", "events", "exec", "logs"),
    "cli.offers": ("offers",),
    "cli.server": ("server", "ui", "temporal-env"),
    "cli.codec_server": ("codec-server",),
    "cli.tokens": ("token",),
    "cli.keys": ("ssh-keys",),
    "cli.db": ("db",),
    "cli.volumes": ("volume",),
}


class Commands(TyperGroup):
    """The top-level commands: ``validate`` (below) and, imported on demand, the groups' (``GROUPS``)."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return [*super().list_commands(ctx), *(name for names in GROUPS.values() for name in names)]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Optional[TyperCommand | TyperGroup]:
        found = super().get_command(ctx, cmd_name)
        module = next((m for m, names in GROUPS.items() if cmd_name in names), None)
        return found or (group_commands(module).get_command(ctx, cmd_name) if module else None)


@functools.cache
def group_commands(module: str) -> TyperGroup:
    """The commands a group's module registers."""
    commands = typer.Typer()
    importlib.import_module(module).register(commands)
    return typer.main.get_group(commands)


app = typer.Typer(
    cls=Commands,
    help="durastack: run ML inference services of several replica groups on GPU clouds.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

def _version(value: bool) -> None:
    if value:
        try:
            out.print(f"durastack {version('durastack')}")
        except PackageNotFoundError:
            out.print("durastack (not installed)")
        raise typer.Exit()


@app.callback()
def main(
    _: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """durastack: run ML inference services of several replica groups on GPU clouds."""


def group_summaries(config: ServiceConfiguration) -> list[dict]:
    out_groups = []
    for g in config.replica_groups:
        out_groups.append({
            "name": g.name,
            "replicas": {"min": g.count.min, "max": g.count.max},
            "scaling": g.scaling.model_dump(mode="json") if g.scaling else None,
            "resources": g.resources.summary(),
        })
    return out_groups


@app.command()
def validate(
    file: Path = FileOption,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Check a service file: exit 0 with one line per group when valid, exit 1 with every error (a `type: volume`
    file too)."""
    if file_type(file) == "volume":
        return _validate_volume(file, as_json)
    result = load_config_file(file)
    if as_json:
        groups = group_summaries(result.config) if result.config else []
        payload = {"valid": result.valid, "errors": [e.to_json() for e in result.errors],
                   "warnings": [w.to_json() for w in result.warnings], "groups": groups}
        out.print_json(json.dumps(payload))
        raise typer.Exit(0 if result.valid else 1)
    if not result.valid:
        print_errors(result, file)
        raise typer.Exit(1)
    config = result.config
    assert config is not None
    out.print(f"{file}: valid service [bold]{config.name or '(unnamed)'}[/bold], port {config.port.container_port}")
    for g in group_summaries(config):
        rng = g["replicas"]
        count = str(rng["min"]) if rng["min"] == rng["max"] else f"{rng['min']}..{rng['max']}"
        scaling = g["scaling"]
        how = f"{scaling['metric']} target {scaling['target']:g}, window {scaling['window']}s" if scaling else "fixed"
        out.print(f"  group={g['name']} replicas={count} ({how}) {g['resources']}", markup=False)
    for w in result.warnings:
        err.print(f"  [yellow]warning:[/yellow] {w}")


def _validate_volume(file: Path, as_json: bool) -> None:
    result = load_volume_file(file)
    if as_json:
        out.print_json(json.dumps({"valid": result.valid, "errors": [e.to_json() for e in result.errors]}))
    elif not result.valid:
        print_errors(result, file)
    else:
        cfg = result.config
        size = f"{cfg.size}GB" if cfg.size else f"volume_id {cfg.volume_id}"
        out.print(f"{file}: valid volume {cfg.name or file.stem}, {cfg.backend} {cfg.availability_zone or cfg.region}, "
                  f"{size}", markup=False)
    raise typer.Exit(0 if result.valid else 1)


def entry() -> None:
    """The `durastack` console script.

    It ends with ``os._exit``: the Temporal SDK's Rust threads can still call into Python while the
    interpreter finalizes, which aborts the process (``PyGILState_Release``) after the command's work
    is done. Exiting directly, once output is flushed, keeps the exit code the command chose.
    """
    import os

    try:
        app()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            sys.stderr.write(e.code + "\n")
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
