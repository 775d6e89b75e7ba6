# Two commands set up and use rewritec on a fresh machine:
#   make demo   - compile the built-in CPU example and print what fired
#   make test   - run the whole test suite
# Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without an NVIDIA GPU, pin the CPU build of torch so pip never
# pulls gigabytes of CUDA wheels. GPU users keep whatever torch they install.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: demo test bench bench-quick lint clean

# setuptools warns at every editable install of a package laid out as this one is
# (the repository root is the package) about folders that may shadow it; none does here.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/rewritec compile examples/mlp.py --out rewritec_out --fast-math

# One test process per core (pytest-xdist): the suite is CPU-bound, and each test
# keeps its own caches (tests/conftest.py), so they share nothing.
test: $(VENV)/.installed
	$(PY) -m pytest -n auto

bench-quick: $(VENV)/.installed
	$(PY) -m benchmarks.run --quick

bench: $(VENV)/.installed
	$(PY) -m benchmarks.run

# ruff and mypy are tools, not dependencies: installed on first use
lint: $(VENV)/.installed
	test -x $(VENV)/bin/ruff || $(PY) -m pip install -q ruff mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine aten frontend passes kinds runtime compiler.py rulecheck.py

clean:
	rm -rf rewritec_out .pytest_cache
