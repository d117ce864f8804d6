"""Find a run: by its directory, or by the Slurm job that runs it; ask its coordinator; and take
one status snapshot of it (`take_snapshot`): from the database, or, from another host while the
run's database is on a network filesystem (seerd.db.sharing), from the coordinator's API.

Jobs are recorded by the coordinator when it starts inside an allocation, in a per-user registry
(`$XDG_STATE_HOME/seerd/slurm-jobs/<job id>`, private to the user) holding the run directory's
path. For jobs started before the registry or by someone else's script, `scontrol show job` is
asked for the `--run-dir` on the job's command line.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import subprocess
from pathlib import Path

from seerd.db.read import DatabaseInUseElsewhere
from seerd.db.sharing import coordinator_elsewhere
from seerd.protocol import SNAPSHOT_TAIL_ROWS, STATUS, STATUS_SNAPSHOT, BadReply, StatusReply, decode_reply
from seerd.rundir import RunDir, RunDirError, write_private
from seerd.signing import Signer, call_key, httpx_auth
from seerd.status.snapshot import UnknownRun, read_snapshot

COORDINATOR_TIMEOUT_S = 0.5  # a hung coordinator must not hang the status view
# The snapshot the coordinator reads for us takes longer than its counts: a big run's queries, on a
# process that also serves every worker.
SNAPSHOT_TIMEOUT_S = 10.0


def registry_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "seerd" / "slurm-jobs"


def record_slurm_job(job_id: str, run_dir: Path) -> None:
    folder = registry_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(folder / job_id, str(Path(run_dir).resolve()))


def run_dir_of_job(job_id: str) -> Path | None:
    entry = registry_dir() / job_id
    if entry.is_file():
        return Path(entry.read_text().strip())
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bCommand=(.*?)(?= \w+=|$)", out.stdout) if out.returncode == 0 else None
    if match is None:
        return None
    words = shlex.split(match.group(1))
    for i, word in enumerate(words):
        if word == "--run-dir" and i + 1 < len(words):
            return Path(words[i + 1])
        if word.startswith("--run-dir="):
            return Path(word.split("=", 1)[1])
    return None


def resolve_run(target: str) -> Path:
    """A run directory, or a Slurm job id whose run directory is known; UnknownRun otherwise."""
    path = Path(target)
    if path.is_dir():
        return path
    if target.isdigit():
        found = run_dir_of_job(target)
        if found is None:
            raise UnknownRun(f"no run directory recorded for Slurm job {target} (give the run directory instead)")
        if not found.is_dir():
            raise UnknownRun(f"Slurm job {target} ran in {found}, which no longer exists")
        return found
    raise UnknownRun(f"no run directory {target}")


def ask_coordinator(run_dir: Path) -> StatusReply | None:
    """The coordinator's status endpoint, or None when it is not running (or does not answer as expected).

    The call is signed, never carrying the secret, and only an answer signed by the run's
    coordinator counts: after a kill -9, `coordinator.json` still names its old port, and whatever
    listens there now learns nothing usable and cannot pass for the coordinator."""
    import httpx

    rundir = RunDir(run_dir)
    try:
        host, port = rundir.read_address()
        secret = rundir.read_secret()
    except RunDirError:
        return None
    try:
        reply = httpx.get(f"http://{host}:{port}{STATUS.path}", timeout=COORDINATOR_TIMEOUT_S,
                          auth=httpx_auth(Signer(call_key(secret, f"{host}:{port}"))))
    except httpx.HTTPError:
        return None
    if reply.status_code != 200 or not reply.extensions.get("seerd_verified"):
        return None
    try:
        return decode_reply(STATUS, reply.content)
    except BadReply:  # a coordinator of another seerd version: the database still tells the run's state
        return None


def take_snapshot(run_dir: Path, tail_rows: int) -> dict:
    """One status snapshot of the run (seerd.status.snapshot): read from its database, with the
    coordinator's figures when it answers; when this host may not open the database (a network
    filesystem, the coordinator on another host: seerd.db.sharing), read by the coordinator on its
    host and served by its API. Raises UnknownRun, or UnreadableDatabase: DatabaseInUseElsewhere
    when the coordinator must serve it and does not."""
    db_path = RunDir(run_dir).db_path
    elsewhere = coordinator_elsewhere(db_path) if db_path.is_file() else None
    if elsewhere is None:
        return read_snapshot(run_dir, tail_rows=tail_rows, coordinator=ask_coordinator(run_dir))
    served, why_not = snapshot_from_coordinator(run_dir, tail_rows)
    if served is None:
        raise DatabaseInUseElsewhere(elsewhere, f"; and its API did not serve the status: {why_not}")
    return {**served, "run_dir": str(run_dir), "read_through_coordinator": True}


def snapshot_from_coordinator(run_dir: Path, tail_rows: int) -> tuple[dict | None, str]:
    """The coordinator's `STATUS_SNAPSHOT`, signed by it; else None and why not."""
    import httpx

    rundir = RunDir(run_dir)
    try:
        host, port = rundir.read_address()
        secret = rundir.read_secret()
    except RunDirError as exc:
        return None, str(exc)
    # A coordinator on loopback (`seerd run`) serves its own host only: the call reaches this one's.
    hint = (f" (it listens on {host}, which is its own host's loopback: `seerd run` serves only its host, a "
            f"Slurm job the node's address)") if _loopback(host) else ""
    try:
        reply = httpx.get(f"http://{host}:{port}{STATUS_SNAPSHOT.path}", params={SNAPSHOT_TAIL_ROWS: tail_rows},
                          timeout=SNAPSHOT_TIMEOUT_S, auth=httpx_auth(Signer(call_key(secret, f"{host}:{port}"))))
    except httpx.HTTPError as exc:
        return None, f"{host}:{port}: {exc or type(exc).__name__}{hint}"
    if not reply.extensions.get("seerd_verified"):
        return None, f"{host}:{port} answered {reply.status_code} without the run's coordinator's signature{hint}"
    if reply.status_code != 200:
        return None, f"{host}:{port} answered {reply.status_code}: {reply.text[:300]}"
    try:
        return decode_reply(STATUS_SNAPSHOT, reply.content).snapshot, ""
    except BadReply as exc:
        return None, str(exc)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
