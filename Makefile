# Set-up and entry points. Every target creates .venv if it is missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned in the install step only (pyproject says torch>=2.6): a bare `torch`
# would pull a multi-GB CUDA build where a CPU wheel is wanted.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv install demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

venv: $(PY)

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m overlapckpt.demo

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/harness.py --size tiny --out benchmarks/results/cpu

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
