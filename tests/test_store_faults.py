"""Store faults under a running service: visible in `ps` and `events`, recovered without a restart, and
back-filled with no gap in the decision log's seq.

SQLite always; the lost-connection case also on PostgreSQL when DURASTACK_TEST_POSTGRES_URL is set. The
service tries a failing store again every second here (``store_retry_seconds``; 30 s by default).
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from unittest.mock import patch

import pytest
import sqlalchemy as sa
from rich.console import Console
from sqlalchemy.exc import OperationalError
from temporalio.worker import Worker

from activities.store import StoreActivities
from cli.inspect import _events
from cli.render import ps_table, status_json
from models.loader import load_config_text
from models.settings import Settings
from models.messages import ScaleRequest, ServiceRecord
from models.state import ServiceState
from models.views import Event, ServiceStatus
from store.db import Store, head_revision
from tests.conftest import eventually
from tests.fakes.cloud import FakeCloud, fake_cloud_worker
from tests.test_store import _pg_admin, url  # noqa: F401 — `url`: the SQLite / PostgreSQL fixture
from rules.names import backend_queue
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

# Async tests are marked one by one: the store-level tests above are plain functions.
async_test = pytest.mark.asyncio(loop_scope="session")

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
SERVICE = """
type: service
name: {name}
port: 8000
replicas: 1..3
scaling: {{metric: rps, target: 10}}
commands: [serve]
"""


def record(service: str, seqs: list[int]) -> ServiceRecord:
    events = [Event(at=T0, kind="scale", message=f"m{s}", seq=s) for s in seqs]
    status = ServiceStatus(name=service, status="running", deployment=0, auth=True, submitted_at=T0, groups=[])
    return ServiceRecord(service=service, events=events, status=status)


def remove_sqlite(path: Path) -> None:
    for f in path.parent.glob(path.name + "*"):
        f.unlink()


# --- the store on its own ---------------------------------------------------------------------------

def test_a_deleted_sqlite_store_is_made_anew_and_migrated_by_the_next_write(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/store.db")
    assert store.record_service(record("svc", [1, 2])).last_before == 0
    remove_sqlite(tmp_path / "store.db")
    # The same Store object: no restart. The new file knows nothing below seq 3, and says so.
    assert store.record_service(record("svc", [3])).last_before == 0
    assert store.current() == head_revision() and [e.seq for e in store.events("svc")] == [3]
    assert store.record_service(record("svc", [1, 2])).last_before == 0
    assert store.record_service(record("svc", [4])).last_before == 3
    assert [e.seq for e in store.events("svc")] == [1, 2, 3, 4]
    store.close()


def test_an_unavailable_sqlite_store_fails_then_takes_writes_again(tmp_path):
    path = tmp_path / "store.db"
    store = Store(f"sqlite:///{path}")
    store.record_service(record("svc", [1]))
    remove_sqlite(path)
    path.mkdir()  # unavailable even to root: no file can be opened there
    with pytest.raises(OperationalError):
        store.record_service(record("svc", [2]))
    with pytest.raises(OperationalError):  # still failing, and still the same object
        store.record_service(record("svc", [2]))
    path.rmdir()
    assert store.record_service(record("svc", [2])).last_before == 0
    store.close()


def test_a_lost_connection_is_reopened_on_the_next_attempt(url):  # noqa: F811
    if url.startswith("sqlite"):
        pytest.skip("SQLite has no server connection to lose")
    store = Store(url)
    store.record_service(record("svc", [1]))
    with _pg_admin().connect() as admin:  # the server drops every session of that database
        admin.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": sa.make_url(url).database})
    failures = 0
    for _ in range(3):
        try:
            store.record_service(record("svc", [2]))
            break
        except sa.exc.DBAPIError:
            failures += 1
    assert failures <= 1 and [e.seq for e in store.events("svc")] == [1, 2]
    store.close()


# --- under a running service --------------------------------------------------------------------------

async def status_of(handle) -> ServiceStatus:
    # A pass that meets a failing store spends seconds in its local activity's retries, and a query waits for
    # that workflow task: ask until it answers.
    return await eventually(lambda: handle.query(ServiceRunWorkflow.status, rpc_timeout=timedelta(seconds=10)))


def shown(status: ServiceStatus) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(ps_table([status]))
    return console.file.getvalue()


async def wait_recorded(handle, logged) -> ServiceStatus:
    """Until the service says nothing waits; ``logged()`` is then every seq from 1, without a gap."""
    async def done():
        status = await status_of(handle)
        return status if status.unrecorded == 0 and status.store_failing_since is None else None
    status = await eventually(done)
    events = await handle.query(ServiceRunWorkflow.events)
    assert await logged() == list(range(1, events[-1].seq + 1))
    return status


async def outage(env, handle, is_down) -> ServiceStatus:
    """Decisions made while the store fails wait in the service, which says how many and since when."""
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="0", count=2))

    async def failing():
        status = await status_of(handle)
        return status if status.store_failing_since is not None and status.unrecorded >= 1 else None
    status = await eventually(failing)
    assert is_down(status.store_error), status.store_error
    assert "the store is unavailable since" in shown(status) and "not in the store yet" in shown(status)
    assert status_json(status, "u")["unrecorded"] == status.unrecorded
    return status


def cli_settings(env, home: Path, monkeypatch, url: str = "") -> Settings:
    """The CLI's settings: Temporal is ``env``; the store ``url``, or ``home``/store.db."""
    monkeypatch.setenv("DURASTACK_HOME", str(home))
    monkeypatch.setenv("DURASTACK_TEMPORAL_ADDRESS", env.client.service_client.config.target_host)
    if url and not url.startswith("sqlite"):
        monkeypatch.setenv("DURASTACK_DATABASE_URL", url)
    else:
        monkeypatch.delenv("DURASTACK_DATABASE_URL", raising=False)
    return Settings.from_env()


