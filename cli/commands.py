"""Commands that talk to the control plane: apply, ps, stop, scale, events, exec, logs, token (list, add, revoke).

Exit codes: 0 ok, 1 user error, 2 control plane down.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional
from urllib.parse import quote

import typer
from rich.live import Live
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from cli.client import EXIT_CONTROL_PLANE_DOWN, ControlPlaneDown, connect
from cli.client import run as _run
from cli.main import FileOption, app, err, out, print_errors
from cli.render import ps_table, status_json
from models.loader import load_config_file
from models.run import ApplyRequest, ScaleRequest, ServiceState, ServiceStatus
from models.service import SERVICE_NAME_RE, ServiceConfiguration
from models.gateway import TOKEN_NAME_PATTERN
from models.settings import Settings
from workflows.changes import classify
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

RPC = timedelta(seconds=5)


def _user_error(message: str) -> typer.Exit:
    err.print(f"[red]{message}[/red]")
    return typer.Exit(1)


def service_url(settings: Settings, name: str) -> str:
    return f"{settings.gateway_url}/services/{name}/"


def ui_link(settings: Settings, name: str) -> str:
    return f"{settings.ui_url}/namespaces/{settings.namespace}/workflows/{quote(service_workflow_id(name), safe='')}"


async def _status(client: Client, name: str) -> Optional[ServiceStatus]:
    """The live status of a running service, or None when no such service runs."""
    handle = client.get_workflow_handle(service_workflow_id(name))
    try:
        description = await handle.describe(rpc_timeout=RPC)
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return None
        raise ControlPlaneDown(f"control plane error: {e}") from e
    if description.status != WorkflowExecutionStatus.RUNNING:
        return None
    for attempt in range(3):  # a query can meet a continue-as-new hop; ask again
        try:
            return await handle.query(ServiceRunWorkflow.status, rpc_timeout=RPC)
        except RPCError as e:
            if attempt == 2:
                raise ControlPlaneDown(f"the worker does not answer ({e.message}); is `durastack server` up?") from e
    return None


async def _running(settings: Settings, name: str):
    """A client and the handle of the running service ``name``; exit 1 when there is none."""
    client = await connect(settings)
    if await _status(client, name) is None:
        raise _user_error(f"no running service named {name!r}")
    return client, client.get_workflow_handle(service_workflow_id(name))


def _config_or_exit(file: Path) -> ServiceConfiguration:
    result = load_config_file(file)
    if not result.valid:
        print_errors(result, file)
        raise typer.Exit(1)
    for w in result.warnings:
        err.print(f"[yellow]warning:[/yellow] {w}")
    assert result.config is not None
    return result.config


def _resolve(config: ServiceConfiguration, file: Path, environ: dict) -> ServiceConfiguration:
    """Fill the service name (from the file name) and `env` entries taken from the caller's environment."""
    name = config.name or file.stem
    if not SERVICE_NAME_RE.match(name):
        raise _user_error(f"{file}: set `name:` (the file name {file.stem!r} is not a valid service name)")
    missing = [k for k, v in config.env.items() if v is None and k not in environ]
    if missing:
        raise _user_error("env: " + ", ".join(missing) + " not set in your environment (`env` takes them from it)")
    env = {k: (environ[k] if v is None else v) for k, v in config.env.items()}
    # Values from your environment are secret (models.secrets): their names join `secrets`.
    secrets = [*config.secrets, *(k for k, v in config.env.items() if v is None and k not in config.secrets)]
    return config.model_copy(update={"name": name, "env": env, "secrets": secrets})


