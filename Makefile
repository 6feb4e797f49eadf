# posttrain: two commands do all the set-up on a fresh machine with Python 3.11:
#   make report   # create .venv, install, run the conformance matrix of every bundled implementation
#   make test     # create/reuse .venv, run lint, mypy --strict, the typing tests and the whole pytest suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch lies on disk here; installing it first keeps pip from fetching a CUDA one.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test lint typecheck pytest report specs specs-check bench fuzz gpu-wheels torchrl-report clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict --warn-unused-ignores

specs-check: $(STAMP)
	$(BIN)/python -m posttrain.specgen specs --check

pytest: $(STAMP)
	$(BIN)/python -m pytest -q --durations=30

test: lint typecheck specs-check pytest

report: $(STAMP)
	$(BIN)/posttrain report --out reports

specs: $(STAMP)
	$(BIN)/python -m posttrain.specgen specs

torchrl-report: $(STAMP)
	RL_WARNINGS=0 $(BIN)/python scripts/publish_torchrl_report.py docs/reports

bench: $(STAMP)
	$(BIN)/python -m pytest benchmarks -q -p no:randomly --benchmark-only $(BENCH_ARGS)

# The buffers' write-path fuzz at full size: >= 1,000 bad batches per local buffer, 50 for
# the Ray-served one (the normal test run takes 150 per buffer).
fuzz: $(STAMP)
	POSTTRAIN_FUZZ_BAD=1000 $(BIN)/python -m pytest -q -p no:randomly tests/test_buffer_fuzz.py

# The wheels the GPU variant needs on a lent device machine (benchmarks/gpu/README.md).
gpu-wheels: $(STAMP)
	PY=$(BIN)/python bash benchmarks/gpu/wheels.sh

clean:
	rm -rf $(VENV) reports .mypy_cache .ruff_cache
