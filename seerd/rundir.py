"""The run directory: database, secret, coordinator address, logs and outputs.

Everything in it is private to the user (directory 0700, secret and database 0600): the secret is
what calls to the coordinator's API are signed with (seerd/signing.py), and the database holds every
generated token. Every coordinator start writes a fresh secret and a fresh metrics token
(`rotate_secret`, `rotate_metrics_token`): what leaked from one start is worthless to the next.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

SECRET_BYTES = 32


class RunDirError(RuntimeError):
    """A run directory file (secret, address) is missing or unreadable."""


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def db_path(self) -> Path:
        return self.path / "state.db"

    @property
    def secret_path(self) -> Path:
        return self.path / "secret"

    @property
    def metrics_token_path(self) -> Path:
        return self.path / "metrics-token"

    @property
    def address_path(self) -> Path:
        return self.path / "coordinator.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def parquet_path(self) -> Path:
        return self.path / "rollouts.parquet"

    @property
    def jsonl_path(self) -> Path:
        return self.path / "rollouts.jsonl"

    @property
    def meta_path(self) -> Path:
        return self.path / "rollouts.meta.json"

    def exists(self) -> bool:
        return self.db_path.exists()

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path, 0o700)
        self.logs.mkdir(exist_ok=True, mode=0o700)
        if not self.secret_path.exists():
            write_private(self.secret_path, secrets.token_urlsafe(SECRET_BYTES))

    def read_secret(self) -> str:
        try:
            return self.secret_path.read_text().strip()
        except OSError as exc:
            raise RunDirError(f"cannot read the run's secret {self.secret_path}: {exc}") from exc

    def rotate_secret(self) -> str:
        """A fresh secret for a coordinator start (signed calls, the KV pool's block key)."""
        secret = secrets.token_urlsafe(SECRET_BYTES)
        write_private(self.secret_path, secret)
        return secret

    def rotate_metrics_token(self) -> str:
        """A fresh read-only token for Prometheus (`GET /metrics` only)."""
        token = secrets.token_urlsafe(SECRET_BYTES)
        write_private(self.metrics_token_path, token)
        return token

    def write_address(self, host: str, port: int, pid: int) -> None:
        write_private(self.address_path, json.dumps({"host": host, "port": port, "pid": pid}))

    def read_address(self) -> tuple[str, int]:
        try:
            data = json.loads(self.address_path.read_text())
            return data["host"], int(data["port"])
        except (OSError, ValueError, KeyError) as exc:
            raise RunDirError(f"no usable coordinator address in {self.address_path}: {exc}") from exc


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically with mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
