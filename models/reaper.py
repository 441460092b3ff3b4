"""Inputs and results of the orphan reaper (workflows/reaper.py, activities/reaper.py): they travel through
Temporal history every few minutes, so they stay small — counts, and one line per instance terminated."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ReapTarget(BaseModel):
    """Reap ``backends`` with the worker that polls ``task_queue`` (the one holding their credentials)."""

    task_queue: str
    backends: list[str]


class ReaperInput(BaseModel):
    targets: list[ReapTarget] = Field(default_factory=list)
    replicas_queue: str = Field("", description="Where replica workflows no service run owns are stopped (the main "
                                                "queue); '' for none.")
    interval_seconds: int = Field(600, gt=0, description="Between two reaps.")
    grace_seconds: int = Field(600, ge=0, description="An instance younger than this is never reaped.")
    closed_seconds: int = Field(30, gt=0, description="Between two quick passes over the replicas of services "
                                                      "whose run closed without stopping them (terminated).")


class ReapRequest(BaseModel):
    backends: list[str]
    grace_seconds: int = 600


class ReplicaReapResult(BaseModel):
    checked: int = Field(0, description="Running replica workflows seen.")
    stopped: list[str] = Field(default_factory=list, description="Replica workflows asked to stop, with why.")
    error: str = ""


class ReapAction(BaseModel):
    service: str = Field(description="The service the instance's tags name (as tagged; GCP labels are slugs).")
    backend: str
    instance_id: str
    region: str
    owner: str = Field(description="The replica its tags name, e.g. r1-s0.")
    reason: str


class ReapResult(BaseModel):
    task_queue: str = ""
    checked: int = Field(0, description="Tagged instances seen.")
    spared: int = Field(0, description="Orphans not reaped yet: young, or their launch still in flight.")
    terminated: list[ReapAction] = Field(default_factory=list)
    error: str = Field("", description="Why this reap did not run to the end, if it did not.")


__all__ = ["ReapAction", "ReapRequest", "ReapResult", "ReapTarget", "ReaperInput", "ReplicaReapResult"]
