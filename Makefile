# Two commands on a fresh machine with Python 3.11:
#   make lab    set up .venv, fetch + convert the models, open the series in JupyterLab
#   make test   set up .venv, fetch + convert the models, run the whole suite (unit, real-model, nbval)
# torch==2.13.0 is installed first and on its own: a plain `torch` requirement with nothing
# installed could pull a multi-GB CUDA build; with 2.13.0 present, the package's range is satisfied.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.nanoserve-installed
PYTEST_ARGS ?=
# test workers: one per core, at most two (each holds the model, transformers' copy and a notebook kernel).
# The notebooks run after the tests, so that a day shares the cores with another day only (one thread each),
# not with the tests' servers and reference models, and its time in the summary stays near a reader's.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 2 ? n : 2 )))
# Jupyter refuses to start as root unless told; root is the usual user in containers and on CI machines
JUPYTER_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test model lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -m nanoserve fetch
	$(BIN)/python -m nanoserve fetch --model gemma3-270m
	$(BIN)/python -m nanoserve kernels

lab: model
	$(BIN)/python -m jupyter lab $(JUPYTER_ARGS) notebooks/01_model_on_disk.ipynb

test: model
	$(BIN)/python -m ruff check nanoserve tests
	$(BIN)/python -m pytest -q -rs -n $(PYTEST_WORKERS) --dist loadscope --durations=15 tests $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -rs -n $(PYTEST_WORKERS) --dist loadscope --nbval --nbval-current-env \
		--nbval-sanitize-with notebooks/sanitize.cfg notebooks $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/python -m ruff check nanoserve tests

bench: model
	$(BIN)/python -m nanoserve bench decode

clean:
	rm -rf $(VENV) .pytest_cache
