# osfarm: `make demo` runs the main job on the embedded default, `make test` runs every test.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian's interpreter: its venv can see python3-gi / python3-pyatspi (system site packages).
SYSTEM_PYTHON ?= /usr/bin/python3
PYTEST_ARGS ?=

.PHONY: demo test system venv bench clean

system:
	bash scripts/setup-system.sh

$(VENV)/.installed: pyproject.toml | system
	test -x $(PY) || $(SYSTEM_PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: system $(VENV)/.installed

demo: venv
	$(VENV)/bin/osfarm demo --out runs
	$(VENV)/bin/osfarm eval --suite tasks/mini --agent replay --envs 2 --out runs/eval-mini

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv
	$(PY) bench/lease_latency.py
	$(PY) bench/step_latency.py

clean:
	rm -rf $(VENV) runs .pytest_cache
