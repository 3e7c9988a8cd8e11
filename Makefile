# stepgrpo: make test (lint and the suite), make demo (train the shipped model on this CPU).
PYTHON ?= python3.11
VENV ?= .venv
# The CPU build of torch; a GPU user installs a CUDA build into the venv first (README).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install lint test demo clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip show torch >/dev/null 2>&1 || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: install lint
	PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 \
	$(PY) -m pytest -q tests

# The demo: the shipped shapes model, a temporary local Prefect server, a run under runs/.
# (One torch thread: the config's `scale.threads`, applied by the flow itself.)
demo: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
	PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 \
	$(VENV)/bin/stepgrpo train --config configs/demo.yaml

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
