# Two commands do everything: `make run` and `make test` (each creates .venv and installs first).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml | cksum | cut -d' ' -f1)
EXTRAS := test,data,mpi,bench
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: run test bench-kernels clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $@

run: $(STAMP)
	$(PY) -m mgnn train --model dense --data digits --layers 16 --width 64 --epochs 10 \
	    --batch-size 32 --optimizer adam --dtype float32 --backend numba --seed 0

test: $(STAMP)
	$(PY) -m pytest -q tests

bench-kernels: $(STAMP)
	$(PY) -m mgnn bench kernels

clean:
	rm -rf $(VENV) .numba_cache build *.egg-info
