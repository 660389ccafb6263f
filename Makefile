# Set-up and entry points. `make demo` and `make test` each create .venv, install what they
# need (once: a stamp file records the install and is redone only when a pyproject.toml or this
# Makefile changes) and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

# Every distribution of the repository that the default install includes (editable).
DISTRIBUTIONS := core[cuda] ops_builtin mappings_builtin mappings_aten .
PYPROJECTS := pyproject.toml core/pyproject.toml ops_builtin/pyproject.toml mappings_builtin/pyproject.toml mappings_aten/pyproject.toml
# The test environment adds every further plugin under plugins/, so that their tests run too.
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
TEST_REQUIREMENTS := pytest pytest-xdist pytest-timeout transformers expecttest

# Test workers (CI's machine has 2 cores); worksteal balances tests of uneven length.
JOBS ?= 2

.PHONY: demo test install install-test clean

demo: $(VENV)/.installed
	$(VENV)/bin/kiln demo

# Every task the CPU tests build is also compiled with NVRTC for these GPU architectures, so CI
# (no GPU) proves that every CUDA kernel Kiln generates for them compiles.
export KILN_NVRTC_CHECK ?= sm_80,sm_90

# Kiln's modules compiled to bytecode first, as pip compiles an installed wheel's (an editable
# install does not, and where PYTHONDONTWRITEBYTECODE is set every test process that starts
# would compile them again: some 0.6 s each).
test: $(VENV)/.installed-test
	$(PY) -m compileall -q -j 0 core ops_builtin mappings_builtin mappings_aten plugins
	$(PY) -m pytest -n $(JOBS) --dist worksteal -q --durations=10 $(PYTEST_ARGS)

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, so that nothing later pulls another build of it; CPU machines take the CPU build.
$(VENV)/.installed: $(PYPROJECTS) Makefile | $(PY)
	$(PIP) torch==2.13.0
	$(PIP) $(addprefix -e ,$(DISTRIBUTIONS))
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed $(addsuffix /pyproject.toml,$(PLUGINS))
	$(PIP) $(TEST_REQUIREMENTS) $(addprefix -e ,$(PLUGINS))
	touch $@

clean:
	rm -rf $(VENV)
