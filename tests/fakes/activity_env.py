"""What a replica's activities use of the world, faked for activity-level tests (``ActivityEnvironment``):
a Temporal client that records signals and answers ``describe``, and a gateway that records (un)registrations."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Optional

from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from models.messages import AddressAnswer, PlacementRefusal


class FakeHandle:
    def __init__(self, client: "FakeClient", workflow_id: str):
        self.client, self.id = client, workflow_id

    async def signal(self, method: Any, arg: Any) -> None:
        if self.client.signals_fail:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        placed = getattr(arg, "placement", None) is not None
        if placed and self.client.lose_placed > 0:  # sent, and lost on the way
            self.client.lose_placed -= 1
            return
        self.client.signals.append((self.id, getattr(method, "__name__", method), arg))

    async def query(self, name: str, arg: Any, result_type: Any = None) -> Any:
        """The service's ``addresses``: whether a report of the asking replica's placement reached it."""
        if self.client.signals_fail:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        assert name == "addresses", name
        placed = any(getattr(u, "placement", None) is not None and (u.replica_num, u.submission_num) ==
                     (arg.replica_num, arg.submission_num) for _, _, u in self.client.signals)
        return AddressAnswer(placed=placed, missing={} if placed else {k: "not placed" for k in arg.keys})

    async def describe(self) -> Any:
        status = self.client.statuses.get(self.id, WorkflowExecutionStatus.RUNNING)
        if status is None:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        return SimpleNamespace(status=status)


class FakeClient:
    """What the activities use of a Temporal client: signal the service, describe a replica's workflow."""

    def __init__(self) -> None:
        self.signals: list[tuple[str, str, Any]] = []
        self.statuses: dict[str, Optional[WorkflowExecutionStatus]] = {}
        self.signals_fail = False
        self.lose_placed = 0  # placement reports lost on the way

    def get_workflow_handle(self, workflow_id: str) -> FakeHandle:
        return FakeHandle(self, workflow_id)

    def reports(self) -> list[tuple[int, str, bool, bool]]:
        return [(u.seq, u.status, u.ready, u.registered) for _, name, u in self.signals if name == "replica_changed"]

    def events(self) -> list[str]:
        """The messages sent to the services' logs (``record_event``)."""
        return [e.message for _, name, e in self.signals if name == "record_event"]


class FakeGateway:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.routed: dict[str, str] = {}

    async def register(self, service: str, replica_id: str, group: str, address: str) -> None:
        self.calls.append(("register", replica_id, time.monotonic()))
        self.routed[replica_id] = address

    async def unregister(self, service: str, replica_id: str) -> None:
        self.calls.append(("unregister", replica_id, time.monotonic()))
        self.routed.pop(replica_id, None)

    async def drained(self) -> bool:
        return True


def activity_env(client: FakeClient, heartbeat_timeout: float = 30.0) -> ActivityEnvironment:
    env = ActivityEnvironment(client=client)
    env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=heartbeat_timeout))
    return env


def refusal_of(error: ApplicationError) -> PlacementRefusal:
    """The typed details of a launch's PlacementRefusal error (as the workflow reads them)."""
    assert error.type == "NoCapacity" and error.non_retryable
    return PlacementRefusal.model_validate(error.details[0])


async def app_server():
    """A stand-in for a cloud instance's app (the fake clouds run no user-data): 200 to any request; and its address."""
    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
