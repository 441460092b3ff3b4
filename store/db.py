"""The store's database: engine and sessions, migrations, the instance ledger, the decision log, the read model.

SQLite at ``$DURASTACK_HOME/store.db`` by default, PostgreSQL (or any URL SQLAlchemy takes) with
``DURASTACK_DATABASE_URL``; the tables are in store/tables.py, their migrations in ``migrations/``. A ``Store``
brings its database to the latest revision when first used, under a lock (a file lock on SQLite, an advisory lock
on PostgreSQL) so workers starting together do not race. Several processes share one SQLite file: WAL lets readers
run beside the writer, a busy timeout makes writers queue, and ``synchronous=FULL`` makes every commit durable
(fsync), which the ledger needs: an intent must survive the worker dying right after the cloud call.

Every method blocks: async code calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional

from sqlalchemy import Engine, create_engine, event, func, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, col, select

from models.messages import RecordResult, ServiceRecord
from models.views import Event, ServiceStatus
from models.settings import Settings
from store.tables import DecisionLogEntry, LedgerEntry, ServiceRow

log = logging.getLogger("durastack.store")
INTENT, CREATED, FAILED, TERMINATED = "intent", "created", "failed", "terminated"
BUSY_SECONDS = 30  # a SQLite writer waits this long for another one before failing
MIGRATION_LOCK = 0x64757261737461  # PostgreSQL advisory lock key ("durasta")
KEYS_PER_QUERY = 500  # bound on the parameters of one IN (…)


def database_url(home: Optional[Path] = None, environ: Mapping[str, str] = os.environ) -> str:
    """``DURASTACK_DATABASE_URL``, or the SQLite file in ``home`` (default: the durastack home)."""
    url = environ.get("DURASTACK_DATABASE_URL")
    if url:
        return url
    return f"sqlite:///{(home or Settings.from_env(dict(environ)).home) / 'store.db'}"


def _driver_url(url: str):
    """``postgresql://`` means psycopg (3) here, the driver durastack installs."""
    u = make_url(url)
    return u.set(drivername="postgresql+psycopg") if u.drivername in ("postgresql", "postgres") else u


def _utc(at: datetime) -> datetime:
    """Every time stamp in UTC; SQLite hands back naive ones, which were written in UTC."""
    return at.replace(tzinfo=timezone.utc) if at.tzinfo is None else at.astimezone(timezone.utc)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {BUSY_SECONDS * 1000}")
    _wal(cursor)
    cursor.execute("PRAGMA synchronous = FULL")  # in WAL mode, NORMAL could lose the last commits on power loss
    cursor.close()


def _wal(cursor) -> None:
    """Switch the file to WAL (it stays so). Processes opening a new file together all switch it, and SQLite answers
    "database is locked" to all but one at once, without waiting its busy timeout: try again until it is done."""
    deadline = time.monotonic() + BUSY_SECONDS
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def make_engine(url: str) -> Engine:
    u = _driver_url(url)
    dumps = lambda value: json.dumps(value, default=str)  # noqa: E731 — ledger data may hold odd values
    if u.get_backend_name() != "sqlite":
        return create_engine(u, json_serializer=dumps, pool_pre_ping=True)
    engine = create_engine(u, json_serializer=dumps,
                           connect_args={"timeout": BUSY_SECONDS, "check_same_thread": False})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def alembic_config(connection=None, url: Optional[str] = None):
    from alembic.config import Config

    from migrations import SCRIPT_LOCATION

    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if url:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head() or ""