@pytest.fixture
async def cloud(ts_env):
    async for fake in fake_cloud_worker(ts_env):
        yield fake


@async_test
async def test_read_only_store_events_wait_and_are_back_filled(ts_env, cloud, tmp_path, monkeypatch, capsys):
    name = "svc-store-ro"
    state = ServiceState(name=name, config=load_config_text(SERVICE.format(name=name)).config)
    inp = ServiceRunInput(state=state, store_retry_seconds=1)
    handle = await ts_env.client.start_workflow(ServiceRunWorkflow.run, inp, id=service_workflow_id(name),
                                                task_queue=cloud.queue)

    async def logged():
        return sorted(cloud.log_by_seq)
    await eventually(lambda: _true(len(cloud.running()) == 1))
    await wait_recorded(handle, logged)

    cloud.store_down = True
    await outage(ts_env, handle, lambda error: "readonly" in error)
    # The store itself reads fine here, but is behind: `durastack events` adds what waits, and says so.
    settings = cli_settings(ts_env, tmp_path, monkeypatch)
    with patch("cli.db.stored_events", lambda *_: ([e for _, e in sorted(cloud.log_by_seq.items())], "")):
        capsys.readouterr()
        await _events(settings, name, as_json=True)
    printed = capsys.readouterr()
    assert "the store is unavailable since" in printed.err and "shown here from the service's workflow" in printed.err
    live = await handle.query(ServiceRunWorkflow.events)
    assert [e["seq"] for e in json.loads(printed.out)] == list(range(1, live[-1].seq + 1))
    tries = cloud.record_calls  # each try is up to 3 attempts; more than one try, with nothing else to do
    await eventually(lambda: _true(cloud.record_calls > tries + 3))
    cloud.store_down = False
    await wait_recorded(handle, logged)
    assert cloud.rows[name].unrecorded == 0 and cloud.rows[name].store_failing_since is None
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


class Fault:
    """Takes the store away under a running service, and gives it back."""

    def __init__(self, url: str, home: Path):
        self.url, self.home = url, home
        self.sqlite = Path(sa.make_url(url).database) if url.startswith("sqlite") else None

    def error(self, message: str) -> bool:
        expected = "unable to open database file" if self.sqlite else "read-only transaction"
        return expected in message

    def _read_only(self, on: bool) -> None:
        database = sa.make_url(self.url).database
        with _pg_admin().connect() as admin:  # new sessions read-only (or not), and every open one dropped
            admin.execute(sa.text(f'ALTER DATABASE "{database}" SET default_transaction_read_only = '
                                  f'{"on" if on else "off"}'))
            admin.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                  "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": database})

    def take(self) -> None:
        if self.sqlite is None:
            self._read_only(True)
            return
        remove_sqlite(self.sqlite)
        self.sqlite.mkdir()  # deleted, and nothing can be made in its place yet (even by root)

    def give_back(self) -> None:
        if self.sqlite is None:
            self._read_only(False)
        else:
            shutil.rmtree(self.sqlite)  # the worker's next try makes a new file


@async_test
async def test_store_lost_under_a_running_service_is_back_filled_without_a_restart(  # noqa: F811
        ts_env, url, tmp_path, monkeypatch, capsys):
    # SQLite: the file is deleted (and cannot be made anew for a while); PostgreSQL: the database turns
    # read-only and drops its sessions. Either way the worker is not restarted.
    store, fault = Store(url), Fault(url, tmp_path)
    fake = FakeCloud()
    fake.queue = f"tq-{uuid.uuid4()}"
    activities = [a for a in fake.activities() if a.__name__ != "record"] + [StoreActivities(store).record_service]
    name = "svc-store-gone"
    async with Worker(ts_env.client, task_queue=fake.queue, workflows=[ServiceRunWorkflow, ReplicaWorkflow],
                      activities=activities), \
            Worker(ts_env.client, task_queue=backend_queue(fake.queue, "local"), activities=fake.replica_activities()):
        state = ServiceState(name=name, config=load_config_text(SERVICE.format(name=name)).config)
        inp = ServiceRunInput(state=state, store_retry_seconds=1)
        handle = await ts_env.client.start_workflow(ServiceRunWorkflow.run, inp, id=service_workflow_id(name),
                                                    task_queue=fake.queue)

        async def logged():
            return [e.seq for e in await asyncio.to_thread(store.events, name)]
        await eventually(lambda: _true(len(fake.running()) == 1))
        await wait_recorded(handle, logged)

        fault.take()
        try:
            await outage(ts_env, handle, fault.error)
            # `durastack events` says what is wrong and shows every decision: from the workflow alone while
            # the store cannot be read (SQLite), or the store's plus what waits (PostgreSQL, readable).
            settings = cli_settings(ts_env, tmp_path, monkeypatch, url)
            capsys.readouterr()
            await _events(settings, name, as_json=True)
            printed = capsys.readouterr()
            said = "unreadable" if fault.sqlite else "the store is unavailable since"
            assert said in printed.err and "workflow" in printed.err, printed.err
            live = await handle.query(ServiceRunWorkflow.events)
            assert [e["seq"] for e in json.loads(printed.out)] == [e.seq for e in live]
        finally:
            fault.give_back()
        # The store took writes again on the worker's next try; the service refilled what the store lacked.
        status = await wait_recorded(handle, logged)
        assert "the store is" not in shown(status)
        ((row, _),) = store.statuses(name)
        assert row.unrecorded == 0 and store.current() == head_revision()
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
    store.close()


async def _true(value: bool):
    return value or None
