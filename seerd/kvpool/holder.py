"""The process that contributes a node's memory to the job's KV pool.

`python -m seerd.kvpool.holder --run-dir R [--segment-bytes N] [--host H]` mounts a global segment
of N bytes (default: `store.default_segment_bytes()`, from the node's free RAM) and keeps it
mounted: every ~0.5 s it re-reads `R/kvpool.json` and sets its store up
again when the generation changes (the coordinator restarted the master) or `health_check()`
fails (the master is gone), retrying with backoff while the pool is down. Engines contribute no
memory (segment 0), so what they stored outlives them as long as the holder runs.

It dies with its parent unless `--no-parent-death` (a Slurm step's parent is slurmstepd, which
ends the step anyway). SIGTERM and SIGINT unmount and exit 0; Slurm's warning signals are
ignored (they reach every step; the coordinator decides). It logs one line per (re)connect and
writes nothing else; kvpool.json holds no secret.

`HolderProcess` spawns and supervises it the way the local worker pool spawns workers.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from seerd.kvpool.address import PoolAddress, PoolAddressError, read_pool_address
from seerd.kvpool.store import (
    MiB, PoolUnavailable, close_quietly, default_segment_bytes, open_store, parse_size,
)
from seerd.parent_death import die_with_parent

log = logging.getLogger("seerd.kvpool.holder")

POLL_S = 0.5
MAX_BACKOFF_S = 5.0
DEFAULT_BUFFER_BYTES = 16 * MiB  # staging only: a holder never puts or gets itself
HOLDER_LOG = "kvpool-holder.log"
STOP_GRACE_S = 10.0  # an unmount against a dead master takes a few seconds


def local_address_towards(address: PoolAddress) -> str:
    """This node's address on the route to the master: what peers on that network reach us at."""
    host = address.master.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


class Holder:
    """The reconnect loop, separate from argv and signals so it can be driven in-process."""

    def __init__(self, run_dir: Path, segment_bytes: int, *, host: str | None = None,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.run_dir = Path(run_dir)
        self.segment_bytes = segment_bytes
        self.host = host
        self.buffer_bytes = buffer_bytes
        self.stopping = threading.Event()
        self.store = None
        self.generation: int | None = None
        self.connects = 0
        self._backoff = POLL_S
        self._last_complaint = ""

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                delay = self.step()
                self.stopping.wait(delay)
        finally:
            self.disconnect()

    def step(self) -> float:
        """One look at kvpool.json and the store; returns how long to wait before the next."""
        try:
            address = read_pool_address(self.run_dir)
        except PoolAddressError as exc:
            return self._complain(str(exc))
        if address is None:
            return self._complain(f"waiting for {self.run_dir}/kvpool.json")
        if self.store is not None and address.generation == self.generation:
            code = self.store.health_check()
            if code == 0:
                return POLL_S
            log.warning("store of generation %d unhealthy (health_check %d); reconnecting",
                        self.generation, code)
        if self.store is not None and address.generation != self.generation:
            log.info("pool generation %d replaces %d; reconnecting", address.generation, self.generation)
        self.disconnect()
        host = self.host or local_address_towards(address)
        try:
            self.store = open_store(address, local_host=host, segment_bytes=self.segment_bytes,
                                    buffer_bytes=self.buffer_bytes, attempts=1)
        except PoolUnavailable as exc:
            return self._complain(f"pool generation {address.generation} unavailable: {exc}")
        self.generation = address.generation
        self.connects += 1
        self._backoff = POLL_S
        self._last_complaint = ""
        log.info("connected to pool generation %d (master %s) as %s with a %d MiB segment (connect #%d)",
                 address.generation, address.master, host, self.segment_bytes // MiB, self.connects)
        return POLL_S

    def disconnect(self) -> None:
        if self.store is not None:
            close_quietly(self.store)
            self.store = None

    def _complain(self, message: str) -> float:
        if message != self._last_complaint:  # once per distinct problem, not every poll
            log.warning("%s", message)
            self._last_complaint = message
        delay = self._backoff
        self._backoff = min(MAX_BACKOFF_S, self._backoff * 2)
        return delay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seerd.kvpool.holder",
                                     description="contribute this node's memory to the job's KV pool")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--segment-bytes", default=None, type=parse_size,
                        help="pool memory of this node: bytes or a size such as 4GiB (default: a quarter "
                             "of MemAvailable, at most 64 GiB)")
    parser.add_argument("--buffer-bytes", default=DEFAULT_BUFFER_BYTES, type=parse_size)
    parser.add_argument("--host", default=None,
                        help="this node's address for peers (default: the local address that routes to "
                             "the master)")
    parser.add_argument("--no-parent-death", action="store_true",
                        help="keep running when the parent exits (Slurm steps)")
    args = parser.parse_args(argv)
    if args.segment_bytes is None:
        args.segment_bytes = default_segment_bytes()
    if args.segment_bytes <= 0:
        parser.error("--segment-bytes must be > 0: a holder exists to contribute memory")
    if not args.no_parent_death:
        parent = os.getppid()
        die_with_parent()
        if os.getppid() != parent:  # the parent died before the signal was armed
            return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    holder = Holder(args.run_dir, args.segment_bytes, host=args.host, buffer_bytes=args.buffer_bytes)
    for warning in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(warning, signal.SIG_IGN)
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda signum, _frame: holder.stopping.set())
    holder.run()
    log.info("stopped after %d connect(s)", holder.connects)
    return 0


class HolderProcess:
    """One holder process on this machine: own session, log file 0600, dies with us."""

    def __init__(self, run_dir: Path, segment_bytes: int | None = None, *, host: str | None = None,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, log_path: Path | None = None,
                 parent_death: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.segment_bytes = segment_bytes
        self.host = host
        self.buffer_bytes = buffer_bytes
        self.log_path = Path(log_path) if log_path else self.run_dir / "logs" / HOLDER_LOG
        self.parent_death = parent_death
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "seerd.kvpool.holder", "--run-dir", str(self.run_dir),
                   "--buffer-bytes", str(self.buffer_bytes)]
        if self.segment_bytes is not None:  # else the holder sizes it from its node's free RAM
            command += ["--segment-bytes", str(self.segment_bytes)]
        if self.host:
            command += ["--host", self.host]
        if not self.parent_death:
            command.append("--no-parent-death")
        return command

    def spawn(self) -> None:
        if self.running():
            raise RuntimeError("the KV pool holder is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.log_path, "ab") as log_file:
            os.chmod(self.log_path, 0o600)
            self.proc = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent if self.parent_death else None, start_new_session=True)

    def poll(self) -> int | None:
        """None while running (or never started), else its exit code."""
        return self.proc.poll() if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.spawn()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (it unmounts its segment), SIGKILL after `grace_s`, then reap its session."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the session is gone
            os.killpg(self.proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
