"""The instance ledger: an append-only JSON-lines file of every cloud launch, before and after the call.

Stand-in for the store's ledger table (not written yet). A line is written and fsynced *before* a cloud
call (phase ``intent``) and after it (``created``, ``failed``), and on termination (``terminated``). A key
whose last phase is ``intent`` had its call's outcome lost (the worker died or the response never came):
the offer walker retries that key first, so the cloud's idempotency returns the instance it may have made.
"""

from __future__ import annotations

import fcntl
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional

INTENT, CREATED, FAILED, TERMINATED = "intent", "created", "failed", "terminated"


def default_ledger_path() -> Path:
    home = os.environ.get("DURASTACK_HOME") or str(Path.home() / ".durastack")
    return Path(home).expanduser() / "ledger" / "instances.jsonl"


class Ledger:
    """``record(key, phase, data)`` appends; ``entries()`` reads back. Safe across threads and processes."""

    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path else default_ledger_path()

    def record(self, key: str, phase: str, data: Optional[dict[str, Any]] = None) -> None:
        line = json.dumps({"at": datetime.now(timezone.utc).isoformat(), "key": key, "phase": phase,
                           "data": data or {}}, sort_keys=True, default=str) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            # One write under an exclusive lock, so lines from concurrent writers never interleave; fsync
            # because the intent must survive the worker dying right after the cloud call.
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = "\n" + line  # a writer died mid-line: end its torn line so this one stays whole
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)  # closing releases the lock

    def entries(self, key: Optional[str] = None) -> list[dict[str, Any]]:
        """All entries in order (only ``key``'s if given). A torn last line (writer killed) is skipped."""
        if not self.path.exists():
            return []
        out = []
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(entry, dict) and (key is None or entry.get("key") == key):
                    out.append(entry)
        return out

    def last_phases(self, keys: Iterable[str]) -> dict[str, str]:
        """The last phase recorded for each of ``keys`` that has any entry."""
        wanted, last = set(keys), {}
        for entry in self.entries():
            if entry.get("key") in wanted:
                last[entry["key"]] = entry.get("phase", "")
        return last

    def unresolved(self, keys: Iterable[str]) -> set[str]:
        """Keys whose call went out but whose outcome was never recorded."""
        return {k for k, phase in self.last_phases(keys).items() if phase == INTENT}


__all__ = ["CREATED", "FAILED", "INTENT", "Ledger", "TERMINATED", "default_ledger_path"]
