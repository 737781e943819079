# Quickstart targets. Each sets up .venv first when it is missing (torch pinned to 2.13.0, the
# CPU build on local disk; an unpinned torch would pull a multi-GB CUDA build).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megazero-installed

.PHONY: setup test train bench data clean-demo

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

data: setup
	PYTHON=$(PY) bash tools/prepare_demo_data.sh

train: data
	PYTHON=$(PY) bash examples/train_demo_cpu.sh

bench: setup
	$(PY) bench/run_all.py

clean-demo:
	rm -rf runs/demo
