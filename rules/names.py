"""Activity names the workflows still spell (the replica's activities are called by reference to their stubs in
activities/interface.py, which name them), the signals activities send by name, and the task queue of each
backend. The search attributes' keys are in workflows/attributes.py (they are Temporal objects)."""

# The stubs' names: the implementations take them (``@implements``), so a workflow scheduling by these names and
# one calling the stubs by reference run the same activities.
ENSURE_ROUTE = "ensure_route"
REMOVE_ROUTE = "remove_route"

# The service's signal its replicas report on (ServiceRunWorkflow.replica_changed, payload ReplicaUpdate). Named
# here because the replica workflow, which the service module imports, sends one too.
REPLICA_CHANGED = "replica_changed"
# Its signal for an event from outside (ServiceRunWorkflow.record_event, payload Event): the activities send it by
# name, as they sit below the workflows.
RECORD_EVENT = "record_event"


def backend_queue(task_queue: str, backend: str) -> str:
    """The task queue of the replica activities (launch, teardown, monitor) of ``backend``: the main worker polls
    it for this machine and the clouds it calls itself, a ``worker.py --backends <cloud>`` worker for its cloud."""
    return f"{task_queue}-{backend}"


def fleet_workflow_id(task_queue: str, backend: str) -> str:
    """The fleet monitor of ``backend`` (workflows/fleet.py): every service's replica watch there."""
    return f"durastack/monitor/{backend_queue(task_queue, backend)}"
