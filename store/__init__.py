"""The store: the instance ledger, each service's decision log and the read model behind ``durastack ps``.

Its own package, outside ``activities/``: the worker's activities write it, and the CLI (``durastack events``,
``ps`` when the control plane is down, ``durastack db``) and the Alembic migrations read it, without importing
any activity. ``store.tables`` holds the tables, ``store.db`` the database code.
"""

from store.db import (CREATED, FAILED, INTENT, TERMINATED, Store, StoreLedger, alembic_config, database_url,
                      head_revision, make_engine)

__all__ = ["CREATED", "FAILED", "INTENT", "TERMINATED", "Store", "StoreLedger", "alembic_config", "database_url",
           "head_revision", "make_engine"]