def _print_plan(config: ServiceConfiguration) -> list[str]:
    """Print each group's count, resources and best offer; return the groups that have no offer."""
    from activities.catalog import local_offer
    from models.offers import describe_mismatch, match_offers

    out.print(f"[bold]Service[/bold] {config.name}  port {config.port.container_port}  "
              f"auth {'on' if config.auth else 'off'}")
    offers, problems = [local_offer()], []
    for g in config.replica_groups:
        where = dict(spot_policy="auto", max_price=config.max_price, backends=config.backends or ["local"],
                     regions=config.regions)
        found = match_offers(offers, g.resources, **where)
        if found:
            best = f"{found[0].backend} {found[0].instance_type} ${found[0].price:g}/h"
        else:
            best = "[red]no offers[/red]"
            problems.append(f"group {g.name}: no offers ({describe_mismatch(offers, g.resources, **where)})")
        scaling = f", rps target {g.scaling.target:g}" if g.scaling else ""
        out.print(f"  group={g.name} replicas={g.count}{scaling}  {g.resources.summary()}  → {best}")
    return problems


def _all_ready(status: ServiceStatus) -> bool:
    return all(sum(1 for r in g.replicas if r.ready and r.status == "running" and r.deployment == status.deployment)
               >= g.desired and not g.rollout for g in status.groups)


def _failed_rollout(status: ServiceStatus) -> Optional[str]:
    failed = [f"group {g.name}: {g.rollout}" for g in status.groups if g.rollout.startswith("failed")]
    return "; ".join(failed) or None


@app.command()
def apply(
    file: Path = FileOption,
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask for confirmation."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once the service is submitted or updated."),
    force: bool = typer.Option(False, "--force", help="With -y: stop and re-create a service whose change "
                                                      "cannot be applied in place."),
) -> None:
    """Submit a service, or update a running one (in place or by rolling deployment), and follow it."""
    settings = Settings.from_env()
    config = _resolve(_config_or_exit(file), file, dict(os.environ))
    problems = _print_plan(config)
    if problems:
        raise _user_error("nothing was submitted: " + "; ".join(problems))
    _run(_apply(settings, config, yes, detach, force))


def _confirm(question: str, yes: bool) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        raise _user_error(f"{question} — no terminal to confirm on: pass -y")
    if not typer.confirm(question):
        raise typer.Exit(1)


async def _apply(settings: Settings, config: ServiceConfiguration, yes: bool, detach: bool, force: bool) -> None:
    client = await connect(settings)
    name = config.name or ""
    if await _status(client, name) is not None:
        handle = client.get_workflow_handle(service_workflow_id(name))
        changes = classify(await handle.query(ServiceRunWorkflow.config, rpc_timeout=RPC), config)
        if not changes.any:
            out.print(f"Active run {name} already exists. Detected no changes.")
            return
        if not changes.not_updatable:
            await _update(client, settings, config, changes, yes, detach)
            return
        out.print(f"Active run {name} already exists. Detected changes that cannot be updated in-place:")
        out.print("- Configuration properties:\n" + "\n".join(f"  - {f}" for f in changes.not_updatable),
                  markup=False)
        if yes and not force:
            raise _user_error("Use --force to stop and re-create it.")
        _confirm("Stop and override the run?", yes)
        await _stop(settings, name, detach=False)
    else:
        _confirm(f"Submit the service {name}?", yes)
    state = ServiceState(name=name, config=config)
    # USE_EXISTING: two concurrent applies can never make two runs of one service.
    await client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=state), id=service_workflow_id(name),
        task_queue=settings.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=f"service **{name}**", rpc_timeout=RPC)
    out.print(f"Submitted [bold]{name}[/bold]; Web UI: {ui_link(settings, name)}")
    if not detach:
        await _follow(client, name)
    _print_access(settings, config)


def _print_access(settings: Settings, config: ServiceConfiguration) -> None:
    out.print(f"URL:   {service_url(settings, config.name or '')}")
    if config.auth:
        out.print("Auth:  header `Authorization: Bearer <token>`, with a gateway token (`durastack token list`; "
                  "`durastack token add NAME` creates one)", markup=False)


