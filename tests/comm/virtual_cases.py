"""Computations run both on virtual ranks (tests/comm/test_virtual.py) and under
``mpiexec -n P python -m tests.comm.virtual_cases OUT.npz``; compared bit for bit.

:func:`everything` returns this rank's results as a dict of arrays: MGRIT solves of the Tanh
propagators of tests/mpi/mpi_cases.py (several engines and coarsest-level solves) over the whole
communicator, and one LayerParallel training step (loss, this rank's gradients, the gathered
gradients, residual histories, an Adam update) of a dense and two conv networks (one with
spatial coarsening) on P layer ranks and, for P = 4, on a 2 x 2 layer x data grid.
"""
import sys

import numpy as np

from mgnn import MGRITOptions, MGRITSolver


def mgrit_tanh(comm):
    """Forward MGRIT solves on ``comm`` with the Tanh family of tests/mpi/mpi_cases.py."""
    from tests.mpi.mpi_cases import (BatchedReplicaTanh, PullTanh, ReplicaTanh, StackedPullTanh,
                                     Tanh)
    out = {}
    n = 37
    u0 = np.random.default_rng(4).standard_normal((2, 3))
    settings = {"V": MGRITOptions(cf=2, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=3),
                "F": MGRITOptions(cf=3, max_levels=2, nrelax=1, tol=0.0, max_iter=2, cycle="F"),
                "tol": MGRITOptions(cf=2, max_levels=4, tol=1e-9, max_iter=30)}
    for sname, opts in settings.items():
        for pname, prop, overlap in (("tanh", Tanh(n), True), ("pull", PullTanh(n), False),
                                     ("replica", ReplicaTanh(n), True),
                                     ("stacked", StackedPullTanh(n), True),
                                     ("batched", BatchedReplicaTanh(n), True)):
            res = MGRITSolver(prop, n, opts, comm=comm, overlap=overlap).solve(u0)
            key = f"mgrit/{sname}/{pname}"
            out[f"{key}/residuals"] = np.array(res.residuals)
            out[f"{key}/iterations"] = np.array(res.iterations)
            owned = [i for i, s in enumerate(res.states) if s is not None]
            out[f"{key}/owned"] = np.array(owned)
            out[f"{key}/states"] = np.array([res.states[i] for i in owned])
            if res.final is not None:
                out[f"{key}/final"] = np.array(res.final)
    return out


def _nets():
    """(name, model, x, y, spatial_levels): dense, conv, conv with spatial coarsening."""
    import mgnn
    rng = np.random.default_rng(7)
    yield ("dense", mgnn.dense_resnet(5, 4, 3, 27, t_final=1.5, seed=1),
           rng.standard_normal((8, 5)), rng.integers(0, 3, 8), ())
    yield ("conv", mgnn.conv_resnet(1, 2, (4, 4), 3, 14, t_final=1.5, seed=1),
           rng.standard_normal((8, 1, 4, 4)), rng.integers(0, 3, 8), ())
    yield ("conv-spatial", mgnn.conv_resnet(1, 2, (8, 8), 3, 16, seed=2),
           rng.standard_normal((8, 1, 8, 8)), rng.integers(0, 3, 8), (0,))


def train_step(comm, data_ranks):
    """One training step of LayerParallel (MGRIT forward and adjoint, both coarsest-level
    solves) on ``comm`` = layer ranks x ``data_ranks``."""
    import mgnn
    out = {}
    fwd = MGRITOptions(cf=2, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=2,
                       skip_downcycle=True)
    bwd = MGRITOptions(cf=2, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=1)
    for kind, model, x, y, spatial in _nets():
        for coarsest in ("redundant", "sequential"):
            lp = mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, comm=comm, data_ranks=data_ranks,
                                    backend="numba", coarsest=coarsest, spatial_levels=spatial)
            shard = np.array_split(np.arange(len(y)), data_ranks)[lp.replica]
            loss, g = lp.loss_and_grad(x[shard], y[shard])
            key = f"train/D{data_ranks}/{kind}/{coarsest}"
            out[f"{key}/loss"] = np.array(loss)
            out[f"{key}/grads"] = g.flat.copy()
            out[f"{key}/gathered"] = lp.gather(g).flat.copy()
            for part in ("forward", "adjoint"):
                out[f"{key}/{part}_residuals"] = np.array(lp.stats[part]["residuals"])
            params = lp.model.params.flat.copy()
            mgnn.Adam(params, lr=0.01).step(g.flat)
            out[f"{key}/updated"] = params
    return out


def everything(comm):
    """All cases on ``comm``: a dict name -> array of this rank's results."""
    out = mgrit_tanh(comm)
    out.update(train_step(comm, 1))
    if comm.Get_size() == 4:
        out.update(train_step(comm, 2))
    return out


def flatten(per_rank):
    """{'rank{r}/name': array} of a list of per-rank dicts."""
    return {f"rank{r}/{k}": v for r, d in enumerate(per_rank) for k, v in d.items()}


if __name__ == "__main__":
    from mpi4py import MPI
    parts = MPI.COMM_WORLD.gather(everything(MPI.COMM_WORLD), root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        np.savez(sys.argv[1], **flatten(parts))
