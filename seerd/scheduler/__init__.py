"""Scheduling policies behind one interface (`Policy.plan(snapshot) -> Plan`); `registry.py` names
them and declares their traits."""

from seerd.scheduler.divided import DividedPolicy
from seerd.scheduler.group import GroupPolicy
from seerd.scheduler.queue import RequestQueue
from seerd.scheduler.registry import POLICIES, make_policy, make_sim_policy
from seerd.scheduler.seer import SeerPolicy
from seerd.scheduler.views import Assignment, Plan, Policy, QueuedRequest, Snapshot, WorkerLoad

__all__ = [
    "Assignment", "DividedPolicy", "GroupPolicy", "POLICIES", "Plan", "Policy", "QueuedRequest",
    "RequestQueue", "SeerPolicy", "Snapshot", "WorkerLoad", "make_policy", "make_sim_policy",
]
