"""A parent-death signal for child processes, beside the packages that start children (the local
worker pool in launch/, the KV pool holder and pool service in kvpool/) so that none of them
imports another for it; kept free of heavy imports (no coordinator, no vLLM)."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: signal.Signals = signal.SIGTERM) -> None:
    """Ask the kernel to send this process `signum` when its parent dies (kill -9 included).

    Use as `preexec_fn`, or call in the child itself. The signal fires when the parent *thread*
    that forked the child exits, so spawn from a long-lived thread."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signum)
