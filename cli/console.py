"""What every command prints with, and the option and messages several command groups share.

Its own module so that the command groups (cli/service.py, cli/inspect.py, …) need nothing from cli/main.py,
which imports them to register them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from models.loader import LoadResult

# Piped output (scripts, tests) gets wide lines rather than tables folded at 80 columns.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)

FileOption = typer.Option(..., "-f", "--file", help="Service configuration file (YAML).", show_default=False)


def user_error(message: str) -> typer.Exit:
    """Print ``message`` and return the exit (code 1) for the caller to raise."""
    err.print(f"[red]{message}[/red]")
    return typer.Exit(1)


def print_errors(result: LoadResult, source: Path) -> None:
    n = len(result.errors)
    err.print(f"[red]{source}: {n} error{'s' if n != 1 else ''}[/red]")
    for e in result.errors:
        err.print(f"  {e}", markup=False)
