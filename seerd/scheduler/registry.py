"""Every policy by name, with the traits the rest of seerd asks about instead of testing names.

The coordinator's start gate, the KV pool's `auto` mode, the report's preemption note and the
CLI's `--policy` choices read this table, so a new policy is declared here once. It imports only
the pure policy modules (no torch, vLLM or FastAPI): config.py and the CLI import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from seerd.scheduler.divided import DividedPolicy
from seerd.scheduler.group import GroupPolicy
from seerd.scheduler.oracle import OraclePolicy, RevealedSeerPolicy, StreamRLOraclePolicy
from seerd.scheduler.seer import SeerPolicy
from seerd.scheduler.views import Policy


@dataclass(frozen=True)
class PolicyTraits:
    """What a policy does that matters outside the scheduler."""

    # Each whole group is bound to one worker once and never chunked (veRL's up-front split).
    binds_groups_up_front: bool
    # No lease before every expected worker registered: the bindings are made over all of them.
    waits_for_every_worker: bool
    # A request's chunks may run on different workers, so a KV pool saves their re-prefill.
    moves_requests: bool
    # A chunk is leased only with KV room for its whole context and budget: engines never preempt.
    respects_kv_admission: bool


# seer, divided and the length oracle: chunks re-queued after each lease, KV admission, any worker.
CHUNKED_TRAITS = PolicyTraits(binds_groups_up_front=False, waits_for_every_worker=False, moves_requests=True,
                              respects_kv_admission=True)


@dataclass(frozen=True)
class PolicyEntry:
    name: str
    policy_class: type
    traits: PolicyTraits
    summary: str  # one line for `--help`


def _by_name(*entries: PolicyEntry) -> Mapping[str, PolicyEntry]:
    return MappingProxyType({entry.name: entry for entry in entries})


# What `seerd run --policy` offers, its default first.
DAEMON_POLICIES = _by_name(
    PolicyEntry("seer", SeerPolicy, CHUNKED_TRAITS, "context-aware (probes first, then longest estimate)"),
    PolicyEntry("divided", DividedPolicy, CHUNKED_TRAITS, "chunked FCFS"),
    PolicyEntry("group", GroupPolicy, PolicyTraits(binds_groups_up_front=True, waits_for_every_worker=True,
                                                   moves_requests=False, respects_kv_admission=False),
                "veRL baseline"),
)

REVEALED_SEER = "seer-revealed"  # takes ":SIGMA", the noise on what is revealed (scheduler/oracle.py)

# The simulator's comparisons, which know the true lengths (the daemon has none).
SIM_ONLY_POLICIES = _by_name(
    PolicyEntry("oracle", OraclePolicy, CHUNKED_TRAITS, "divided, longest true length first"),
    PolicyEntry("streamrl-oracle", StreamRLOraclePolicy,
                # Group-atomic but bound as workers ask, each group only when all of it fits.
                PolicyTraits(binds_groups_up_front=False, waits_for_every_worker=False, moves_requests=False,
                             respects_kv_admission=True),
                "whole groups, longest true length bucket first"),
    PolicyEntry(REVEALED_SEER, RevealedSeerPolicy, CHUNKED_TRAITS,
                "seer told each group's true longest at its first finish (a diagnostic)"),
)

POLICIES: Mapping[str, type] = MappingProxyType({name: e.policy_class for name, e in DAEMON_POLICIES.items()})


def policy_entry(name: str) -> PolicyEntry:
    """The entry of a daemon or simulator policy (`seer-revealed:SIGMA` is `seer-revealed`'s)."""
    base = name.partition(":")[0] if name.startswith(f"{REVEALED_SEER}:") else name
    entry = DAEMON_POLICIES.get(base) or SIM_ONLY_POLICIES.get(base)
    if entry is None:
        raise ValueError(f"unknown policy {name!r}; choose from "
                         f"{', '.join([*DAEMON_POLICIES, *SIM_ONLY_POLICIES])}")
    return entry


def policy_traits(name: str) -> PolicyTraits:
    return policy_entry(name).traits


def daemon_policies_where(test: Callable[[PolicyTraits], bool]) -> tuple[str, ...]:
    """The daemon policies whose traits pass `test`, in `DAEMON_POLICIES` order (for messages)."""
    return tuple(name for name, entry in DAEMON_POLICIES.items() if test(entry.traits))


def make_policy(name: str) -> Policy:
    if name not in DAEMON_POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(DAEMON_POLICIES))}")
    return DAEMON_POLICIES[name].policy_class()


def make_sim_policy(name: str, true_lengths: dict[int, int], group_of: dict[int, int] | None = None) -> Policy:
    """The daemon's policies plus the simulation-only ones, which need the true lengths (and,
    for `seer-revealed[:SIGMA]`, each request's group)."""
    base, _, sigma = name.partition(":")
    if base == REVEALED_SEER and group_of is not None:
        try:
            return RevealedSeerPolicy(true_lengths, group_of, float(sigma or 0.0))
        except ValueError as exc:
            raise ValueError(f"bad policy {name!r}: seer-revealed takes a sigma >= 0 ({exc})") from None
    if name in DAEMON_POLICIES:
        return DAEMON_POLICIES[name].policy_class()
    oracles = [n for n in SIM_ONLY_POLICIES if n != REVEALED_SEER]
    if name in oracles:
        return SIM_ONLY_POLICIES[name].policy_class(true_lengths)
    raise ValueError(f"unknown policy {name!r}; choose from "
                     f"{', '.join([*sorted(DAEMON_POLICIES), *oracles, f'{REVEALED_SEER}[:SIGMA]'])}")
