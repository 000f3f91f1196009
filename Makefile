# Set-up and entry points. Every target creates .venv if it is missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned in the install step only (pyproject says torch>=2.6): a bare `torch`
# would pull a multi-GB CUDA build where a CPU wheel is wanted.
TORCH_PIN ?= torch==2.13.0
# TorchTitan for tests/test_titan.py, without the dependencies its components do not import
# (datasets, tensorboard, wandb, pillow: minutes of install). Users install overlapckpt[titan].
TITAN_TEST_PKGS := torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 tyro==1.0.17 docstring_parser==0.18.0 \
	typeguard==4.6.1 shtab==1.13.0 einops==0.8.2 spmd_types==0.2.3

.PHONY: venv install demo demo-dist check docs test soak bench bench-limits bench-dist peers clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

venv: $(PY)

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $(TITAN_TEST_PKGS)
	@# The optional native helper (csrc/): built ahead where a C compiler exists, else the Python twin runs.
	$(PY) -c 'from overlapckpt.train.copying.native import build; print("native helper:", build() or "not built (the Python twin runs)")'
	$(PY) -c 'from overlapckpt.train.copying.tensor_passes import build; print("tensor passes:", build() or "not built (the Python twins run)")'
	$(PY) -c 'from overlapckpt.cuda_adam_native import build; print("fused Adam replay:", build() or "not built (its torch twin runs)")'
	$(PY) -c 'from overlapckpt.format.native_pickle_walk import build; print("pickle walk:", build() or "not built (the Python walk runs)")'
	touch $@

install: $(VENV)/.installed

# torch_checkpointing (pure Python) copied into peers/, which benchmarks/gpu.sh puts on PYTHONPATH:
# the GPU machine installs nothing, so the peer travels with the working tree (carry ["peers"]).
peers: install
	rm -rf peers && mkdir -p peers
	$(PY) -c 'import os, shutil, torch_checkpointing as t; d = os.path.dirname(t.__file__); shutil.copytree(d, os.path.join("peers", os.path.basename(d)), ignore=shutil.ignore_patterns("__pycache__"))'
	@echo "peers/: $$(ls peers)"

demo: install
	$(PY) examples/demo.py

# 2 ranks of FSDP2 on CPU under torchrun (--standalone picks a free port), then a restore in one process.
demo-dist: install
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node=2 examples/demo_dist.py train
	OMP_NUM_THREADS=1 $(PY) examples/demo_dist.py restore

# The checkers first (seconds), then the tests on both cores.
check: install docs
	$(VENV)/bin/ruff check overlapckpt tests benchmarks examples
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The documentation site (docs/ and the docstrings, mkdocs + mkdocstrings) into build/site,
# strict: a warning, a broken link or an unparsable docstring fails it.
docs: install
	$(PY) -m mkdocs build --strict --quiet

test: check
	$(PY) -m pytest -q -n 2 tests

# Many seeded random fault schedules (tests/fault_schedule.py): writer and trainer SIGKILLs at
# random steps and inside persists and replays, slow storage, every mode; two trials at once.
SOAK_TRIALS ?= 200
# Then the crash loop: each entry point's script (plain, local tier, Lightning, Hugging Face) SIGKILLed at 50 seeded
# random steps and run again; its final state bit-exact to a twin's, the root and the tier never past keep + 1.
CRASH_LOOP_CYCLES ?= 50
soak: install
	$(PY) tests/workers/soak.py --trials $(SOAK_TRIALS) --jobs 2
	$(PY) tests/workers/soak.py --crash-loop $(CRASH_LOOP_CYCLES) --jobs 2

# Every figure the README quotes, each with min / median / p90 / max over at least 7 repeats
# (benchmarks/stats.py): the stall, time to durable against the peers, loads, hooks' host time,
# restores by tier (benchmarks/tiers.py; --drop-caches, as root, for a cold page cache).
bench: install
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/harness.py --size tiny --out benchmarks/results/cpu
	$(PY) benchmarks/durable.py --out benchmarks/results/durable
	$(PY) benchmarks/load.py --out benchmarks/results/load
	$(PY) benchmarks/hook_scaling.py --tensors 300,3000,30000 --cycles 7 --out benchmarks/results/hook-scaling
	$(PY) benchmarks/hook_scaling.py --tensors 30000 --passes python --cycles 7 --out benchmarks/results/hook-scaling --resume
	$(PY) benchmarks/hook_scaling.py --tensors 100000 --schedules held --cycles 7 --out benchmarks/results/hook-scaling --resume
	$(PY) benchmarks/tiers.py --out benchmarks/results/tiers-warm
	$(PY) benchmarks/fused_replay_speed.py
	$(PY) benchmarks/many_tensors.py --out benchmarks/results/many-tensors
	$(PY) benchmarks/small_checkpoint.py --out benchmarks/results/small-checkpoint/make-bench.txt
	$(PY) benchmarks/short_every.py --out benchmarks/results/short-every/make-bench.md
	$(PY) benchmarks/restore_listing.py
	-$(PY) benchmarks/tiers_nodes.py --out benchmarks/results/tiers-nodes  # needs root (network namespaces): skipped, saying why, elsewhere
	$(PY) benchmarks/scale.py --worlds 2,4,8 --out benchmarks/results/scale --name make-bench  # docs/scale.md's run1 went to 16
	$(PY) benchmarks/group_formation.py --worlds 2,4,8 --out benchmarks/results/scale/make-bench  # docs/scale.md's went to 16

# The performance goals in one run on one code (benchmarks/results/limits/README.md holds the table):
# time to durable against the raw write and the peers (local disk, tmpfs), a small checkpoint in each
# mode, every=2 on a tiny model, 30,000 small tensors saved and loaded, replay's arithmetic per element,
# and the loop's steps while the writer persists and replays (W=8) against the steps with no checkpoint.
LIMITS := benchmarks/results/limits
bench-limits: install
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/many_tensors.py --out $(LIMITS)/many-tensors
	$(PY) benchmarks/durable.py --scale-mib '' --s3-mib 0 --replay-window 1 --out $(LIMITS)/durable
	$(PY) benchmarks/hashing_priority.py --repeats 15 --out $(LIMITS)/hashing-priority
	$(PY) benchmarks/small_checkpoint.py --out $(LIMITS)/small-checkpoint.txt
	$(PY) benchmarks/short_every.py --out $(LIMITS)/short-every.md
	{ echo '$$ python benchmarks/fused_replay_speed.py --repeats 9'; $(PY) benchmarks/fused_replay_speed.py --repeats 9; echo; \
	  echo '$$ python benchmarks/fused_replay_speed.py --repeats 9 --threads 2'; $(PY) benchmarks/fused_replay_speed.py --repeats 9 --threads 2; echo; \
	  echo '$$ python benchmarks/fused_replay_speed.py --repeats 7 --threads 2 --elements 100000000'; \
	  $(PY) benchmarks/fused_replay_speed.py --repeats 7 --threads 2 --elements 100000000; } > $(LIMITS)/replay-arithmetic.txt
	$(PY) benchmarks/harness.py --size tiny --methods baseline,dcp_async_process,torch_checkpointing_async,overlapckpt_w1,overlapckpt_w8_replay --out $(LIMITS)/steps

# 2 CPU ranks (gloo), DDP then FSDP2: overlapckpt against dcp.async_save, about 6 minutes on 2 cores.
bench-dist: install
	$(PY) benchmarks/harness.py --nproc 2 --size tiny --throughput-checkpoints 1 --out benchmarks/results/cpu-2rank

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
