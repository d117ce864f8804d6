"""Apply Alembic migrations to a run's database.

Only two callers migrate an existing run's database: the coordinator at start and `seerd db
upgrade`, both through `upgrade_run_database`, which copies the database aside first. Readers
(`seerd status`, `report`, `export`, and a resume's look at the run) never migrate: they read
whatever schema they find, read-only. `upgrade` itself is for a database just created.
"""

from __future__ import annotations

import os
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from seerd import migrations  # the top-level migrations/, installed under seerd (see pyproject.toml)


class UpgradeFailed(RuntimeError):
    """A migration failed (its transaction rolled back), or its result fails SQLite's quick_check;
    the copy taken just before is kept, and the message says where."""


@dataclass(frozen=True)
class Upgrade:
    before: str | None  # the revision the database was at (None: empty)
    after: str


def alembic_config(engine: Engine | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    if engine is not None:
        config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False))
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    with engine.begin() as connection:
        _migrate(engine, connection, revision)


def _migrate(engine: Engine, connection: Connection, revision: str) -> None:
    config = alembic_config(engine)
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


def upgrade_run_database(engine: Engine, db_path: Path) -> Upgrade:
    """Bring the run database at `db_path` (opened by `engine`, a writer) to the head revision.

    At head already: nothing is written. Otherwise, holding the write lock so nothing changes in
    between, SQLite's online backup copies the database as committed (the -wal's pages included,
    into one self-contained file) to `<db>.before-<revision>-<time>` beside it, mode 0600; then
    the migrations run in that one transaction. The copy is removed once they committed and the
    database passes SQLite's quick_check; if they fail, it stays and `UpgradeFailed` names it.
    An empty database (just created, nothing to lose) is migrated without a copy.
    """
    before, head = current_revision(engine), head_revisions()
    if before in head:
        return Upgrade(before, before)
    if before is None:
        upgrade(engine)
        return Upgrade(None, current_revision(engine))
    copy = db_path.with_name(f"{db_path.name}.before-{before}-{time.strftime('%Y%m%dT%H%M%S')}")
    try:
        with engine.begin() as connection:  # BEGIN IMMEDIATE: the write lock, through the copy and the migration
            _copy_aside(db_path, copy)
            _migrate(engine, connection, "head")
        with engine.connect() as connection:
            check = connection.exec_driver_sql("PRAGMA quick_check").scalar()
        if check != "ok":
            raise RuntimeError(f"the migrated database fails SQLite's quick_check: {check}")
    except Exception as exc:
        if not copy.exists():
            raise UpgradeFailed(f"could not copy {db_path} aside before migrating it (nothing was migrated): "
                                f"{exc}") from exc
        raise UpgradeFailed(f"upgrading {db_path} from schema {before} failed: {exc}; a copy of the database "
                            f"as it was is at {copy}") from exc
    copy.unlink()
    return Upgrade(before, current_revision(engine))


def _copy_aside(db_path: Path, copy: Path) -> None:
    """A consistent copy of the database as committed, through SQLite's backup API (a -wal's
    committed pages included), into a new private file; a partial copy is removed."""
    os.close(os.open(copy, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    try:
        source = sqlite3.connect(f"file:{urllib.parse.quote(str(db_path))}?mode=ro", uri=True)
        target = sqlite3.connect(copy)
        try:
            source.backup(target)
        finally:
            target.close()
            source.close()
    except BaseException:
        copy.unlink(missing_ok=True)
        raise


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revisions() -> tuple[str, ...]:
    return tuple(ScriptDirectory.from_config(alembic_config()).get_heads())
