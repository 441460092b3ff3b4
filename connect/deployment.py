"""Worker Versioning: the main workers are one Temporal Worker Deployment, and the newest build takes every
workflow task.

Without it, old and new main workers poll one task queue side by side during an upgrade, and a service's
workflow task may go to either: an old worker then replays a run that a new one already moved past a
``workflow.patched`` change, fails it as non-deterministic, and retries with a growing back-off until the old
worker is gone. With it, each main worker polls as ``<task queue>/<build id>``, and workflow tasks go to the
deployment's *current* build only. A main worker makes its build current when it starts, unless a newer build has
polled already (an old worker restarting mid-upgrade must not take the runs back); from then on the older builds
get no workflow task. Every workflow is auto-upgrade: a run moves to the current build at its next task, which the
patches make safe (CONTRIBUTING.md).

Only the workflows' queue is versioned. The backends' queues (``<queue>-<backend>``) carry activities alone, which
never replay: their workers, cloud workers in their own deployment included, stay unversioned, so an upgrade of the
main workers never waits for them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Optional

from temporalio.api.enums.v1 import RoutingConfigUpdateState
from temporalio.api.workflowservice.v1 import (DescribeWorkerDeploymentRequest,
                                               SetWorkerDeploymentCurrentVersionRequest)
from temporalio.client import Client
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import WorkerDeploymentConfig

from models.settings import Settings

log = logging.getLogger("durastack.deployment")
ROOT = Path(__file__).resolve().parent.parent
# What a worker runs: every Python source of durastack but its tests and benchmarks.
NOT_SHIPPED = ("tests", "bench")
# A worker's build appears in its deployment once the worker has polled, and a new current build reaches every task
# queue of it: each within a second or two.
REGISTERED_SECONDS = 60.0
PROPAGATING = RoutingConfigUpdateState.ROUTING_CONFIG_UPDATE_STATE_IN_PROGRESS


class VersioningUnavailable(RuntimeError):
    """The Temporal server has no Worker Deployments (an older one, or the feature off)."""


def code_build_id(root: Path = ROOT) -> str:
    """A hash of durastack's own Python sources: the same code gives the same build, any change a new one."""
    sources = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and not (folder == str(root) and d in NOT_SHIPPED)]
        sources += [Path(folder, f) for f in files if f.endswith(".py")]
    digest = hashlib.sha256()
    for path in sorted(sources):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return "code-" + digest.hexdigest()[:16]


def deployment_version(settings: Settings) -> WorkerDeploymentVersion:
    return WorkerDeploymentVersion(deployment_name=settings.task_queue, build_id=settings.build_id or code_build_id())


def deployment_config(settings: Settings) -> Optional[WorkerDeploymentConfig]:
    """The main worker's: its build of the deployment, every workflow auto-upgrade; None with versioning off."""
    if not settings.worker_versioning:
        return None
    return WorkerDeploymentConfig(version=deployment_version(settings), use_worker_versioning=True,
                                  default_versioning_behavior=VersioningBehavior.AUTO_UPGRADE)


async def become_current(client: Client, version: WorkerDeploymentVersion, identity: str = "") -> bool:
    """Make ``version`` its deployment's current build once its worker has polled, unless a newer build has polled
    already; whether it is current now (every task queue of the deployment routing to it). Raises
    ``VersioningUnavailable`` when the server has no deployments."""
    deadline = time.monotonic() + REGISTERED_SECONDS
    while True:
        info = await _describe(client, version.deployment_name)
        created = {v.deployment_version.build_id: v.create_time.ToDatetime()
                   for v in (info.worker_deployment_info.version_summaries if info else [])}
        if version.build_id not in created:
            if time.monotonic() > deadline:
                raise VersioningUnavailable(f"build {version.build_id} did not appear in Worker Deployment "
                                            f"{version.deployment_name} within {REGISTERED_SECONDS:g} s")
            await asyncio.sleep(0.2)
            continue
        current = info.worker_deployment_info.routing_config.current_deployment_version.build_id
        if current == version.build_id:
            if info.worker_deployment_info.routing_config_update_state != PROPAGATING or time.monotonic() > deadline:
                return True
            await asyncio.sleep(0.2)  # until every task queue routes to it: before, an old build may get a task
            continue
        newer = sorted(b for b, at in created.items() if at > created[version.build_id])
        if newer:
            log.warning("build %s of %s is not made current: newer builds polled already (%s); it only finishes "
                        "what it has", version.build_id, version.deployment_name, ", ".join(newer))
            return False
        try:
            await client.workflow_service.set_worker_deployment_current_version(
                SetWorkerDeploymentCurrentVersionRequest(
                    namespace=client.namespace, deployment_name=version.deployment_name, build_id=version.build_id,
                    conflict_token=info.conflict_token, identity=identity or client.identity))
        except RPCError as e:  # another worker changed the deployment meanwhile: look again
            if e.status not in (RPCStatusCode.FAILED_PRECONDITION, RPCStatusCode.ABORTED) or \
                    time.monotonic() > deadline:
                raise
            continue
        log.info("build %s is now current in %s (was %s)", version.build_id, version.deployment_name,
                 current or "unversioned")


async def _describe(client: Client, name: str):
    """The deployment, or None before its first worker has polled."""
    try:
        return await client.workflow_service.describe_worker_deployment(DescribeWorkerDeploymentRequest(
            namespace=client.namespace, deployment_name=name))
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return None
        if e.status in (RPCStatusCode.UNIMPLEMENTED, RPCStatusCode.FAILED_PRECONDITION, RPCStatusCode.PERMISSION_DENIED):
            raise VersioningUnavailable(f"{e.message} (set DURASTACK_WORKER_VERSIONING=off for a Temporal server "
                                        "without Worker Deployments)") from e
        raise
