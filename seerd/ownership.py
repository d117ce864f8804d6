"""One live coordinator per run directory: the owner record, its heartbeat, and taking it over.

Two coordinators on one database never finish a run (each re-queues the other's leases), so every
command that writes a run's database (`seerd run`, `resume`, `slurm-run`, a submitted job, `seerd db
upgrade`; `seerd submit` while it creates or checks the run) first owns the run directory, and a
second one exits 2 naming the owner.

No flock(2): on NFS it goes through the lock manager or stays local to one client, on Lustre it
depends on the mount (`localflock` locks per node, no option at all refuses it), and a lock held by
a node that died lingers until lock recovery. Instead, two files in the run directory:
- `owner.json`: who owns it (a token, host name, boot id, pid namespace, pid and the pid's start
  time, Slurm job, command, since when). Written whole to a temporary file, then made visible with
  link(2), which fails when the name exists: the way to create a file exclusively that also holds on
  NFS (open(2)'s notes on O_EXCL) and is atomic on Lustre. The name changes only by that link, by a
  taker's rename and by the owner's unlink at release; the owner never rewrites it, so an owner that
  was taken over cannot overwrite its successor's record when it wakes up.
- `owner-<token>.beat`: the owner's heartbeat, a counter and a time rewritten in place every
  HEARTBEAT_S by a thread of its own. Not on the daemon's 0.5 s tick: the export and long
  transactions on the state thread stall the tick for as long as they take, and a live coordinator
  must never look dead. In place, on one inode: NFS's close-to-open consistency revalidates a
  file's data at every open(), whereas a name replaced by rename may come from the client's cache.

Is the owner alive?
- On this host (same host name, boot id and pid namespace, so that its pid means the same process
  here): exactly when that pid runs (not a zombie) and started when the record says (not a reused
  pid). A kill -9 is seen at once; a live process is never taken over, however long it is stopped.
- Elsewhere: when its heartbeat counter moves. A taker watches the counter on its own monotonic
  clock, so the nodes' clocks never need to agree: a live owner is refused after one beat
  (~HEARTBEAT_S); one silent for STALE_AFTER_S is stale (so a Slurm job requeued on another node
  waits at most that long for its killed predecessor); a heartbeat time older than STALE_AFTER_S +
  CLOCK_SKEW_S by our clock is stale without waiting.

Taking over a stale owner: rename `owner.json` to a name of our own (of racing takers one wins),
check that what we moved is the record we judged (else put it back and judge again), then publish
ours with link(2). The owner's heartbeat thread reads `owner.json` at every beat: a record that is
not its own means it was taken over, `lost` says by whom, and the daemon stops at its next tick
without writing the run's final status.

What it does not cover: it is a lease, not a fence. A remote owner paused (SIGSTOP, a frozen VM, a
hung filesystem) for longer than STALE_AFTER_S that then resumes may still commit until its next
beat or tick sees the loss (a few seconds), while its successor runs: the database carries no owner
epoch that would refuse those writes. NFS clients that cache directory lookups (`lookupcache=all`,
the default, up to `acdirmax`) may see an old `owner.json` for a while: a new owner then waits or is
refused (safe), a taken-over one learns of it late. A filesystem without hard links (some FUSE
mounts) cannot hold the lock: the command says so. A live coordinator that hangs keeps its run until
someone stops it (its heartbeat thread goes on). Removing `owner.json` by hand makes the live owner
stop as if taken over. Readers (`seerd status`, `export`, `report`) and workers take no ownership;
on a network filesystem a reader asks `remote_owner` whether a live coordinator on another host
writes the run, and then does not open its database (seerd.db.sharing).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("seerd.ownership")

OWNER_FILE = "owner.json"
HEARTBEAT_S = 2.0
# A remote owner whose heartbeat did not move while we watched this long is gone: 30 missed beats,
# far beyond a slow fsync or a busy node, and short beside a requeued job's start-up.
STALE_AFTER_S = 60.0
# How far apart two nodes' clocks may be; only a heartbeat older than both bounds skips the watch.
CLOCK_SKEW_S = 60.0
_BEAT_BYTES = 96  # the beat is rewritten in place at a fixed size: one write, never a short file


class RunOwned(RuntimeError):
    """A live coordinator owns the run directory."""

    def __init__(self, run_path: Path, owner: OwnerRecord, heartbeat_age_s: float | None) -> None:
        self.run_path = run_path
        self.owner = owner
        beat = "" if heartbeat_age_s is None else f", last heartbeat {heartbeat_age_s:.0f}s ago"
        super().__init__(f"{run_path} is owned by a live coordinator: {owner.describe()}{beat}. Only one "
                         f"coordinator may run a run at a time: wait for it to end, or stop it (pid {owner.pid} "
                         f"on {owner.host}) and run the command again")


class OwnershipError(RuntimeError):
    """The owner record cannot be written or read (the filesystem refuses, or someone edited it)."""


@dataclass(frozen=True)
class OwnerRecord:
    token: str
    host: str
    boot_id: str
    pid_namespace: str
    pid: int
    pid_started: int | None  # clock ticks after boot (/proc/PID/stat), None without /proc
    slurm_job_id: str | None
    since: float
    command: str

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
        return f"pid {self.pid} on {self.host}{job} since {since} (`{self.command}`)"

    def on_this_host(self) -> bool:
        """True when the record's process runs (ran) on this host: same host name and boot."""
        return (self.host, self.boot_id) == (socket.gethostname(), _boot_id())

    def same_processes_as(self, other: OwnerRecord) -> bool:
        """True when this record's pid is a pid of `other`'s host, as seen from there."""
        return (self.host, self.boot_id, self.pid_namespace) == (other.host, other.boot_id, other.pid_namespace)


