# Two entry points: `make demo` runs the main job on its defaults, `make test` runs the tests.
# Each creates the virtual environment on first use. torch is pinned to 2.13.0 because a CPU
# wheel of exactly that release ships with these machines; an unpinned torch pulls a
# multi-GB CUDA build. It is installed first, so the extras (dev, and hf: transformers and
# accelerate, which the recipes in examples/ need) resolve against it and leave it alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.thinwire-installed
NATIVE := $(VENV)/.thinwire-native
NATIVE_SRC := src/thinwire/compress/native.py
DELAYLINE := $(VENV)/.thinwire-delayline
DELAYLINE_SRC := src/thinwire/testbed/delayline.c

.PHONY: demo test check lint install native clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,hf]'
	touch $(STAMP)

# The compiled packing kernels, built once here so that no run compiles (about a minute).
# A failed build is not fatal: packing then runs on pure torch and says so once per run.
$(NATIVE): $(STAMP) $(NATIVE_SRC)
	$(PY) -m thinwire bench native build packing || echo "thinwire: continuing without them"
	touch $(NATIVE)

# The testbed's delay line (delay, jitter and loss), a small C program: about a second.
# Without it the testbed still runs, only without --delay/--jitter/--loss.
$(DELAYLINE): $(STAMP) $(DELAYLINE_SRC)
	$(PY) -m thinwire bench native build delayline || echo "thinwire: testbed without delay, jitter, loss"
	touch $(DELAYLINE)

install: $(NATIVE) $(DELAYLINE)

# Rebuild the kernels for this machine, showing the compiler command and its errors.
native: $(STAMP)
	$(PY) -m thinwire bench native build packing --force --verbose
	touch $(NATIVE)

demo: $(NATIVE) $(DELAYLINE)
	$(VENV)/bin/thinwire demo

# pytest exits 5 when it collects no test; that is reported, not hidden, and not a failure
# of the command itself.
test: $(NATIVE) $(DELAYLINE)
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

# The fast lane: the unit tests (a declared timeout of at most 30 s) and one end-to-end
# smoke per pillar (marked smoke), in a few minutes on 2 cores. `make test` runs everything.
check: $(NATIVE) $(DELAYLINE)
	$(PY) -m pytest -q --lane fast

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tools examples
	$(VENV)/bin/ruff format --check src tests tools examples

clean:
	rm -rf $(VENV) runs .pytest_cache src/thinwire/compress/_native src/thinwire/testbed/_native
