# Two commands matter: `make demo` and `make test`. Both start with `make setup`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mopar-setup
DEMO    := build/demo-resnet50
MODEL   := examples.cnn:resnet50 --input x=1x3x224x224:float32

.PHONY: setup demo test clean

setup: $(STAMP)

# torch==2.13.0 (CPU) goes in first and explicitly: a looser requirement makes pip fetch a
# multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# Compile ResNet-50 into 3 slices and, for comparison, into 1; run both locally (one process per
# slice, /dev/shm handoff), check the outputs and print the measured comparison.
demo: setup
	$(BIN)/mopar compile $(MODEL) --slices 3 --out $(DEMO) --force
	$(BIN)/mopar compile $(MODEL) --slices 1 --out $(DEMO)-unsplit --force
	$(BIN)/mopar run $(DEMO) --check --requests 20 --baseline $(DEMO)-unsplit

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf build .pytest_cache