def this_process(clock: Callable[[], float] = time.time) -> OwnerRecord:
    """A record for this process, with a new token."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    program = "seerd" if sys.argv[0].endswith(("seerd", "seerd/cli/main.py")) else Path(sys.argv[0]).name
    command = " ".join([program, *sys.argv[1:]])
    return OwnerRecord(token=secrets.token_hex(8), host=socket.gethostname(), boot_id=_boot_id(),
                       pid_namespace=namespace, pid=os.getpid(), pid_started=process_start(os.getpid()),
                       slurm_job_id=os.environ.get("SLURM_JOB_ID"), since=clock(), command=command[:160])


def _boot_id() -> str:
    """This kernel's boot: two hosts (or two boots of one) never share it; "" without /proc."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """When process `pid` started (ticks after boot), or None if it does not run (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


class Ownership:
    """This process owns `run_path` until `release()` (or the end of a `with` block)."""

    def __init__(self, run_path: Path, record: OwnerRecord, beat_fd: int, heartbeat_s: float) -> None:
        self.run_path = run_path
        self.record = record
        self.lost: str | None = None  # why the run is no longer ours (taken over), set by the heartbeat
        self._beat_fd = beat_fd
        self._beats = 0
        self._heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self._released = False
        self._thread = threading.Thread(target=self._beat_until_released, name="seerd-owner", daemon=True)
        self._thread.start()

    def _beat_until_released(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                self.beat()
            except (OSError, OwnershipError) as exc:  # a filesystem hiccup: the next beat tries again
                log.warning("could not refresh the ownership of %s: %s", self.run_path, exc)

    def beat(self) -> None:
        """Check that the run is still ours and advance the heartbeat (the thread does it every
        HEARTBEAT_S)."""
        current = read_owner(self.run_path)
        if current is None or current.token != self.record.token:
            self.lost = (f"it was taken over by {current.describe()}" if current is not None
                         else "its owner record was removed (by hand, or by a coordinator taking the run over)")
            log.error("this coordinator no longer owns %s: %s", self.run_path, self.lost)
            self._stop.set()
            return
        self._beats += 1
        _write_beat(self._beat_fd, self._beats, time.time())

    def release(self) -> None:
        """Stop the heartbeat and remove the record (if it is still ours). Idempotent."""
        if self._released:
            return
        self._released = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        try:
            current = read_owner(self.run_path)
            if current is not None and current.token == self.record.token:
                (self.run_path / OWNER_FILE).unlink()
        except (OSError, OwnershipError) as exc:  # a stale record is taken over by the next owner
            log.warning("could not release the ownership of %s: %s", self.run_path, exc)
        finally:
            os.close(self._beat_fd)
            _beat_path(self.run_path, self.record.token).unlink(missing_ok=True)

    def require(self, run_path: Path) -> None:
        """Raise unless this ownership is held, for `run_path`."""
        if self._released or self.run_path.resolve() != Path(run_path).resolve():
            raise OwnershipError(f"{run_path} is not owned here (ownership of {self.run_path}, "
                                 f"{'released' if self._released else 'held'})")

    def __enter__(self) -> Ownership:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def take_ownership(run_path: Path, *, stale_after_s: float = STALE_AFTER_S, heartbeat_s: float = HEARTBEAT_S,
                   clock: Callable[[], float] = time.time) -> Ownership:
    """Own the existing directory `run_path`: at once when nobody does or the owner is dead on this
    host; after watching a remote owner's heartbeat stay silent for `stale_after_s`; RunOwned when
    the owner lives."""
    run_path = Path(run_path)
    me = this_process(clock)
    watch = _HeartbeatWatch(stale_after_s)
    told_waiting = False
    while True:
        owner = read_owner(run_path)
        if owner is None:
            try:
                beat_fd = _publish(run_path, me)
            except OSError as exc:  # a directory we may not write, or a filesystem without hard links
                raise OwnershipError(f"cannot own {run_path}: {exc} (seerd publishes {OWNER_FILE} there with "
                                     f"link(2): the directory must be writable, on a filesystem with hard "
                                     f"links)") from exc
            if beat_fd is not None:
                return Ownership(run_path, me, beat_fd, heartbeat_s)
            continue  # another process published first: judge it
        if owner.pid_started is not None and owner.same_processes_as(me):
            if process_start(owner.pid) == owner.pid_started:
                raise RunOwned(run_path, owner, None)
            verdict = "stale"
        else:
            verdict = watch.judge(owner, _read_beat(run_path, owner.token), clock())
        if verdict == "live":
            raise RunOwned(run_path, owner, watch.heartbeat_age(clock()))
        if verdict == "stale":
            watched = watch.count if watch.token == owner.token else None
            if _claim(run_path, owner, me.token, watched):
                log.warning("%s: took over from a stale owner, %s", run_path, owner.describe())
            continue  # publish ours, or judge whoever was faster
        if not told_waiting and watch.watched_s() > 2 * heartbeat_s:  # a live owner beats before this
            told_waiting = True
            log.warning("%s is owned by %s, whose heartbeat is silent; waiting up to %.0fs for it to go stale",
                        run_path, owner.describe(), stale_after_s)
        time.sleep(min(heartbeat_s, 1.0))


def read_owner(run_path: Path) -> OwnerRecord | None:
    """The record in `run_path/owner.json`, or None when nobody owns the directory."""
    return _read_record(Path(run_path) / OWNER_FILE)


@dataclass(frozen=True)
class RemoteOwner:
    """A run directory's owner on another host that may be alive."""

    owner: OwnerRecord
    heartbeat_age_s: float | None  # by our clock; None when its heartbeat cannot be read

    @property
    def stale_in_s(self) -> float | None:
        """How long until its heartbeat is old enough to call it dead without watching it."""
        return None if self.heartbeat_age_s is None else max(0.0, STALE_AFTER_S + CLOCK_SKEW_S
                                                                - self.heartbeat_age_s)


def remote_owner(run_path: Path, *, now: float | None = None) -> RemoteOwner | None:
    """The owner of `run_path` when it is on another host and may be alive, judged at one look
    (readers cannot wait a heartbeat, as `take_ownership` does): alive unless its heartbeat is older
    than STALE_AFTER_S + CLOCK_SKEW_S by our clock (`now`). So a remote owner counts for up to that
    long after it died; one whose heartbeat cannot be read counts until its record goes. None when
    nobody owns the directory, the owner is on this host, or its record is not one a coordinator
    wrote (none can be running on it: its heartbeat thread would have stopped it), or one that
    cannot be read at all (nothing tells then; this errs towards "nobody", as an unknown filesystem
    counts as local in seerd.db.sharing)."""
    try:
        owner = read_owner(run_path)
    except (OwnershipError, OSError):
        return None
    if owner is None or owner.on_this_host():
        return None
    beat = _read_beat(Path(run_path), owner.token)
    if beat is None:
        return RemoteOwner(owner, None)
    age = max(0.0, (time.time() if now is None else now) - beat[1])
    return None if age > STALE_AFTER_S + CLOCK_SKEW_S else RemoteOwner(owner, age)


class _HeartbeatWatch:
    """A remote owner's heartbeat, watched on our own monotonic clock."""

    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self.token: str | None = None
        self.count: int | None = None
        self.beat_at: float | None = None
        self.watching_since = 0.0

    def judge(self, owner: OwnerRecord, beat: tuple[int, float] | None, now: float) -> str:
        """"live" (the counter moved), "stale" (silent for the bound, or long ago) or "silent"."""
        if owner.token != self.token:
            self.token, self.count, self.beat_at, self.watching_since = owner.token, None, None, time.monotonic()
        if beat is None:  # unreadable for now (or never written): neither a beat nor a reset
            return self._waited()
        count, at = beat
        if self.count is not None and count != self.count:
            self.beat_at = at
            return "live"
        self.count, self.beat_at = count, at
        return "stale" if now - at > self.stale_after_s + CLOCK_SKEW_S else self._waited()

    def watched_s(self) -> float:
        return time.monotonic() - self.watching_since

    def _waited(self) -> str:
        return "stale" if self.watched_s() >= self.stale_after_s else "silent"

    def heartbeat_age(self, now: float) -> float | None:
        return None if self.beat_at is None else max(0.0, now - self.beat_at)


def _read_record(path: Path) -> OwnerRecord | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return OwnerRecord(**json.loads(text))
    except (ValueError, TypeError) as exc:  # never half-written (see the module docstring): edited by hand
        raise OwnershipError(f"{path} is not an owner record ({exc}); if no coordinator runs this run, "
                             f"remove the file") from None


def _beat_path(run_path: Path, token: str) -> Path:
    return run_path / f"owner-{token}.beat"


def _write_beat(fd: int, count: int, at: float) -> None:
    payload = json.dumps({"count": count, "at": at}).encode().ljust(_BEAT_BYTES)
    os.pwrite(fd, payload, 0)
    os.fsync(fd)


def _read_beat(run_path: Path, token: str) -> tuple[int, float] | None:
    try:
        beat = json.loads(_beat_path(run_path, token).read_bytes())
        return int(beat["count"]), float(beat["at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _publish(run_path: Path, me: OwnerRecord) -> int | None:
    """Create the heartbeat, then make `me` the owner with link(2); the heartbeat's descriptor, or
    None when another record appeared first."""
    beat_path = _beat_path(run_path, me.token)
    beat_fd = os.open(beat_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    staged = run_path / f".owner-{me.token}.tmp"
    published = False
    try:
        _write_beat(beat_fd, 0, me.since)
        staged_fd = os.open(staged, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(staged_fd, "w") as handle:
            handle.write(json.dumps(asdict(me)))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(staged, run_path / OWNER_FILE)
            published = True
        except FileExistsError:
            # Over NFS a link whose reply was lost is retried and reports EEXIST: it still took
            # when the staged file has gained a second name.
            published = staged.stat().st_nlink == 2
    finally:
        staged.unlink(missing_ok=True)
        if not published:
            os.close(beat_fd)
            beat_path.unlink(missing_ok=True)
    return beat_fd if published else None


def _claim(run_path: Path, stale: OwnerRecord, token: str, beat_count: int | None) -> bool:
    """Remove the stale owner's record, atomically against other takers; False if it changed since
    it was judged (another record, or a heartbeat past `beat_count`, the last one watched)."""
    owner_path = run_path / OWNER_FILE
    claimed = run_path / f".owner-{token}.claimed"
    try:
        os.rename(owner_path, claimed)
    except FileNotFoundError:  # another taker was faster
        return False
    try:
        moved = _read_record(claimed)
    except OwnershipError:
        moved = None
    beat = _read_beat(run_path, stale.token)
    woke_up = beat_count is not None and beat is not None and beat[0] != beat_count
    if moved is None or moved.token != stale.token or woke_up:  # changed since we judged it: put it back
        with contextlib.suppress(FileExistsError):  # a new owner came meanwhile: theirs stands
            os.link(claimed, owner_path)
        claimed.unlink()
        return False
    claimed.unlink()
    _beat_path(run_path, stale.token).unlink(missing_ok=True)
    return True
