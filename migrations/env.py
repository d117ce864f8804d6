"""Alembic environment for seerd's SQLite database.

Run through `seerd db upgrade RUN_DIR` or `seerd.db.migrate.upgrade(path)`; the connection is
passed in `config.attributes["connection"]` so the same pragmas (WAL, foreign keys) apply.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

import seerd.db  # noqa: F401  (registers every model on the metadata)
from seerd.db.base import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_with(connection) -> None:  # noqa: ANN001
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_with(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        _run_with(connection)


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
