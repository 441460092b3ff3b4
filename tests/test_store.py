"""The store (store/) on SQLite and, when DURASTACK_TEST_POSTGRES_URL is set, on PostgreSQL.

Each PostgreSQL test gets a database of its own, ``durastack_test_<uuid>``, dropped afterwards, so parallel runs
and reruns never meet. Several tests start real processes that write to one database at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlmodel import SQLModel
from temporalio.worker import Worker
from typer.testing import CliRunner

from activities.store import StoreActivities
from models.loader import load_config_text
from models.messages import ServiceRecord
from models.state import ServiceState
from models.views import Event, GroupView, ReplicaView, ServiceStatus
from store.db import INTENT, KEYS_PER_QUERY, Store, StoreLedger, alembic_config, head_revision
from store.tables import LedgerEntry
from tests.conftest import eventually
from tests.test_server import free_ports
from tests.fakes.cloud import FakeCloud
from rules.names import backend_queue
from workflows.replica import ReplicaWorkflow
from rules.names import backend_queue
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

ROOT = Path(__file__).resolve().parents[1]
PG_URL = os.environ.get("DURASTACK_TEST_POSTGRES_URL")
T0 = datetime(2026, 11, 29, 3, 0, tzinfo=timezone.utc)
SERVICE = """
type: service
name: svc-store
port: 8000
replicas:
  - count: 1
    commands: [python3 -m http.server 8000]
"""


def _pg_admin() -> sa.Engine:
    return sa.create_engine(sa.make_url(PG_URL).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT")


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    """An empty database's URL: a SQLite file, or a throwaway PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/store.db"
        return
    if not PG_URL:
        pytest.skip("DURASTACK_TEST_POSTGRES_URL is not set")
    name = f"durastack_test_{uuid.uuid4().hex}"
    admin = _pg_admin()
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def store(url):
    s = Store(url)
    yield s
    s.close()


def status(name: str, state: str = "running", deployment: int = 0, submitted_at: datetime = T0) -> ServiceStatus:
    return ServiceStatus(name=name, status=state, deployment=deployment, auth=True, submitted_at=submitted_at,
                         groups=[GroupView(name="llm", desired=1, min=1, max=1, resources="cpu=1", replicas=[
                             ReplicaView(replica=0, submission=0, deployment=deployment, group="llm", status=state,
                                         ready=True, backend="aws", region="us-east-1", instance_type="g5.xlarge",
                                         price=1.006, submitted_at=submitted_at)])])


def ev(seq: int, message: str = "", kind: str = "scale", group: str | None = "llm") -> Event:
    return Event(at=T0 + timedelta(minutes=seq), kind=kind, group=group, message=message or f"decision {seq}", seq=seq)


def diffs(store: Store, metadata: sa.MetaData = SQLModel.metadata) -> list:
    with store.engine.connect() as c:
        return compare_metadata(MigrationContext.configure(c), metadata)


def run_children(setup: str, body: str, args: list[str], gate: Path) -> list[subprocess.CompletedProcess]:
    """One process per ``args`` item (its ``sys.argv[2]``): each runs ``setup`` (imports), says it is ready, and
    runs ``body`` once every one is ready — so they really start together."""
    code = (f"import os, sys, time\n{setup}\nopen(sys.argv[1] + '.ready' + str(os.getpid()), 'w').close()\n"
            f"while not os.path.exists(sys.argv[1]):\n    time.sleep(0.002)\n{body}")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(gate), a], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for a in args]
    deadline = time.monotonic() + 120
    while (len(list(gate.parent.glob(gate.name + ".ready*"))) < len(procs) and time.monotonic() < deadline
           and all(p.poll() is None for p in procs)):
        time.sleep(0.01)
    gate.touch()
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


# --- migrations ---------------------------------------------------------------------------------------

def test_migrations_on_an_empty_database_make_exactly_the_tables(url):
    store = Store(url, upgrade=False)
    assert store.current() == ""
    store.open()
    assert store.current() == "" and not sa.inspect(store.engine).get_table_names()  # upgrade=False: untouched
    assert store.upgrade() == head_revision() == "0002"
    assert diffs(store) == []
    # The comparison is live: a column the revisions lack is reported.
    wider = sa.MetaData()
    for table in SQLModel.metadata.tables.values():
        table.to_metadata(wider)
    wider.tables["decision_log"].append_column(sa.Column("extra", sa.Integer()))
    assert [d[0] for d in diffs(store, wider)] == ["add_column"]
    # Down to nothing and up again.
    with store.engine.connect() as c:
        command.downgrade(alembic_config(c), "base")
        c.commit()
    assert store.current() == "" and set(sa.inspect(store.engine).get_table_names()) <= {"alembic_version"}
    assert store.upgrade() == "0002" and diffs(store) == []
    store.close()


