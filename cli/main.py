"""The ``durastack`` command."""

from __future__ import annotations

import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from models.loader import LoadResult, load_config_file
from models.service import ServiceConfiguration

app = typer.Typer(
    help="durastack: run ML inference services of several replica groups on GPU clouds.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output (scripts, tests) gets wide lines rather than tables folded at 80 columns.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)

FileOption = typer.Option(..., "-f", "--file", help="Service configuration file (YAML).", show_default=False)


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


def print_errors(result: LoadResult, source: Path) -> None:
    n = len(result.errors)
    err.print(f"[red]{source}: {n} error{'s' if n != 1 else ''}[/red]")
    for e in result.errors:
        err.print(f"  {e}", markup=False)


@app.command()
def validate(
    file: Path = FileOption,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Check a service file: exit 0 with one line per group when valid, exit 1 with every error."""
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
        how = f"rps target {scaling['target']:g}, window {scaling['window']}s" if scaling else "fixed"
        out.print(f"  group={g['name']} replicas={count} ({how}) {g['resources']}", markup=False)
    for w in result.warnings:
        err.print(f"  [yellow]warning:[/yellow] {w}")


def _register_commands() -> None:
    from cli import codec_server, commands, db, offers, server  # noqa: F401  (commands registers itself on `app`)

    offers.register(app)
    server.register(app)
    codec_server.register(app)
    db.register(app)


_register_commands()


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
