# Two entry points: `make demo` runs the main job on its defaults, `make test` runs the tests.
# Each creates the virtual environment on first use. torch is pinned to 2.13.0 because a CPU
# wheel of exactly that release ships with these machines; an unpinned torch pulls a
# multi-GB CUDA build. It is installed first, so the extras (dev, and hf: transformers and
# accelerate, which the recipes in examples/ need) resolve against it and leave it alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.thinwire-installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,hf]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/thinwire demo

# pytest exits 5 when it collects no test; that is reported, not hidden, and not a failure
# of the command itself.
test: $(STAMP)
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tools examples
	$(VENV)/bin/ruff format --check src tests tools examples

clean:
	rm -rf $(VENV) runs .pytest_cache
