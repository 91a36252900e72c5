"""The propagator contract under real ``mpiexec -n P`` (tests/mpi/contract_cases.py), each run
under a timeout: in-place steppers are exact at every level, bad step outputs end every rank with
the serial solve's TypeError."""
import re
import time

import numpy as np
import pytest

from mgnn import MGRITOptions, MGRITSolver
from tests.mgrit.test_contract import BadAt
from tests.mpi.test_mpi import _json, mpirun, pytestmark  # noqa: F401  (mpi marker, skipif)


@pytest.mark.parametrize("ranks", [2, 3])
def test_in_place_steppers_distributed_equal_serial(ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.contract_cases", "inplace", timeout=120))
    assert out["ranks"] == ranks and out["checked"] == 25
    # converged on every rank alike (False: tol 1e-13 in 2 cycles); one warning, on rank 0
    assert out["converged_warned"] == [[False, 1]] + [[False, 0]] * (ranks - 1)


@pytest.mark.parametrize("level", [0, 2])
def test_bad_step_output_ends_every_rank_with_the_serial_message(level):
    with pytest.raises(TypeError) as serial:
        MGRITSolver(BadAt(32, level, lambda u: u.astype(np.float32)), 32,
                    MGRITOptions(cf=2, max_levels=4, nrelax=1, tol=0.0, max_iter=2)).solve(
            np.ones(3))
    # the same text up to the step's indices (the first bad step differs per rank)
    pattern = re.escape(str(serial.value)).replace(
        re.escape(re.search(r"\(u, \d+, \d+,", str(serial.value)).group()), r"\(u, \d+, \d+,")
    t0 = time.perf_counter()
    proc = mpirun(3, "-m", "tests.mpi.contract_cases", "bad", str(level), timeout=60)
    assert time.perf_counter() - t0 < 50
    assert proc.returncode != 0
    assert re.search(r"rank \d: TypeError: " + pattern, proc.stderr), proc.stderr[-3000:]
    assert f"level={level})" in str(serial.value)
