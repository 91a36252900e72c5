"""The propagator contract under MPI: ``mpiexec -n P python -m tests.mpi.contract_cases CASE``,
run by tests/mpi/test_contract_mpi.py: in-place steppers (push, pull, batched) give the serial
out-of-place result on every level; a bad step output ends every rank with the serial message.

Each case raises (mpiexec exits non-zero) on a mismatch; rank 0 prints one JSON line.
"""
import json
import sys
import warnings

import numpy as np
from mpi4py import MPI

from mgnn import MGRITOptions, MGRITSolver
from mgnn.mgrit.solver import NotConvergedWarning
from tests.mgrit.test_contract import (CONFIGS, BadAt, InPlaceBatched, InPlaceTanh, Reference,
                                       Scale, Tanh)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


class PullInPlace(InPlaceTanh):
    pull = True


class PullInPlaceBatched(InPlaceBatched):
    pull = True


def _check(cond, what):
    if not cond:
        raise AssertionError(f"rank {RANK}: {what}")


def case_inplace():
    """Every CONFIGS level count, push / pull / batched in-place steppers on states (2, 3)."""
    n, checked = 37, 0
    rng = np.random.default_rng(5)
    u0 = rng.standard_normal((3, 2)).T.copy()
    guesses = {c: rng.standard_normal((2, 3)) for c in range(n + 1)}
    kept = {c: g.copy() for c, g in guesses.items()}
    for levels, cf, nrelax, skip, cycle in CONFIGS:
        opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax, skip_downcycle=skip,
                            cycle=cycle, tol=0.0, max_iter=3)
        for prop, ref in ((InPlaceTanh(n), Tanh(n)), (PullInPlace(n), Tanh(n)),
                          (InPlaceBatched(n), Tanh(n)), (PullInPlaceBatched(n), Tanh(n)),
                          (Scale(), Reference())):
            want = MGRITSolver(ref, n, opts).solve(u0, guesses.__getitem__)
            before = u0.copy()
            got = MGRITSolver(prop, n, opts, comm=COMM).solve(u0, guesses.__getitem__)
            what = f"{type(prop).__name__} {opts}"
            _check(got.iterations == want.iterations, f"iterations {what}")
            _check(np.allclose(got.residuals, want.residuals, rtol=1e-12, atol=0),
                   f"residuals {what}: {got.residuals} != {want.residuals}")
            owned = [i for i, s in enumerate(got.states) if s is not None]
            _check(owned, f"owns no state {what}")
            for i in owned:
                _check(np.array_equal(got.states[i], want.states[i]), f"state {i} {what}")
            _check(len({id(got.states[i]) for i in owned}) == len(owned), f"aliased {what}")
            _check(np.array_equal(u0, before), f"u0 was modified {what}")
            checked += 1
    for c, g in guesses.items():
        _check(np.array_equal(g, kept[c]), f"initial guess {c} was modified")
    # converged on every rank alike; the warning once, on the first rank
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = MGRITSolver(Tanh(n), n, MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=2),
                          comm=COMM).solve(u0)
    flags = COMM.allgather((res.converged,
                            sum(issubclass(x.category, NotConvergedWarning) for x in w)))
    if RANK == 0:
        print(json.dumps({"ranks": SIZE, "checked": checked, "converged_warned": flags}))


def case_bad():
    """The step returns float32 on level ``argv[2]`` only: every rank ends, with the message a
    serial solve gives."""
    level = int(sys.argv[2])
    prop = BadAt(32, level, lambda u: u.astype(np.float32))
    MGRITSolver(prop, 32, MGRITOptions(cf=2, max_levels=4, nrelax=1, tol=0.0, max_iter=2),
                comm=COMM).solve(np.ones(3))


if __name__ == "__main__":
    globals()["case_" + sys.argv[1]]()
