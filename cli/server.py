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


# The `temporal` CLI's environment variable for each connection setting of an external server (models.settings).
TEMPORAL_CLI_ENV = {"temporal_tls": "TEMPORAL_TLS", "temporal_tls_ca": "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
                    "temporal_tls_cert": "TEMPORAL_TLS_CLIENT_CERT_PATH",
                    "temporal_tls_key": "TEMPORAL_TLS_CLIENT_KEY_PATH",
                    "temporal_tls_server_name": "TEMPORAL_TLS_SERVER_NAME", "temporal_api_key": "TEMPORAL_API_KEY"}


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

    @app.command(name="ui")
    def ui() -> None:
        """Where the embedded Web UI is, and its login (user durastack; the password comes from the home's key)."""
        from cli.door import UI_USER, possible, ui_password
        from connect.codec import CodecKeyError, load_keys

        settings, out, err = _settings_or_exit()
        if settings.temporal_address is not None:
            err.print(f"durastack uses the Temporal at {settings.address} (DURASTACK_TEMPORAL_ADDRESS): its Web UI is "
                      "that server's own", markup=False)
            raise typer.Exit(1)
        locked, why = possible()
        if not locked:
            out.print(f"{settings.ui_url}  ({why}: no login)", markup=False)
            return
        try:
            password = ui_password(load_keys(settings.home))
        except CodecKeyError as e:
            err.print(str(e), style="red", markup=False)
            raise typer.Exit(1)
        host = settings.ui_url.removeprefix("http://")
        out.print(f"Web UI    {settings.ui_url}\nuser      {UI_USER}\npassword  {password}\n"
                  f"or open   http://{UI_USER}:{password}@{host}/", markup=False)

    @app.command(name="temporal-env")
    def temporal_env() -> None:
        """Shell lines for the `temporal` CLI to connect as durastack does: eval "$(durastack temporal-env)"."""
        import shlex

        from connect.connection import embedded_api_key

        settings, out, _ = _settings_or_exit()
        env = {"TEMPORAL_ADDRESS": settings.address, "TEMPORAL_NAMESPACE": settings.namespace}
        if settings.temporal_address is None:
            key = embedded_api_key(settings)
            env |= {"TEMPORAL_API_KEY": key, "TEMPORAL_TLS": "false"} if key else {}
        else:  # the same TLS and key the workers use, under the CLI's names
            for field, name in TEMPORAL_CLI_ENV.items():
                value = getattr(settings, field)
                if value is not None:
                    env[name] = value.get_secret_value() if hasattr(value, "get_secret_value") else \
                        str(value).lower() if isinstance(value, bool) else str(value)
        for name, value in env.items():
            out.print(f"export {name}={shlex.quote(value)}", markup=False, soft_wrap=True)


def _settings_or_exit():
    out = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        return Settings.from_env(), out, err
    except ValidationError as e:
        err.print(f"invalid settings: {e}", style="red", markup=False)
        raise typer.Exit(1)
