"""PoolService's failures, with stand-in binaries (no Mooncake process): clear errors, nothing left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from seerd.kvpool.address import PoolAddress, write_pool_address
from seerd.kvpool.service import MASTER_BINARY, METADATA_BINARY, PoolService, PoolStartError


def fake_binaries(directory: Path, master: str, metadata: str) -> Path:
    directory.mkdir()
    for name, body in ((MASTER_BINARY, master), (METADATA_BINARY, metadata)):
        path = directory / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return directory


def test_missing_binaries_are_named(tmp_path):
    with pytest.raises(PoolStartError, match=f"{MASTER_BINARY} is missing"):
        PoolService(tmp_path, "127.0.0.1", binaries_dir=tmp_path / "nowhere")


def test_a_master_that_exits_fails_start_with_its_log(tmp_path):
    bins = fake_binaries(tmp_path / "bin", master='echo "cannot bind the rpc port" >&2; exit 3',
                         metadata="exec sleep 30")
    service = PoolService(tmp_path, "127.0.0.1", binaries_dir=bins)
    with pytest.raises(PoolStartError, match="(?s)master exited with 3.*cannot bind the rpc port"):
        service.start()
    assert not service.running()
    for pid in service.pids():
        assert not os.path.exists(f"/proc/{pid}")
    assert not (tmp_path / "kvpool.json").exists()
    assert service.check() is False  # never started: nothing to restart


def test_a_resumed_run_continues_the_generations(tmp_path):
    write_pool_address(tmp_path, PoolAddress(generation=7, master="127.0.0.1:1",
                                             metadata_url="http://127.0.0.1:2/metadata"))
    assert PoolService(tmp_path, "127.0.0.1")._next_generation() == 8
    (tmp_path / "kvpool.json").write_text("{")
    assert PoolService(tmp_path, "127.0.0.1")._next_generation() > 1_000_000_000  # time-based
