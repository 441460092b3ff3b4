"""What one replica of a group runs: its job spec and the input of its ReplicaWorkflow (pure)."""

from __future__ import annotations

import hashlib
import json
from typing import Optional

from models.replica import JobSpec
from models.messages import ReplicaInput
from models.service import ProbeSpec, ReplicaGroup, ServiceConfiguration
from rules.addresses import commands as resolved_commands, late, router_key

# The replica's coordinates, in its env on every backend. Its own address (DURASTACK_REPLICA_IP) is set by
# the backend that places it: only the backend knows it before the commands run.
COORDINATES = ("DURASTACK_SERVICE", "DURASTACK_GROUP", "DURASTACK_REPLICA")
ROUTER_ENV = ("DSTACK_ROUTER_INTERNAL_IP", "DURASTACK_ROUTER_INTERNAL_IP")  # a Dynamo router's address: dstack's, ours


def replica_workflow_id(service: str, group: str, replica_num: int, submission_num: int) -> str:
    return f"service/{service}/{group}/r{replica_num}-s{submission_num}"


def job_spec(config: ServiceConfiguration, service: str, group_name: str, replica_num: int,
             submission_num: int, refs: Optional[dict[str, str]] = None) -> JobSpec:
    """``refs``: the values of the replica addresses its commands name (rules.addresses); None leaves
    the expressions as written (a job rebuilt only to find or tear down its instance)."""
    group = config.group(group_name)
    assert group is not None, group_name
    env = {k: v for k, v in config.env.items() if v is not None}
    env.update(zip(COORDINATES, (service, group_name, str(replica_num))))
    router = router_key(config, group_name)
    if router is not None and refs and router in refs:  # dstack's name, and ours
        env.update(dict.fromkeys(ROUTER_ENV, refs[router]))
    commands = resolved_commands(config, group_name, refs) if refs is not None else list(group.commands)
    return JobSpec(service=service, group=group_name, replica_num=replica_num, submission_num=submission_num,
                   commands=commands, env=env, secrets=[k for k in config.secrets if k in env],
                   port=config.port.container_port,
                   python=group.python or config.python, image=group.image or config.image,
                   working_dir=config.working_dir, user=config.user, shell=config.shell,
                   entrypoint=config.entrypoint, volumes=list(config.volumes),
                   registry_auth=config.registry_auth.resolved(env) if config.registry_auth else None,
                   **runtime_fields(config, group_name))


def runtime_fields(config: ServiceConfiguration, group_name: str) -> dict:
    """A group's nvcc/docker/privileged, the group's value winning over the service's. Docker-in-Docker is
    always privileged, whichever level set `privileged: false`."""
    group = config.group(group_name)
    assert group is not None, group_name

    def pick(name: str) -> bool:
        value = getattr(group, name)
        return bool(getattr(config, name) if value is None else value)

    docker = pick("docker")
    return {"nvcc": pick("nvcc"), "docker": docker, "privileged": docker or pick("privileged")}


def replica_input(config: ServiceConfiguration, service: str, service_workflow_id: str, group_name: str,
                  replica_num: int, submission_num: int, deployment_num: int,
                  refs: Optional[dict[str, str]] = None) -> ReplicaInput:
    group = config.group(group_name)
    assert group is not None, group_name
    return ReplicaInput(
        service_workflow_id=service_workflow_id,
        job=job_spec(config, service, group_name, replica_num, submission_num, refs),
        deployment_num=deployment_num,
        resources=group.resources,
        probes=config.effective_probes() or router_probes(group),
        backends=list(config.backends) if config.backends else None,
        regions=list(config.regions) if config.regions else None,
        instance_types=list(config.instance_types) if config.instance_types else None,
        zones=list(config.availability_zones) if config.availability_zones else None,
        reservation=group.reservation or config.reservation,
        spot_policy=group.spot_policy or config.spot_policy or "on-demand",
        max_price=config.max_price,
        stop_duration=config.stop_duration,
        startup_timeout=group.startup_timeout or config.startup_timeout,
        route=config.routed(group_name),
        late_refs=late(config, group_name),
        late_env=_late_env(config, group_name),
    )


def _late_env(config: ServiceConfiguration, group_name: str) -> dict[str, str]:
    """The router's address, in dstack's name and ours, when the worker resolves it only once placed (a Dynamo
    router whose commands name the worker back)."""
    router = router_key(config, group_name)
    if router is None or router not in late(config, group_name):
        return {}
    return dict.fromkeys(ROUTER_ENV, router)


def router_probes(group: ReplicaGroup) -> list[ProbeSpec]:
    """A kept router (``router: {type: sglang}``) without probes of the service's own is ready once it answers
    ``GET /readiness`` (the model gateway says 503 until it has healthy workers): it never takes traffic empty."""
    if group.router is None or group.router.type != "sglang":
        return []
    return [ProbeSpec(type="http", url="/readiness", interval=5)]


# What a replica's instance is chosen by (activities place on them): an idle instance is reused only by a replica
# whose inputs are these same values (`idle_duration`).
PLACEMENT_FIELDS = ("resources", "backends", "regions", "zones", "instance_types", "spot_policy", "max_price")


def placement_key(inp: ReplicaInput) -> str:
    """The replica's placement inputs, hashed (it is kept with every replica in the service's state)."""
    values = {name: getattr(inp, name) for name in PLACEMENT_FIELDS}
    values["resources"] = inp.resources.model_dump(mode="json")
    # Only when set, so that the keys of services without them stay as they were: an instance outside the group's
    # (new) reservation, or the zone of its (new) network volumes, is not its to take.
    if inp.reservation:
        values["reservation"] = inp.reservation
    if inp.job.volumes:
        values["volumes"] = [v.model_dump(mode="json") for v in inp.job.volumes]
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
