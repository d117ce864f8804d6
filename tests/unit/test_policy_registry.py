"""The policy registry: each policy's traits, and the places that read them instead of its name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from seerd.cli.options import rollout_options
from seerd.config import ROLLOUT_DEFAULTS, ConfigError, RunConfig, resolve_pool_mode
from seerd.scheduler import make_policy, make_sim_policy
from seerd.scheduler.registry import DAEMON_POLICIES, SIM_ONLY_POLICIES, policy_traits


def test_each_entry_names_its_class_and_builds_it():
    for name, entry in DAEMON_POLICIES.items():
        assert entry.name == name == entry.policy_class.name == make_policy(name).name
    for name in ("oracle", "streamrl-oracle"):
        assert make_sim_policy(name, {}).name == name == SIM_ONLY_POLICIES[name].policy_class.name
    assert make_sim_policy("seer-revealed:0.5", {}, {}).name == "seer-revealed:0.5"
    assert policy_traits("seer-revealed:0.5") == policy_traits("seer")


def test_traits_that_go_together():
    for entry in [*DAEMON_POLICIES.values(), *SIM_ONLY_POLICIES.values()]:
        traits = entry.traits
        if traits.binds_groups_up_front:  # bindings made once must be made over every worker, never moved
            assert traits.waits_for_every_worker and not traits.moves_requests, entry.name


def test_group_is_the_one_daemon_policy_that_binds_and_preempts():
    group = policy_traits("group")
    assert group.binds_groups_up_front and group.waits_for_every_worker
    assert not group.moves_requests and not group.respects_kv_admission
    for name in DAEMON_POLICIES.keys() - {"group"}:
        assert policy_traits(name).moves_requests and policy_traits(name).respects_kv_admission


def test_kv_pool_auto_follows_whether_requests_move():
    assert resolve_pool_mode("auto", workers=4, policy="seer", nodes=2) == "mooncake"
    assert resolve_pool_mode("auto", workers=2, policy="seer") == "off"  # one node: `seerd run`
    assert resolve_pool_mode("auto", workers=4, policy="group", nodes=2) == "off"
    assert resolve_pool_mode("auto", workers=1, policy="seer", nodes=2) == "off"
    assert resolve_pool_mode("auto", workers=4, policy="fastest", nodes=2) == "off"
    # GPU workers: the pool on one node too (recomputing a moved chunk's context costs GPU time).
    assert resolve_pool_mode("auto", workers=4, policy="seer", nodes=2, gpus_per_worker=1) == "mooncake"
    assert resolve_pool_mode("auto", workers=8, policy="divided", gpus_per_worker=1) == "mooncake"
    assert resolve_pool_mode("auto", workers=1, policy="seer", gpus_per_worker=8) == "off"
    assert resolve_pool_mode("auto", workers=8, policy="group", gpus_per_worker=1) == "off"
    with pytest.raises(ConfigError, match="--policy must be one of seer, divided, group"):
        RunConfig(input_path="p", model_path="m", policy="fastest").validate()


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="unknown policy 'oracle'"):  # the daemon has no true lengths
        make_policy("oracle")
    with pytest.raises(ValueError, match="unknown policy"):
        policy_traits("fastest")


def test_rollout_defaults_name_every_rollout_option():
    params = rollout_options(lambda **_: None).__click_params__
    flags = {p.name: p.default for p in params if p.name not in ("input_path", "model_path", "run_dir")}
    assert flags == dict(ROLLOUT_DEFAULTS)
    policy = next(p for p in params if p.name == "policy")
    assert list(policy.type.choices) == list(DAEMON_POLICIES)


def test_the_registry_loads_without_heavy_packages():
    heavy = ("torch", "vllm", "fastapi", "starlette", "sqlalchemy", "click")
    code = ("import sys, seerd.scheduler.registry; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(heavy)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stdout
