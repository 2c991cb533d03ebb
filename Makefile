# Two commands set everything up on a fresh machine with Python 3.11:
#   make demo   -> creates .venv, installs, runs the main job (workbench compare)
#   make test   -> creates .venv if missing, runs the unit tests (2 workers), every notebook under nbval
#                  and the strict documentation build
#   make docs   -> builds the documentation site into site/ (open site/index.html)
#
# TORCH is installed before the package: an open range ("torch") pulls a multi-GB CUDA build
# on a CPU-only machine. Override it on a GPU box: make demo TORCH=torch
# pip would compile every installed module to bytecode, one file after another (torch alone has
# thousands no lesson imports); here it does not, and Python writes a module's bytecode the first
# time a process imports it, under $(VENV)/pycache (PYTHONPYCACHEPREFIX: the source tree stays
# clean), so only what runs is compiled, once. An environment's PYTHONDONTWRITEBYTECODE would make
# every process compile torch's modules again; make does not pass it on.

PYTHON ?= python3
TORCH  ?= torch==2.13.0
VENV   ?= .venv
BIN    := $(VENV)/bin
# Jupyter finds kernels/workbench/kernel.json through JUPYTER_PATH: no global install needed.
export JUPYTER_PATH := $(CURDIR)$(if $(JUPYTER_PATH),:$(JUPYTER_PATH))
export PATH := $(CURDIR)/$(BIN):$(PATH)
export OMP_NUM_THREADS ?= 1
export MPLBACKEND ?= Agg
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test docs lab notebooks notebook install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install --no-compile "$(TORCH)"
	$(BIN)/python -m pip install --no-compile -e ".[test]"
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/workbench compare

# Three parts. First the unit tests and the lessons that assert no wall-clock timing claim of their
# own, on TEST_WORKERS pytest-xdist workers (a file stays on one worker: a notebook's cells share a
# kernel, the lessons' torchrun fixture its test file); a lesson that asserts its timing claims only
# where workbench.runtime.busy.were_free says other work left the cores free (05, 07, 08) runs here
# and states them without asserting them, and so does one whose margins other work cannot flip
# (00, marked "load-robust timing claim"). Then the lessons that assert a wall-clock timing claim
# unconditionally (TIMED_LESSONS; a test checks the list), one after another on cores nothing else
# is using. Then the documentation is built into site/ with --strict (a broken link, a missing anchor
# or a page left out of mkdocs.yml's nav fails it; not --quiet, which hides the warnings --strict
# counts). Every part always runs; make test fails if any part failed.
TEST_WORKERS ?= 2
NBVAL := --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg
TIMED_LESSONS := $(addprefix notebooks/,01_collectives.ipynb 03_inside_ddp.ipynb 04_sharded_data_parallel.ipynb)
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(NBVAL) tests notebooks \
		$(addprefix --ignore=,$(TIMED_LESSONS)); unit=$$?; \
	$(BIN)/python -m pytest -q $(NBVAL) $(TIMED_LESSONS); lessons=$$?; \
	$(BIN)/mkdocs build --strict; docs=$$?; \
	test $$unit -eq 0 -a $$lessons -eq 0 -a $$docs -eq 0

# The documentation site (mkdocs.yml, docs/): make docs builds it into site/; open site/index.html.
docs: install
	$(BIN)/mkdocs build --strict

lab: install
	$(BIN)/jupyter lab notebooks

# Re-create a lesson's notebook from its paired script and execute it, storing outputs.
notebook: install
	$(BIN)/jupytext --sync $(NB)
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace $(basename $(NB)).ipynb

notebooks: install
	for f in notebooks/[0-9]*.py; do $(MAKE) notebook NB=$$f || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache site
