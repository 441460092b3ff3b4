"""Alembic's entry point for the store: the target is the sqlmodel metadata of store/tables.py.

``store.Store`` hands over an open connection (``config.attributes["connection"]``), already holding the
migration lock; without one (the ``alembic`` command line), the URL of the config is used.
"""

from alembic import context
from sqlmodel import SQLModel

import store.tables  # noqa: F401 — registers the tables on SQLModel.metadata

target_metadata = SQLModel.metadata


def _run(connection) -> None:
    # SQLite cannot ALTER most things: later revisions rewrite tables in batch mode there.
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


def run_migrations() -> None:
    if context.is_offline_mode():
        context.configure(url=context.config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                          literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from store.db import make_engine  # postgresql:// → psycopg, SQLite pragmas

    engine = make_engine(context.config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


run_migrations()