def test_workers_starting_together_migrate_once(url, tmp_path):
    # Alembic and the revisions are loaded before the start, so the processes meet in the DDL itself (without the
    # lock, that fails: "table … already exists" on SQLite, a unique violation in pg_type on PostgreSQL).
    setup = "from store import Store, head_revision\nimport alembic.command\nhead_revision()"
    results = run_children(setup, "print(Store(sys.argv[2]).open().current())", [url] * 4, tmp_path / "go")
    assert [(r.returncode, r.stdout.strip()) for r in results] == [(0, "0002")] * 4, [r.stderr for r in results]
    store = Store(url, upgrade=False)
    assert diffs(store) == []
    with store.engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM alembic_version")).scalar() == 1
    store.close()


# --- the instance ledger ------------------------------------------------------------------------------

def test_ledger_round_trip_and_unresolved_keys(store):
    ledger = StoreLedger(store)
    assert ledger.entries() == [] and ledger.unresolved(["k1"]) == set()
    ledger.record("k1", "intent", {"region": "us-east-1", "price": 1.5, "when": T0})
    ledger.record("k2", "intent")
    ledger.record("k1", "created", {"instance_id": "i-1"})
    ledger.record("k3", "intent")
    ledger.record("k3", "failed", {"kind": "capacity"})
    assert [e["phase"] for e in ledger.entries("k1")] == ["intent", "created"]
    first = ledger.entries("k1")[0]
    assert first["data"] == {"region": "us-east-1", "price": 1.5, "when": str(T0)}  # odd values kept as text
    assert datetime.fromisoformat(first["at"]).tzinfo == timezone.utc
    assert [e["key"] for e in ledger.entries()] == ["k1", "k2", "k1", "k3", "k3"]
    assert ledger.last_phases(["k1", "k2", "k3", "k4"]) == {"k1": "created", "k2": "intent", "k3": "failed"}
    assert ledger.unresolved(["k1", "k2", "k3", "k4"]) == {"k2"}
    if store.sqlite_path:  # every commit is fsynced (WAL, synchronous=FULL): an intent survives a crash
        with store.engine.connect() as c:
            assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 2


def test_last_phases_of_more_keys_than_one_query_takes(store):
    keys = [f"key-{i:05d}" for i in range(KEYS_PER_QUERY * 2 + 7)]
    with store.session() as s:  # one transaction for speed; what record() writes, row by row
        s.execute(sa.insert(LedgerEntry), [{"key": k, "phase": INTENT if i % 3 else "created", "data": {}, "at": T0}
                                           for i, k in enumerate(keys)])
        s.commit()
    last = store.last_phases(keys + ["missing"])
    assert len(last) == len(keys) and sum(p == INTENT for p in last.values()) == len(keys) - (len(keys) + 2) // 3


def test_concurrent_writers_from_several_processes(store, url, tmp_path):
    """4 processes × 2 threads × 25 entries, all at once: none lost, each writer's own order kept."""
    store.open()  # migrated before: the writers race on entries, not on the schema
    setup = ("import threading\nfrom store import Store, StoreLedger\n"
             "ledger = StoreLedger(Store(sys.argv[2].split('|')[0]).open())\nproc = sys.argv[2].split('|')[1]")
    code = ("def write(t):\n"
            "    for i in range(25):\n"
            "        ledger.record(f'{proc}-{t}-{i}', 'intent', {'i': i})\n"
            "        if i % 2 == 0:\n"
            "            ledger.record(f'{proc}-{t}-{i}', 'created', {'i': i})\n"
            "threads = [threading.Thread(target=write, args=(t,)) for t in range(2)]\n"
            "[t.start() for t in threads]\n[t.join() for t in threads]\n")
    results = run_children(setup, code, [f"{url}|p{n}" for n in range(4)], tmp_path / "go")
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    ledger = StoreLedger(store)
    entries = ledger.entries()
    assert len(entries) == 4 * 2 * (25 + 13)
    for writer in (f"p{n}-{t}" for n in range(4) for t in range(2)):
        mine = [(e["key"], e["phase"]) for e in entries if e["key"].startswith(writer + "-")]
        expected = [(f"{writer}-{i}", p) for i in range(25) for p in (["intent", "created"] if i % 2 == 0
                                                                       else ["intent"])]
        assert mine == expected
    keys = [f"p{n}-{t}-{i}" for n in range(4) for t in range(2) for i in range(25)]
    assert ledger.unresolved(keys) == {k for k in keys if int(k.rsplit("-", 1)[1]) % 2}


