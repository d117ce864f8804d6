#!/bin/bash
# seerd rollout as one Slurm job:
#
#   sbatch [SBATCH OPTIONS] slurm/rollout.sh --input PROMPTS --model MODEL_DIR --run-dir RUN_DIR \
#       [--workers-per-node N] [--gpus-per-worker G] [--policy seer|divided|group] [--chunk-tokens K] \
#       [--n G] [--max-tokens M] [--engine-arg KEY=VALUE ...] [any other `seerd run` option]
#
# The first node runs the coordinator (this script); every node runs its workers as job steps
# (`srun`, one vLLM instance each, G GPUs = tensor parallel size G; G=0 means CPU workers, the
# default when the job has no GPUs). RUN_DIR must be on a filesystem every node sees: the
# database, the secret (0600) and the coordinator's address live there. The output lands in
# RUN_DIR/rollouts.parquet and RUN_DIR/rollouts.jsonl. `seerd slurm-run --help` lists every option.
#
# Exit status 0 only when the output is complete; otherwise non-zero with the reason here (the job
# log) and in the run's database. Before the time limit (or on preemption) Slurm sends the warning
# signal below: the coordinator stops handing out work, lets in-flight chunks report (--drain-grace,
# 120 s), and requeues the job; the requeued job resumes the run from its database. Sending the
# same script again (same arguments) also resumes an unfinished run.
#
# Defaults are for H800 nodes (8 GPUs each), whole nodes; override any on the sbatch command line,
# e.g. on a CPU-only cluster: sbatch --gpus-per-node=0 slurm/rollout.sh ... --workers-per-node 2
#SBATCH --job-name=seerd-rollout
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=seerd-rollout-%j.out
#
# --signal=B:USR1@300: USR1 to this script (B:) 5 minutes before the time limit (Slurm may send it
#   up to a minute early). Keep it longer than --drain-grace plus a minute to stop the workers.
# --requeue: the job may be put back in the queue (by the coordinator after the warning, or by
#   Slurm's preemption); --open-mode=append keeps the log of every attempt.
#
# Environment: SEERD_PYTHON (default: the repository's .venv/bin/python, else python3), SEERD_ROOT
# (default: the repository this script is in), SEERD_COORDINATOR_HOST (default: this node's
# address on its default route; never loopback).
set -euo pipefail

# sbatch runs a copy of this script from Slurm's spool directory; the original's path is the job's
# Command. Its repository's `seerd` is the one imported (before any installed copy).
if [[ -n ${SEERD_ROOT:-} ]]; then
    root=$SEERD_ROOT
elif [[ -n ${SLURM_JOB_ID:-} ]]; then
    # Command= is the script's path and its arguments (a path with spaces needs SEERD_ROOT).
    script=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*$/\1/p' | head -n1)
    root=$(cd "$(dirname "$script")/.." 2>/dev/null && pwd || echo "${script:-?}")
else
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fi
if [[ ! -f $root/seerd/__init__.py ]]; then
    echo "rollout.sh: error: no seerd repository at $root; set SEERD_ROOT to it" >&2
    exit 2
fi
python=${SEERD_PYTHON:-}
if [[ -z $python ]]; then
    if [[ -x $root/.venv/bin/python ]]; then python=$root/.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}

echo "rollout.sh: job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}: $python -m seerd.cli.main slurm-run $*"
# exec: the coordinator itself receives the warning signal (B:USR1) and Slurm's SIGTERM.
exec "$python" -m seerd.cli.main slurm-run "$@"
