# Two commands set everything up on a fresh machine with Python 3.11:
#   make demo   -> creates .venv, installs, runs the main job (workbench compare)
#   make test   -> creates .venv if missing, runs the unit tests (2 workers) and every notebook under nbval
#
# TORCH is installed before the package: an open range ("torch") pulls a multi-GB CUDA build
# on a CPU-only machine. Override it on a GPU box: make demo TORCH=torch

PYTHON ?= python3
TORCH  ?= torch==2.13.0
VENV   ?= .venv
BIN    := $(VENV)/bin
# Jupyter finds kernels/workbench/kernel.json through JUPYTER_PATH: no global install needed.
export JUPYTER_PATH := $(CURDIR)$(if $(JUPYTER_PATH),:$(JUPYTER_PATH))
export PATH := $(CURDIR)/$(BIN):$(PATH)
export OMP_NUM_THREADS ?= 1
export MPLBACKEND ?= Agg

.PHONY: demo test lab notebooks notebook install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/workbench compare

# The unit tests run on TEST_WORKERS pytest-xdist workers (a test file stays on one worker: the
# lessons' torchrun fixture is shared by its file); the lessons run one after another afterwards, on
# cores nothing else is using, so their timing claims are asserted. Both parts always run.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests; unit=$$?; \
	$(BIN)/python -m pytest -q --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg notebooks; lessons=$$?; \
	test $$unit -eq 0 -a $$lessons -eq 0

lab: install
	$(BIN)/jupyter lab notebooks

# Re-create a lesson's notebook from its paired script and execute it, storing outputs.
notebook: install
	$(BIN)/jupytext --sync $(NB)
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace $(basename $(NB)).ipynb

notebooks: install
	for f in notebooks/[0-9]*.py; do $(MAKE) notebook NB=$$f || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
