# The project's commands (see README):
#   make setup   installs everything: .venv (core, simulator, CPU runtime) and .venv-vllm (vLLM plug-in)
#   make run     the main job on built-in defaults (sloweave reproduce)
#   make test    the whole test suite, in both environments (.ci/run runs exactly this)
# vLLM pins a CUDA build of torch that conflicts with the CPU runtime's torch, so the
# plug-in lives in its own environment; `make setup-core` installs only .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV := .venv-vllm
EXTRAS := dev,runtime

.PHONY: setup setup-core setup-vllm test test-core test-vllm run clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -e '.[dev,vllm]'
	touch $@

setup-core: $(VENV)/.installed
setup-vllm: $(VLLM_VENV)/.installed
setup: setup-core setup-vllm

test-core: setup-core
	$(BIN)/python -m pytest -q

test-vllm: setup-vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm_plugin

test: test-core test-vllm

run: setup-core
	$(BIN)/sloweave reproduce

clean:
	rm -rf $(VENV) $(VLLM_VENV) results
