# The README's two commands: `make repro` (set up + default pipeline) and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: repro status test lint bench clean-venv

# torch==2.13.0 first: it is the CPU build on disk; a bare `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# dvc.yaml commands call `python`: put the venv first on PATH. `dvc repro` without a target runs ./dvc.yaml only;
# profiles run with `dvc repro profiles/<name>/dvc.yaml` (README, "Profiles").
repro: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro

# The default pipeline's status (a bare `dvc status` also lists every profile's stages).
status: $(STAMP)
	$(BIN)/dvc status dvc.yaml

test: $(STAMP)
	$(BIN)/ruff check pipeline stages tests benchmarks
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/dump.py
	$(BIN)/python benchmarks/geometry.py
	$(BIN)/python benchmarks/generate.py

clean-venv:
	rm -rf $(VENV)