# --- decision log and read model --------------------------------------------------------------------

def test_decision_log_is_idempotent_and_ordered(store):
    store.record_service(ServiceRecord(service="svc", events=[ev(1), ev(2), ev(3)], status=status("svc")))
    # A retried write (at least once) overlaps the last one: same seq, one row; the first text stays.
    store.record_service(ServiceRecord(service="svc", events=[ev(2, "again"), ev(3), ev(4)], status=status("svc")))
    store.record_service(ServiceRecord(service="svc", events=[ev(4)], status=status("svc")))
    store.record_service(ServiceRecord(service="other", events=[ev(1, "theirs")], status=status("other")))
    log = store.events("svc")
    assert [(e.seq, e.message) for e in log] == [(1, "decision 1"), (2, "decision 2"), (3, "decision 3"),
                                                (4, "decision 4")]
    assert log[0] == ev(1) and log[0].at.tzinfo == timezone.utc
    assert [e.message for e in store.events("other")] == ["theirs"]
    assert store.events("nobody") == []
    # since (inclusive) and limit (the latest N)
    assert [e.seq for e in store.events("svc", since=T0 + timedelta(minutes=2))] == [2, 3, 4]
    assert [e.seq for e in store.events("svc", limit=2)] == [3, 4]
    assert [e.seq for e in store.events("svc", since=T0 + timedelta(minutes=2), limit=1)] == [4]


def test_a_service_applied_again_is_a_new_run_numbered_from_one(store):
    store.record_service(ServiceRecord(service="svc", events=[ev(1, "first run"), ev(2, "stopped")],
                                       status=status("svc", "terminated")))
    later = T0 + timedelta(days=1)
    store.record_service(ServiceRecord(
        service="svc", events=[Event(at=later, kind="apply", message="second run", seq=1)],
        status=status("svc", submitted_at=later)))
    assert [(e.seq, e.message) for e in store.events("svc")] == [(1, "first run"), (2, "stopped"), (1, "second run")]


def test_times_in_other_zones_are_stored_as_the_same_instant(store):
    paris = timezone(timedelta(hours=1))
    at = datetime(2026, 11, 29, 4, 12, 30, 123000, tzinfo=paris)
    store.record_service(ServiceRecord(service="svc", events=[Event(at=at, kind="scale", message="m", seq=1)],
                                       status=status("svc", submitted_at=T0.astimezone(paris))))
    (e,) = store.events("svc")
    assert e.at == at and e.at.utcoffset() == timedelta(0)
    assert store.events("svc", since=datetime(2026, 11, 29, 3, 12, 30, 123000, tzinfo=timezone.utc)) == [e]


def test_read_model_keeps_one_row_per_service_with_its_latest_view(store):
    store.record_service(ServiceRecord(service="b", status=status("b")))
    store.record_service(ServiceRecord(service="a", status=status("a", "provisioning")))
    ((_, first_at),) = [(s, at) for s, at in store.statuses() if s.name == "a"]
    store.record_service(ServiceRecord(service="a", status=status("a", "running", deployment=2)))
    rows = store.statuses()
    assert [s.name for s, _ in rows] == ["a", "b"]
    (a, at), _ = rows
    assert a == status("a", "running", deployment=2) and at >= first_at and at.tzinfo == timezone.utc
    assert [s.name for s, _ in store.statuses("b")] == ["b"] and store.statuses("c") == []
    with store.engine.connect() as c:
        assert c.execute(sa.text("SELECT status, deployment FROM service_status WHERE name = 'a'")).one() == (
            "running", 2)


# --- the workflow writes through the real local activity ----------------------------------------------

@pytest.mark.asyncio(loop_scope="session")
async def test_service_workflow_records_its_decisions_and_ps_row(ts_env, tmp_path):
    store = Store(f"sqlite:///{tmp_path}/store.db")
    fake = FakeCloud()
    fake.queue = f"tq-{uuid.uuid4()}"
    activities = [a for a in fake.activities() if a.__name__ != "record"] + [StoreActivities(store).record_service]
    async with Worker(ts_env.client, task_queue=fake.queue, workflows=[ServiceRunWorkflow, ReplicaWorkflow],
                      activities=activities), \
            Worker(ts_env.client, task_queue=backend_queue(fake.queue, "local"), activities=fake.replica_activities()):
        config = load_config_text(SERVICE).config
        handle = await ts_env.client.start_workflow(
            ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name="svc-store", config=config)),
            id=service_workflow_id("svc-store"), task_queue=fake.queue)

        async def row_running():  # the read model follows the workflow: its replica came up
            rows = await asyncio.to_thread(store.statuses, "svc-store")
            return rows and rows[0][0].status == "running" and rows[0][0].groups[0].replicas[0].ready
        await eventually(row_running)
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
        live = await handle.query(ServiceRunWorkflow.events)
    logged = store.events("svc-store")
    # Every decision once, as the workflow keeps them (times aside: a query of a closed run replays it, and the
    # time-skipping server may stamp that replay's tasks differently).
    assert [e.seq for e in logged] == list(range(1, len(logged) + 1))
    assert [(e.seq, e.kind, e.group, e.message) for e in logged] == [(e.seq, e.kind, e.group, e.message) for e in live]
    assert [e.at for e in logged] == sorted(e.at for e in logged)
    assert logged[0].message.startswith("service submitted") and logged[-1].message == "service stopped"
    ((row, _),) = store.statuses("svc-store")
    assert row.status == "terminated"
    store.close()


