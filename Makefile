# `make demo` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_DIR := demo-out

# Modules compiled once and reused, as an installed package has them: a machine that sets
# PYTHONDONTWRITEBYTECODE would make every `ckpt` process the suite starts compile them again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint format venv clean bench fuzz check-torch-free docs

venv: $(STAMP)

# --no-compile: pip would byte-compile every module of torch, transformers and deepspeed, most
# of which no test imports; an import compiles (and caches) what it needs.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile --upgrade pip setuptools wheel -c constraints.txt
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e '.[torch,plot,dev]'
	touch $(STAMP)

# The documentation site into site/: offline, and strict (a warning fails the build). Its
# tools are the docs extra, installed into the venv once.
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

demo: $(STAMP)
	rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	$(VENV)/bin/ckpt harness parity --world-size 2 --steps 5 --out $(DEMO_DIR) --plot $(DEMO_DIR)/parity.png
	$(VENV)/bin/ckpt inspect $(DEMO_DIR)/ddp/wrapped.pt
	$(VENV)/bin/ckpt strip-module $(DEMO_DIR)/ddp/wrapped.pt $(DEMO_DIR)/ddp/stripped.pt
	$(VENV)/bin/ckpt diff $(DEMO_DIR)/ddp/wrapped.pt $(DEMO_DIR)/ddp/stripped.pt --align --fail-on value
	$(VENV)/bin/ckpt diff $(DEMO_DIR)/ddp/stripped.pt $(DEMO_DIR)/single/bare.pt --fail-on missing,unexpected,shape,dtype,value

# Includes the fuzzer's short, derandomized budget (tests/fuzz; CKPT_FUZZ_LONG=0 keeps it so).
# Two workers (pytest-xdist); tests that share a costly fixture, or must not run at once, run
# on one of them (tests/helpers/worker_groups.py). `make test PYTEST_ARGS=-n0` runs the suite in
# one process, and PYTEST_ARGS="-n 2 tests/io" the tests of one folder.
PYTEST_ARGS ?= -n 2
test: $(STAMP)
	CKPT_FUZZ_LONG=0 $(PY) -m pytest -q --dist loadgroup $(PYTEST_ARGS)

# The fuzzer's long run (the short one is part of `make test`): random inputs for
# FUZZ_SECONDS (FUZZ_SEED repeats a run), and the scaling scenario at its full size. New findings are written to tests/fuzz/regressions/
# and logged in tests/fuzz/findings/; `cd tests/fuzz && ../../.venv/bin/python -m
# fuzzkit.manifest` drafts their EXPECTED_FAILURES.json entries.
FUZZ_SECONDS ?= 600
FUZZ_SEED ?= $(shell date +%s)
fuzz: $(STAMP)
	CKPT_FUZZ_LONG=1 CKPT_FUZZ_SECONDS=$(FUZZ_SECONDS) CKPT_FUZZ_SEED=$(FUZZ_SEED) \
	$(PY) -m pytest -q -s -p no:cacheprovider -p no:randomly \
	  tests/fuzz/test_fuzz_library.py::test_fuzz_library tests/fuzz/test_fuzz_cli.py \
	  tests/fuzz/test_scaling.py

lint: $(STAMP)
	$(VENV)/bin/ruff check ckpt_tools tests benchmarks fixtures
	$(VENV)/bin/ruff format --check ckpt_tools tests benchmarks fixtures

# `pip install .` without extras in a fresh venv: no torch; the torch-free commands work on the
# fixtures and the torch ones name the extra (.ci/torch-free; the venv here saves its DCP input).
check-torch-free: $(STAMP)
	.ci/torch-free

format: $(STAMP)
	$(VENV)/bin/ruff format ckpt_tools tests benchmarks fixtures
	$(VENV)/bin/ruff check --fix ckpt_tools tests benchmarks fixtures

clean:
	rm -rf $(VENV) $(DEMO_DIR) site *.egg-info