class Store:
    """One database. Cheap to build; the first call connects and migrates (see ``open``)."""

    def __init__(self, url: Optional[str] = None, *, upgrade: bool = True):
        """``upgrade=False``: never migrate (readers such as the CLI; ``durastack db upgrade`` does it)."""
        self.url = url or database_url()
        self.engine = make_engine(self.url)
        self.upgrade_on_open = upgrade
        self._opened = False
        self._file: Optional[tuple[int, int]] = None  # (device, inode) of the SQLite file opened
        self._lock = threading.Lock()

    @property
    def sqlite_path(self) -> Optional[Path]:
        u = make_url(self.url)
        in_file = u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:")
        return Path(u.database) if in_file else None

    def where(self) -> str:
        """The database, for messages (without a password)."""
        return str(self.sqlite_path or make_url(self.url).render_as_string(hide_password=True))

    def open(self) -> "Store":
        """Connect and bring the schema to head (unless built with ``upgrade=False``). Idempotent; again after
        ``reset`` (a lost database is made anew, migrated, by the next call)."""
        with self._lock:
            if self._opened and self._moved():
                log.warning("store %s was deleted or replaced: reopening it", self.where())
                self._reset()
            if not self._opened:
                if self.sqlite_path is not None:
                    self.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
                if self.upgrade_on_open:
                    self.upgrade()
                self._file = self._file_id()
                self._opened = True
        return self

    def _file_id(self) -> Optional[tuple[int, int]]:
        try:
            st = os.stat(self.sqlite_path) if self.sqlite_path is not None else None
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino) if st else None

    def _moved(self) -> bool:
        """The SQLite file is not the one the pool's connections have open: they would write to a deleted file
        (or fail with SQLITE_READONLY_DBMOVED) until reopened."""
        return self.sqlite_path is not None and self._file_id() != self._file

    def _reset(self) -> None:
        # Closing the pool's connections also lets SQLite drop a deleted database's WAL before a new file
        # takes its name.
        self.engine.dispose()
        self._opened, self._file = False, None

    def reset(self) -> None:
        """Forget every connection: the next call reconnects (and migrates, if it may). After a failed call,
        so that a lost connection or a replaced database never needs a restart to be written again."""
        with self._lock:
            self._reset()

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        self.open()
        try:
            with Session(self.engine, expire_on_commit=False) as session:
                yield session
        except DBAPIError:
            self.reset()
            raise

    # --- migrations ---------------------------------------------------------------------------------

    def current(self) -> str:
        """The database's revision ('' when it has none: empty, or never migrated)."""
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision() or ""

    def upgrade(self, revision: str = "head") -> str:
        """Migrate to ``revision`` under the migration lock; returns the revision reached."""
        from alembic import command

        now = self.current()
        if revision == "head" and now == head_revision():
            return now  # the common case, without taking the lock
        with self._migration_lock() as connection:
            command.upgrade(alembic_config(connection), revision)
            connection.commit()
        reached = self.current()
        log.info("store %s at revision %s", self.where(), reached)
        return reached

    @contextmanager
    def _migration_lock(self):
        if self.sqlite_path is not None:
            lock_path = self.sqlite_path.with_name(self.sqlite_path.name + ".migrate.lock")
            with open(lock_path, "a") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
                with self.engine.connect() as connection:
                    yield connection
            return
        with self.engine.connect() as connection:
            postgres = connection.dialect.name == "postgresql"
            if postgres:  # a session lock: it outlives the transactions the migration commits
                connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
                connection.commit()
            try:
                yield connection
            finally:
                if postgres:
                    connection.rollback()
                    connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK})
                    connection.commit()

    def _insert(self, table):
        return (pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert)(table)

    # --- instance ledger ----------------------------------------------------------------------------

    def add_ledger_entry(self, key: str, phase: str, data: Optional[dict[str, Any]] = None) -> None:
        """Append one entry; returns once it is committed (durable)."""
        with self.session() as s:
            s.add(LedgerEntry(key=key, phase=phase, data=data or {}, at=datetime.now(timezone.utc)))
            s.commit()

    def ledger_entries(self, key: Optional[str] = None) -> list[LedgerEntry]:
        query = select(LedgerEntry).order_by(col(LedgerEntry.id))
        if key is not None:
            query = query.where(LedgerEntry.key == key)
        with self.session() as s:
            return list(s.exec(query))

    def last_phases(self, keys: Iterable[str]) -> dict[str, str]:
        """The last phase recorded for each of ``keys`` that has any entry."""
        wanted, last = sorted(set(keys)), {}
        with self.session() as s:
            for i in range(0, len(wanted), KEYS_PER_QUERY):
                chunk = wanted[i:i + KEYS_PER_QUERY]
                latest = (select(func.max(LedgerEntry.id)).where(col(LedgerEntry.key).in_(chunk))
                          .group_by(LedgerEntry.key))
                rows = s.exec(select(LedgerEntry.key, LedgerEntry.phase).where(col(LedgerEntry.id).in_(latest)))
                last.update(dict(rows.all()))
        return last

    # --- decision log and read model --------------------------------------------------------------

    def record_service(self, rec: ServiceRecord) -> RecordResult:
        """New decision-log entries and the `ps` row of one service, in one transaction. Idempotent: an entry
        already there (same service, run and seq: a retried write) is left as it is. Returns the highest seq of
        the run the store has below the entries written, so that the service can refill a lost stretch."""
        run = _utc(rec.status.submitted_at or datetime.fromtimestamp(0, timezone.utc))
        now = datetime.now(timezone.utc)
        with self.session() as s:
            if rec.events:
                rows = [dict(service=rec.service, run=run, seq=e.seq, at=_utc(e.at), kind=e.kind, group=e.group,
                             message=e.message) for e in rec.events]
                s.execute(self._insert(DecisionLogEntry).values(rows).on_conflict_do_nothing(
                    index_elements=["service", "run", "seq"]))
            row = dict(name=rec.service, status=rec.status.status, deployment=rec.status.deployment,
                       updated_at=now, view=rec.status.model_dump(mode="json"))
            upsert = self._insert(ServiceRow).values(row)
            s.execute(upsert.on_conflict_do_update(
                index_elements=["name"], set_={k: upsert.excluded[k] for k in row if k != "name"}))
            last_before = 0
            if rec.events:
                below = (select(func.max(DecisionLogEntry.seq))
                         .where(DecisionLogEntry.service == rec.service, DecisionLogEntry.run == run,
                                col(DecisionLogEntry.seq) < min(e.seq for e in rec.events)))
                last_before = s.exec(below).one() or 0
            s.commit()
        return RecordResult(last_before=last_before)

    def events(self, service: str, *, since: Optional[datetime] = None, limit: Optional[int] = None) -> list[Event]:
        """The service's decision log, every run, oldest first: at or after ``since``, the last ``limit``."""
        query = select(DecisionLogEntry).where(DecisionLogEntry.service == service)
        if since is not None:
            query = query.where(col(DecisionLogEntry.at) >= _utc(since))
        newest_first = query.order_by(col(DecisionLogEntry.run).desc(), col(DecisionLogEntry.seq).desc())
        if limit is not None:
            newest_first = newest_first.limit(limit)
        with self.session() as s:
            rows = list(s.exec(newest_first))
        return [Event(at=_utc(r.at), kind=r.kind, group=r.group, message=r.message, seq=r.seq)
                for r in reversed(rows)]

    def statuses(self, name: Optional[str] = None) -> list[tuple[ServiceStatus, datetime]]:
        """The read model: each service's last `ps` view and when it was written, by name."""
        query = select(ServiceRow).order_by(col(ServiceRow.name))
        if name is not None:
            query = query.where(ServiceRow.name == name)
        with self.session() as s:
            rows = list(s.exec(query))
        return [(ServiceStatus.model_validate(r.view), _utc(r.updated_at)) for r in rows]


