"""The in-service router's worker list, as durastack keeps it (``router: {type: sglang}``).

SGLang's model gateway starts with no workers and learns them through its worker API; durastack keeps that list
equal to the service's ready, not-stopping workers (``activities/router.py`` does the calls,
``rules/routers.py`` decides what the list should be).
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import BaseModel, Field

from models.backends import CloudInstance
from models.replica import LocalInstance

# What a replica runs on: a local process tree or a cloud VM (models.state and models.messages use this one).
Instance = Annotated[Union[LocalInstance, CloudInstance], Field(discriminator="kind")]


class RouterWorker(BaseModel):
    """A worker the router should know."""

    replica_num: int
    submission_num: int
    group: str
    url: str = Field(description="Where the router reaches it: http://<its address on the service network>:<port>.")
    instance: Instance = Field(description="Its instance: where durastack reads its /server_info (its role).")


class RouterTarget(BaseModel):
    """One replica of the router group (two while the router group rolls)."""

    replica_num: int
    submission_num: int
    instance: Instance


class RouterEntry(BaseModel):
    """A worker as the router lists it."""

    url: str
    worker_type: str = Field("regular", description="prefill, decode or regular.")
    healthy: bool = False


class RouterState(BaseModel):
    """What one router replica knows, as last read."""

    replica_num: int
    submission_num: int
    reachable: bool = True
    error: str = Field("", description="Why its worker API could not be used, while it cannot.")
    workers: list[RouterEntry] = Field(default_factory=list)

    def healthy(self) -> set[str]:
        return {w.url for w in self.workers if w.healthy}


class RouterView(BaseModel):
    """The routers' worker lists, and what the last sync changed (for the decision log)."""

    routers: list[RouterState] = Field(default_factory=list)
    changes: list[str] = Field(default_factory=list, description="What the sync did since the last view, in order.")

    def without_changes(self) -> "RouterView":
        return self.model_copy(update={"changes": []})


class RouterSyncInput(BaseModel):
    """Keep every router replica's worker list equal to ``workers``; return when a router's list or health changes."""

    service: str
    backend: str
    routers: list[RouterTarget]
    workers: list[RouterWorker]
    known: RouterView = Field(default_factory=RouterView, description="The view the service has: return on a change.")
    poll_seconds: float = Field(1.0, description="How often each router's list is read and put right.")


class RouterLeave(BaseModel):
    """Take one worker out of the routers before it stops (sent with its stop request)."""

    routers: list[RouterTarget]
    url: str
    grace_seconds: Optional[float] = Field(
        None, description="Longest wait for its in-flight requests after it left; None: the drain time.")
