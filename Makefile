# The two commands a newcomer needs: `make demo` and `make test`. Both install what they need.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
SEERD := $(VENV)/bin/seerd
DEMO_RUN := runs/demo

.PHONY: setup demo rl-demo test unit clean-demo

setup:
	@tools/setup.sh

# A local rollout of the trained motif model (examples/motif_model: EOS, a heavy tail, responses
# that repeat their prompt's motifs): 24 prompt groups x 8 responses on 2 vLLM-CPU workers,
# seer's default policy, then the report's plots and a few responses decoded.
MOTIF := examples/motif_model/weights
demo: setup
	rm -rf $(DEMO_RUN)
	OMP_NUM_THREADS=1 $(SEERD) run --input examples/motif_prompts.jsonl --model $(MOTIF) --run-dir $(DEMO_RUN) \
		--workers 2 --n 8 --max-tokens 2048 --chunk-tokens 256 --temperature 1.0 --dtype float32 --seed 0
	$(SEERD) report $(DEMO_RUN)
	$(PY) tools/show_outputs.py $(DEMO_RUN)

# RL on the motif model, every rollout through `seerd serve` with the trainer's newest weights
# (examples/grpo_motif.py, docs/training.md): 20 iterations, the reward per iteration printed and
# plotted to runs/rl-demo/reward.png.
rl-demo: setup
	rm -rf runs/rl-demo
	OMP_NUM_THREADS=1 $(PY) examples/grpo_motif.py --iterations 20 --work-dir runs/rl-demo

# The CPU first: which vLLM-CPU kernels the engines take (bfloat16, AMX) depends on it.
test: setup
	@$(PY) -m seerd.machine
	OMP_NUM_THREADS=1 $(PY) -m pytest

unit: setup
	$(PY) -m pytest tests/unit -q

clean-demo:
	rm -rf $(DEMO_RUN)
