"""What runs: ``durastack ps``, ``events``, ``exec`` and ``logs``.

Exit codes: 0 ok, 1 user error, 2 control plane down.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.live import Live
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client
from temporalio.service import RPCError

from activities import interface
from cli.client import ControlPlaneDown, connect, run
from cli.console import err, out, user_error
from cli.control import RPC, ask, live_status, running, running_status, service_url
from cli.render import ps_table, status_json, store_note
from models.views import ServiceStatus
from models.settings import Settings
from workflows.fleet import FleetMonitorWorkflow
from rules.jobs import replica_workflow_id
from rules.names import fleet_workflow_id
from workflows.service import ServiceRunWorkflow, service_workflow_id


async def with_progress(client: Client, status: ServiceStatus) -> ServiceStatus:
    """Each starting replica's reason, when it has none, is what its launch's step last said (an image pull's
    layers, its probes): the heartbeat details the Web UI shows on the replica workflow's pending activity."""
    starting = [(g, r) for g in status.groups for r in g.replicas
                if not r.ready and not r.reason and r.status in ("submitted", "provisioning", "running")]
    said = await asyncio.gather(*(step_progress(client, replica_workflow_id(status.name, g.name, r.replica,
                                                                             r.submission)) for g, r in starting))
    for (_, r), text in zip(starting, said):
        r.reason = text
    return status


async def step_progress(client: Client, workflow_id: str) -> str:
    """"<step>: <its last heartbeat>" of the workflow's pending activity; '' when there is none (or no answer)."""
    try:
        pending = (await client.get_workflow_handle(workflow_id).describe(rpc_timeout=RPC)).raw_description \
            .pending_activities
    except RPCError:
        return ""
    for activity in pending:
        details = activity.heartbeat_details.payloads
        said = await client.data_converter.decode(list(details)) if details else []
        if said and isinstance(said[0], str):
            return f"{activity.activity_type.name}: {said[0]}"
    return ""


async def watchers_of(client: Client, task_queue: str, service: str, backend: str = "local") -> set[str]:
    """Identities of the workers watching ``service``'s replicas on ``backend``: the fleet monitor's watch once it
    lists the service, and the service's own monitors (a started attempt; one the service cancelled lingers until
    its next heartbeat: not counted)."""
    fleet = client.get_workflow_handle(fleet_workflow_id(task_queue, backend))
    handles = [(client.get_workflow_handle(service_workflow_id(service)), interface.monitor_replicas.__name__)]
    try:
        if any(w.service == service for w in (await fleet.query(FleetMonitorWorkflow.changes, 0)).watched):
            handles.append((fleet, interface.watch_fleet.__name__))
    except RPCError:  # no fleet monitor runs: the service watches on its own
        pass
    out = set()
    for handle, kind in handles:
        d = await handle.describe()
        out |= {p.last_worker_identity for p in d.raw_description.pending_activities
                if p.activity_type.name == kind and p.last_worker_identity and p.last_started_time.seconds
                and p.state != PendingActivityState.PENDING_ACTIVITY_STATE_CANCEL_REQUESTED}
    return out


async def _running_services(client: Client) -> list[str]:
    query = "WorkflowType='ServiceRunWorkflow' AND ExecutionStatus='Running'"
    names = []
    try:
        async for wf in client.list_workflows(query, rpc_timeout=RPC):
            names.append(wf.id.removeprefix("service/"))
    except RPCError as e:
        raise ControlPlaneDown(f"control plane error: {e.message}") from e
    return sorted(names)


