"""``durastack server``: the embedded stack in the foreground (see cli/stack.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from cli.stack import Stack, StackError
from models.settings import Settings


def register(app: typer.Typer) -> None:
    @app.command()
    def server(
        home: Optional[Path] = typer.Option(None, "--home", help="State directory (env DURASTACK_HOME, default ~/.durastack)."),
        temporal_port: Optional[int] = typer.Option(None, "--temporal-port", help="Temporal gRPC port (env DURASTACK_TEMPORAL_PORT, default 7233)."),
        ui_port: Optional[int] = typer.Option(None, "--ui-port", help="Temporal Web UI port (env DURASTACK_UI_PORT, default 8233)."),
        gateway_port: Optional[int] = typer.Option(None, "--gateway-port", help="Gateway port (env DURASTACK_GATEWAY_PORT, default 8000)."),
        gateway_control_port: Optional[int] = typer.Option(None, "--gateway-control-port", help="Gateway control API port (env DURASTACK_GATEWAY_CONTROL_PORT, default 8001)."),
        codec_port: Optional[int] = typer.Option(None, "--codec-port", help="Web UI codec endpoint port, 0 for none (env DURASTACK_CODEC_PORT, default 8234)."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Also stream the children's logs here."),
    ) -> None:
        """Run the embedded stack (Temporal dev server, worker, gateway) until Ctrl-C.

        With DURASTACK_TEMPORAL_ADDRESS set, that Temporal server is used and none is started.
        """
        out = Console(highlight=False, soft_wrap=True)
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        try:
            settings = Settings.from_env(home=home, temporal_port=temporal_port, ui_port=ui_port,
                                         gateway_port=gateway_port, gateway_control_port=gateway_control_port,
                                         codec_port=codec_port)
        except ValidationError as e:  # e.g. DURASTACK_GATEWAY_PORT=abc
            err.print(f"invalid settings: {e}", style="red", markup=False)
            raise typer.Exit(1)
        stack = Stack(settings, verbose=verbose, echo=lambda line: out.print(line, markup=False))
        try:
            code = asyncio.run(stack.run())
        except (StackError, OSError) as e:  # OSError: e.g. a home we cannot write
            err.print(str(e), style="red", markup=False)
            code = 1
        raise typer.Exit(code)  # cli.main.entry ends the process with os._exit (Temporal SDK threads)
