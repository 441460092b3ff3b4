"""What one replica of a group runs: its job spec and the input of its ReplicaWorkflow (pure)."""

from __future__ import annotations

from models.replica import JobSpec
from models.run import ReplicaInput
from models.service import ServiceConfiguration


def replica_workflow_id(service: str, group: str, replica_num: int, submission_num: int) -> str:
    return f"service/{service}/{group}/r{replica_num}-s{submission_num}"


def job_spec(config: ServiceConfiguration, service: str, group_name: str, replica_num: int,
             submission_num: int) -> JobSpec:
    group = config.group(group_name)
    assert group is not None, group_name
    env = {k: v for k, v in config.env.items() if v is not None}
    return JobSpec(service=service, group=group_name, replica_num=replica_num, submission_num=submission_num,
                   commands=list(group.commands), env=env, secrets=[k for k in config.secrets if k in env],
                   port=config.port.container_port,
                   python=group.python or config.python, image=group.image or config.image)


def replica_input(config: ServiceConfiguration, service: str, service_workflow_id: str, group_name: str,
                  replica_num: int, submission_num: int, deployment_num: int) -> ReplicaInput:
    group = config.group(group_name)
    assert group is not None, group_name
    return ReplicaInput(
        service_workflow_id=service_workflow_id,
        job=job_spec(config, service, group_name, replica_num, submission_num),
        deployment_num=deployment_num,
        resources=group.resources.model_dump(mode="json"),
        probes=[p.model_dump(mode="json") for p in config.effective_probes()],
        backends=list(config.backends) if config.backends else None,
        regions=list(config.regions) if config.regions else None,
        spot_policy=group.spot_policy or config.spot_policy or "on-demand",
        max_price=config.max_price,
        stop_duration=config.stop_duration,
    )
