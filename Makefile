# Two commands do everything: `make run` and `make test` (each creates .venv and installs first).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml | cksum | cut -d' ' -f1)
EXTRAS := test,data,mpi,bench,cuda
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: run test bench bench-kernels clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $@

# Layer-parallel training on 2 MPI ranks: 32 residual layers split over the ranks, forward and
# adjoint propagation by 3-level MGRIT (cf 4, 2 forward / 1 adjoint cycles), digits data.
RANKS ?= 2
MPI_ENV := NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
run: $(STAMP)
	$(MPI_ENV) timeout 900 $(VENV)/bin/mpiexec -n $(RANKS) $(PY) -m mgnn train --layer-ranks $(RANKS) \
	    --model dense --data digits --layers 32 --width 64 --epochs 10 --batch-size 32 \
	    --optimizer adam --dtype float32 --backend numba --seed 0 \
	    --levels 3 --cf 4 --fwd-iters 2 --bwd-iters 1 --skip-downcycle --timings

# Two pytest workers (this project's CI machine has 2 cores); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

# Fast asv profile, offline, on the existing environment (full runs: docs/benchmarks.md).
bench: $(STAMP)
	$(VENV)/bin/asv machine --yes --machine local >/dev/null
	MGNN_ASV_FAST=1 $(MPI_ENV) $(VENV)/bin/asv run -E existing:$(CURDIR)/$(PY) --quick \
	    --set-commit-hash $$(git rev-parse HEAD) --machine local --show-stderr
	$(VENV)/bin/asv show --machine local $$(git rev-parse HEAD) || true

bench-kernels: $(STAMP)
	$(PY) -m mgnn bench kernels

clean:
	rm -rf $(VENV) .numba_cache build *.egg-info .asv
