# osfarm: `make demo` runs the main job on the embedded default, `make test` runs every test.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian's interpreter: its venv can see python3-gi / python3-pyatspi (system site packages).
SYSTEM_PYTHON ?= /usr/bin/python3
PYTEST_ARGS ?=
# PyTorch for the policy server and trainer. This pin is the CPU build on our machines' disk;
# elsewhere PyPI's build of it (CUDA) installs. Override: make TORCH='torch==2.5.1'.
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast lint system venv services images bench clean

# Debian packages, then VS Code for the vs_code tasks (code-server from npm, built with Node 24: ~3 min once)
system:
	bash scripts/setup-system.sh
	bash scripts/setup-fonts.sh
	bash scripts/setup-vscode.sh

$(VENV)/.installed: pyproject.toml | system
	test -x $(PY) || $(SYSTEM_PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[dev,all]'
	# compare_image_text (extra ocr): easyocr without its torchvision dependency (PyPI's build is
	# for the CUDA torch; see osfarm/evaluators/metrics/torchvision_subset.py)
	$(PY) -m pip install -q --no-deps 'easyocr==1.7.2'
	touch $@

venv: system $(VENV)/.installed

# dockerd (no bridge, no iptables) + Compose v2, and libvirtd: started when not running.
services: system
	bash scripts/setup-docker.sh
	bash scripts/setup-libvirt.sh

# Desktop images (debootstrap base, runtime, desktop) and the libvirt VM disk made from them;
# each is skipped when its recipe label matches this checkout, so only the first run builds.
images: venv services
	$(VENV)/bin/osfarm image build
	$(VENV)/bin/osfarm image build-vm

demo: venv
	$(VENV)/bin/osfarm demo --out runs
	$(VENV)/bin/osfarm eval --suite suites/mini --agent replay --envs 2 --out runs/eval-mini
	$(VENV)/bin/osfarm train --updates 2 --run-dir runs/train --no-resume

test: venv images
	$(PY) -m pytest $(PYTEST_ARGS)

# The unit tier only (tests/tiers.py): no desktop, farm, service, browser or model; a few minutes
# on 2 cores, on the venv alone (no images, no services, nothing installed by `system`).
test-fast:
	@test -x $(PY) || { echo "no venv at $(VENV): run make venv first" >&2; exit 1; }
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

# ruff (rules and line length in pyproject.toml): pyflakes, pycodestyle, isort, bugbear, pyupgrade;
# then mypy on osfarm/ ([tool.mypy] in pyproject.toml)
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: venv
	$(PY) bench/lease_latency.py
	$(PY) bench/step_latency.py

clean:
	rm -rf $(VENV) runs .pytest_cache
