"""An MGRIT divergence under real ``mpiexec``: the residual is summed over every rank, so every
rank raises the same ``DivergenceError`` (no ``MPI_Abort``) and ``fit`` names the epoch and batch
on each of them. Unguarded (``guard=None``): under the gradient guard a divergence falls back to
exact propagation (tests/test_guard.py), which here overflows too and ``fit`` reports the
non-finite loss instead."""
import json
import subprocess
import sys

from tests.mpi.test_mpi import REPO, mpirun, pytestmark  # noqa: F401  (mpi marker, skipif)

PROGRAM = r"""
import json, sys
import numpy as np
from mpi4py import MPI
import mgnn
from mgnn import MGRITOptions
comm = MPI.COMM_WORLD
model = mgnn.dense_resnet(4, 4, 2, 8, activation="relu", dtype="float32", seed=0)
model.params["steps.weight"][...] = 1e19       # states overflow to inf within a few layers
opts = MGRITOptions(cf=2, max_levels=2, max_iter=2, tol=0.0)
lp = mgnn.LayerParallel(model, opts, opts, comm=comm, data_ranks=int(sys.argv[1]), guard=None)
x = np.ones((8, 4), np.float32)
y = np.arange(8) % 2
try:
    mgnn.fit(lp, mgnn.SGD(model.params.flat, lr=0.1), x, y, x, y, epochs=1, batch_size=8,
             rng=np.random.default_rng(0), progress=False)
    out = "no error"
except mgnn.DivergenceError as exc:
    out = str(exc)
msgs = comm.gather(out, root=0)
print(json.dumps(msgs) if comm.Get_rank() == 0 else "", flush=True)
"""


def _run(ranks, data_ranks):
    proc = mpirun(ranks, "-c", PROGRAM, str(data_ranks), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Abort" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("[")][-1])


def test_divergence_is_raised_on_every_rank_with_epoch_and_batch():
    for ranks, data_ranks in ((2, 1), (4, 2)):
        msgs = _run(ranks, data_ranks)
        assert len(msgs) == ranks
        for m in msgs:
            assert "diverged" in m and "epoch 1, batch 1 of 1" in m, msgs
