# `make train` and `make test` set up .venv on first use, then run.
# Extra arguments: make train ARGS="model=mlp optimizer=sgd"   make test ARGS="-k sampler"
# make test-fast: the inner loop (unit tests and quick CLI checks; no test marked slow). Other marks: MARKS="...",
# e.g. a fork whose README is its own: make test-fast MARKS="not slow and not template" (ARGS='-m ...' would replace
# the marks, not add to them: pytest keeps the last -m).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test test-fast clean-venv

# uv installs the packages pip would, downloading and unpacking in parallel (requirements-dev.txt in 75-97 s where
# pip took 151-162 s on 2 cores: docs/speed.md). --compile-bytecode, as pip does: no run compiles torch's sources again
# (where PYTHONDONTWRITEBYTECODE is set, every run would). uv reads its own settings, not pip's: a package index
# set for pip goes in UV_INDEX_URL / UV_EXTRA_INDEX_URL too.
INSTALL := $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY)

$(VENV)/bin/uv:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "uv>=0.13,<0.14"

# Stamp files record what is installed, so a changed requirements file re-installs.
$(VENV)/.runtime: requirements.txt | $(VENV)/bin/uv
	$(INSTALL) -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt benchmarks/requirements-lightning.txt
	$(INSTALL) -r requirements-dev.txt
	touch $@

train: $(VENV)/.runtime
	$(PY) train.py $(ARGS)

test: $(VENV)/.dev
	$(PY) -m pytest $(ARGS)

MARKS ?= not slow
test-fast: $(VENV)/.dev
	$(PY) -m pytest -m "$(MARKS)" $(ARGS)

clean-venv:
	rm -rf $(VENV)
