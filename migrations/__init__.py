"""Alembic migrations of the store (store/tables.py). ``store.Store`` runs them; operators run
``durastack db upgrade`` (``durastack db current`` tells where a database stands).

A new revision: change store/tables.py, then autogenerate against a database at the previous head::

    from alembic import command
    from store import alembic_config
    command.revision(alembic_config(url="sqlite:////tmp/s.db"), "what changed", autogenerate=True)

and read what it wrote: keep it portable (SQLite alters tables in batch mode, which env.py turns on), name
indexes and constraints, and check that tests/test_store.py still finds no difference on both databases.
"""

from pathlib import Path

SCRIPT_LOCATION = str(Path(__file__).parent)
