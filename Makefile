PYTHON ?= python3
export PYTHON

.PHONY: setup demo test lint

setup:
	bash scripts/setup.sh

demo: setup
	$(PYTHON) -m spmd_compiler demo

test: setup
	$(PYTHON) -m pytest

lint:
	$(PYTHON) -m ruff check .
