"""Rich rendering of service status: the `ps` table in the seed's layout."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

from rich.table import Table
from rich.text import Text

from models.router import RouterView
from models.views import ReplicaView, ServiceStatus


def age(at: Optional[datetime], now: Optional[datetime] = None) -> str:
    if at is None:
        return ""
    now = now or datetime.now(timezone.utc)
    seconds = max(0, int((now - at).total_seconds()))
    for unit, size in (("day", 86400), ("hour", 3600), ("min", 60)):
        if seconds >= size:
            n = seconds // size
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return f"{seconds} sec ago" if seconds else "now"


def rollout_in_progress(status: ServiceStatus) -> bool:
    return any(r.deployment != status.deployment and r.status not in ("terminated", "failed")
               for g in status.groups for r in g.replicas)


def _backend(r: ReplicaView) -> str:
    if not r.backend:
        return ""
    return r.backend if r.backend == "local" else f"{r.backend} ({r.region})"


def _status_text(r: ReplicaView) -> Text:
    colour = {"running": "green", "failed": "red", "terminated": "grey50", "terminating": "yellow"}
    label = r.status if r.status != "running" or r.ready else "starting"
    return Text(label, style=colour.get(r.status, ""))


def ps_table(statuses: list[ServiceStatus], verbose: bool = False) -> Table:
    table = Table(box=None, pad_edge=True, show_edge=False, header_style="bold")
    table.add_column("NAME", no_wrap=True)
    table.add_column("BACKEND")
    if verbose:
        table.add_column("RESOURCES")
        table.add_column("INSTANCE TYPE")
    else:
        table.add_column("GPU")
    table.add_column("PRICE")
    table.add_column("STATUS")
    table.add_column("SUBMITTED")
    if verbose:
        table.add_column("ERROR")
    for status in statuses:
        show_deployment = verbose or rollout_in_progress(status)
        name = status.name + (f" deployment={status.deployment}" if show_deployment else "")
        row = [name, "", *([""] * 2 if verbose else ["-"]), "-", Text(status.status), age(status.submitted_at)]
        table.add_row(*row, *([""] if verbose else []))
        if status.unrecorded or status.store_failing_since:
            table.add_row(Text("   " + store_note(status), style="yellow"), *[""] * (len(table.columns) - 1))
        if status.unavailable:  # the gateway answers 503 with it rather than hold requests
            table.add_row(Text(f"   cannot serve: {status.unavailable}", style="red"), *[""] * (len(table.columns) - 1))
        for group in status.groups:
            label = f"group={group.name}" + (f" ({group.role})" if group.role else "")
            for i, r in enumerate(sorted(group.replicas, key=lambda r: r.replica)):
                prefix = "   " + (label if i == 0 else " " * len(label))
                cell = f"{prefix} replica={r.replica}" + (f" deployment={r.deployment}" if show_deployment else "")
                cols = [cell, _backend(r)]
                cols += [group.resources or "", r.instance_type] if verbose else [r.gpu or "-"]
                cols += [f"${r.price:g}" if r.backend else "", _status_text(r), age(r.submitted_at)]
                if verbose:
                    cols.append(r.reason)
                table.add_row(*cols)
            if not group.replicas:
                table.add_row(f"   {label} (no replicas)", *[""] * (len(table.columns) - 1))
            if group.waiting:
                table.add_row(Text(f"   {label} waits: {group.waiting}", style="yellow"),
                              *[""] * (len(table.columns) - 1))
            if verbose and group.signal:
                table.add_row(Text(f"   {label} scales on {group.signal}", style="cyan"),
                              *[""] * (len(table.columns) - 1))
            if group.idle:
                table.add_row(Text(f"   {label} keeps idle for its next replica: {', '.join(group.idle)}",
                                   style="cyan"), *[""] * (len(table.columns) - 1))
            if group.retry_after is not None:
                wait = f"   {label} waits on a back-off until {group.retry_after:%H:%M:%S} UTC (after failures in a row)"
                table.add_row(Text(wait, style="yellow"), *[""] * (len(table.columns) - 1))
        if verbose and status.place:
            table.add_row(Text(f"   one place: every replica on {status.place} (they reach each other)", style="cyan"),
                          *[""] * (len(table.columns) - 1))
        if verbose and status.router is not None:
            for line in router_lines(status.router):
                table.add_row(Text("   " + line, style="cyan"), *[""] * (len(table.columns) - 1))
    return table


def router_lines(view: RouterView) -> list[str]:
    """What each router replica lists: its workers, their role and health (`ps -v`)."""
    out = []
    for r in view.routers:
        if not r.reachable:
            out.append(f"router replica={r.replica_num} not reached: {r.error}")
            continue
        workers = ", ".join(f"{w.url} {w.worker_type}{'' if w.healthy else ' (unhealthy)'}" for w in r.workers)
        out.append(f"router replica={r.replica_num} knows {len(r.workers)} worker(s){': ' + workers if workers else ''}")
    return out


def store_note(status: ServiceStatus) -> str:
    """What `ps` and `events` say of a service whose decisions wait for the store."""
    waiting = f"{status.unrecorded} decision{'s' if status.unrecorded != 1 else ''} not in the store yet"
    if status.store_failing_since is None:
        return f"the store is behind: {waiting}"
    since = f"{status.store_failing_since:%Y-%m-%d %H:%M:%S} UTC ({age(status.store_failing_since)})"
    return f"the store is unavailable since {since}: {status.store_error or 'write failed'}; {waiting}"


def status_json(status: ServiceStatus, url: str) -> dict:
    return {
        "name": status.name, "status": status.status, "deployment": status.deployment, "url": url,
        "unrecorded": status.unrecorded, "store_error": status.store_error or None,
        "unavailable": status.unavailable or None,
        "store_failing_since": status.store_failing_since.isoformat() if status.store_failing_since else None,
        "place": status.place or None,
        "router": status.router.model_dump(mode="json")["routers"] if status.router else None,
        "groups": [{"name": g.name, "desired": g.desired, "min": g.min, "max": g.max, "role": g.role,
                    "waiting": g.waiting, "idle": g.idle,
                    "retry_after": g.retry_after.isoformat() if g.retry_after else None,
                    "replicas": [{"replica": r.replica, "submission": r.submission, "deployment": r.deployment,
                                  "status": r.status, "ready": r.ready, "backend": r.backend, "region": r.region,
                                  "instance_type": r.instance_type, "price": r.price, "gpu": r.gpu,
                                  "address": r.address}
                                 for r in g.replicas]}
                   for g in status.groups],
    }
