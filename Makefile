# posttrain: two commands do all the set-up on a fresh machine with Python 3.11:
#   make report   # create .venv, install, run the conformance matrix of the bundled implementations
#                 # (the in-process rows; make report-distributed runs the Ray and torch.distributed ones)
#   make test     # create/reuse .venv, run lint, mypy --strict, the typing tests and the whole pytest suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch lies on disk here; installing it first keeps pip from fetching a CUDA one.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test test-distributed test-reach lint typecheck pytest report report-distributed specs specs-check bench fuzz gpu-wheels torchrl-report losses-report matrix clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	# verl's and OpenRLHF's loss code for their loss rows: --no-deps, since their own pins would
	# replace torch, transformers and tensordict (and OpenRLHF's need flash_attn, no CPU build).
	$(BIN)/python -m pip install -q omegaconf codetiming
	$(BIN)/python -m pip install -q --no-deps verl==0.9.1 openrlhf==0.11.2
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict --warn-unused-ignores

specs-check: $(STAMP)
	$(BIN)/python -m posttrain.specgen specs --check

# One pytest worker per core (TEST_JOBS=N to choose), each taking whole files: the suite runs
# torch with one thread per process (tests/conftest.py), so two cores take half the time.
TEST_JOBS ?= auto
pytest: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=30

test: lint typecheck specs-check pytest

# The tests that start Ray clusters or torch.distributed process groups (about 5 min on 2 cores):
# a target of their own, as make report-distributed is for the matrix.
# The specs-only one-bug variants of every round alone (make test runs them too): each must
# fail the requirement its bug breaks; the designs without the bug must pass.
test-reach: $(STAMP)
	$(BIN)/python -m pytest -q -m reach tests

test-distributed: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20 -m distributed tests

# Every row that starts neither Ray nor torch.distributed, in one worker process per core
# (JOBS=N to choose), merged into reports/conformance.{md,html,json}.
report: $(STAMP)
	$(BIN)/posttrain report --rows in-process --out reports $(if $(JOBS),--jobs $(JOBS))

# The rows that start Ray or torch.distributed, one at a time, each in a fresh process; per-check
# timeouts from the measured start-up of such a process; a row whose failures differ from its
# declaration runs once more, shown as retried: reports/distributed/conformance.{md,html,json}.
report-distributed: $(STAMP)
	$(BIN)/posttrain report --rows distributed --out reports/distributed

specs: $(STAMP)
	$(BIN)/python -m posttrain.specgen specs

torchrl-report: $(STAMP)
	RL_WARNINGS=0 $(BIN)/python scripts/publish_torchrl_report.py docs/reports

# Every loss row of the field (reference, NeMo-RL, TorchRL, verl, TRL, OpenRLHF) through the
# loss suite, with measured gradient weights: docs/reports/losses.md (a few minutes on 2 cores).
losses-report: $(STAMP)
	RL_WARNINGS=0 $(BIN)/python scripts/publish_losses_report.py docs/reports

# The release matrix: one venv per TorchRL/TRL release (scripts/release_matrix.py's CELLS, or
# CELLS="torchrl-0.12 trl-1.0"), built from the registry under /tmp/posttrain-matrix; writes
# docs/reports/compatibility.md. About 1 min of install and 1-2 min of runs per cell on 2 cores;
# a longer job than CI's budget. POSTTRAIN_MATRIX_LOCK=<file> holds that lock during each cell's runs.
matrix: $(STAMP)
	$(BIN)/python scripts/release_matrix.py $(if $(CELLS),--cells $(CELLS))

bench: $(STAMP)
	$(BIN)/python -m pytest benchmarks -q -p no:randomly --benchmark-only $(BENCH_ARGS)

# The buffers' write-path fuzz at full size: >= 1,000 bad batches per local buffer, 50 for
# the Ray-served one (the normal test run takes 150 per buffer).
fuzz: $(STAMP)
	POSTTRAIN_FUZZ_BAD=1000 $(BIN)/python -m pytest -q -p no:randomly tests/reference_impls/test_buffer_fuzz.py

# The wheels the GPU variant needs on a lent device machine (benchmarks/gpu/README.md).
gpu-wheels: $(STAMP)
	PY=$(BIN)/python bash benchmarks/gpu/wheels.sh

clean:
	rm -rf $(VENV) reports .mypy_cache .ruff_cache
