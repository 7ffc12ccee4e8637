# `make demo` and `make test` set up what is missing (scripts/setup.sh) and then run.
# Set-up runs again only when pyproject.toml or scripts/setup.sh changed (a stamp file).
# Defaults: a virtual environment of the project's own in $(VENV); PYTHON=... uses that
# interpreter instead (nothing is created then).
VENV ?= .venv
ifeq ($(origin PYTHON), command line)
STAMP := .setup-stamp
else
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
endif
export VENV

.PHONY: setup demo test test-all lint

$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(if $(filter command line,$(origin PYTHON)),$(PYTHON),) bash scripts/setup.sh
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m spmd_compiler demo

# Two phases: the in-process tests on 2 workers (pytest-xdist, a file per worker at a
# time), then the real multi-process (gloo) tests alone, so that their ranks and timeouts
# never share the cores with another test.
test: $(STAMP)
	$(PYTHON) -m pytest -m "not slow and not dist" -n 2 --dist loadfile
	$(PYTHON) -m pytest -m "dist and not slow"

test-all: $(STAMP)  # the slow tier too (model zoo, Inductor float64/fsdp, ...)
	$(PYTHON) -m pytest

lint: $(STAMP)  # ruff, then mypy on the library (config: [tool.mypy] in pyproject.toml)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy spmd_compiler passes parallel_modes