# --- the CLI: events from the store, ps from the read model when the control plane is down -------------

@pytest.fixture
def cli_home(tmp_path, monkeypatch):
    """A durastack home with a store and no control plane (a free port)."""
    monkeypatch.setenv("DURASTACK_HOME", str(tmp_path))
    monkeypatch.setenv("DURASTACK_TEMPORAL_PORT", str(free_ports(1)[0]))
    monkeypatch.delenv("DURASTACK_TEMPORAL_ADDRESS", raising=False)
    monkeypatch.delenv("DURASTACK_DATABASE_URL", raising=False)
    return tmp_path


def cli(*args: str):
    from cli.main import app

    return CliRunner().invoke(app, list(args))


def test_events_reads_the_whole_log_from_the_store(cli_home):
    store = Store(f"sqlite:///{cli_home}/store.db")
    events = [ev(n, f"decision {n}") for n in range(1, 301)]  # more than the workflow keeps (200)
    store.record_service(ServiceRecord(service="svc", events=events, status=status("svc")))
    store.close()
    result = cli("events", "svc")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 300 and lines[0].endswith("decision 1") and lines[-1].endswith("decision 300")
    assert lines[0] == "2026-11-29 03:01:00 scale    group=llm decision 1"
    result = cli("events", "svc", "--since", "2026-11-29T07:00", "--limit", "2", "--json")
    assert [e["seq"] for e in json.loads(result.stdout)] == [299, 300]
    assert cli("events", "svc", "--since", "yesterday-ish").exit_code == 1
    result = cli("events", "svc", "--since", "2026-11-30")  # nothing that recent: empty, not a question to Temporal
    assert (result.exit_code, result.stdout) == (0, "")


def test_since_takes_a_time_or_an_age():
    from cli.db import parse_since

    assert parse_since("2026-11-29T03:12") == datetime(2026, 11, 29, 3, 12, tzinfo=timezone.utc)
    assert parse_since("2026-11-29T04:12+01:00") == datetime(2026, 11, 29, 3, 12, tzinfo=timezone.utc)
    assert parse_since("90m", now=T0) == T0 - timedelta(minutes=90) and parse_since(None) is None
    with pytest.raises(ValueError):
        parse_since("soon")


def test_events_fall_back_to_the_control_plane_when_the_store_has_none(cli_home):
    result = cli("events", "svc")
    assert result.exit_code == 2 and "control plane not running" in result.stderr


def test_ps_shows_the_read_model_marked_stale_when_the_control_plane_is_down(cli_home):
    store = Store(f"sqlite:///{cli_home}/store.db")
    store.record_service(ServiceRecord(service="live-one", status=status("live-one")))
    store.record_service(ServiceRecord(service="gone", status=status("gone", "terminated")))
    store.close()
    result = cli("ps")
    assert result.exit_code == 2 and "control plane not running" in result.stderr
    assert "STALE" in result.stdout and "live-one as of" in result.stdout and "gone" not in result.stdout
    result = cli("ps", "gone", "--json")
    payload = json.loads(result.stdout)
    assert payload["name"] == "gone" and payload["status"] == "terminated" and payload["stale"] is True
    assert datetime.fromisoformat(payload["as_of"]) <= datetime.now(timezone.utc)
    assert cli("ps", "nobody").stdout == ""


def test_db_commands(cli_home):
    result = cli("db", "current", "--check")
    assert result.exit_code == 1 and "(empty) (latest 0002)" in result.stdout
    assert not (cli_home / "store.db").exists()  # reading never creates it
    assert cli("db", "upgrade").stdout.strip() == f"{cli_home}/store.db: (empty) → 0002"
    assert cli("db", "upgrade").stdout.strip() == f"{cli_home}/store.db: at 0002 already"
    assert cli("db", "current", "--check").exit_code == 0
