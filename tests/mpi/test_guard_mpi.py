"""The gradient guard under a real ``mpiexec``: on 2 layer ranks and on 2 layer ranks x 2 data
replicas every rank takes the one process's decisions (accept, iterate, fallback / exact) and
the gradients equal the one process's (tests/mpi/mpi_cases.py, ``case_guard``)."""
import pytest

from tests.mpi.test_mpi import HAVE_MPI, _json, mpirun

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed")]


@pytest.mark.parametrize("ranks, data_ranks", [(2, 1), (4, 2)])
def test_guard_decisions_are_collective_and_equal_one_process(ranks, data_ranks):
    out = _json(mpirun(ranks, "-m", "tests.mpi.mpi_cases", "guard", str(data_ranks),
                       timeout=240))
    assert out["ranks"] == ranks and out["data_ranks"] == data_ranks and out["checked"] == 3
