"""What seerd asks Slurm for, pinned: rollout.sh's #SBATCH defaults, the worker steps' srun
commands, and the submitit parameters with the sbatch script submitit makes of them, against
tests/unit/reference/slurm_parameters.txt. After an intended change:
SEERD_UPDATE_REFERENCE=1 pytest tests/unit/test_slurm_parameters.py, then review the diff.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from seerd.cli.main import EXIT_BAD_INPUT, cli
from seerd.launch.prepare import BadRun
from seerd.launch.slurm import (
    LayoutError, NotInAllocation, SlurmWorkerPool, allocation_layout, node_address, step_environment,
)
from seerd.launch.submitit_launch import SlurmResources, sbatch_script, submitit_parameters
from seerd.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(__file__).parent / "reference" / "slurm_parameters.txt"

H800_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "8",
            "SLURM_CPUS_ON_NODE": "128", "SLURM_MEM_PER_NODE": "1800000"}
CPU_ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm", "SLURM_CPUS_ON_NODE": "2"}


def two_gpu_nodes(nodelist: str) -> list[str]:
    # What `scontrol show hostnames gpu[01-02]` prints (without needing Slurm installed here).
    return {"gpu[01-02]": ["gpu01", "gpu02"], "vm": ["vm"]}[nodelist]


def step_commands(env: dict, **layout_options) -> list[str]:
    layout = allocation_layout(env, hostnames=two_gpu_nodes, **layout_options)
    pool = SlurmWorkerPool(RunDir(Path("/shared/runs/r1")), layout)
    lines = [f"# {layout.describe()}"]
    for rank in range(layout.total_workers):
        lines.append(" ".join(pool.command(rank)).replace(sys.executable, "PYTHON"))
    return lines


def submitit_section(resources: SlurmResources) -> list[str]:
    script = sbatch_script(resources, Path("/shared/runs/r1/submitit/FOLDER"), "PYTHON")
    return [json.dumps(submitit_parameters(resources), indent=1, sort_keys=True), "", script.rstrip("\n")]


def render() -> str:
    sbatch_lines = [line for line in (REPO / "slurm" / "rollout.sh").read_text().splitlines()
                    if line.startswith("#SBATCH")]
    sections = {
        "slurm/rollout.sh: #SBATCH defaults (H800 nodes)": sbatch_lines,
        "worker steps: 2 H800 nodes, 2 GPUs per worker (tensor parallel 2)": step_commands(H800_ENV, gpus_per_worker=2),
        "worker steps: this machine's CPU node, 2 workers": step_commands(CPU_ENV, workers_per_node=2),
        "submitit: defaults (1 H800 node, 8 workers)": submitit_section(SlurmResources()),
        "submitit: 4 H800 nodes, tensor parallel 4, partition and memory": submitit_section(SlurmResources(
            nodes=4, gpus_per_worker=4, mem_per_worker_mb=400_000, partition="h800", account="rl",
            slurm_args={"constraint": "ib"})),
        "submitit: the tests' CPU job": submitit_section(SlurmResources(
            gpus_per_worker=0, workers_per_node=2, time_min=10, signal_delay_s=120, drain_grace_s=60)),
    }
    return "".join(f"## {title}\n" + "\n".join(lines) + "\n\n" for title, lines in sections.items())


def test_parameters_match_the_reference_file():
    text = render()
    if os.environ.get("SEERD_UPDATE_REFERENCE"):
        REFERENCE.parent.mkdir(exist_ok=True)
        REFERENCE.write_text(text)
    assert text == REFERENCE.read_text()


def test_layout_defaults_follow_the_allocation():
    gpu = allocation_layout(H800_ENV, hostnames=two_gpu_nodes)
    assert (gpu.nodes, gpu.workers_per_node, gpu.gpus_per_worker, gpu.cpus_per_worker) == (("gpu01", "gpu02"), 8, 1, 16)
    assert gpu.mem_per_worker_mb == 1800000 // 8 and gpu.total_workers == 16 and gpu.node_of(8) == "gpu02"
    cpu = allocation_layout(CPU_ENV, hostnames=two_gpu_nodes)
    assert (cpu.workers_per_node, cpu.gpus_per_worker, cpu.cpus_per_worker, cpu.mem_per_worker_mb) == (1, 0, 2, None)


@pytest.mark.parametrize("options, words", [
    ({"gpus_per_worker": 3, "workers_per_node": 3}, "do not fit the 8 GPUs"),
    ({"gpus_per_worker": 16}, "no worker fits"),
    ({"cpus_per_worker": 64, "workers_per_node": 4}, "do not fit the 128 CPUs"),
    ({"gpus_per_worker": -1}, "must be >= 0"),
])
def test_layouts_that_do_not_fit_are_refused(options, words):
    with pytest.raises(LayoutError, match=words):
        allocation_layout(H800_ENV, hostnames=two_gpu_nodes, **options)


def test_gpu_workers_need_gpus_and_a_job_is_required():
    with pytest.raises(LayoutError, match="no GPUs"):
        allocation_layout(CPU_ENV, hostnames=two_gpu_nodes, gpus_per_worker=1)
    with pytest.raises(NotInAllocation, match="not inside a Slurm job"):
        allocation_layout({}, hostnames=two_gpu_nodes)


def test_worker_steps_do_not_inherit_the_launching_steps_settings():
    layout = allocation_layout(CPU_ENV, hostnames=two_gpu_nodes, workers_per_node=2)
    env = {"SLURM_JOB_ID": "7", "SLURM_CONF": "/etc/slurm/slurm.conf", "SLURM_NTASKS": "1", "SLURM_OVERLAP": "1",
           "SLURM_CPUS_PER_TASK": "2", "SLURM_STEP_ID": "0", "PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    assert step_environment(env, layout) == {"SLURM_JOB_ID": "7", "SLURM_CONF": "/etc/slurm/slurm.conf",
                                             "PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    assert step_environment({}, layout)["OMP_NUM_THREADS"] == "1"  # its one CPU


def test_coordinator_address_is_never_loopback(monkeypatch):
    monkeypatch.delenv("SEERD_COORDINATOR_HOST", raising=False)
    address = node_address()
    assert not address.startswith("127.") and address not in ("0.0.0.0", "localhost")
    monkeypatch.setenv("SEERD_COORDINATOR_HOST", "10.1.2.3")
    assert node_address() == "10.1.2.3"


@pytest.mark.parametrize("resources, words", [
    (SlurmResources(gpus_per_worker=3, workers_per_node=3), "exceed gpus_per_node"),
    (SlurmResources(time_min=2), "time_min must be >= 3"),
    (SlurmResources(drain_grace_s=400), "below signal_delay_s"),
    (SlurmResources(time_min=4), "below the time limit"),
    (SlurmResources(nodes=0), "nodes must be >= 1"),
])
def test_bad_resources_are_refused(resources, words):
    with pytest.raises(BadRun, match=words):
        resources.validate()


def test_slurm_run_outside_a_job_says_so_and_creates_nothing(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt_token_ids": [5, 6]}\n')
    result = CliRunner().invoke(cli, ["slurm-run", "--input", str(tmp_path / "p.jsonl"), "--model",
                                      str(tiny_model_dir), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == EXIT_BAD_INPUT and "not inside a Slurm job" in result.output
    assert not (tmp_path / "run").exists()


def test_submit_with_bad_input_fails_before_submitting(tmp_path, tiny_model_dir):
    import seerd

    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt_token_ids": "not a list"}\n')
    with pytest.raises(BadRun, match=":1:"):
        seerd.submit(tmp_path / "p.jsonl", tiny_model_dir, tmp_path / "run", gpus_per_worker=0, cluster="local")
    assert not (tmp_path / "run").exists()
    with pytest.raises(TypeError, match="unknown options"):
        seerd.submit(tmp_path / "p.jsonl", tiny_model_dir, tmp_path / "run", max_tokenz=5)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt_token_ids": [5, 6]}\n')
    for options, words in [({"kv_pool_size": "lots"}, "--kv-pool-size"), ({"policy": "fastest"}, "--policy")]:
        with pytest.raises(BadRun, match=words):
            seerd.submit(tmp_path / "p.jsonl", tiny_model_dir, tmp_path / "run", gpus_per_worker=0,
                         cluster="local", **options)
    assert not (tmp_path / "run").exists()


def test_a_worker_without_a_coordinator_gives_up_with_a_clear_message(tmp_path):
    rundir = RunDir(tmp_path / "run")
    rundir.create()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "seerd.worker", "--run-dir", str(rundir.path),
                          "--wait-for-coordinator", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 3
    assert "no coordinator address appeared" in out.stderr and "within 1s" in out.stderr


def test_a_plain_node_list_needs_no_scontrol_and_a_compressed_one_without_it_is_a_clear_error(monkeypatch):
    from seerd.launch.slurm import expand_nodelist

    monkeypatch.setenv("PATH", "/nonexistent")  # no Slurm tools on this node
    assert expand_nodelist("node01") == ["node01"]
    assert expand_nodelist("a,b") == ["a", "b"]
    with pytest.raises(LayoutError, match="scontrol is not on PATH"):
        expand_nodelist("gpu[01-02]")
