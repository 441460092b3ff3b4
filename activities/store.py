"""The store's activity: the ServiceRunWorkflow writes its decisions and `ps` row through it (store/ does the I/O)."""

from __future__ import annotations

import asyncio
from typing import Optional

from activities import interface
from activities.interface import implements
from models.messages import RecordResult, ServiceRecord
from store import Store


class StoreActivities:
    """``record_service``: the ServiceRunWorkflow's local activity that writes its decisions and `ps` row.

    Registered on the worker that runs the workflows (local activities run there). It runs at least once, so
    ``Store.record_service`` is an idempotent upsert; the blocking write runs in a thread.
    """

    def __init__(self, store: Store):
        self.store = store

    @implements(interface.record_service)
    async def record_service(self, rec: ServiceRecord) -> Optional[RecordResult]:
        # A failed write resets the store's connections (Store.session), so the next attempt reconnects and, for
        # a deleted SQLite file, makes and migrates a new one: no worker restart is needed.
        return await asyncio.to_thread(self.store.record_service, rec)


__all__ = ["StoreActivities"]
