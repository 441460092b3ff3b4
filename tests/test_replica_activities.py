"""Where ReplicaActivities.provision places a replica: this machine, or not (cluster workers)."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.local import LocalBackend
from activities.replica import ReplicaActivities
from models.loader import load_config_text
from workflows.jobs import replica_input

CONFIG = """
type: service
name: svc
port: 8000
commands: [python3 -m http.server 8000]
"""


def _input():
    config = load_config_text(CONFIG).config
    return replica_input(config, "svc", "service/svc", "0", 0, 0, 1)


async def test_a_worker_without_local_replicas_never_starts_one(tmp_path):
    acts = ReplicaActivities(LocalBackend(tmp_path / "home"), gateway=None, local_replicas=False)
    with pytest.raises(ApplicationError) as refused:
        await ActivityEnvironment().run(acts.provision, _input())
    assert refused.value.type == "NoOffers" and refused.value.non_retryable
    assert "DURASTACK_LOCAL_REPLICAS=off" in str(refused.value)
    assert acts.local.find(_input().job) is None  # nothing was started on this machine