class StoreLedger:
    """The instance ledger in the store, for the offer walker (activities/cloud.py) and the reaper.

    ``record`` returns once the entry is committed, so an ``intent`` written before a cloud call survives the
    worker dying during it. A key whose last phase is ``intent`` had its call's outcome lost: the walker retries
    that key first (the cloud's idempotency returns the instance it may have made) and the reaper spares it.
    """

    def __init__(self, store: Optional[Store] = None):
        self.store = store or Store()

    def record(self, key: str, phase: str, data: Optional[dict[str, Any]] = None) -> None:
        self.store.add_ledger_entry(key, phase, data)

    def entries(self, key: Optional[str] = None) -> list[dict[str, Any]]:
        """All entries in order (only ``key``'s if given), as ``{"at", "key", "phase", "data"}``."""
        return [{"at": _utc(e.at).isoformat(), "key": e.key, "phase": e.phase, "data": e.data}
                for e in self.store.ledger_entries(key)]

    def last_phases(self, keys: Iterable[str]) -> dict[str, str]:
        return self.store.last_phases(keys)

    def unresolved(self, keys: Iterable[str]) -> set[str]:
        """Keys whose call went out but whose outcome was never recorded."""
        return {k for k, phase in self.last_phases(keys).items() if phase == INTENT}


__all__ = ["CREATED", "FAILED", "INTENT", "TERMINATED", "Store", "StoreLedger",
           "alembic_config", "database_url", "head_revision", "make_engine"]
