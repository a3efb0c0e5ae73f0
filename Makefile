# `make train` and `make test` set up .venv on first use, then run.
# Extra arguments: make train ARGS="model=mlp optimizer=sgd"   make test ARGS="-k sampler"
# make test-fast: the inner loop (unit tests and quick CLI checks; no test marked slow).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test test-fast clean-venv

# Stamp files record what is installed, so a changed requirements file re-installs.
$(VENV)/.runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt benchmarks/requirements-lightning.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

train: $(VENV)/.runtime
	$(PY) train.py $(ARGS)

test: $(VENV)/.dev
	$(PY) -m pytest $(ARGS)

test-fast: $(VENV)/.dev
	$(PY) -m pytest -m "not slow" $(ARGS)

clean-venv:
	rm -rf $(VENV)
