"""Activity names shared by workflows (which schedule them) and the worker (which runs them)."""

PROVISION = "provision_replica"
WAIT_READY = "wait_replica_ready"
WATCH = "watch_replica"
TERMINATE = "terminate_replica"
REGISTER = "register_replica"
UNREGISTER = "unregister_replica"
ENSURE_ROUTE = "ensure_service_route"
REMOVE_ROUTE = "remove_service_route"
WATCH_STATS = "watch_service_stats"
REAP_ORPHANS = "reap_orphans"
RECORD_SERVICE = "record_service"  # a local activity: decision log + read model in the store


def backend_queue(task_queue: str, backend: str) -> str:
    """The task queue of a worker that runs only ``backend``'s cloud activities (``worker.py --backends``)."""
    return f"{task_queue}-{backend}"
