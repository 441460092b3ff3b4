"""Worker Versioning on the dev server: during an upgrade, old and new main workers poll side by side, and once the
new build is current no workflow task goes to the old one (it could not replay what the new one recorded)."""

from __future__ import annotations

import contextlib
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

import worker as worker_module
from connect.deployment import become_current, code_build_id, deployment_config, deployment_version
from models.messages import ApplyRequest, ScaleRequest
from models.state import ServiceState
from models.settings import Settings
from tests.fakes.changed_workflow import PatchedInV2
from tests.fakes.cloud import FakeCloud
from tests.conftest import eventually
from tests.test_service_workflow import deployments, rolling_config, status_of, wait_ready
from rules import names
from workflows.reaper import ReaperWorkflow
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id



def _settings(queue: str, build: str) -> Settings:
    return Settings.from_env({"DURASTACK_TASK_QUEUE": queue, "DURASTACK_BUILD_ID": build})


def _main(client: Client, fake: FakeCloud, settings: Settings, workflows: list) -> Worker:
    return worker_module.main_worker(client, settings.task_queue, fake.activities(), deployment_config(settings),
                                     workflows)


async def _tasks(handle) -> list[tuple[datetime, str, str]]:
    """When each workflow task completed, on which build; and each failed task's cause."""
    out = []
    async for e in handle.fetch_history_events():
        at = e.event_time.ToDatetime().replace(tzinfo=timezone.utc)
        if e.HasField("workflow_task_completed_event_attributes"):
            out.append((at, e.workflow_task_completed_event_attributes.deployment_version.build_id, ""))
        if e.HasField("workflow_task_failed_event_attributes"):
            out.append((at, "", e.workflow_task_failed_event_attributes.failure.message))
    return out


@pytest.mark.asyncio(loop_scope="session")
async def test_a_new_build_made_current_mid_rollout_takes_every_workflow_task(dev_env):
    """Old and new main workers poll side by side, as in a rolling upgrade, and the switch comes while a rollout
    runs: from then on every workflow task is the new build's (the old one, which cannot replay what the new one
    records, gets none), and the rollout ends on it."""
    client, queue, fake = dev_env.client, f"tq-{uuid.uuid4().hex[:12]}", FakeCloud()
    fake.queue = queue
    old, new = _settings(queue, "v1"), _settings(queue, "v2")
    name = "svc-upgrade"
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(Worker(client, task_queue=names.backend_queue(queue, "local"),
                                               activities=fake.replica_activities()))  # unversioned
        await stack.enter_async_context(_main(client, fake, old, [ServiceRunWorkflow, ReplicaWorkflow,
                                                                  ReaperWorkflow]))
        assert await become_current(client, deployment_version(old))
        handle = await client.start_workflow(
            ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=rolling_config(name))),
            id=service_workflow_id(name), task_queue=queue)
        await wait_ready(handle, {"a": [0, 1], "b": [2]})

        # A rollout whose new replicas take a few seconds to load, one at a time.
        fake.load_default, fake.load_poll = timedelta(seconds=2), timedelta(seconds=0.5)
        await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=rolling_config(name, "serve a v2")))
        await eventually(lambda: _rolling(handle))
        # The upgrade: a new build starts beside the old one, which goes on polling, and becomes current.
        await stack.enter_async_context(_main(client, fake, new, [PatchedInV2, ReplicaWorkflow, ReaperWorkflow]))
        assert await become_current(client, deployment_version(new))
        switched = datetime.now(timezone.utc)
        assert await _rolling(handle)  # the switch came mid-rollout
        # The old build restarting mid-upgrade does not take the runs back.
        assert not await become_current(client, deployment_version(old))

        status = await eventually(lambda: _rolled(handle), timeout=60)
        assert [dep for _, dep in deployments(status)["a"]] == [1, 1] and deployments(status)["b"] == [(2, 1)]
        await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="b", count=1))  # the v2 patch
        after = [(build, failure) for at, build, failure in await _tasks(handle) if at > switched]
        assert after and all(build == "v2" and not failure for build, failure in after), after
        assert {build for at, build, _ in await _tasks(handle) if at <= switched} == {"v1"}
        assert await (await handle.describe()).memo_value("build", default=None) == "v2"
        for r in status.groups[0].replicas:  # the rollout's replicas: the second started after the switch
            if r.status == "running":
                tasks = await _tasks(client.get_workflow_handle(f"service/{name}/a/r{r.replica}-s{r.submission}"))
                assert tasks and not any(failure for _, _, failure in tasks), tasks
        await handle.signal(ServiceRunWorkflow.stop)
        assert await handle.result() == "stopped"


async def _rolling(handle) -> bool:
    return any(g.rollout == "rolling" for g in (await status_of(handle)).groups)


async def _rolled(handle):
    status = await status_of(handle)
    d = deployments(status)
    return status if [dep for _, dep in d["a"]] == [1, 1] and not any(g.rollout for g in status.groups) else None


def test_the_build_is_a_hash_of_the_code_unless_given(tmp_path):
    (tmp_path / "workflows").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "workflows" / "a.py").write_text("x = 1\n")
    first = code_build_id(tmp_path)
    (tmp_path / "tests" / "t.py").write_text("y = 1\n")  # tests are not shipped
    assert code_build_id(tmp_path) == first
    (tmp_path / "workflows" / "a.py").write_text("x = 2\n")
    assert code_build_id(tmp_path) != first
    assert deployment_version(_settings("q", "abc")).build_id == "abc"
    assert deployment_config(Settings.from_env({"DURASTACK_WORKER_VERSIONING": "off"})) is None
