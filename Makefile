# Quickstart targets. Each sets up .venv first when it is missing (torch pinned to 2.13.0, the
# CPU build on local disk; an unpinned torch would pull a multi-GB CUDA build).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megazero-installed

.PHONY: setup test peers train bench data clean-demo

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests --ignore=tests/peers

# The peer suite: megazero against the real Megatron-LM core and DeepSpeed releases pinned in
# tests/peers/requirements.txt, in its own virtualenv (never .venv), on CPU/gloo.
PEERS_VENV  ?= .peers/venv
PEERS_PY    := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.peers-installed

$(PEERS_STAMP): tests/peers/requirements.txt pyproject.toml
	test -x $(PEERS_PY) || python3 -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install -q --upgrade pip
	$(PEERS_PY) -m pip install -q torch==2.13.0
	$(PEERS_PY) -m pip install -q -r tests/peers/requirements.txt
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)
	# importlib mode: tests/megatron must not shadow the real `megatron` package on sys.path
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(PEERS_PY) -m pytest -q --import-mode=importlib tests/peers

data: setup
	PYTHON=$(PY) bash tools/prepare_demo_data.sh

train: data
	PYTHON=$(PY) bash examples/train_demo_cpu.sh

bench: setup
	$(PY) bench/run_all.py

clean-demo:
	rm -rf runs/demo
