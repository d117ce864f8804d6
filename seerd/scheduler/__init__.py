"""Scheduling policies behind one interface (`Policy.plan(snapshot) -> Plan`)."""

from seerd.scheduler.base import Assignment, Plan, Policy, QueuedRequest, Snapshot, WorkerLoad
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
    "RequestQueue", "SeerPolicy", "Snapshot", "WorkerLoad", "make_policy",
]
