# Two entry points for a fresh machine with Python 3.11 and pip: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test lint typecheck unit serve bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first, so nothing below pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[hf,dev]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check tokenyard tests bench
	$(PY) -m ruff format --check tokenyard tests bench
	$(PY) -m mypy tokenyard

test: lint
	$(PY) -m pytest -q -p no:cacheprovider

unit: install
	$(PY) -m pytest -q tests/unit

serve: install
	$(PY) -m tokenyard serve --model tiny

bench: install
	$(PY) bench/broker_throughput.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
