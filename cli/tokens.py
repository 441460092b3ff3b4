"""``durastack token list|add|revoke``: the gateway's bearer tokens, through its control API."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Optional

import typer

from cli.client import EXIT_CONTROL_PLANE_DOWN
from cli.console import err, out
from models.gateway import SERVICE_NAME_PATTERN, TOKEN_NAME_PATTERN
from models.settings import Settings

token_app = typer.Typer(no_args_is_help=True, help="Bearer tokens of the gateway: every service with auth accepts "
                        "each of them, or those a token is scoped to (`add --service`). The gateway keeps only their "
                        "hashes: a token is shown once, when added.")


def _gateway(command: str, call, errors: Optional[dict[int, str]] = None):
    """``await call(gateway client)``; a gateway that is not there exits 2, an error answer exits 1."""
    import httpx

    from gateway.client import GatewayClient, GatewayError

    settings = Settings.from_env()

    async def go():
        async with GatewayClient(settings.gateway_control_url, token=settings.control_token, timeout=30) as gw:
            return await call(gw)

    try:
        return asyncio.run(go())
    except httpx.TransportError:
        err.print(f"durastack {command}: the gateway is not running at {settings.gateway_control_url}; "
                  "start it with `durastack server`", style="red", markup=False)
        raise typer.Exit(EXIT_CONTROL_PLANE_DOWN)
    except GatewayError as e:
        err.print(f"durastack {command}: {(errors or {}).get(e.status, e)}", style="red", markup=False)
        raise typer.Exit(1)


@token_app.command("list")
def token_list(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The gateway's tokens: name, first characters, creation time (never the tokens themselves)."""
    tokens = _gateway("token list", lambda gw: gw.tokens())
    if as_json:
        out.print_json(json.dumps([t.model_dump(mode="json") for t in tokens]))
        return
    if not tokens:
        out.print("no tokens; `durastack token add NAME` creates one", markup=False)
    for t in tokens:
        opens = ", ".join(t.services) if t.services else "all services"
        out.print(f"{t.name:<24} {t.prefix}…  created {t.created_at:%Y-%m-%d %H:%M:%S} UTC  opens {opens}",
                  markup=False)


@token_app.command("add")
def token_add(
    name: str = typer.Argument(..., help="A new, unique name: letters, digits, '_', '.', '-'."),
    service: Optional[list[str]] = typer.Option(None, "--service", "-s", help=(
        "A service the token opens (repeat, or comma-separated); fixed at creation. Default: every service.")),
) -> None:
    """Create a token and print it, this once (alone on stdout: TOKEN=$(durastack token add ci))."""
    if not re.fullmatch(TOKEN_NAME_PATTERN, name):
        err.print(f"durastack token add: {name!r} is not a token name: up to 64 letters, digits, '_', '.', '-', "
                  "starting with a letter or digit", style="red", markup=False)
        raise typer.Exit(1)
    services = sorted({s.strip() for v in service or [] for s in v.split(",") if s.strip()})
    bad = [s for s in services if not re.fullmatch(SERVICE_NAME_PATTERN, s)]
    if bad:
        err.print(f"durastack token add: --service {bad[0]!r} is not a service name (lowercase letters, digits and "
                  "'-', starting with a letter)", style="red", markup=False)
        raise typer.Exit(1)
    new = _gateway("token add", lambda gw: gw.create_token(name, services or None),
                   {409: f"a token named {name!r} exists already; revoke it first or choose another name"})
    out.print(new.token, markup=False)
    err.print(f"token {name!r} added; it is not shown again. Send it as `Authorization: Bearer <token>`.",
              markup=False)


@token_app.command("revoke")
def token_revoke(name: str = typer.Argument(..., help="Name of the token, as `durastack token list` shows it.")) -> None:
    """Revoke a token: once this returns, the gateway answers 403 to it."""
    _gateway("token revoke", lambda gw: gw.revoke_token(name),
             {404: f"no token named {name!r}; `durastack token list` shows them"})
    out.print(f"token {name!r} revoked", markup=False)


def register(app: typer.Typer) -> None:
    app.add_typer(token_app, name="token")
