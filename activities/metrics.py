"""durastack's own activity metrics, on the worker runtime's metrics endpoint (Prometheus).

``durastack_provisioning_failures{backend, reason}`` counts each failed attempt to get an instance:

* a cloud offer that failed: ``backend`` is its cloud, ``reason`` the error kind — ``capacity``,
  ``quota``, ``transient`` (outcome unknown: retried with the same key) or ``fatal``;
* ``not_running``: a launched instance that went away or never ran within the boot timeout;
* ``no_offers``: no offer of the backend a launch tried fits the replica (this machine is ``local``'s one offer);
* ``unsupported``: this machine cannot run the job (``backend`` is ``local``).

Outside an activity (unit tests of the offer walker) nothing is counted.
"""

from __future__ import annotations

from temporalio import activity

PROVISIONING_FAILURES = "durastack_provisioning_failures"


def provisioning_failed(backend: str, reason: str) -> None:
    """Count one failure; also callable from the worker thread of an activity (its context is copied)."""
    if not activity.in_activity():
        return
    counter = activity.metric_meter().create_counter(
        PROVISIONING_FAILURES, "Failed attempts to get an instance for a replica, by backend and reason.")
    counter.add(1, {"backend": backend, "reason": reason})
