"""Where the job's KV pool answers: `RUN_DIR/kvpool.json`, written by the coordinator's
`PoolService`, read by holders and engines.

The file holds addresses only (no secret), but like everything in the run dir it is 0600. Its
`generation` grows every time the master is (re)started, also across a resumed run, so a client
that still holds an older generation knows its store is stale and must be set up again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from seerd.rundir import write_private

POOL_FILE = "kvpool.json"


class PoolAddressError(RuntimeError):
    """kvpool.json exists but cannot be used."""


@dataclass(frozen=True)
class PoolAddress:
    generation: int        # bumped every time the master is (re)started; clients re-setup when it changes
    master: str            # "host:port" of mooncake_master's RPC
    metadata_url: str      # "http://host:port/metadata" (mooncake_http_metadata_server)
    protocol: str = "tcp"  # "tcp" | "rdma"
    devices: str = ""      # RDMA device names, "" for tcp
    metrics_url: str | None = None  # master's HTTP metrics endpoint if enabled
    started_at: float = 0.0


def pool_file(run_dir: Path) -> Path:
    return Path(run_dir) / POOL_FILE


def write_pool_address(run_dir: Path, address: PoolAddress) -> None:
    """Atomically (tmp + rename, fsynced), mode 0600: readers never see half a file."""
    write_private(pool_file(run_dir), json.dumps(asdict(address), indent=1, sort_keys=True))


def read_pool_address(run_dir: Path) -> PoolAddress | None:
    """The pool's address, or None when no pool was started in this run dir."""
    path = pool_file(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PoolAddressError(f"cannot read the KV pool address {path}: {exc}") from exc
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        known = {field.name for field in fields(PoolAddress)}
        address = PoolAddress(**{key: value for key, value in data.items() if key in known})
        _validate(address)
    except (ValueError, TypeError) as exc:
        raise PoolAddressError(f"malformed KV pool address {path}: {exc}") from exc
    return address


def _validate(address: PoolAddress) -> None:
    generation = address.generation
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
        raise ValueError(f"generation must be a positive integer, got {generation!r}")
    host, sep, port = str(address.master).rpartition(":")
    if not (isinstance(address.master, str) and sep and host and port.isdigit()):
        raise ValueError(f"master must be 'host:port', got {address.master!r}")
    if not (isinstance(address.metadata_url, str) and address.metadata_url.startswith("http")):
        raise ValueError(f"metadata_url must be an http URL, got {address.metadata_url!r}")
    if address.protocol not in ("tcp", "rdma"):
        raise ValueError(f"protocol must be 'tcp' or 'rdma', got {address.protocol!r}")
    if not isinstance(address.devices, str):
        raise ValueError(f"devices must be a string, got {address.devices!r}")
    if address.metrics_url is not None and not isinstance(address.metrics_url, str):
        raise ValueError(f"metrics_url must be a string or null, got {address.metrics_url!r}")
    if not isinstance(address.started_at, (int, float)):
        raise ValueError(f"started_at must be a number, got {address.started_at!r}")
