"""Real ``mpiexec -n P`` runs (P = 1..4 on this 2-core machine), each under a timeout."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")

try:
    import mpi4py  # noqa: F401
    HAVE_MPI = MPIEXEC is not None
except ImportError:
    HAVE_MPI = False

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed")]


def mpirun(n, *args, timeout=300):
    """Run ``python *args`` on n ranks; returns CompletedProcess (never hangs past timeout)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=REPO)
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _json(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_distributed_solver_equals_serial(ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "solver"))
    assert out["ranks"] == ranks and out["configs"] > 100


@pytest.mark.parametrize("ranks", [2, 3])
def test_reference_cases_distributed(ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "reference"))
    assert out["cases"] >= 3


def test_failure_on_one_rank_ends_all_ranks():
    t0 = time.perf_counter()
    proc = mpirun(3, "-m", "tests.mpi.mpi_cases", "fail", timeout=60)
    assert time.perf_counter() - t0 < 30
    assert proc.returncode != 0
    assert "rank 2: RuntimeError: user propagator failed at step" in proc.stderr


@pytest.mark.parametrize("ranks, data_ranks", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2),
                                               (4, 4)])
def test_distributed_network_equals_single_process(ranks, data_ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "network", str(data_ranks)))
    assert out["checked"] == 8


def test_bad_input_on_one_rank_raises_everywhere():
    out = _json(mpirun(3, "-m", "tests.mpi.mpi_cases", "bad_input", timeout=120))
    assert "rank 2" in out["message"]
