"""The wire protocol: engine request ids round-trip, and the module stays light."""

from __future__ import annotations

import subprocess
import sys

from seerd.protocol import ChunkIdentity, parse_engine_id


def test_engine_ids_round_trip():
    identity = ChunkIdentity(12, 3, 7, 99, 31, True)
    assert identity.engine_id == "c12e3g7r99p31h"
    assert parse_engine_id(identity.engine_id) == identity
    assert parse_engine_id("c12e3g7r99p31").is_probe is False
    assert parse_engine_id("c12e3g7r99p31h-94554842") == identity  # vLLM's internal suffix
    assert identity.lease_key == "c12e3"
    for foreign in ("0_c12e3g7r99p31", "c1e2", "cmpl-abc", ""):
        assert parse_engine_id(foreign) is None


def test_the_protocol_imports_nothing_else_of_seerd_and_nothing_heavy():
    code = ("import sys, seerd.protocol; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('seerd', 'fastapi', 'httpx', 'sqlalchemy', 'numpy', 'torch', 'vllm')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['seerd', 'seerd.protocol']"
