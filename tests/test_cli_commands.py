"""The top-level commands: each group's module is imported only when one of its commands runs (cli/main.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.service import RPCError, RPCStatusCode

from cli.main import GROUPS, group_commands

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", sorted(GROUPS))
def test_each_group_registers_the_commands_listed_for_it(module):
    assert sorted(group_commands(module).commands) == sorted(GROUPS[module])


def test_a_command_imports_its_own_group_alone():
    code = ("import json, sys; from cli.main import app, GROUPS; app(['apply', '--help'], standalone_mode=False); "
            "print(json.dumps([m for m in sys.modules if m in GROUPS or m == 'aiohttp']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == ["cli.service"]  # no codec server (aiohttp), no store, …


def test_ps_shows_a_service_that_does_not_answer_as_the_store_saw_it_and_the_others_live(tmp_path, monkeypatch,
                                                                                        capsys):
    import asyncio

    from cli import inspect
    from cli.client import ControlPlaneDown
    from models.messages import ServiceRecord
    from models.settings import Settings
    from store import Store
    from tests.test_store import status

    monkeypatch.setenv("DURASTACK_HOME", str(tmp_path))
    settings = Settings.from_env()
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.record_service(ServiceRecord(service="stuck", status=status("stuck", deployment=3)))
    store.close()

    async def live_status(_client, name):
        if name == "stuck":
            raise ControlPlaneDown("the worker does not answer (query failed)")
        return status(name)

    async def no_client(_settings):
        return None

    async def names(_client):
        return ["live", "stuck"]

    monkeypatch.setattr(inspect, "connect", no_client)
    monkeypatch.setattr(inspect, "_running_services", names)
    monkeypatch.setattr(inspect, "live_status", live_status)
    asyncio.run(inspect._ps(settings, None, False, True, False))
    shown = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
    assert shown["live"]["status"] == "running"
    assert shown["stuck"]["status"] == "not answering" and shown["stuck"]["deployment"] == 3

    async def down(_client, name):  # nothing answers: the control plane is down, ps says so (exit 2)
        raise ControlPlaneDown("control plane error")

    monkeypatch.setattr(inspect, "live_status", down)
    with pytest.raises(ControlPlaneDown):
        asyncio.run(inspect._ps(settings, None, False, True, False))


def test_exec_names_the_running_replicas_when_the_one_asked_for_has_ended(capfd):
    import typer

    from cli.inspect import _replica
    from tests.test_store import status

    svc = status("svc")
    old = svc.groups[0].replicas[0]
    svc.groups[0].replicas = [old.model_copy(update={"replica": 1, "status": "terminated"}),
                              old.model_copy(update={"replica": 2}), old.model_copy(update={"replica": 3})]
    assert _replica(svc, 1).replica == 1  # `logs` still reads an ended replica
    assert _replica(svc, None, running=True).replica == 2  # the first running one
    with pytest.raises(typer.Exit) as refused:
        _replica(svc, 1, running=True)
    assert refused.value.exit_code == 1
    assert "svc: replica 1 is terminated; running replicas: 2, 3" in capfd.readouterr().err


def _rpc_error(detail) -> RPCError:
    from google.protobuf.any_pb2 import Any
    from temporalio.api.common.v1 import GrpcStatus

    packed = Any()
    packed.Pack(detail)
    status = GrpcStatus(code=RPCStatusCode.FAILED_PRECONDITION, message="refused", details=[packed])
    return RPCError("refused", RPCStatusCode.FAILED_PRECONDITION, status.SerializeToString())


def test_an_update_the_server_was_not_ready_for_is_asked_again_and_no_other_failure_is():
    """WorkflowNotReady (the task that was to take the update failed, e.g. at a continue-as-new): the update was
    not delivered, so `scale`, `apply` and `rollback` ask again; any other refusal goes to the user at once."""
    import asyncio

    from temporalio.api.errordetails.v1 import NamespaceNotFoundFailure, WorkflowNotReadyFailure

    from cli.control import deliver

    calls = []

    def update(failures: list):
        async def once():
            calls.append(1)
            if failures:
                raise failures.pop(0)
            return "done"
        return lambda: once()

    assert asyncio.run(deliver(update([_rpc_error(WorkflowNotReadyFailure())] * 2))) == "done"
    assert len(calls) == 3
    with pytest.raises(RPCError) as refused:
        asyncio.run(deliver(update([_rpc_error(NamespaceNotFoundFailure())])))
    assert refused.value.message == "refused" and len(calls) == 4
    with pytest.raises(RPCError):  # patience ends: the last answer is the user's
        asyncio.run(deliver(update([_rpc_error(WorkflowNotReadyFailure())] * 100), patience=0.5))
    assert 5 < len(calls) < 104
