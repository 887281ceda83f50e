# Two commands matter: `make demo` and `make test`. Both start with `make setup`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mopar-setup
LOCK    := requirements.lock
SAM_VENV := build/sam-venv
SAM_LOCK := requirements-sam.lock
DEMO    := build/demo-resnet50
MODEL   := examples.cnn:resnet50 --input x=1x3x224x224:float32

BASE_IMAGE := localhost/mopar-base:bookworm

.PHONY: setup system-packages base-image lock demo lint test test-slow models-doc cli-doc clean

setup: $(STAMP) system-packages $(SAM_VENV)/.mopar-setup

# Installs requirements.lock, every package pinned, and nothing else. torch (the CPU build on
# this machine's disk) goes in first and explicitly: a looser requirement would make pip fetch a
# multi-GB CUDA build. `pip check` proves the locked set consistent.
$(STAMP): $(LOCK) pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-deps -c $(LOCK) pip
	$(BIN)/pip install --quiet -c $(LOCK) torch==2.13.0
	$(BIN)/pip install --quiet --no-deps -r $(LOCK)
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $(STAMP)

# The AWS SAM CLI in a virtual environment of its own (it pins click 8.1.8, mopar another), from
# requirements-sam.lock, every package pinned. Its package carries AWS's Lambda Runtime Interface
# Emulator (samcli/local/rapid/aws-lambda-rie-*); tests/sam.py finds both there. Where PyPI is
# not reachable, a warning, and the tests that need it skip, naming what is missing.
$(SAM_VENV)/.mopar-setup: $(SAM_LOCK)
	@{ test -x $(SAM_VENV)/bin/python || $(PY) -m venv $(SAM_VENV); } && \
	    $(SAM_VENV)/bin/pip install --quiet --no-deps -r $(SAM_LOCK) && \
	    $(SAM_VENV)/bin/pip check >/dev/null && touch $@ || \
	    echo "warning: could not install the AWS SAM CLI into $(SAM_VENV); the SAM tests will skip" >&2

# What the tests need beside Python, from Debian, where this machine lets us install it (root,
# apt-get): podman, runc and mmdebstrap for `mopar build` and `mopar run --containers`, and
# redis-server for the redis transport. Elsewhere a warning, and the tests that need them skip,
# naming what is missing.
SYSTEM_PACKAGES := podman runc catatonit mmdebstrap redis-server

system-packages:
	@missing=""; for p in podman mmdebstrap redis-server; do command -v $$p >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || \
	    { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	        $(SYSTEM_PACKAGES) >/dev/null; } || \
	    echo "warning: could not install $(SYSTEM_PACKAGES); the tests that need them will skip" >&2

# A local base image for machines that reach no image registry: Debian bookworm's minbase with
# python3 and its venv module, made by mmdebstrap from Debian's packages and imported by podman.
# `mopar build --base-image $(BASE_IMAGE)` (or MOPAR_BASE_IMAGE) builds on it.
base-image: system-packages
	podman image exists $(BASE_IMAGE) || { \
	    mkdir -p build && \
	    mmdebstrap --quiet --variant=minbase \
	        --include=python3,python3-venv,python3-pip,ca-certificates bookworm build/base-rootfs.tar && \
	    podman import --quiet build/base-rootfs.tar $(BASE_IMAGE) && rm -f build/base-rootfs.tar; }

# Remakes the lock from pyproject.toml and requirements.in with uv (itself pinned here).
lock:
	test -x build/uv/bin/uv || ($(PY) -m venv build/uv && build/uv/bin/pip install --quiet uv==0.13.9)
	build/uv/bin/uv pip compile pyproject.toml requirements.in --extra test --extra models \
	    --find-links /opt/wheels --python-version 3.11 --custom-compile-command "make lock" \
	    --quiet -o $(LOCK)
	build/uv/bin/uv pip compile requirements-sam.in --python-version 3.11 \
	    --custom-compile-command "make lock" --quiet -o $(SAM_LOCK)

# Compile ResNet-50 into 3 slices and, for comparison, into 1; say which plan mopar recommends;
# run both bundles locally (one process per slice, /dev/shm handoff), check the outputs, and end
# on the measured comparison and the two plans' bills.
demo: setup
	$(BIN)/mopar compile $(MODEL) --slices 3 --out $(DEMO) --force
	$(BIN)/mopar compile $(MODEL) --slices 1 --out $(DEMO)-unsplit --force
	$(BIN)/mopar plan $(MODEL)
	$(BIN)/mopar run $(DEMO) --check --requests 20 --baseline $(DEMO)-unsplit

# ruff (lint and format) and the import contracts of pyproject.toml, over the package and the
# lab beside it (benchmarks/, tools/, examples/).
lint: setup
	$(BIN)/ruff check mopar tests examples benchmarks tools
	$(BIN)/ruff format --check mopar tests examples benchmarks tools
	$(BIN)/lint-imports
	$(BIN)/mypy

# Two workers (pytest-xdist), each taking a whole test file at a time, so a file's shared
# bundles are compiled once; JOBS=0 runs the suite in pytest's own process.
JOBS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile

# The tests marked slow: .ci/run runs them after `make test`. Each says which default test
# covers what it checks: the zoo models (tests/test_end_to_end.py) whose family or layers a
# default entry covers, the MoE and T5 export checks, the soaks, a whole `mopar bench --quick`,
# and the error cases through the real executable whose in-process twins run by default.
test-slow: setup
	$(BIN)/python -m pytest -q -m slow -n $(JOBS) --dist loadfile

# Rebuilds docs/models.md: every zoo model saved in its own process, compiled and run fresh.
models-doc: setup
	$(BIN)/python -m examples.zoo --doc docs/models.md

# Rewrites docs/cli.md's option tables from the options' specs (mopar/cli/options.py).
cli-doc: setup
	$(BIN)/python -m tools.cli_docs

clean:
	rm -rf build .pytest_cache
