"""The store from the command line: ``durastack db upgrade|current`` for operators, and the reads behind
``durastack events`` (the full decision log) and ``durastack ps`` when the control plane is down (the read model).

The CLI never migrates on its own (``Store(upgrade=False)``): ``durastack db upgrade`` does, or the worker when
it starts. A store that does not exist yet, or cannot be read, reads as empty: the commands then ask Temporal.
SQLAlchemy is imported only by the commands that read the store, to keep the others quick to start.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Callable, Optional

import typer

from cli.client import EXIT_CONTROL_PLANE_DOWN
from cli.console import err, out
from cli.render import age, ps_table, status_json
from models.common import parse_duration
from models.views import Event, ServiceStatus
from models.settings import Settings

db_app = typer.Typer(no_args_is_help=True, help="The store's database: DURASTACK_DATABASE_URL, default SQLite "
                     "at $DURASTACK_HOME/store.db.")


def _store(settings: Optional[Settings] = None):
    from store import Store, database_url

    return Store(database_url((settings or Settings.from_env()).home), upgrade=False)


def _exists(store) -> bool:
    return store.sqlite_path is None or store.sqlite_path.exists()


@db_app.command("upgrade")
def upgrade(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Migrate the store's database to the latest revision (run once per release, e.g. as a k8s job)."""
    from sqlalchemy.exc import SQLAlchemyError

    store = _store()
    try:
        before = store.open().current()  # open: makes the SQLite file's directory; never migrates here
        after = store.upgrade(revision)
    except SQLAlchemyError as e:
        err.print(f"store {store.where()}: {e}", style="red", markup=False)
        raise typer.Exit(EXIT_CONTROL_PLANE_DOWN)
    out.print(f"{store.where()}: {before or '(empty)'} → {after}" if before != after
              else f"{store.where()}: at {after} already", markup=False)


@db_app.command("current")
def current(check: bool = typer.Option(False, "--check", help="Exit 1 unless at the latest revision.")) -> None:
    """The revision of the store's database, and the latest this durastack knows."""
    from sqlalchemy.exc import SQLAlchemyError

    from store import head_revision

    store = _store()
    try:
        revision = store.current() if _exists(store) else ""
    except SQLAlchemyError as e:
        err.print(f"store {store.where()}: {e}", style="red", markup=False)
        raise typer.Exit(EXIT_CONTROL_PLANE_DOWN)
    head = head_revision()
    out.print(f"{store.where()}: {revision or '(empty)'} (latest {head})", markup=False)
    if check and revision != head:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")


# --- reads for events and ps ----------------------------------------------------------------------------

_WHEN = re.compile(r"^\d{4}-\d{2}-\d{2}")


def parse_since(value: Optional[str], now: Optional[datetime] = None) -> Optional[datetime]:
    """``--since``: a time (``2026-11-29``, ``2026-11-29T03:12``; UTC unless it says) or an age (``30m``, ``2h``)."""
    if value is None:
        return None
    if _WHEN.match(value):
        at = datetime.fromisoformat(value)
        return at if at.tzinfo else at.replace(tzinfo=timezone.utc)
    return (now or datetime.now(timezone.utc)) - timedelta(seconds=parse_duration(value))


def select_events(items: list[Event], since: Optional[datetime], limit: Optional[int]) -> list[Event]:
    kept = [e for e in items if since is None or e.at >= since]
    return kept[-limit:] if limit else kept


def stored_events(settings: Settings, name: str, since: Optional[datetime] = None,
                  limit: Optional[int] = None) -> tuple[Optional[list[Event]], str]:
    """The service's decision log from the store (every run, oldest first), or None when the store has none of
    it; and why the store could not be read ('' when it could)."""
    from sqlalchemy.exc import SQLAlchemyError

    store = _store(settings)
    try:
        if not _exists(store):
            return None, ""
        items = store.events(name, since=since, limit=limit)
        return (items if items or store.events(name, limit=1) else None), ""
    except SQLAlchemyError as e:
        why = str(getattr(e, "orig", None) or e).splitlines()[0]
        return None, f"store {store.where()} unreadable: {why}"
    finally:
        store.close()


def silent_statuses(settings: Settings, silent: dict[str, Exception], warn: bool) -> list[ServiceStatus]:
    """The store's last view of running services whose workflows do not answer, their status "not answering";
    with ``warn``, each said on stderr with why and as of when."""
    from sqlalchemy.exc import SQLAlchemyError

    store = _store(settings)
    try:
        rows = {s.name: (s, at) for s, at in store.statuses()} if _exists(store) else {}
    except SQLAlchemyError:
        rows = {}
    finally:
        store.close()
    shown = []
    for name, why in silent.items():
        row = rows.get(name)
        if warn:
            seen = f"shown as the store saw it at {row[1]:%Y-%m-%d %H:%M:%S} UTC" if row else "not in the store"
            err.print(f"{name}: not answering ({why}); {seen}", style="yellow", markup=False)
        if row:
            shown.append(row[0].model_copy(update={"status": "not answering"}))
    return shown


def print_stale_ps(settings: Settings, name: Optional[str], verbose: bool, as_json: bool,
                   url: Callable[[str], str]) -> bool:
    """The read model as ``ps`` shows it, marked stale with when each service last wrote it; False if empty.
    Without a name: the services not ended (terminated, or failed)."""
    from sqlalchemy.exc import SQLAlchemyError

    store = _store(settings)
    try:
        rows = store.statuses(name) if _exists(store) else []
    except SQLAlchemyError:
        return False
    finally:
        store.close()
    rows = [(s, at) for s, at in rows if name or s.status not in ("terminated", "failed")]
    if not rows:
        return False
    if as_json:
        import json

        payload = [{**status_json(s, url(s.name)), "stale": True,
                    "as_of": at.isoformat()} for s, at in rows]
        out.print_json(json.dumps(payload[0] if name else payload))
        return True
    out.print("STALE — the control plane is not answering; the store's last view: "
              + ", ".join(f"{s.name} as of {at:%Y-%m-%d %H:%M:%S} UTC ({age(at)})" for s, at in rows),
              style="yellow", markup=False)
    statuses: list[ServiceStatus] = [s for s, _ in rows]
    out.print(ps_table(statuses, verbose))
    return True


__all__ = ["db_app", "parse_since", "print_stale_ps", "register", "select_events", "stored_events"]
