# Two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv (Python 3.10+) with everything pinned in constraints-dev.txt when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tmcore-installed

.PHONY: test test-slow demo lint bench docs clean-venv

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-dev.txt -e ".[all]"
	touch $(STAMP)

# Two worker processes of one thread each (one per core of a 2-core machine), a test file
# per worker at a time (its module fixtures are built once); TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check tmcore backends adapters tests examples benchmarks
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Only the tests marked slow (skipped by `make test`); CI runs them after it.
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 TMCORE_SLOW_TESTS=1 $(PY) -m pytest -q -m slow $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Binding under the paper protocol and the streaming one, seed 0, two worker processes of one
# thread each (deterministic: a rerun prints the same table; compared with the committed results).
demo: $(STAMP)
	$(PY) -m examples.diagnostics demo --jobs 2

lint: $(STAMP)
	$(PY) -m ruff check tmcore backends adapters tests examples benchmarks

# Regenerates BENCHMARKS.md and benchmarks/results/ (about 15 min on a 2-core CPU).
bench: $(STAMP)
	$(PY) -m benchmarks.run --quick

# The documentation site (guides and the API reference) into docs/_build/html; warnings are errors.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

clean-venv:
	rm -rf $(VENV)
