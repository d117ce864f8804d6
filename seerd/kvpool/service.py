"""The job's KV pool service: `mooncake_master` and `mooncake_http_metadata_server`, owned by the
coordinator (rank 0), their address published in `RUN_DIR/kvpool.json`.

The pool is a cache. If either process dies, `check()` restarts both (the master's state is
lost anyway) under a new generation; holders and engines see the generation change and set
their store up again. Restarts first try the previous ports, so a client that does not re-setup
keeps working after one failed call (-900).

Master flags (measured with mooncake-transfer-engine-non-cuda 0.3.13.post1, see `MASTER_FLAGS`):
- `--enable_http_metadata_server=false`: its embedded metadata server binds 0.0.0.0 whatever
  its host flag says; the standalone `mooncake_http_metadata_server --host` binds as asked.
- `--default_kv_lease_ttl=1000` (ms, default 10 s): the lease is taken by reads (`get_size`,
  `get`, `get_into`; a `put` takes none) and keeps the object from eviction and `remove` while
  it is copied out. 1 s covers a read of ~1 GB at the ~1-2 GB/s measured on loopback; 0 is
  accepted but would let a read race an eviction.
- `--eviction_high_watermark_ratio=0.8 --eviction_ratio=0.1` (defaults 0.9 / 0.05): eviction
  runs in the background, and a put finding no room fails (-200) instead of evicting. With the
  defaults a burst of 1 MiB puts into a 64 MiB pool failed 15 of 691 (56 of 200 in another run);
  with 0.8 / 0.1 none of 763 failed (at 40 MB/s neither setting failed).
- `--client_ttl=5` (s, default 10): how long a dead holder's segment stays mounted; meanwhile
  puts routed to it fail with -800 (measured: 3.2 s with ttl 2, 11.2 s with ttl 10). Not lower:
  a holder starved of CPU by engines must not lose its segment for a late heartbeat.
- `--metrics_host/--metrics_port`: Prometheus text at /metrics (`master_allocated_bytes`,
  `master_total_capacity_bytes`, `master_key_count`, `master_active_clients`,
  `master_evicted_key_count`, `master_evicted_size_bytes`, `master_put_start_alloc_failures_total`,
  ...), JSON at /health.
  The same port serves admin reads (/get_all_keys, /query_key, /get_all_segments).
- `--enable_metric_reporting=false`: stops a ~1.6 KB summary line every ~10 s in the log; the
  /metrics endpoint is served either way.
- `--logtostderr=true`: glog into our log file, never files under /tmp.

Network exposure (what `ss -ltnp` showed with host 127.0.0.1): the master's RPC and HTTP ports
and the metadata server bind `host` only. What cannot be bound: every store client (holders,
engines) listens on all interfaces, with a transfer-engine handshake port (0.0.0.0:random) and
a TCP data port ([::]:random, dual stack); `MC_TCP_BIND_ADDRESS` does not change that. None of
Mooncake's ports authenticates anything, and the TCP data port reads and writes any registered
buffer a peer names (0.3.13.post1 refuses other addresses): the holders' segments, and the
engines' staging areas (connector.py registers no KV cache). Binding to the node's address keeps
the service off other networks, nothing more; blocks are authenticated by their MAC
(connector.py), and what stays exposed is in docs/security.md.

Children run in their own session with a parent-death signal: call `start()` and `check()` from
a long-lived thread (the signal fires when the thread that forked them exits).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from seerd.kvpool.address import PoolAddress, PoolAddressError, read_pool_address, write_pool_address
from seerd.parent_death import die_with_parent

log = logging.getLogger("seerd.kvpool")

MASTER_BINARY = "mooncake_master"
METADATA_BINARY = "mooncake_http_metadata_server"
MASTER_LOG = "kvpool-master.log"
METADATA_LOG = "kvpool-metadata.log"
# Mooncake evicts, in its own order, once the pool is this full (the coordinator trims below it).
EVICTION_HIGH_WATERMARK = 0.8
MASTER_FLAGS = (
    "--enable_http_metadata_server=false",
    "--default_kv_lease_ttl=1000",
    f"--eviction_high_watermark_ratio={EVICTION_HIGH_WATERMARK}",
    "--eviction_ratio=0.1",
    "--client_ttl=5",
    "--enable_metric_reporting=false",
    "--logtostderr=true",
)
START_TIMEOUT_S = 20.0
START_ATTEMPTS = 3
STOP_GRACE_S = 5.0
RESTART_BACKOFF_S = 5.0
HTTP_TIMEOUT_S = 1.0
LOG_TAIL_BYTES = 2000
# Prometheus names of the master's /metrics -> the keys of `stats()`.
STAT_METRICS = {
    "master_allocated_bytes": "bytes_used",
    "master_total_capacity_bytes": "capacity_bytes",
    "master_key_count": "keys",
    "master_active_clients": "clients",
    "master_evicted_key_count": "evicted_keys",
    "master_evicted_size_bytes": "evicted_bytes",
    "master_put_start_alloc_failures_total": "put_no_space_failures",
}


class PoolStartError(RuntimeError):
    """The master or the metadata server did not start or did not answer in time."""


class PoolService:
    def __init__(self, run_dir: Path, host: str, *, protocol: str = "tcp", devices: str = "",
                 log_dir: Path | None = None, binaries_dir: Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.host = host
        self.protocol = protocol
        self.devices = devices
        self.log_dir = Path(log_dir) if log_dir is not None else self.run_dir / "logs"
        bin_dir = Path(binaries_dir) if binaries_dir is not None else Path(sys.executable).parent
        self.master_binary = bin_dir / MASTER_BINARY
        self.metadata_binary = bin_dir / METADATA_BINARY
        for binary in (self.master_binary, self.metadata_binary):
            if not os.access(binary, os.X_OK):
                raise PoolStartError(f"{binary} is missing or not executable: the KV pool needs "
                                     f"mooncake-transfer-engine(-non-cuda) installed in {bin_dir}")
        self.address: PoolAddress | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.master: subprocess.Popen | None = None
        self.metadata: subprocess.Popen | None = None
        self._ports: tuple[int, int, int] | None = None  # rpc, metrics, metadata
        self._next_attempt = 0.0
        self._stopped = False
        self._log_starts: dict[str, int] = {}

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> PoolAddress:
        """Start both processes, wait until they answer, publish kvpool.json."""
        if self.running():
            raise RuntimeError("the KV pool service is already running")
        self._stopped = False
        return self._launch(self._next_generation())

    def check(self) -> bool:
        """Restart both processes if either died. True when a restart happened now. A failed
        restart is logged (the pool is a cache; the rollout goes on) and tried again later."""
        if self.address is None or self._stopped or self.running():
            return False
        if time.monotonic() < self._next_attempt:
            return False
        processes = (("master", self.master), ("metadata server", self.metadata))
        died = {name: proc.returncode for name, proc in processes if proc and proc.poll() is not None}
        log.warning("KV pool %s exited (%s); restarting the pool (generation %d lost)",
                    ", ".join(died) or "processes", ", ".join(f"{k}: {v}" for k, v in died.items()),
                    self.address.generation)
        self._terminate()
        try:
            self._launch(self.address.generation + 1)
        except PoolStartError as exc:
            self.last_error = str(exc)
            self._next_attempt = time.monotonic() + RESTART_BACKOFF_S
            log.error("KV pool restart failed, trying again in %.0f s: %s", RESTART_BACKOFF_S, exc)
            return False
        self.restarts += 1
        return True

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM both, SIGKILL what is left after `grace_s`. kvpool.json stays (a resumed run
        reads its generation)."""
        self._stopped = True
        self._terminate(grace_s)

    @property
    def generation(self) -> int | None:
        return self.address.generation if self.address else None

    def running(self) -> bool:
        return all(proc is not None and proc.poll() is None for proc in (self.master, self.metadata))

    def pids(self) -> list[int]:
        return [proc.pid for proc in (self.master, self.metadata) if proc is not None]

    # --- figures ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """The pool's figures from the master's /metrics (absent keys when it does not answer),
        plus generation, restarts and whether both processes run."""
        figures: dict = {"generation": self.generation,
                         "restarts": self.restarts, "up": self.running()}
        if self.last_error:
            figures["last_error"] = self.last_error
        url = self.address.metrics_url if self.address else None
        if not url:
            return figures
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
                text = response.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return figures
        figures.update(parse_master_metrics(text))
        return figures

    # --- internals -------------------------------------------------------------------------

    def _next_generation(self) -> int:
        try:
            previous = read_pool_address(self.run_dir)
        except PoolAddressError as exc:
            # Unknown previous generation: seconds since the epoch exceed any restart count.
            log.warning("%s; starting the KV pool at a time-based generation", exc)
            return int(time.time())
        return previous.generation + 1 if previous else 1

    def _launch(self, generation: int) -> PoolAddress:
        failures = []
        for attempt in range(START_ATTEMPTS):
            ports = self._pick_ports(reuse=attempt == 0)
            started = time.monotonic()
            try:
                self._spawn(ports, generation)
                self._wait_ready(ports)
            except PoolStartError as exc:
                failures.append(str(exc))
                self._terminate()
                continue
            self._ports = ports
            self.last_error = None
            self.address = PoolAddress(
                generation=generation,
                master=_join(self.host, ports[0]),
                metadata_url=f"http://{_join(self.host, ports[2])}/metadata",
                protocol=self.protocol, devices=self.devices,
                metrics_url=f"http://{_join(self.host, ports[1])}/metrics",
                started_at=time.time())
            write_pool_address(self.run_dir, self.address)
            log.info("KV pool generation %d: master %s, metadata %s (ready in %.2f s)", generation,
                     self.address.master, self.address.metadata_url, time.monotonic() - started)
            return self.address
        raise PoolStartError(f"the KV pool did not start in {START_ATTEMPTS} attempts (new ports each "
                             f"time); the last one: {failures[-1]}")

    def _pick_ports(self, *, reuse: bool) -> tuple[int, int, int]:
        if reuse and self._ports and all(_port_free(self.host, port) for port in self._ports):
            return self._ports
        ports: list[int] = []
        while len(ports) < 3:
            port = _free_port(self.host)
            if port not in ports:
                ports.append(port)
        return ports[0], ports[1], ports[2]

    def _spawn(self, ports: tuple[int, int, int], generation: int) -> None:
        rpc_port, metrics_port, metadata_port = ports
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.metadata = self._popen(
            [str(self.metadata_binary), "--host", self.host, "--port", str(metadata_port),
             "--log-level", "WARNING"],  # INFO logs every client request
            METADATA_LOG, generation)
        self.master = self._popen(
            [str(self.master_binary), f"--rpc_address={self.host}", f"--rpc_port={rpc_port}",
             f"--metrics_host={self.host}", f"--metrics_port={metrics_port}", *MASTER_FLAGS],
            MASTER_LOG, generation)

    def _popen(self, command: list[str], log_name: str, generation: int) -> subprocess.Popen:
        path = self.log_dir / log_name
        with open(path, "ab") as log_file:
            os.chmod(path, 0o600)
            self._log_starts[log_name] = log_file.tell()  # errors quote this start's lines only
            log_file.write(f"--- seerd: generation {generation}: {' '.join(command)}\n".encode())
            log_file.flush()
            return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                    start_new_session=True)

    def _wait_ready(self, ports: tuple[int, int, int]) -> None:
        rpc_port, metrics_port, metadata_port = ports
        checks = {
            "master": (self.master, MASTER_LOG, lambda: _tcp_answers(self.host, rpc_port)
                       and _master_healthy(self.host, metrics_port)),
            "metadata server": (self.metadata, METADATA_LOG,
                                lambda: _metadata_answers(self.host, metadata_port)),
        }
        deadline = time.monotonic() + START_TIMEOUT_S
        while checks:
            for name, (proc, log_name, answers) in list(checks.items()):
                if proc is not None and proc.poll() is not None:
                    raise PoolStartError(f"the KV pool {name} exited with {proc.returncode}; "
                                         f"{self._log_tail(log_name)}")
                if answers():
                    del checks[name]
                elif time.monotonic() > deadline:
                    raise PoolStartError(f"the KV pool {name} did not answer within {START_TIMEOUT_S:.0f} s; "
                                         f"{self._log_tail(log_name)}")
            if checks:
                time.sleep(0.05)

    def _log_tail(self, log_name: str) -> str:
        path = self.log_dir / log_name
        return f"{path} ends with:\n{_tail(path, self._log_starts.get(log_name, 0))}"

    def _terminate(self, grace_s: float = STOP_GRACE_S) -> None:
        procs = [proc for proc in (self.master, self.metadata) if proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the session is gone
                os.killpg(proc.pid, signal.SIGKILL)


def parse_master_metrics(text: str) -> dict:
    """`stats()` figures from the master's Prometheus text; unknown or malformed lines skipped."""
    figures: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2 or parts[0] not in STAT_METRICS:
            continue
        try:
            value = float(parts[1])
        except ValueError:
            continue
        figures[STAT_METRICS[parts[0]]] = int(value) if value.is_integer() else value
    return figures


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _free_port(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _tcp_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=HTTP_TIMEOUT_S):
            return True
    except OSError:
        return False


def _master_healthy(host: str, metrics_port: int) -> bool:
    try:
        url = f"http://{_join(host, metrics_port)}/health"
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            return json.loads(response.read()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def _metadata_answers(host: str, port: int) -> bool:
    # Its process lives on even when its server thread failed to bind: ask it, do not trust poll().
    try:
        with urllib.request.urlopen(f"http://{_join(host, port)}/metadata?key=seerd-probe",
                                    timeout=HTTP_TIMEOUT_S):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code == 404
    except OSError:
        return False


def _tail(path: Path, start: int = 0) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(start, handle.tell() - LOG_TAIL_BYTES))
            return handle.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(cannot read it: {exc})"
