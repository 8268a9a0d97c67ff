# The README's two commands: `make repro` (set up + default pipeline) and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: repro study status test test-lowest lint bench bench-gpu clean-venv

# The installer is uv (pip's resolution, the same versions, in under a minute where pip takes three: pip resolves
# over the indexes and compiles the bytecode on one core; docs/train.md "Time budget"), itself installed by pip into
# the venv. uv does not read pip's configuration: a local wheel directory pip is pointed at (PIP_FIND_LINKS, e.g. the
# CPU torch build on disk) is passed on. Where uv cannot install (its index unreachable), pip installs the same
# requirements.
# --compile-bytecode: write every installed module's .pyc now, as pip does; uv leaves it to the first import, and
# where PYTHONDONTWRITEBYTECODE is set (many containers) no import ever writes it, so every stage process and pool
# worker would compile torch, sklearn, dask and polars from source again (15 s for `import skops.io`, 5 s for torch;
# the gates stage 69 s instead of 39 s). 20–30 s once at install.
uv_install = $(1)/bin/uv pip install -q --compile-bytecode --python $(1)/bin/python $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
pip_install = $(1)/bin/python -m pip install -q

# torch==2.13.0 first: it is the CPU build on disk; a bare `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call pip_install,$(VENV)) 'uv>=0.9'
	$(call uv_install,$(VENV)) torch==2.13.0 || $(call pip_install,$(VENV)) torch==2.13.0
	$(call uv_install,$(VENV)) -e '.[dev]' || $(call pip_install,$(VENV)) -e '.[dev]'
	touch $(STAMP)

# dvc.yaml commands call `python`: put the venv first on PATH. `dvc repro` without a target runs ./dvc.yaml only;
# profiles run with `dvc repro profiles/<name>/dvc.yaml` (docs/pipeline.md "Profiles").
repro: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro

# The study profile: the full matrix (both tasks × uniform, geometric, joint × three seeds = 18 models, dynamics and
# generate on every seed), outputs under artifacts/study/ (docs/pipeline.md "Profiles", docs/train.md "Time budget").
study: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro profiles/study/dvc.yaml

# The default pipeline's status (a bare `dvc status` also lists every profile's stages).
status: $(STAMP)
	$(BIN)/dvc status dvc.yaml

# The package at the lowest versions pyproject.toml admits (every runtime floor pinned, .ci/floors.py): a floor below
# an API the code uses fails here, not in a user's run. The fast suite (not the slow end-to-end tests), no dev extra.
LOW := .venv-lowest
LOW_REQS := -e '.[hf]' 'pytest>=8' 'pytest-xdist>=3.5' 'hypothesis>=6.100'
$(LOW)/.installed: pyproject.toml .ci/floors.py
	$(PYTHON) -m venv $(LOW)
	$(call pip_install,$(LOW)) 'uv>=0.9'
	$(call uv_install,$(LOW)) torch==2.13.0 || $(call pip_install,$(LOW)) torch==2.13.0
	$(PYTHON) .ci/floors.py hf > $(LOW)/constraints.txt
	$(call uv_install,$(LOW)) -c $(LOW)/constraints.txt $(LOW_REQS) || $(call pip_install,$(LOW)) -c $(LOW)/constraints.txt $(LOW_REQS)
	touch $@

test-lowest: $(LOW)/.installed
	PATH="$(abspath $(LOW)/bin):$$PATH" $(LOW)/bin/python -m pytest -n 2 --dist loadfile -m "not slow"

# mypy reads pyproject.toml's [tool.mypy] (the package from the tree, the DVC launchers); a type error fails the
# target. The floor in the dev extra (mypy>=2.0) passes as well as the newest.
# The exactness tests (one token's numbers whatever its batch; device decisions = host decisions; online = offline)
# run again under two other CPU code paths of ATen and MKL than the machine's own: a claim that holds on one CPU
# family only fails here (SPEC §8 "Batch-invariant inference").
EXACT := tests/test_invariant.py tests/test_device_rules.py tests/test_latency.py tests/test_lookahead.py tests/test_stats.py

test: $(STAMP)
	$(BIN)/ruff check pipeline stages tests benchmarks
	$(BIN)/mypy
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -n 2 --dist loadfile
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(BIN)/python -m pytest -q -n 2 --dist loadfile $(EXACT)
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -n 2 --dist loadfile $(EXACT)

bench: $(STAMP)
	$(BIN)/python benchmarks/dump.py
	$(BIN)/python benchmarks/geometry.py
	$(BIN)/python benchmarks/generate.py

# One CUDA device, ≤ 6 min: dump and early-exit decoding at Ouro-1.4B shape vs the bare model (docs/dump.md,
# "On an accelerator"); without CUDA the same code at a tiny shape on the CPU. Needs the hf extra for the Ouro part.
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/gpu.py --timeout 360

clean-venv:
	rm -rf $(VENV)
