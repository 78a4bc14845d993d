# Two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv (Python 3.10+) with everything pinned in constraints-dev.txt when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tmcore-installed

.PHONY: test demo lint bench clean-venv

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-dev.txt -e ".[all]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check tmcore backends adapters tests examples benchmarks
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m examples.numpy_recurrence

lint: $(STAMP)
	$(PY) -m ruff check tmcore backends adapters tests examples benchmarks

clean-venv:
	rm -rf $(VENV)
