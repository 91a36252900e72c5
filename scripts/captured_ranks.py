"""Per-step time of a layer-parallel training step with captured cycles and without, on the
ranks of ``mpiexec -n P`` (P = 1 included): the host-side orchestration a tape removes.

    mpiexec -n 2 python scripts/captured_ranks.py [--layers 64] [--width 4] [--batch 8]

A narrow network (width 4, batch 8: kernels of a few microseconds) makes the step's time its
host time: the Python calls through solver, engine and propagator per level and cycle, which a
tape replaces by one Numba call per segment between halo messages. Rank 0 prints one JSON line
(median seconds per step over ``--steps`` steps after 3 warm-up steps).
"""
import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import mgnn
from mgnn import MGRITOptions


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.width)).astype(np.float32)
    y = rng.integers(0, 10, args.batch)
    fwd = MGRITOptions(cf=4, max_levels=3, tol=0.0, max_iter=2, skip_downcycle=True)
    bwd = MGRITOptions(cf=4, max_levels=3, tol=0.0, max_iter=1)
    out = {"ranks": comm.Get_size(), "layers": args.layers, "width": args.width,
           "batch": args.batch}
    losses = {}
    for capture in (True, False):
        model = mgnn.dense_resnet(args.width, args.width, 10, args.layers, dtype="float32",
                                  seed=0)
        lp = mgnn.LayerParallel(model, fwd, bwd, comm=comm, backend="numba", capture=capture,
                                guard=None)
        grads = model.params.zeros_like()
        for _ in range(3):
            lp.loss_and_grad(x, y, out=grads)
        times = []
        for _ in range(args.steps):
            comm.Barrier()
            t0 = time.perf_counter()
            losses[capture], _ = lp.loss_and_grad(x, y, out=grads)
            times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        out["captured_ms" if capture else "uncaptured_ms"] = 1e3 * statistics.median(times)
    if losses[True] != losses[False]:
        raise SystemExit(f"captured loss {losses[True]} != uncaptured {losses[False]}")
    out["speedup"] = out["uncaptured_ms"] / out["captured_ms"]
    if comm.Get_rank() == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
