# Quick start: `make demo` and `make test`. Both create .venv if missing and
# install only when pyproject.toml changed since the last install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := jax,torch,testing,test,docs,bench
# Every test dependency pinned (`make lock` refreshes it): a fresh clone installs what CI got.
LOCK := requirements/lock.txt
# `make test-latest` and `make lock`: the same set-up with the newest releases, in a venv of its own.
LATEST := .venv-latest
# An editable install whose path mypy and pyright can read (setuptools' default is an import hook
# they cannot see, so outside the repository they did not find `activity`).
EDITABLE := --config-settings editable_mode=compat

.PHONY: demo test test-latest lock bench install clean flake screenshots

$(STAMP): pyproject.toml Makefile $(LOCK)
	$(MAKE) --no-print-directory setup VENV=$(VENV) CONSTRAINTS="-c $(LOCK)"
	touch $(STAMP)

# One set-up for both environments: CONSTRAINTS is the lock for `make test`, empty for the newest releases.
.PHONY: setup
setup:
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@# The exact torch first: here 2.13.0 is a local CPU wheel, and the [torch] extra's range
	@# (torch>=2.2) then accepts it instead of downloading a CUDA build.
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
	# The project was installed as "activity" before its rename to activity-ad: two copies would load the pytest plugin twice.
	$(VENV)/bin/python -m pip uninstall --quiet --yes activity 2>/dev/null || true
	rm -rf activity.egg-info
	@# uv installs the rest in seconds where pip takes over a minute; it keeps the torch above
	@# (2.13.0 satisfies the extra's range) and compiles the bytecode as pip does, for the first imports
	@# of the suite's processes. Where uv cannot be had, pip does it.
	( $(VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(CONSTRAINTS) uv && \
	  $(VENV)/bin/python -m uv pip install --quiet --compile-bytecode --python $(VENV)/bin/python $(CONSTRAINTS) -e ".[$(EXTRAS)]" $(EDITABLE) ) || \
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(CONSTRAINTS) -e ".[$(EXTRAS)]" $(EDITABLE)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py
	$(PY) -m activity.testing

# One worker per core; a test file stays on one worker, so its module fixtures run once.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile

# The suite against the newest release of every dependency (torch stays the exact build above), in
# .venv-latest, installed anew each time: it catches a release that breaks activity before the lock moves.
test-latest:
	rm -rf $(LATEST)
	$(MAKE) --no-print-directory setup VENV=$(LATEST) CONSTRAINTS=
	$(LATEST)/bin/python -m pytest -q -n auto --dist loadfile -p no:cacheprovider

# Refreshes the lock from the newest releases (run `make test-latest` first, then commit the lock
# with what it needed): every installed package but activity itself, torch as the Makefile names it.
lock:
	test -x $(LATEST)/bin/python || $(MAKE) --no-print-directory setup VENV=$(LATEST) CONSTRAINTS=
	{ sed -n '1,3p' $(LOCK); $(LATEST)/bin/python -m pip freeze --exclude-editable --disable-pip-version-check | \
	  grep -v -i '^activity' | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

# Times activity against the raw JAX / torch calls (under 5 minutes on 2 cores) and
# rewrites docs/benchmarks.md and docs/assets/benchmarks.png.
bench: $(STAMP)
	$(PY) -m benchmarks

# The 200-seed sweeps, in two shards (one per core, one thread each): the torch catalogue
# against finite differences, and the kinked float32 models (false alarms, planted errors caught).
flake: $(STAMP)
	OMP_NUM_THREADS=1 ACTIVITY_FLAKE_SEEDS=0:100 ACTIVITY_SWEEP_SEEDS=0:100 $(PY) -m pytest -q -s -p no:cacheprovider tests/test_flakes.py tests/test_reference_sweep.py & first=$$!; \
	OMP_NUM_THREADS=1 ACTIVITY_FLAKE_SEEDS=100:200 ACTIVITY_SWEEP_SEEDS=100:200 $(PY) -m pytest -q -s -p no:cacheprovider tests/test_flakes.py tests/test_reference_sweep.py; second=$$?; \
	wait $$first && exit $$second

# Builds the docs site and takes 1280 px headless Chromium screenshots of its main pages into
# build/screenshots (needs Debian's chromium: apt-get install -y chromium).
screenshots: $(STAMP)
	$(PY) docs/hooks/screenshots.py build/screenshots

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache build dist *.egg-info
