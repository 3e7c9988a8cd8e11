# stepgrpo: make test (lint and the suite), make demo (train the shipped model on this CPU).
PYTHON ?= python3.11
VENV ?= .venv
# torch: kept if the venv has it (a GPU user installs a CUDA build first, README); else the CPU
# build on a Linux machine without a GPU (scripts/install_torch.py says which it got).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install lint test test-fast bench-smoke demo clean FORCE

# The install is editable and strict (pyproject.toml: each file linked into the installed layout,
# what a type checker in another project follows): it is made again when the list of the code's
# files changes, not only pyproject.toml.
CODE_FILES := $(shell find stepgrpo stepgrpo_cli stepgrpo_core flows tasks storage -name '*.py' -not -path '*/__pycache__/*' 2>/dev/null | LC_ALL=C sort)
$(VENV)/.code-files: FORCE
	@mkdir -p $(VENV)
	@echo "$(CODE_FILES)" | cmp -s - $@ || echo "$(CODE_FILES)" > $@

$(VENV)/.installed: pyproject.toml $(VENV)/.code-files
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) scripts/install_torch.py "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	# the reference model code the HPSv2 / ImageReward conversions are tested against
	# (tests/test_preference_rewards.py); without their dependencies (torchvision, timm, fairscale)
	$(PY) -m pip install --quiet --no-deps "open-clip-torch==3.3.0" "image-reward==1.5"
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers, one test file each at a time (a file's fixtures, e.g. its trained run, are built once);
# most slow tests wait on servers and subprocesses, so two of them share 2 cores well. The slowest 15 at the end.
# The product's tests; the benchmarks' smoke tests (tests/test_bench_*.py) are `make bench-smoke`.
test: install lint
	PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 \
	$(PY) -m pytest -q tests -n 2 --dist loadfile --no-loadscope-reorder --durations=15 \
	  --ignore-glob='tests/test_bench_*.py'

# The lab's: every benchmark path once at its tiniest settings, and the records' analyses (CI runs both).
bench-smoke: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 \
	$(PY) -m pytest -q tests/test_bench_*.py -n 2 --dist loadfile --no-loadscope-reorder --durations=10

# The edit-test loop: every test not marked slow (no Prefect server, no subprocess run), two at a time.
test-fast: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
	$(PY) -m pytest -q tests -m "not slow" -n 2 --durations=10

# The demo: the shipped shapes model, a temporary local Prefect server, a run under runs/.
# (One torch thread: the config's `scale.threads`, applied by the flow itself.)
demo: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 \
	$(VENV)/bin/stepgrpo demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
