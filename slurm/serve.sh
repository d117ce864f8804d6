#!/bin/bash
# seerd serve as one Slurm job: the coordinator and its engines stay up for batch after batch.
#
#   sbatch [SBATCH OPTIONS] slurm/serve.sh --model MODEL_DIR --run-dir RUN_DIR \
#       [--workers-per-node N] [--gpus-per-worker G] [--policy seer|divided|group] [--chunk-tokens K] \
#       [--n G] [--max-tokens M] [--engine-arg KEY=VALUE ...] [any other `seerd serve` option]
#
# Batches come from the trainer: `seerd rollout --server RUN_DIR --input PROMPTS [--weights CKPT]`
# or `seerd.Client(RUN_DIR)`, from any host that sees RUN_DIR (the serve's address and secret live
# there; docs/training.md). The first node runs the serve (this script); every node runs its
# workers as job steps (`srun`, one vLLM instance each, G GPUs = tensor parallel size G; G=0: CPU
# workers). RUN_DIR must be on a filesystem every node sees. Each finished batch is also written
# to RUN_DIR/batches/N/. `seerd slurm-serve --help` lists every option.
#
# The serve runs until the job is cancelled or its time runs out. Before the time limit (or on
# preemption) Slurm sends the warning signal below: the serve stops (the batch in flight is
# interrupted, nothing acknowledged is lost) and requeues the job, which serves on from the
# database, that batch first; a client following the batch waits through the restart.
#SBATCH --job-name=seerd-serve
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=seerd-serve-%j.out
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
    echo "serve.sh: error: no seerd repository at $root; set SEERD_ROOT to it" >&2
    exit 2
fi
python=${SEERD_PYTHON:-}
if [[ -z $python ]]; then
    if [[ -x $root/.venv/bin/python ]]; then python=$root/.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}

echo "serve.sh: job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}: $python -m seerd.cli.main slurm-serve $*"
# exec: the coordinator itself receives the warning signal (B:USR1) and Slurm's SIGTERM.
exec "$python" -m seerd.cli.main slurm-serve "$@"
