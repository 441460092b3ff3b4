"""A stand-in for a worker process running the provision activity, for the kill -9 tests.

``python -m tests.fakes.provision_child SPEC.json``: SPEC holds the backends config, job, resources, offers and
store URL. With ``"kill": true`` the process SIGKILLs itself right after the cloud call returns (or, when an
earlier instance was adopted and nothing was called, right after the walk) — before it could report anything,
as a worker killed before its activity completes. Otherwise it prints the result as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from activities.cloud import provision_cloud
from backends.cloud import make_backends
from models.backends import BackendsConfig
from models.offers import InstanceOffer
from models.replica import JobSpec
from models.resources import ResourcesSpec
from store import Store, StoreLedger


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    offers = [InstanceOffer.model_validate(o) for o in spec["offers"]]
    backends = make_backends(BackendsConfig.model_validate(spec["config"]), catalog=offers)
    if spec.get("kill"):
        for backend in backends.values():
            create = backend.create

            def create_then_die(*args, _create=create, **kwargs):
                _create(*args, **kwargs)
                _die()  # the cloud call returned; its answer is lost with us
            backend.create = create_then_die  # type: ignore[method-assign]
    offer, instance = provision_cloud(JobSpec.model_validate(spec["job"]),
                                      ResourcesSpec.model_validate(spec["resources"]), offers,
                                      backends=backends, ledger=StoreLedger(Store(spec["store"])), max_offers=25)
    if spec.get("kill"):
        _die()
    print(json.dumps({"offer": offer.model_dump(mode="json"), "instance": instance.model_dump(mode="json")}))


if __name__ == "__main__":
    main(sys.argv[1])
