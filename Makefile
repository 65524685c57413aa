# The two commands a newcomer runs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fourfold-installed

.PHONY: setup demo test check docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of PyTorch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# galore-torch without its requirement bitsandbytes (CUDA libraries, 129 MB installed), which
	# only its 8-bit optimizer imports; the tests load its AdamW alone (pyproject.toml)
	$(PY) -m pip install -q --no-deps galore-torch==1.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fourfold train --out runs/demo

# Everything, as CI runs it; prints the slowest tests. Two pytest workers (pytest-xdist), each
# taking whole test files (a file's module fixtures are made once): a rank job waits on
# collectives much of its time, so one worker alone leaves a core idle. More workers start
# more rank jobs at once: mind the memory.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile

# The quick loop while you work (under 90 s on 2 idle cores): leaves out tests that start
# ranks, compile or take seconds each; a quick test whose call runs over 3 s fails and says to
# mark it (FOURFOLD_QUICK_LIMIT_S raises the limit on a slow host; tests/conftest.py). Run
# `make test` before you push.
check: $(STAMP)
	$(PY) -m pytest -q --durations=10 -m "not ranks and not compile and not slow"

# docs/configuration.md from the config dataclasses (tests/test_docs.py holds them equal).
docs: $(STAMP)
	$(PY) scripts/config_reference.py --write

clean:
	rm -rf runs .cache