async def _update(client: Client, settings: Settings, config: ServiceConfiguration, changes, yes: bool,
                  detach: bool) -> None:
    """The seed's update prompt, then the `apply` update: refused changes leave the service untouched."""
    name = config.name or ""
    out.print(f"Active run {name} already exists. Detected changes that can be updated in-place:")
    # dstack's shape: one sub-item per top-level field; what changed inside the groups follows it.
    fields: dict[str, list[str]] = {}
    for f in changes.in_place + changes.rolling:
        top, _, inner = f.partition(".")
        fields.setdefault(top, []).append(inner)
    lines = [f"  - {top}" + (": " + ", ".join(i for i in inner if i) if any(inner) else "")
             for top, inner in fields.items()]
    out.print("- Configuration properties:\n" + "\n".join(lines), markup=False)
    _confirm("Update the run?", yes)
    handle = client.get_workflow_handle(service_workflow_id(name))
    await _send_update(handle, ServiceRunWorkflow.apply, ApplyRequest(config=config.model_dump(mode="json")))
    if not detach:
        await _follow(client, name)
    _print_access(settings, config)


async def _send_update(handle, update, *args):
    try:
        result = await handle.execute_update(update, *args, rpc_timeout=RPC)
    except WorkflowUpdateFailedError as e:
        raise _user_error(f"update refused: {getattr(e.cause, 'message', e.cause)}")
    out.print(f"{handle.id.removeprefix('service/')}: deployment {result.deployment}: {result.kept} replica(s) "
              f"kept in place, {result.replacing} to replace one at a time per group")
    return result


@app.command()
def rollback(
    name: str = typer.Argument(..., help="Service name."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once the rollback is accepted."),
) -> None:
    """Return a service to the configuration it had before the last apply."""
    settings = Settings.from_env()
    _run(_rollback(settings, name, detach))


async def _rollback(settings: Settings, name: str, detach: bool) -> None:
    client, handle = await _running(settings, name)
    await _send_update(handle, ServiceRunWorkflow.rollback)
    if not detach:
        await _follow(client, name)


async def _follow(client: Client, name: str) -> None:
    """Redraw the ps table until every group has its desired replicas ready (Ctrl-C detaches)."""
    try:
        with Live(console=out, refresh_per_second=4) as live:
            while True:
                status = await _status(client, name)
                if status is None:
                    raise _user_error(f"service {name} ended")
                live.update(ps_table([status]))
                if _all_ready(status):
                    break
                failure = _failed_rollout(status)
                if failure:
                    live.stop()
                    raise _user_error(f"rollout stopped ({failure}); the previous replicas keep serving. "
                                      f"`durastack rollback {name}` returns to the previous configuration")
                await asyncio.sleep(0.5)
    except (KeyboardInterrupt, asyncio.CancelledError):
        out.print("detached; the service keeps running")
    out.print()


async def _running_services(client: Client) -> list[str]:
    query = "WorkflowType='ServiceRunWorkflow' AND ExecutionStatus='Running'"
    names = []
    try:
        async for wf in client.list_workflows(query, rpc_timeout=RPC):
            names.append(wf.id.removeprefix("service/"))
    except RPCError as e:
        raise ControlPlaneDown(f"control plane error: {e.message}") from e
    return sorted(names)


@app.command()
def ps(
    name: Optional[str] = typer.Argument(None, help="Service name; all running services when omitted."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Resources, instance types and errors."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
    watch: bool = typer.Option(False, "-w", "--watch", help="Redraw until Ctrl-C."),
) -> None:
    """Show services and their replicas, group by group."""
    settings = Settings.from_env()
    _run(_ps(settings, name, verbose, as_json, watch))


async def _ps(settings: Settings, name: Optional[str], verbose: bool, as_json: bool, watch: bool) -> None:
    try:
        await _live_ps(settings, name, verbose, as_json, watch)
    except ControlPlaneDown:  # show the store's last view, marked stale; still exit 2
        from cli.db import print_stale_ps

        if not watch:
            await asyncio.to_thread(print_stale_ps, settings, name, verbose, as_json,
                                    lambda n: service_url(settings, n))
        raise


async def _live_ps(settings: Settings, name: Optional[str], verbose: bool, as_json: bool, watch: bool) -> None:
    client = await connect(settings)

    async def collect() -> list[ServiceStatus]:
        names = [name] if name else await _running_services(client)
        statuses = [s for s in [await _status(client, n) for n in names] if s is not None]
        if name and not statuses:
            raise _user_error(f"no running service named {name!r}")
        return statuses

    if as_json:
        statuses = await collect()
        payload = [status_json(s, service_url(settings, s.name)) for s in statuses]
        out.print_json(json.dumps(payload[0] if name else payload))
        return
    if not watch:
        out.print(ps_table(await collect(), verbose))
        return
    try:
        with Live(console=out, refresh_per_second=2) as live:
            while True:
                live.update(ps_table(await collect(), verbose))
                await asyncio.sleep(1)
    except KeyboardInterrupt:
        pass


@app.command()
def stop(
    name: str = typer.Argument(..., help="Service name."),
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask for confirmation."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once the stop is requested."),
) -> None:
    """Stop a service: every replica leaves the gateway and is terminated, then the run ends."""
    settings = Settings.from_env()
    if not yes and sys.stdin.isatty() and not typer.confirm(f"Stop the service {name}?"):
        raise typer.Exit(1)
    _run(_stop(settings, name, detach))


async def _stop(settings: Settings, name: str, detach: bool) -> None:
    _, handle = await _running(settings, name)
    await handle.signal(ServiceRunWorkflow.stop, rpc_timeout=RPC)
    if detach:
        out.print(f"stopping {name}")
        return
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        description = await handle.describe(rpc_timeout=RPC)
        if description.status != WorkflowExecutionStatus.RUNNING:
            out.print(f"{name} stopped")
            return
        await asyncio.sleep(0.5)


@app.command()
def scale(
    name: str = typer.Argument(..., help="Service name."),
    group: str = typer.Argument(..., help="Replica group name."),
    count: int = typer.Argument(..., help="Desired replica count, within the group's range."),
) -> None:
    """Set a group's desired replica count now (refused when outside the group's range)."""
    settings = Settings.from_env()
    _run(_scale(settings, name, group, count))


async def _scale(settings: Settings, name: str, group: str, count: int) -> None:
    _, handle = await _running(settings, name)
    try:
        desired = await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group=group, count=count),
                                              rpc_timeout=RPC)
    except WorkflowUpdateFailedError as e:
        raise _user_error(f"scale refused: {getattr(e.cause, 'message', e.cause)}")
    out.print(f"{name}: group={group} desired={desired}")


