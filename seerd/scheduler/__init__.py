"""Scheduling policies behind one interface (`Policy.plan(snapshot) -> Plan`)."""

from seerd.scheduler.views import Assignment, Plan, Policy, QueuedRequest, Snapshot, WorkerLoad
from seerd.scheduler.divided import DividedPolicy
from seerd.scheduler.group import GroupPolicy
from seerd.scheduler.queue import RequestQueue
from seerd.scheduler.seer import SeerPolicy

POLICIES: dict[str, type] = {"divided": DividedPolicy, "group": GroupPolicy, "seer": SeerPolicy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None


__all__ = [
    "Assignment", "DividedPolicy", "GroupPolicy", "POLICIES", "Plan", "Policy", "QueuedRequest",
    "RequestQueue", "SeerPolicy", "Snapshot", "WorkerLoad", "make_policy", "make_sim_policy",
]


def make_sim_policy(name: str, true_lengths: dict[int, int], group_of: dict[int, int] | None = None) -> Policy:
    """The daemon's policies plus the simulation-only ones, which need the true lengths (and,
    for `seer-revealed[:SIGMA]`, each request's group)."""
    from seerd.scheduler.oracle import OraclePolicy, RevealedSeerPolicy, StreamRLOraclePolicy

    oracles = {"oracle": OraclePolicy, "streamrl-oracle": StreamRLOraclePolicy}
    if name in oracles:
        return oracles[name](true_lengths)
    base, _, sigma = name.partition(":")
    if base == "seer-revealed" and group_of is not None:
        try:
            return RevealedSeerPolicy(true_lengths, group_of, float(sigma or 0.0))
        except ValueError as exc:
            raise ValueError(f"bad policy {name!r}: seer-revealed takes a sigma >= 0 ({exc})") from None
    if name in POLICIES:
        return POLICIES[name]()
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join([*POLICIES, *oracles, 'seer-revealed[:SIGMA]'])}")
