"""Programs run under ``mpiexec -n P python -m tests.mpi.mpi_cases CASE`` by tests/mpi/test_mpi.py.

Each case compares the distributed result with a single-process computation done on every rank
and raises (so mpiexec exits non-zero) on any mismatch; rank 0 prints one JSON summary line.
"""
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from mgnn import MGRITOptions, MGRITSolver
from mgnn.mgrit.partition import Partition, block_starts

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


class Tanh:
    """u + (stop-start) h tanh(W_start u + b_start) on states (B, d)."""

    pull = False

    def __init__(self, n, d=3, seed=0, h=0.1):
        rng = np.random.default_rng(seed)
        self.W, self.b, self.h = rng.standard_normal((n, d, d)), rng.standard_normal((n, d)), h

    def step(self, u, start, stop, level):
        return u + (stop - start) * self.h * np.tanh(u @ self.W[start].T + self.b[start])


class PullTanh(Tanh):
    pull = True


def _close(a, b, rtol, what):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise AssertionError(f"rank {RANK}: {what}: shapes {a.shape} != {b.shape}")
    if b.size and not np.allclose(a, b, rtol=rtol, atol=rtol * max(1.0, float(np.abs(b).max()))):
        raise AssertionError(f"rank {RANK}: {what}: {a} != {b}")


def case_solver():
    configs = []
    for n in (13, 24, 37):
        for levels, cf in ((1, 2), (2, 2), (3, 2), (4, 2), (2, 4), (3, 3)):
            for nrelax in (0, 1, [0, 1]):
                for skip in (False, True):
                    for cycle in ("V", "F"):
                        configs.append((n, levels, cf, nrelax, skip, cycle))
    checked = 0
    for (n, levels, cf, nrelax, skip, cycle) in configs:
        if levels > 1 and n // cf < 2:
            continue
        if (n - 0) // cf + 1 < SIZE:
            continue
        opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax, tol=0.0, max_iter=3,
                            skip_downcycle=skip, cycle=cycle)
        try:
            MGRITSolver(Tanh(n), n, opts)
        except ValueError:
            continue  # hierarchy does not fit
        u0 = np.random.default_rng(n).standard_normal((2, 3))
        serial = MGRITSolver(Tanh(n), n, opts).solve(u0)
        for prop in (Tanh(n), PullTanh(n)):
            res = MGRITSolver(prop, n, opts, comm=COMM).solve(u0)
            if res.iterations != serial.iterations or len(res.residuals) != len(serial.residuals):
                raise AssertionError(f"rank {RANK}: cycle counts differ for {opts}")
            _close(res.residuals, serial.residuals, 1e-12, f"residuals {opts}")
            owned = [i for i, s in enumerate(res.states) if s is not None]
            if not owned:
                raise AssertionError(f"rank {RANK} owns no state")
            for i in owned:
                _close(res.states[i], serial.states[i], 1e-12, f"state {i} {opts}")
            if (res.final is not None) != (RANK == SIZE - 1):
                raise AssertionError(f"rank {RANK}: final on the wrong rank")
            checked += 1
    # an uneven, mirrored partition (the adjoint's) with pull semantics
    n = 29
    opts = MGRITOptions(cf=2, max_levels=3, nrelax=1, tol=0.0, max_iter=2)
    part = Partition(n, tuple(block_starts(n + 1, SIZE, 2)), tuple(range(SIZE))).mirrored()
    u0 = np.ones((2, 3))
    serial = MGRITSolver(PullTanh(n), n, opts).solve(u0)
    res = MGRITSolver(PullTanh(n), n, opts, comm=COMM, partition=part).solve(u0)
    _close(res.residuals, serial.residuals, 1e-12, "mirrored residuals")
    for i, s in enumerate(res.states):
        if s is not None:
            _close(s, serial.states[i], 1e-12, f"mirrored state {i}")
    if RANK == 0:
        print(json.dumps({"case": "solver", "ranks": SIZE, "configs": checked}))


def case_reference():
    sys.path.insert(0, os.getcwd())
    from tests.mgrit.test_solver import CASES, _case
    for path in CASES:
        d, opts, prop, n, u0 = _case(path)
        res = MGRITSolver(prop, n, opts, comm=COMM).solve(u0)
        ref = d["xbraid"]
        if res.iterations != ref["iterations"]:
            raise AssertionError(f"{path}: {res.iterations} cycles, reference {ref['iterations']}")
        if np.max(np.abs(np.array(res.residuals) - ref["rnorms"])) > 1e-13:
            raise AssertionError(f"{path}: residuals {res.residuals} vs {ref['rnorms']}")
        if res.final is not None and np.max(np.abs(res.final - ref["final_state"])) > 1e-13:
            raise AssertionError(f"{path}: final state {res.final}")
    if RANK == 0:
        print(json.dumps({"case": "reference", "ranks": SIZE, "cases": len(CASES)}))


class Failing(Tanh):
    def step(self, u, start, stop, level):
        if RANK == SIZE - 1 and start >= 10:
            raise RuntimeError(f"user propagator failed at step {start}")
        return super().step(u, start, stop, level)


def case_fail():
    MGRITSolver(Failing(40), 40, MGRITOptions(cf=2, max_levels=3), comm=COMM).solve(
        np.ones((2, 3)))


if __name__ == "__main__":
    globals()[f"case_{sys.argv[1]}"]()
