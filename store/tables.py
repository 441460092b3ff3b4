"""The store's tables (sqlmodel): the instance ledger, the decision log, and the read model behind `ps`.

The same tables run on SQLite (the embedded default) and PostgreSQL (``DURASTACK_DATABASE_URL``), so the types
are the portable ones: strings, integers, JSON (``json`` on PostgreSQL, text on SQLite) and time stamps with a
time zone (``timestamptz`` on PostgreSQL; SQLite keeps no zone, so ``store/db.py`` always writes UTC).
The schema is created by the Alembic revisions in ``migrations/``, never by ``create_all``; a test checks that
the revisions produce exactly these tables.

No ``from __future__ import annotations`` here: sqlmodel reads the field annotations at class creation.
"""

from datetime import datetime
from typing import Any, Optional

from sqlalchemy import JSON, Boolean, Column, DateTime, Index, Text
from sqlmodel import Field, SQLModel


def _when(description: str, **kw: Any) -> Any:
    return Field(sa_column=Column(DateTime(timezone=True), nullable=False, **kw), description=description)


class LedgerEntry(SQLModel, table=True):
    """One line of the instance ledger: a cloud launch before (``intent``) and after (``created``, ``failed``)
    the call, and its termination (``terminated``). Append-only; a key's last phase is its latest ``id``."""

    __tablename__ = "instance_ledger"
    __table_args__ = (Index("ix_instance_ledger_key_id", "key", "id"),)

    id: Optional[int] = Field(default=None, primary_key=True, description="Append order.")
    key: str = Field(description="The provisioning key (models.backends.provisioning_key).")
    phase: str = Field(description="intent, created, failed or terminated.")
    data: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False),
                       description="Where and what (backend, region, instance id…); never env values or secrets.")
    at: datetime = _when("When it was recorded (UTC).")


class DecisionLogEntry(SQLModel, table=True):
    """One entry of a service's decision log (models.views.Event), as ``durastack events`` reads it.

    The key is (service, run, seq): the workflow numbers its events from 1 and writes them at least once, so a
    retried write lands on the same row; a service stopped and applied again is a new run, numbered from 1 again.
    """

    __tablename__ = "decision_log"

    service: str = Field(primary_key=True, description="Service name.")
    run: datetime = Field(sa_column=Column(DateTime(timezone=True), primary_key=True),
                          description="When this run of the service was submitted (its `submitted_at`).")
    seq: int = Field(primary_key=True, description="Position in the run's log, from 1.")
    at: datetime = _when("When it was decided (workflow time, UTC).")
    kind: str = Field(description="scale, replica, rollout, apply, stop, rejected, reap, …")
    group: Optional[str] = Field(default=None, description="The replica group it concerns, if one.")
    message: str = Field(sa_column=Column(Text, nullable=False), description="What and why, with the inputs.")


class ServiceRow(SQLModel, table=True):
    """The read model: each service's last `ps` view, for when the control plane is down."""

    __tablename__ = "service_status"

    name: str = Field(primary_key=True, description="Service name.")
    status: str = Field(description="The service's status (running, terminated, …).")
    deployment: int = Field(description="Its deployment number.")
    updated_at: datetime = _when("When the workflow last wrote it (UTC): how stale the view is.")
    view: dict = Field(sa_column=Column(JSON, nullable=False), description="models.views.ServiceStatus as JSON.")


class VolumeRow(SQLModel, table=True):
    """A network volume (models.volumes.VolumeRecord): made or registered by `durastack apply -f` of a `type: volume`
    file, looked up by name when a replica that mounts it is planned, placed and started."""

    __tablename__ = "volumes"

    name: str = Field(primary_key=True, description="The name services mount it by.")
    backend: str = Field(description="aws or gcp.")
    region: str = Field(description="Its region.")
    zone: str = Field(description="Its zone.")
    cloud_id: str = Field(description="AWS vol-…, the GCP disk's name.")
    size_gb: int = Field(description="Its size in GB.")
    registered: bool = Field(sa_column=Column(Boolean, nullable=False),
                             description="Registered with `volume_id` (never deleted in the cloud).")
    created_at: datetime = _when("When it was made or registered (UTC).")


__all__ = ["DecisionLogEntry", "LedgerEntry", "ServiceRow", "VolumeRow"]