def ps(
    name: Optional[str] = typer.Argument(None, help="Service name; all running services when omitted."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Resources, instance types and errors."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
    watch: bool = typer.Option(False, "-w", "--watch", help="Redraw until Ctrl-C."),
) -> None:
    """Show services and their replicas, group by group."""
    settings = Settings.from_env()
    run(_ps(settings, name, verbose, as_json, watch))


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
        """Every service asked at once: one that does not answer (its workflow stuck, its worker gone) is shown as
        the store last saw it, marked, and never holds up the others; none answering is the control plane down."""
        names = [name] if name else await _running_services(client)
        answers = await asyncio.gather(*[live_status(client, n) for n in names], return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, ControlPlaneDown):
                raise answer
        silent = {n: a for n, a in zip(names, answers) if isinstance(a, ControlPlaneDown)}
        statuses = [a for a in answers if isinstance(a, ServiceStatus)]
        if silent and not statuses:
            raise next(iter(silent.values()))
        if name and not statuses:
            raise user_error(f"no running service named {name!r}")
        if silent:
            from cli.db import silent_statuses

            statuses += await asyncio.to_thread(silent_statuses, settings, silent, not watch)
        if verbose:
            await asyncio.gather(*(with_progress(client, s) for s in statuses))
        return sorted(statuses, key=lambda s: s.name)

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
        raise user_error(f"--since: {e}")
    run(_events(settings, name, as_json, start, limit))


async def _events(settings: Settings, name: str, as_json: bool, since=None, limit: Optional[int] = None) -> None:
    from cli.db import select_events, stored_events

    items, unreadable = await asyncio.to_thread(stored_events, settings, name, since, limit)
    if items is None:  # none in the store (unreadable, another database, an older worker): the workflow's own
        if unreadable:  # said first: the control plane may not answer either
            err.print(f"{unreadable}; asking the service's workflow, which keeps its latest decisions",
                      style="yellow", markup=False)
        _, handle = await running(settings, name)
        live = await ask(handle, ServiceRunWorkflow.events)
        if unreadable:
            err.print(f"the service's latest {len(live)} decisions, from its workflow; older ones are in the store",
                      style="yellow", markup=False)
        items = select_events(live, since, limit)
    else:
        items = select_events(items + await _unrecorded(settings, name, items), since, limit)
    if as_json:
        out.print_json(json.dumps([e.model_dump(mode="json") for e in items]))
        return
    for e in items:
        group = f" group={e.group}" if e.group else ""
        out.print(f"{e.at:%Y-%m-%d %H:%M:%S} {e.kind:<8}{group} {e.message}", markup=False)


async def _unrecorded(settings: Settings, name: str, stored: list) -> list:
    """The decisions a running service has not written to the store yet (it fails or is behind), said so on
    stderr; [] when it has none, or the control plane does not answer (the store's log is all there is)."""
    try:
        client = await connect(settings, timeout=2.0)  # the store answered: do not keep the reader waiting
        status = await live_status(client, name)
        if status is None or not status.unrecorded:
            return []
        live = await client.get_workflow_handle(service_workflow_id(name)).query(ServiceRunWorkflow.events, rpc_timeout=RPC)
    except (ControlPlaneDown, RPCError):
        return []
    err.print(store_note(status) + "; shown here from the service's workflow.", style="yellow", markup=False)
    seen = {(e.seq, e.kind, e.message) for e in stored}
    return [e for e in live if (e.seq, e.kind, e.message) not in seen]


def _replica(status: ServiceStatus, replica: Optional[int], running: bool = False):
    """The replica's latest submission (default: the first running replica); with ``running``, only a running one
    (`exec`; `logs` also reads a replica that has ended)."""
    live = [r for g in status.groups for r in g.replicas if r.status == "running"]
    candidates = live
    if replica is not None:
        candidates = [r for g in status.groups for r in g.replicas if r.replica == replica]
    if not candidates:
        raise user_error(f"{status.name}: no running replica" + (f" {replica}" if replica is not None else ""))
    view = max(candidates, key=lambda r: r.submission)
    if running and view.status != "running":
        raise user_error(f"{status.name}: replica {view.replica} is {view.status}; running replicas: "
                         + (", ".join(str(r.replica) for r in sorted(live, key=lambda r: r.replica)) or "none"))
    return view


def _local_instance(settings: Settings, name: str, replica: Optional[int], running: bool = False):
    from backends.local import LocalBackend

    status = run(running_status(settings, name))
    view = _replica(status, replica, running)
    if view.backend != "local":
        raise user_error(f"replica {view.replica} runs on {view.backend}; exec and logs reach local replicas")
    backend = LocalBackend(settings.home)
    instance = backend.find_instance(f"{name}/{view.group}/r{view.replica}-s{view.submission}")
    if instance is None:
        raise user_error(f"replica {view.replica} has no process on this machine")
    return backend, instance


def _cloud_replica(settings: Settings, name: str, replica: Optional[int], running: bool = False):
    """(status view, SSH client, target) of a cloud replica, or None for a local one."""
    status = run(running_status(settings, name))
    view = _replica(status, replica, running)
    if view.backend in ("", "local"):
        return None
    if not (view.ssh_host and view.instance_key):
        raise user_error(f"replica {view.replica} on {view.backend} has no instance address yet")
    from backends.ssh import SSHClient, ssh_target
    from backends.ssh_keys import SSHKeys, SSHKeysError

    try:
        keys = SSHKeys.of_home(settings.home)
    except SSHKeysError as e:
        raise user_error(str(e))
    return SSHClient.from_keys(keys), ssh_target(keys, view.ssh_host, view.instance_key, view.host_key_after_boot)


async def cloud_exec(client, target, argv: list[str], *, stdout=None) -> int:
    """``docker exec`` in the replica's container over SSH (the host key pinned); its output, its exit code."""
    from backends.ssh import exec_command

    conn = await client.connect(target)
    try:
        result = await conn.run(exec_command(argv), check=False)
    finally:
        conn.close()
    (stdout or sys.stdout).write(str(result.stdout or "") + str(result.stderr or ""))
    return int(result.exit_status if result.exit_status is not None else 255)


async def cloud_logs(client, target, *, follow: bool, stdout=None) -> int:
    """The container's output over SSH; with ``follow``, until the container ends or Ctrl-C."""
    from backends.ssh import logs_command

    out_ = stdout or sys.stdout
    conn = await client.connect(target)
    try:
        async with conn.create_process(logs_command(follow=follow), stderr=asyncssh_stdout()) as proc:
            async for line in proc.stdout:
                out_.write(line)
                out_.flush()
            await proc.wait()
            return int(proc.exit_status or 0)
    finally:
        conn.close()


def asyncssh_stdout():
    import asyncssh

    return asyncssh.STDOUT


def exec_(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Service name."),
    replica: Optional[int] = typer.Option(None, "--replica", "-r", help="Replica number (default: the first)."),
) -> None:
    """Run a command inside a replica (its namespaces on the local backend, its container over SSH on a cloud):
    durastack exec NAME -- CMD..."""
    argv = [a for a in ctx.args if a != "--"]
    if not argv:
        raise user_error("give the command after --, e.g. durastack exec NAME -- cat /tmp/version.txt")
    settings = Settings.from_env()
    cloud = _cloud_replica(settings, name, replica, running=True)
    if cloud is not None:  # over SSH, into its container
        raise typer.Exit(run(cloud_exec(*cloud, argv)))
    from backends.local import LocalBackendError

    backend, instance = _local_instance(settings, name, replica, running=True)
    try:
        code, output = backend.exec(instance, argv)
    except LocalBackendError as e:  # it ended since `ps` saw it running
        raise user_error(f"{name}: {e}")
    sys.stdout.write(output)
    raise typer.Exit(code)


def logs(
    name: str = typer.Argument(..., help="Service name."),
    replica: Optional[int] = typer.Option(None, "--replica", "-r", help="Replica number (default: the first)."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines until Ctrl-C."),
) -> None:
    """Print a replica's output."""
    settings = Settings.from_env()
    cloud = _cloud_replica(settings, name, replica)
    if cloud is not None:  # its container's output, over SSH
        try:
            run(cloud_logs(*cloud, follow=follow))
        except KeyboardInterrupt:
            pass
        return
    _, instance = _local_instance(settings, name, replica)
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


def register(app: typer.Typer) -> None:
    app.command()(ps)
    app.command()(events)
    app.command(name="exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(exec_)
    app.command()(logs)
