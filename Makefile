# Two commands matter: `make demo` and `make test`. Both start with `make setup`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mopar-setup
DEMO    := build/demo-resnet50

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

demo: setup
	rm -rf $(DEMO)
	$(BIN)/mopar compile examples.cnn:resnet50 --input x=1x3x224x224:float32 --slices 3 --out $(DEMO)
	$(BIN)/mopar run $(DEMO) --check --requests 20 --concurrency 2

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf build .pytest_cache
