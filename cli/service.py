"""Changing what runs: ``durastack apply``, ``rollback``, ``stop``, ``scale``, and ``config`` (what an apply set).

Exit codes: 0 ok, 1 user error, 2 control plane down.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from secrets import token_hex
from typing import Awaitable, Optional

import typer
from rich.live import Live
from temporalio.client import (Client, WithStartWorkflowOperation, WorkflowExecutionStatus, WorkflowUpdateFailedError,
                               WorkflowUpdateRPCTimeoutOrCancelledError)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError

from cli.client import ControlPlaneDown, connect, run
from cli.console import FileOption, err, out, print_errors, user_error
from cli.control import RPC, ask, deliver, last_run, live_status, running, service_url, ui_link
from cli.render import ps_table
from connect.codec import CodecKeys, load_keys
from models.loader import file_type, load_config_file
from models.messages import ApplyRequest, ApplyResult, ScaleRequest
from models.state import ServiceState
from models.views import ServiceStatus
from models.secrets import REVEAL
from models.service import SERVICE_NAME_RE, ServiceConfiguration
from models.settings import Settings
from rules.addresses import NO_NETWORK
from rules.autoscaler import bounds
from rules.changes import classify
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id


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
        raise user_error(f"{file}: set `name:` (the file name {file.stem!r} is not a valid service name)")
    missing = [k for k, v in config.env.items() if v is None and k not in environ]
    if missing:
        raise user_error("env: " + ", ".join(missing) + " not set in your environment (`env` takes them from it)")
    env = {k: (environ[k] if v is None else v) for k, v in config.env.items()}
    # Values from your environment are secret (models.secrets): their names join `secrets`.
    secrets = [*config.secrets, *(k for k, v in config.env.items() if v is None and k not in config.secrets)]
    return config.model_copy(update={"name": name, "env": env, "secrets": secrets})


def _print_plan(config: ServiceConfiguration) -> tuple[list[str], list[str]]:
    """Print each group's count, resources and best offer; return the groups that have no offer, and, for a service
    whose replicas reach each other, the places that hold it whole (cheapest first; its best offers are there).

    Planned from the offers ``durastack offers -f`` lists (backends/catalog/plan.py), on the backends
    config.yml configures: a GPU service can be submitted to a cloud from a machine without a GPU."""
    from backends.catalog.plan import candidate_offers, group_queries, look_up_reservations, one_place, plan_query
    from backends.quota import launchable
    from backends.runtime import group_runtime_fields, local_limits
    from cli.offers import cloud_backends
    from cli.volumes import plan as volume_plan
    from models.backends import load_backends_config
    from rules.addresses import one_place as reach_each_other

    out.print(f"[bold]Service[/bold] {config.name}  port {config.port.container_port}  "
              f"auth {'on' if config.auth else 'off'}")
    try:
        backends = load_backends_config(os.environ)
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        raise user_error(f"config.yml: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    candidates, offers = candidate_offers(backends), {}
    clouds = cloud_backends(backends)
    queries, problems = volume_plan(config, look_up_reservations(group_queries(config), backends))
    for i, (g, q) in enumerate(zip(config.replica_groups, queries)):
        found, reason = plan_query(candidates, q, backends)
        found, short = launchable(clouds, found)  # as the launch skips them: never planned on
        if not found and short:
            reason = "no quota for any: " + "; ".join(short[:3]) + (f"; {len(short) - 3} more" if len(short) > 3 else "")
        # This machine runs commands without containers: what it cannot honour is said now, by field path.
        cannot, notes = local_limits(group_runtime_fields(config, i))
        if any(o.backend == "local" for o in found):
            for note in notes:
                err.print(f"[yellow]warning:[/yellow] {note}", markup=True, highlight=False)
            if cannot:
                found = [o for o in found if o.backend != "local"]
                reason = "local: " + "; ".join(cannot)
        if not found:
            problems.append(f"group {g.name}: no offers ({reason})")
        offers[g.name or ""] = found
    places: list[str] = []
    if reach_each_other(config) and not problems:
        places, why = one_place(offers, {g.name or "": bounds(g)[0] for g in config.replica_groups})
        if why:
            problems.append(why)
        else:
            backend, region = places[0].split("/", 1)
            out.print(f"  place: {backend}{'' if region == backend else ' ' + region}  (one place for all groups: their replicas reach "
                      f"each other{f'; {len(places) - 1} other place(s) can hold it' if len(places) > 1 else ''})")
    for g, q in zip(config.replica_groups, queries):
        found = [o for o in offers[g.name or ""] if not places or f"{o.backend}/{o.region}" == places[0]]
        best = (f"{found[0].backend} {found[0].instance_type} ({found[0].region}) ${found[0].price:g}/h" if found
                else "[red]no offers[/red]")
        scaling = f", {g.scaling.metric} target {g.scaling.target:g}" if g.scaling else ""
        out.print(f"  group={g.name} replicas={g.count}{scaling}  {g.resources.summary()}  → {best}")
        if found and found[0].reservation:
            _print_reservation(q.reservation, found[0])
    return problems, places


def _print_reservation(lookup, offer) -> None:
    """Which reservation the group's replicas go into; a warning when it has no free instance now (the launch will
    find it full: the replica fails for no capacity, and is retried if `retry` says so)."""
    taking = [r for r in lookup.taking(offer) if r.zone in offer.zones]
    out.print(f"    in reservation {lookup.name}: " + "; ".join(r.summary() for r in taking), markup=False,
              highlight=False)
    if not any(r.free for r in taking):
        err.print(f"[yellow]warning:[/yellow] reservation {lookup.name} has no free instance now: a replica "
                  "placed in it fails for no capacity until one is freed", markup=True, highlight=False)


def _all_ready(status: ServiceStatus) -> bool:
    """Every group has its replicas ready, and the gateway has the route (so a first request is not a 404,
    also for a group at zero). A route the gateway refused is in `events`: following stops there too."""
    return status.routed is not None and all(sum(1 for r in g.replicas if r.ready and r.status == "running" and r.deployment == status.deployment)
               >= g.desired and not g.rollout for g in status.groups)


def _failed_rollout(status: ServiceStatus) -> Optional[str]:
    failed = [f"group {g.name}: {g.rollout}" for g in status.groups if g.rollout.startswith("failed")]
    return "; ".join(failed) or None


def apply(
    file: Path = FileOption,
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask for confirmation."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once the service is submitted or updated."),
    force: bool = typer.Option(False, "--force", help="With -y: stop and re-create a service whose change "
                                                      "cannot be applied in place."),
) -> None:
    """Submit a service, or update a running one (in place or by rolling deployment), and follow it; or make a
    network volume (a `type: volume` file)."""
    if file_type(file) == "volume":
        from cli.volumes import apply_volume
        return apply_volume(file, yes)
    settings = Settings.from_env()
    config = _resolve(_config_or_exit(file), file, dict(os.environ))
    problems, places = _print_plan(config)
    if problems:
        raise user_error("nothing was submitted: " + "; ".join(problems))
    run(_apply(settings, config, yes, detach, force, places))


def _confirm(question: str, yes: bool) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        raise user_error(f"{question} — no terminal to confirm on: pass -y")
    if not typer.confirm(question):
        raise typer.Exit(1)


async def _apply(settings: Settings, config: ServiceConfiguration, yes: bool, detach: bool, force: bool,
                 places: Optional[list[str]] = None) -> None:
    """Ask what to confirm from what runs now, then one update-with-start: it starts the service if no run is
    open and applies the configuration to whichever run is, so concurrent applies cannot race between a check
    and a start. What the update answers, not what was seen before, says what happened."""
    client = await connect(settings)
    name = config.name or ""
    status = await live_status(client, name)
    seen = None if status is None else status.deployment
    if status is not None:
        handle = client.get_workflow_handle(service_workflow_id(name))
        changes = classify(await ask(handle, ServiceRunWorkflow.config), config)
        if changes.not_updatable:
            out.print(f"Active run {name} already exists. Detected changes that cannot be updated in-place:")
            out.print("- Configuration properties:\n" + "\n".join(f"  - {f}" for f in changes.not_updatable),
                      markup=False)
            if yes and not force:
                raise user_error("Use --force to stop and re-create it.")
            _confirm("Stop and override the run?", yes)
            await _stop(settings, name, detach=False)
            seen = None
        elif changes.any:
            _print_changes(name, changes)
            _confirm("Update the run?", yes)
    else:
        _confirm(f"Submit the service {name}?", yes)
    after = await last_run(client, name) if seen is None else None
    update_id = apply_update_id(config, load_keys(settings.home), seen, after)
    result = await _apply_with_start(client, settings, config, update_id, places or [])
    if not result.changed and (seen is not None or result.deployment > 0):
        other = "" if result.deployment == seen else ", from another apply"
        out.print(f"Active run {name} already exists. Detected no changes (deployment {result.deployment}{other}).")
        return
    if not result.changed:  # this update started the run, so it found its own configuration there
        out.print(f"Submitted [bold]{name}[/bold]; Web UI: {ui_link(settings, name)}")
    else:
        _print_result(name, result, expected=0 if seen is None else seen + 1)
    if not detach:
        await _follow(client, name)
    _print_access(settings, config)


def apply_update_id(config: ServiceConfiguration, keys: CodecKeys, seen: Optional[int],
                    after: Optional[str] = None) -> str:
    """The id of the `apply` update: the configuration's hash and the deployment it was applied over, or, when no
    run was open, the run it follows (``after``, the last closed run's id; none for a service never run).

    The same file applied over the same deployment (a retry, or two people applying it at once) is one update,
    which Temporal runs once. The deployment is part of it because a run remembers the ids of its past updates:
    with the hash alone, applying A, then B, then A again would get back the answer of the first A and change
    nothing. The closed run is part of it because Temporal answers an update-with-start whose id completed in the
    workflow's last run with that old answer, and starts nothing: `stop`, then the same file again, would start
    no service. Secret values count (a new token is a change): the hash is keyed with the codec key, since the id
    sits in history in clear, where a plain hash would let anyone test guesses of a secret against it."""
    payload = config.model_dump(mode="json", context=REVEAL)
    digest = keys.digest("apply update id", json.dumps(payload, sort_keys=True).encode())
    if seen is not None:
        return f"apply-{digest}-d{seen}"
    return f"apply-{digest}-" + ("new" if after is None else f"after-{after}")


async def _apply_with_start(client: Client, settings: Settings, config: ServiceConfiguration,
                            update_id: str, places: list[str]) -> ApplyResult:
    name = config.name or ""

    def request() -> Awaitable[ApplyResult]:
        # USE_EXISTING: two concurrent applies never make two runs of one service; the workflow runs their updates
        # one at a time, so each gets its own deployment number. A start operation serves one request only.
        start = WithStartWorkflowOperation(
            ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config, places=places,
                                                                       hash_key=token_hex(32)),
                                                   fleet_monitor=True),
            id=service_workflow_id(name), id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            task_queue=settings.task_queue, static_summary=f"service **{name}**")
        return client.execute_update_with_start_workflow(
            ServiceRunWorkflow.apply, ApplyRequest(config=config), start_workflow_operation=start,
            id=update_id, rpc_timeout=RPC)

    try:
        return await deliver(request)
    except WorkflowUpdateFailedError as e:
        raise user_error(f"update refused: {getattr(e.cause, 'message', e.cause)}")
    except WorkflowUpdateRPCTimeoutOrCancelledError as e:
        raise ControlPlaneDown(f"the worker does not answer the apply of {name}; is `durastack server` up? "
                               "Applying the same file again is safe: it is the same update") from e
    except RPCError as e:
        raise ControlPlaneDown(f"control plane error: {e.message}") from e


def _print_access(settings: Settings, config: ServiceConfiguration) -> None:
    out.print(f"URL:   {service_url(settings, config.name or '')}")
    if config.auth:
        out.print("Auth:  header `Authorization: Bearer <token>`, with a gateway token (`durastack token list`; "
                  "`durastack token add NAME` creates one)", markup=False)


def _print_changes(name: str, changes) -> None:
    """The seed's update prompt: one sub-item per top-level field; what changed inside the groups follows it."""
    out.print(f"Active run {name} already exists. Detected changes that can be updated in-place:")
    fields: dict[str, list[str]] = {}
    for f in changes.in_place + changes.rolling:
        top, _, inner = f.partition(".")
        fields.setdefault(top, []).append(inner)
    lines = [f"  - {top}" + (": " + ", ".join(i for i in inner if i) if any(inner) else "")
             for top, inner in fields.items()]
    out.print("- Configuration properties:\n" + "\n".join(lines), markup=False)


def _print_result(name: str, result: ApplyResult, expected: Optional[int] = None) -> None:
    """What an apply or rollback did; ``expected``: the deployment it would get if nobody else applied meanwhile."""
    after = ""
    if expected is not None and result.deployment > expected:
        after = f" (applied after deployment {result.deployment - 1} from another apply)"
    then = "".join(f", then {n} in group {g} that name(s) them" for g, n in sorted(result.following.items()))
    out.print(f"{name}: deployment {result.deployment}{after}: {result.kept} replica(s) kept in place, "
              f"{result.replacing} to replace one at a time per group{then}")


def rollback(
    name: str = typer.Argument(..., help="Service name."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once the rollback is accepted."),
) -> None:
    """Return a service to the configuration it had before the last apply."""
    settings = Settings.from_env()
    run(_rollback(settings, name, detach))


async def _rollback(settings: Settings, name: str, detach: bool) -> None:
    client, handle = await running(settings, name)
    try:
        result = await deliver(lambda: handle.execute_update(ServiceRunWorkflow.rollback, rpc_timeout=RPC))
    except WorkflowUpdateFailedError as e:
        raise user_error(f"update refused: {getattr(e.cause, 'message', e.cause)}")
    _print_result(name, result)
    if not detach:
        await _follow(client, name)


async def _follow(client: Client, name: str) -> None:
    """Redraw the ps table until every group has its desired replicas ready (Ctrl-C detaches), or until the service
    cannot serve and backs off after failures in a row (a command that keeps exiting): exit 1, saying why."""
    try:
        with Live(console=out, refresh_per_second=4) as live:
            while True:
                status = await live_status(client, name)
                if status is None:
                    raise user_error(f"service {name} ended (stopped, failed or past its max_duration: "
                                     f"`durastack events {name}` says why)")
                live.update(ps_table([status]))
                if _all_ready(status):
                    break
                stuck = [f"group {g.name} waits: {g.waiting}" for g in status.groups if NO_NETWORK in g.waiting]
                if stuck:
                    live.stop()
                    raise user_error("; ".join(stuck) + f". The service keeps running; its workers start once "
                                     f"replicas can reach each other (or `durastack stop {name}`)")
                if status.unavailable and any(g.retry_after for g in status.groups):
                    live.stop()  # failures in a row: waiting would only redraw the back-off
                    raise user_error(f"service {name} cannot serve: {status.unavailable}. durastack keeps retrying; "
                                     f"`durastack events {name}` shows each failure with its last output, "
                                     f"`durastack stop {name}` ends it")
                failure = _failed_rollout(status)
                if failure:
                    live.stop()
                    raise user_error(f"rollout stopped ({failure}); the previous replicas keep serving. "
                                      f"`durastack rollback {name}` returns to the previous configuration")
                await asyncio.sleep(0.5)
    except (KeyboardInterrupt, asyncio.CancelledError):
        out.print("detached; the service keeps running")
    out.print()


def stop(
    name: str = typer.Argument(..., help="Service name."),
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask for confirmation."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return once the stop is requested."),
) -> None:
    """Stop a service: every replica leaves the gateway and is terminated, then the run ends."""
    settings = Settings.from_env()
    if not yes and sys.stdin.isatty() and not typer.confirm(f"Stop the service {name}?"):
        raise typer.Exit(1)
    run(_stop(settings, name, detach))


async def _stop(settings: Settings, name: str, detach: bool) -> None:
    _, handle = await running(settings, name)
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


def scale(
    name: str = typer.Argument(..., help="Service name."),
    group: str = typer.Argument(..., help="Replica group name."),
    count: int = typer.Argument(..., help="Desired replica count, within the group's range."),
) -> None:
    """Set a group's desired replica count now (refused when outside the group's range)."""
    settings = Settings.from_env()
    run(_scale(settings, name, group, count))


async def _scale(settings: Settings, name: str, group: str, count: int) -> None:
    _, handle = await running(settings, name)
    try:
        desired = await deliver(lambda: handle.execute_update(
            ServiceRunWorkflow.scale, ScaleRequest(group=group, count=count), rpc_timeout=RPC))
    except WorkflowUpdateFailedError as e:
        raise user_error(f"scale refused: {getattr(e.cause, 'message', e.cause)}")
    out.print(f"{name}: group={group} desired={desired}")


def config_(
    name: str = typer.Argument(..., help="Service name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Print the configuration a service runs; secret env values show as *** (models.secrets)."""
    settings = Settings.from_env()
    run(_config(settings, name, as_json))


async def _config(settings: Settings, name: str, as_json: bool) -> None:
    from models.secrets import REDACT

    _, handle = await running(settings, name)
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


def register(app: typer.Typer) -> None:
    app.command()(apply)
    app.command()(rollback)
    app.command()(stop)
    app.command()(scale)
    app.command(name="config")(config_)
