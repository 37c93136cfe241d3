# The project's two commands: `make setup` installs everything into .venv,
# `make test` runs the test suite (and sets up first when needed). `.ci/run` runs `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := dev

.PHONY: setup test run clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

setup: $(VENV)/.installed

test: setup
	$(BIN)/python -m pytest -q

run: setup
	$(BIN)/sloweave reproduce

clean:
	rm -rf $(VENV) results