@app.command()
def events(
    name: str = typer.Argument(..., help="Service name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    since: Optional[str] = typer.Option(None, "--since", help="From this time (2026-11-29T03:00, UTC) or age (2h)."),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", min=1, help="Only the last N entries."),
) -> None:
    """The decision log of a service: scaling, replica failures, stops (every run, from the store)."""
    from cli.db import parse_since

    settings = Settings.from_env()
    try:
        start = parse_since(since)
    except ValueError as e:
        raise _user_error(f"--since: {e}")
    _run(_events(settings, name, as_json, start, limit))


async def _events(settings: Settings, name: str, as_json: bool, since=None, limit: Optional[int] = None) -> None:
    from cli.db import select_events, stored_events

    items = await asyncio.to_thread(stored_events, settings, name, since, limit)
    if items is None:  # none in the store (another database, or an older worker): the workflow's latest entries
        _, handle = await _running(settings, name)
        items = select_events(await handle.query(ServiceRunWorkflow.events, rpc_timeout=RPC), since, limit)
    if as_json:
        out.print_json(json.dumps([e.model_dump(mode="json") for e in items]))
        return
    for e in items:
        group = f" group={e.group}" if e.group else ""
        out.print(f"{e.at:%Y-%m-%d %H:%M:%S} {e.kind:<8}{group} {e.message}", markup=False)


