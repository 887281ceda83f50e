# Two commands matter: `make demo` and `make test`. Both start with `make setup`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mopar-setup
LOCK    := requirements.lock
DEMO    := build/demo-resnet50
MODEL   := examples.cnn:resnet50 --input x=1x3x224x224:float32

.PHONY: setup lock demo test test-slow models-doc clean

setup: $(STAMP)

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

# Remakes the lock from pyproject.toml and requirements.in with uv (itself pinned here).
lock:
	test -x build/uv/bin/uv || ($(PY) -m venv build/uv && build/uv/bin/pip install --quiet uv==0.13.9)
	build/uv/bin/uv pip compile pyproject.toml requirements.in --extra test --extra models \
	    --find-links /opt/wheels --python-version 3.11 --custom-compile-command "make lock" \
	    --quiet -o $(LOCK)

# Compile ResNet-50 into 3 slices and, for comparison, into 1; run both locally (one process per
# slice, /dev/shm handoff), check the outputs and print the measured comparison.
demo: setup
	$(BIN)/mopar compile $(MODEL) --slices 3 --out $(DEMO) --force
	$(BIN)/mopar compile $(MODEL) --slices 1 --out $(DEMO)-unsplit --force
	$(BIN)/mopar run $(DEMO) --check --requests 20 --baseline $(DEMO)-unsplit

test: setup
	$(BIN)/python -m pytest -q

# The tests marked slow (zoo models whose family a default entry covers, the MoE and T5 export
# checks): .ci/run runs them after `make test`.
test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# Rebuilds docs/models.md: every zoo model saved in its own process, compiled and run fresh.
models-doc: setup
	$(BIN)/python -m examples.zoo --doc docs/models.md

clean:
	rm -rf build .pytest_cache
