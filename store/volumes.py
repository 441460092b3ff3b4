"""The store's network volumes (``volumes`` table): what ``durastack apply -f`` of a ``type: volume`` file made or
registered, by name. Read by the plan (`apply`) and by a replica's launch (its zone, its cloud id); written by the CLI's
volume commands. Every method blocks."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

from sqlmodel import col, select

from models.volumes import VolumeRecord
from store.db import Store, _utc
from store.tables import VolumeRow


class VolumeStore:
    def __init__(self, store: Optional[Store] = None):
        self.store = store or Store()

    def get(self, name: str) -> Optional[VolumeRecord]:
        with self.store.session() as s:
            row = s.get(VolumeRow, name)
        return _record(row) if row is not None else None

    def all(self) -> list[VolumeRecord]:
        with self.store.session() as s:
            return [_record(r) for r in s.exec(select(VolumeRow).order_by(col(VolumeRow.name)))]

    def add(self, record: VolumeRecord) -> VolumeRecord:
        """Keep ``record``; one of that name kept already (another apply, a moment before) wins, and is returned."""
        row = dict(record.model_dump(), created_at=record.created_at or datetime.now(timezone.utc))
        with self.store.session() as s:
            s.execute(self.store._insert(VolumeRow).values(row).on_conflict_do_nothing(index_elements=["name"]))
            s.commit()
        found = self.get(record.name)
        assert found is not None, record.name
        return found

    def remove(self, name: str) -> None:
        with self.store.session() as s:
            row = s.get(VolumeRow, name)
            if row is not None:
                s.delete(row)
                s.commit()


def _record(row: VolumeRow) -> VolumeRecord:
    return VolumeRecord(name=row.name, backend=row.backend, region=row.region, zone=row.zone, cloud_id=row.cloud_id,
                        size_gb=row.size_gb, registered=row.registered, created_at=_utc(row.created_at))


__all__ = ["VolumeStore"]
