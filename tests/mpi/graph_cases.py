"""Captured CUDA graphs on several layer ranks, run under ``mpiexec -n P``: by
tests/test_fake_gpu.py on the fake cupy (tests/fakegpu first on sys.path: the host emulation's
kernels), by scripts/gpu_check.py on a GPU (CuPy's). Each cycle is captured as graphs cut at
its halo messages, which run between them at every launch. Four SGD steps on new data each
step: losses, residual histories, gradients and updated parameters bit for bit those of the
uncaptured run, and
equal to the numba backend to round-off. Prints one JSON line (rank 0).

    mpiexec -n 2 python tests/mpi/graph_cases.py dense redundant
"""
import json
import sys

import numpy as np
from mpi4py import MPI

import cupy
import mgnn
import mgnn.backend as _backend
from mgnn import MGRITOptions
from mgnn.backend import to_host
from mgnn.backend.cupy_raw import CupyLauncher, RawBackend
from mgnn.backend.host_emulation import EMULATION_GEOMETRY
from mgnn.mgrit.engines import GraphCycle

FAKE = cupy.__version__.endswith("fake")
if FAKE:  # the emulated kernels with their tiny tiles
    _backend._instances["cuda"] = RawBackend(CupyLauncher(EMULATION_GEOMETRY), "cuda")
comm = MPI.COMM_WORLD
kind, coarsest = sys.argv[1], sys.argv[2]
FWD = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0)
BWD = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0)
SHAPE = (4, 5) if kind == "dense" else (4, 1, 4, 4)


def model():
    if kind == "dense":
        return mgnn.dense_resnet(5, 4, 3, 16, t_final=1.5, seed=4, dtype="float64")
    return mgnn.conv_resnet(1, 2, (4, 4), 3, 16, t_final=1.5, seed=4, dtype="float64")


def train(backend, capture):
    m = model()
    lp = mgnn.LayerParallel(m, FWD, BWD, comm=comm, backend=backend, capture=capture,
                            coarsest=coarsest, guard=None)
    opt = mgnn.optim.SGD(m.params, lr=0.1)
    rng = np.random.default_rng(1)
    out = []
    for _ in range(4):
        x, y = rng.standard_normal(SHAPE), rng.integers(0, 3, SHAPE[0])
        loss, g = lp.loss_and_grad(x, y)
        res = tuple(tuple(lp.stats[k]["residuals"]) for k in ("forward", "adjoint"))
        out.append((loss, to_host(g.flat).copy(), res))
        opt.step(g)
    out.append((0.0, to_host(m.params.flat).copy(), ()))
    return lp, out


ref = train("numba", True)[1]
plain = train("cuda", False)[1]
before = cupy.calls.get("graph_launches", 0)
lp, graphed = train("cuda", True)
cycles = [c for sv in lp._solvers.values() for c in sv._graphs.values()
          if isinstance(c, GraphCycle)]
same = all(a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2] == b[2]  # residuals too
           for a, b in zip(plain, graphed))
err = max(max(abs(a[0] - b[0]), float(np.abs(a[1] - b[1]).max())) for a, b in zip(ref, graphed))
res = {"same_as_uncaptured": bool(comm.allreduce(same, op=MPI.LAND)),
       "max_diff_numba": comm.allreduce(err, op=MPI.MAX),
       "graph_launches": comm.allreduce(cupy.calls.get("graph_launches", 0) - before),
       "cycles": comm.allreduce(len(cycles)),
       "max_graphs_per_cycle": comm.allreduce(max((c.graphs for c in cycles), default=0),
                                              op=MPI.MAX),
       "min_launches": comm.allreduce(min((c.launches for c in cycles), default=0),
                                      op=MPI.MIN),
       "redundant_solves": comm.allreduce(sum(sv.redundant_solves
                                              for sv in lp._solvers.values())),
       # graphs that captured nothing (the fake's graphs list their operations): a launch each
       "empty_graphs": comm.allreduce(sum(
           not p.graph.ops for c in cycles for p in c.parts
           if hasattr(getattr(p, "graph", None), "ops"))) if FAKE else None,
       # arrays made while capturing (the fake counts them): freed by CuPy while graphs use them
       "capture_allocs": comm.allreduce(cupy.calls.get("capture_allocs", 0)) if FAKE else None}
res["fake_cupy"] = FAKE
if comm.rank == 0:
    print(json.dumps(res))
