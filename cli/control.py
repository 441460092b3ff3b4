"""What the commands that talk to a running service share: its live status, its handle, its addresses.

Exit codes: 0 ok, 1 user error, 2 control plane down.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Awaitable, Callable, Optional, TypeVar
from urllib.parse import quote

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from cli.client import ControlPlaneDown, connect
from cli.console import user_error
from models.views import ServiceStatus
from models.settings import Settings
from workflows.service import ServiceRunWorkflow, service_workflow_id

T = TypeVar("T")
RPC = timedelta(seconds=5)
QUERY_PATIENCE = 25.0  # seconds `ps` and friends keep asking a service that its worker may be replacing


def service_url(settings: Settings, name: str) -> str:
    return f"{settings.gateway_url}/services/{name}/"


def ui_link(settings: Settings, name: str) -> str:
    return f"{settings.ui_url}/namespaces/{settings.namespace}/workflows/{quote(service_workflow_id(name), safe='')}"


async def live_status(client: Client, name: str) -> Optional[ServiceStatus]:
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
    return await ask(handle, ServiceRunWorkflow.status)


async def last_run(client: Client, name: str) -> Optional[str]:
    """The id of the service's latest run, running or closed; None if it never ran."""
    try:
        return (await client.get_workflow_handle(service_workflow_id(name)).describe(rpc_timeout=RPC)).run_id
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return None
        raise ControlPlaneDown(f"control plane error: {e}") from e


async def ask(handle: WorkflowHandle, query):
    """A query of the service's workflow, asked again while QUERY_PATIENCE lasts: a query can meet a
    continue-as-new hop, and right after a worker died the server still hands the service's queries to that
    worker's sticky queue until it stops counting on it (about 10 s), then to the worker that replaced it."""
    deadline = time.monotonic() + QUERY_PATIENCE
    while True:
        try:
            return await handle.query(query, rpc_timeout=RPC)
        except RPCError as e:
            if time.monotonic() >= deadline:
                raise ControlPlaneDown(f"the worker does not answer ({e.message}); is `durastack server` up?") from e
            await asyncio.sleep(0.2)


def not_ready(e: RPCError) -> bool:
    """The server's WorkflowNotReady: the workflow task that was to take an update failed (one meeting the run's
    continue-as-new does); the update was not delivered, so asking again is safe."""
    return any(d.type_url.endswith("WorkflowNotReadyFailure") for d in e.grpc_status.details)


async def deliver(update: Callable[[], Awaitable[T]], patience: float = QUERY_PATIENCE) -> T:
    """``update()``, asked again while the server answers WorkflowNotReady and ``patience`` lasts."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return await update()
        except RPCError as e:
            if not not_ready(e) or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def running(settings: Settings, name: str):
    """A client and the handle of the running service ``name``; exit 1 when there is none."""
    client = await connect(settings)
    if await live_status(client, name) is None:
        raise user_error(f"no running service named {name!r}")
    return client, client.get_workflow_handle(service_workflow_id(name))


async def running_status(settings: Settings, name: str) -> ServiceStatus:
    status = await live_status(await connect(settings), name)
    if status is None:
        raise user_error(f"no running service named {name!r}")
    return status
