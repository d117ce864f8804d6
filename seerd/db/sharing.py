"""Who may open a run's database from which host, when the run directory is on a network filesystem.

SQLite's WAL keeps its index in `state.db-shm`, which every connection maps into memory. All the
processes of one host share that host's page cache, so their maps agree, on NFS, Lustre or GPFS
as on a local disk. A process on another host maps a copy that nothing keeps coherent with the
coordinator's: a reader there can follow a stale index into pages the coordinator is rewriting
(wrong rows, "database disk image is malformed"), and a writer there can corrupt the database.
SQLite's docs: "all processes using a database must be on the same host computer; WAL does not
work over a network filesystem".

So, for a database on a network filesystem (`seerd.db.filesystem`):
- The coordinator is the one process that writes it (one per run: seerd.ownership), and it says
  at start what that means (`coordinator_warning`).
- Any other process may open it directly only when no coordinator lives on another host: the run
  is not owned, its owner is on this host, or the owner's heartbeat is long silent (a killed node).
  Otherwise `coordinator_elsewhere` says who, and the opener (`seerd.db.read.open_read_only`, the
  one every reader goes through) refuses with that: `seerd status` then reads through the
  coordinator's API; `export`, `report` and the rest say where to run instead.
- A coordinator that takes a run over on another host after its owner died is safe: its first
  connection takes the WAL's exclusive lock and rebuilds the index from the `-wal` file, and the
  ownership's heartbeat is what says the old process is gone.
On a local filesystem nothing changes: another host cannot see the run directory at all.

This is a guard against the common mistake, not a lock: a coordinator that starts on another host
just after the check is not seen by a reader already past it, whose one read (a frame, an export)
then overlaps the coordinator's first writes.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from seerd.db.filesystem import Filesystem, filesystem_of
from seerd.ownership import Ownership, RemoteOwner, remote_owner

log = logging.getLogger("seerd.db")


@dataclass(frozen=True)
class CoordinatorElsewhere:
    """A database on a network filesystem whose run's live coordinator is on another host."""

    db_path: Path
    filesystem: Filesystem
    remote: RemoteOwner

    @property
    def host(self) -> str:
        return self.remote.owner.host

    def explain(self) -> str:
        age = self.remote.heartbeat_age_s
        beat = ", its heartbeat unreadable" if age is None else f", last heartbeat {age:.0f} s ago"
        dead = "" if self.remote.stale_in_s is None else (
            f" (if that coordinator was killed, its heartbeat is old enough to tell within "
            f"{self.remote.stale_in_s:.0f} s, and then the database may be opened from here)")
        return (f"{self.db_path} is on a network filesystem ({self.filesystem.describe()}) and the run's "
                f"coordinator is live on another host: {self.remote.owner.describe()}{beat}. SQLite's WAL index "
                f"({self.db_path.name}-shm) is memory that hosts do not share over a network filesystem, so "
                f"opening the database here while that coordinator writes it could read wrong pages or corrupt "
                f"the run. Read the run through the coordinator's API (`seerd status` does), run this on "
                f"{self.host}, or wait until the run stops{dead}")


def coordinator_elsewhere(db_path: Path, *, ownership: Ownership | None = None, mountinfo: Path | None = None,
                          now: float | None = None) -> CoordinatorElsewhere | None:
    """Why this process must not open `db_path` directly, or None when it may (see the module
    docstring). `ownership`: the caller's own, held for the run (the coordinator reading its own
    database), which is never elsewhere. `mountinfo` and `now` for tests: the mount table to read
    (/proc/self/mountinfo) and the time to judge the owner's heartbeat by."""
    db_path = Path(db_path)
    filesystem = filesystem_of(db_path, mountinfo)
    if not filesystem.network:
        return None
    remote = remote_owner(db_path.parent, now=now)
    if remote is None or (ownership is not None and remote.owner.token == ownership.record.token):
        return None
    return CoordinatorElsewhere(db_path, filesystem, remote)


def coordinator_warning(db_path: Path, *, mountinfo: Path | None = None) -> str | None:
    """What the coordinator says at start about a database on a network filesystem; None on a
    local one (or an unknown one: nothing to say on a guess)."""
    filesystem = filesystem_of(db_path, mountinfo)
    if not filesystem.network:
        return None
    host = socket.gethostname()
    text = (f"the run's database {db_path} is on a network filesystem ({filesystem.describe()}). SQLite's "
            f"WAL index ({Path(db_path).name}-shm) is shared memory that only processes on this host ({host}) "
            f"see coherently: while this coordinator runs, only processes on {host} may open the database. From "
            f"other hosts, `seerd status` reads through this coordinator's API, and `seerd export`, `report` "
            f"and `db snapshot` refuse until the run stops (run them on {host}). Never copy the database while "
            f"the run goes (a copy misses what is still in its -wal): `seerd db snapshot` or `seerd export` on "
            f"{host} take consistent copies (docs/shared-filesystems.md)")
    caveat = filesystem.lock_caveat
    if caveat:
        text += (f". The mount's options matter: {caveat}. SQLite's own locks do not keep a second "
                 f"coordinator on another host out of this database; only the run directory's ownership "
                 f"(owner.json and its heartbeat) does, so never start one by hand beside a live run")
    return text


def warn_if_shared(db_path: Path, *, mountinfo: Path | None = None) -> str | None:
    """Log `coordinator_warning` once (the coordinator's start); the text, for tests."""
    text = coordinator_warning(db_path, mountinfo=mountinfo)
    if text:
        log.warning("%s", text)
    return text