@app.command(name="config")
def config_(
    name: str = typer.Argument(..., help="Service name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Print the configuration a service runs; secret env values show as *** (models.secrets)."""
    settings = Settings.from_env()
    _run(_config(settings, name, as_json))


async def _config(settings: Settings, name: str, as_json: bool) -> None:
    from models.secrets import REDACT

    _, handle = await _running(settings, name)
    config = await handle.query(ServiceRunWorkflow.config, rpc_timeout=RPC)
    data = config.model_dump(mode="json", context=REDACT, exclude_none=True)
    if as_json:
        out.print_json(json.dumps(data))
        return
    from io import StringIO

    from ruamel.yaml import YAML

    text = StringIO()
    YAML().dump(data, text)
    out.print(text.getvalue().rstrip(), markup=False)


def _replica(status: ServiceStatus, replica: Optional[int]):
    candidates = [r for g in status.groups for r in g.replicas if r.status == "running"]
    if replica is not None:
        candidates = [r for g in status.groups for r in g.replicas if r.replica == replica]
    if not candidates:
        raise _user_error(f"{status.name}: no running replica" + (f" {replica}" if replica is not None else ""))
    return max(candidates, key=lambda r: r.submission)


def _local_instance(settings: Settings, name: str, replica: Optional[int]):
    from activities.local import LocalBackend

    status = _run(_running_status(settings, name))
    view = _replica(status, replica)
    if view.backend != "local":
        raise _user_error(f"replica {view.replica} runs on {view.backend}; exec and logs reach local replicas")
    backend = LocalBackend(settings.home)
    instance = backend.find_instance(f"{name}/{view.group}/r{view.replica}-s{view.submission}")
    if instance is None:
        raise _user_error(f"replica {view.replica} has no process on this machine")
    return backend, instance


async def _running_status(settings: Settings, name: str) -> ServiceStatus:
    status = await _status(await connect(settings), name)
    if status is None:
        raise _user_error(f"no running service named {name!r}")
    return status


@app.command(name="exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Service name."),
    replica: Optional[int] = typer.Option(None, "--replica", "-r", help="Replica number (default: the first)."),
) -> None:
    """Run a command inside a replica (its namespaces on the local backend): durastack exec NAME -- CMD..."""
    argv = [a for a in ctx.args if a != "--"]
    if not argv:
        raise _user_error("give the command after --, e.g. durastack exec NAME -- cat /tmp/version.txt")
    backend, instance = _local_instance(Settings.from_env(), name, replica)
    code, output = backend.exec(instance, argv)
    sys.stdout.write(output)
    raise typer.Exit(code)


@app.command()
def logs(
    name: str = typer.Argument(..., help="Service name."),
    replica: Optional[int] = typer.Option(None, "--replica", "-r", help="Replica number (default: the first)."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines until Ctrl-C."),
) -> None:
    """Print a replica's output."""
    _, instance = _local_instance(Settings.from_env(), name, replica)
    path = Path(instance.log_path)
    with open(path, "rb") as f:
        sys.stdout.write(f.read().decode(errors="replace"))
        sys.stdout.flush()
        try:
            while follow:
                chunk = f.read()
                if chunk:
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()
                else:
                    time.sleep(0.5)
        except KeyboardInterrupt:
            pass


token_app = typer.Typer(no_args_is_help=True, help="Bearer tokens of the gateway: every service with auth accepts "
                        "each of them. The gateway keeps only their hashes: a token is shown once, when added.")
app.add_typer(token_app, name="token")


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
        out.print(f"{t.name:<24} {t.prefix}…  created {t.created_at:%Y-%m-%d %H:%M:%S} UTC", markup=False)


@token_app.command("add")
def token_add(name: str = typer.Argument(..., help="A new, unique name: letters, digits, '_', '.', '-'.")) -> None:
    """Create a token and print it, this once (alone on stdout: TOKEN=$(durastack token add ci))."""
    if not re.fullmatch(TOKEN_NAME_PATTERN, name):
        err.print(f"durastack token add: {name!r} is not a token name: up to 64 letters, digits, '_', '.', '-', "
                  "starting with a letter or digit", style="red", markup=False)
        raise typer.Exit(1)
    new = _gateway("token add", lambda gw: gw.create_token(name),
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
