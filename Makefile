# shardkit: `make install` sets everything up, `make test` runs the suite, `make demo` shows the flow.
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= dev,plot,ray,torch,s3,http,video
PY := $(VENV)/bin/python
DEMO ?= demo

.PHONY: install system-deps venv pillow-simd img2dataset pip-smoke test test-fast lint typecheck check demo bench clean installed

install: system-deps venv pillow-simd img2dataset
	@$(VENV)/bin/shardkit doctor

# img2dataset in a venv of its own (it pins webdataset < 0.3 and pandas < 3): the tests adopt its
# real output with `shardkit index` (they say so and skip where it is missing).
I2D_VENV ?= .venv-img2dataset
img2dataset: $(I2D_VENV)/bin/img2dataset
$(I2D_VENV)/bin/img2dataset:
	$(PYTHON) -m venv $(I2D_VENV)
	$(I2D_VENV)/bin/python -m pip install -q img2dataset

# libturbojpeg (fast JPEG decode/encode) and the headers Pillow-SIMD builds against.
system-deps:
	@bash scripts/install_system_deps.sh

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

# The torch versions are the [torch] extra's range (pyproject.toml), the one pin pip users get too.
# torch from PyPI can be a multi-GB CUDA build: TORCH_SPEC lets a machine pick its wheels, e.g.
# TORCH_SPEC="torch==2.14.1+cpu --extra-index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC ?=
venv: $(PY)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" $(if $(findstring torch,$(EXTRAS)),$(TORCH_SPEC))

# Last on purpose: anything installed after stock Pillow would otherwise put it back.
pillow-simd: venv
	@bash scripts/install_pillow_simd.sh $(PY)

# Everything, the integration tests with Ray, the S3 server, signals and killed processes included (CI):
# test-fast's part on two processes, then the tests marked slow in one (they start clusters, servers
# and process groups of their own, and time signals).
test: test-fast
	$(PY) -m pytest -q -m slow

# What needs the venv says so in one line where `make install` has not made it yet.
installed:
	$(if $(wildcard $(PY)),,$(error $(PY) is not here: run 'make install' first (it makes $(VENV) with every extra)))

# The inner loop: the suite without the tests marked slow, on two processes.
# CLI tests run the command in-process (tests/inprocess.py); what needs a real process stays one.
# Bytecode is cached even where PYTHONDONTWRITEBYTECODE is set: each worker otherwise compiles and
# assertion-rewrites every test module again. --dist loadfile keeps a module's fixtures (packed
# outputs) on one worker instead of building them on both.
test-fast: installed
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

lint: installed
	$(VENV)/bin/ruff check shardkit tests scripts
	$(VENV)/bin/ruff format --check shardkit tests scripts

typecheck: installed
	$(VENV)/bin/mypy

# A pip user's install on another Python: `pip install .` in a fresh venv, the core tests against it.
PIP_SMOKE_PYTHON ?= python3.12
pip-smoke:
	bash scripts/pip_smoke.sh $(PIP_SMOKE_PYTHON)

# What to run before a commit (and what the pre-commit hooks run).
check: lint typecheck test-fast

demo: install
	rm -rf $(DEMO)
	$(PY) scripts/make_sample.py $(DEMO)/images
	$(VENV)/bin/shardkit probe $(DEMO)/images --plot $(DEMO)/probe.png
	$(VENV)/bin/shardkit pack $(DEMO)/images $(DEMO)/shards --config imagenet-256
	$(VENV)/bin/shardkit verify $(DEMO)/shards --deep --source $(DEMO)/images
	$(VENV)/bin/shardkit bench $(DEMO)/shards --against $(DEMO)/images --plot $(DEMO)/bench.png

bench: installed
	$(PY) scripts/bench_probe.py ../shared/data/imagenet-sample

clean:
	rm -rf $(DEMO) build dist *.egg-info .pytest_cache .ruff_cache
