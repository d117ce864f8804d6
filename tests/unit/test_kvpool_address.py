"""kvpool.json, pool sizes and the parsing of the master's metrics (no Mooncake process)."""

from __future__ import annotations

import json
import stat
from dataclasses import replace

import pytest

from seerd.kvpool.address import (
    POOL_FILE, PoolAddress, PoolAddressError, read_pool_address, write_pool_address,
)
from seerd.kvpool.holder import HolderProcess, local_address_towards
from seerd.kvpool.service import parse_master_metrics
from seerd.kvpool.store import GiB, MiB, default_segment_bytes, parse_size

ADDRESS = PoolAddress(generation=3, master="10.0.0.5:50051", metadata_url="http://10.0.0.5:8080/metadata",
                      metrics_url="http://10.0.0.5:9003/metrics", started_at=1700000000.5)


def test_round_trip_private_and_atomic(tmp_path):
    write_pool_address(tmp_path, ADDRESS)
    assert read_pool_address(tmp_path) == ADDRESS
    assert stat.S_IMODE((tmp_path / POOL_FILE).stat().st_mode) == 0o600
    rdma = replace(ADDRESS, generation=4, protocol="rdma", devices="mlx5_0,mlx5_1", metrics_url=None)
    write_pool_address(tmp_path, rdma)
    assert read_pool_address(tmp_path) == rdma
    assert [path.name for path in tmp_path.iterdir()] == [POOL_FILE]  # no temporary file left


def test_absent_file_is_none(tmp_path):
    assert read_pool_address(tmp_path) is None


def test_unknown_keys_are_ignored(tmp_path):
    data = json.loads(json.dumps(ADDRESS.__dict__))
    data["added_later"] = 1
    (tmp_path / POOL_FILE).write_text(json.dumps(data))
    assert read_pool_address(tmp_path) == ADDRESS


@pytest.mark.parametrize("text", [
    "", "{", "[]", "null",
    '{"master": "h:1", "metadata_url": "http://h:2/metadata"}',                    # no generation
    '{"generation": 0, "master": "h:1", "metadata_url": "http://h:2/metadata"}',
    '{"generation": "1", "master": "h:1", "metadata_url": "http://h:2/metadata"}',
    '{"generation": 1, "master": "h", "metadata_url": "http://h:2/metadata"}',
    '{"generation": 1, "master": "h:1", "metadata_url": "h:2"}',
    '{"generation": 1, "master": "h:1", "metadata_url": "http://h:2/metadata", "protocol": "udp"}',
])
def test_malformed_file_is_a_clear_error(tmp_path, text):
    (tmp_path / POOL_FILE).write_text(text)
    with pytest.raises(PoolAddressError, match="malformed KV pool address .*kvpool.json"):
        read_pool_address(tmp_path)


@pytest.mark.parametrize("text, size", [
    ("4GiB", 4 * GiB), ("512MiB", 512 * MiB), ("512 mib", 512 * MiB), ("1.5GiB", 3 * GiB // 2),
    ("2GB", 2_000_000_000), ("1.1GB", 1_100_000_000), ("1048576", MiB), ("0", 0), ("64KiB", 65536),
    ("7b", 7), (4096, 4096),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1", "4 GiBs", "1.5", "0.0001KiB", "4x", "1e9", -5])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("available_kib, expected", [
    (24_077_552, 5632 * MiB),      # this machine: a quarter of 22.96 GiB, rounded down to 256 MiB
    (1024 * 1024, 256 * MiB),      # 1 GiB available: 256 MiB
    (512 * 1024, 256 * MiB),       # never below 256 MiB
    (2 * 1024**3, 64 * GiB),       # 2 TiB available: capped
])
def test_default_segment_bytes(tmp_path, available_kib, expected):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available_kib} kB\n")
    assert default_segment_bytes(str(meminfo)) == expected


def test_default_segment_bytes_of_this_machine():
    size = default_segment_bytes()
    assert 256 * MiB <= size <= 64 * GiB and size % (256 * MiB) == 0


def test_parse_master_metrics():
    text = """# HELP master_allocated_bytes Total memory bytes currently allocated across all segments
# TYPE master_allocated_bytes gauge
master_allocated_bytes 1048576
master_total_capacity_bytes 67108864
master_key_count 1
master_active_clients 2
master_evicted_key_count nonsense
master_evicted_size_bytes 2097152
master_put_start_alloc_failures_total 0
master_ping_requests_total 7
garbage
"""
    assert parse_master_metrics(text) == {"bytes_used": MiB, "capacity_bytes": 64 * MiB, "keys": 1,
                                          "clients": 2, "evicted_bytes": 2 * MiB, "put_no_space_failures": 0}
    assert parse_master_metrics("") == {}


def test_holder_address_is_the_one_routing_to_the_master():
    assert local_address_towards(replace(ADDRESS, master="127.0.0.1:50051")) == "127.0.0.1"


def test_holder_command(tmp_path):
    sized = HolderProcess(tmp_path, 64 * MiB, host="10.0.0.7", parent_death=False).command()
    assert sized[1:3] == ["-m", "seerd.kvpool.holder"]
    assert sized[sized.index("--segment-bytes") + 1] == str(64 * MiB)
    assert sized[sized.index("--host") + 1] == "10.0.0.7" and "--no-parent-death" in sized
    assert "--segment-bytes" not in HolderProcess(tmp_path).command()  # sized from the node's free RAM
