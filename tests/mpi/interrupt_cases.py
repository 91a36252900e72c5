"""Programs run by tests/mpi/test_interrupts.py as
``mpiexec -n P python -m tests.mpi.interrupt_cases WORKDIR KIND ACTION DATA_RANKS VICTIM``.

Every rank writes ``WORKDIR/pid.RANK`` at once (so the test can kill a hung rank) and
``WORKDIR/ready.RANK`` after its first training step (or solve); then it keeps stepping until
the test acts, for at most ``LIMIT`` seconds (then it exits 0, which the test counts as a
failure). KIND: ``network`` (LayerParallel training steps on a tiny dense ResNet, ``DATA_RANKS``
replicas) or ``solver`` (the user's own MGRITSolver and propagator on COMM_WORLD). ACTION:
``sigint`` (the test sends SIGINT to rank VICTIM) or ``keyboard`` / ``exit0`` / ``exit`` (once
the test creates ``WORKDIR/go``, the propagator of rank VICTIM raises ``KeyboardInterrupt`` /
calls ``sys.exit(0)`` / ``sys.exit()``), or ``uncaught`` (rank VICTIM raises ``KeyboardInterrupt``
between two steps, outside every mgnn call, and nothing catches it).
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mgnn
from mgnn import MGRITOptions, MGRITSolver

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
LIMIT = 120.0


def _touch(path, text=""):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _failing(step, go, action):
    """``step`` wrapped to raise/exit as ``action`` once the file ``go`` exists."""
    def failing(*args, **kwargs):
        if os.path.exists(go):
            if action == "keyboard":
                raise KeyboardInterrupt
            sys.exit(0 if action == "exit0" else None)
        return step(*args, **kwargs)
    return failing


class Tanh:
    """The user's propagator: u + (stop - start) h tanh(W_start u + b_start) on (B, d) states."""

    def __init__(self, n, d=4, h=0.1):
        rng = np.random.default_rng(0)
        self.W, self.b, self.h = rng.standard_normal((n, d, d)), rng.standard_normal((n, d)), h

    def step(self, u, start, stop, level):
        return u + (stop - start) * self.h * np.tanh(u @ self.W[start].T + self.b[start])


def main(workdir, kind, action, data_ranks, victim):
    _touch(os.path.join(workdir, f"pid.{RANK}"), str(os.getpid()))
    go = os.path.join(workdir, "go")
    fails = action in ("keyboard", "exit0", "exit") and RANK == victim
    if kind == "solver":
        prop = Tanh(64)
        if fails:
            prop.step = _failing(prop.step, go, action)
        solver = MGRITSolver(prop, 64, MGRITOptions(cf=2, max_levels=3, max_iter=3, tol=0.0),
                             comm=COMM)
        u0 = np.ones((2, 4))
        step = lambda: solver.solve(u0)  # noqa: E731
    else:
        if fails:
            prop = mgnn.network.ForwardPropagator
            prop.step = _failing(prop.step, go, action)
            prop.step_batch = _failing(prop.step_batch, go, action)
            prop.advance = _failing(prop.advance, go, action)  # the stacked path
            prop.advance_final = _failing(prop.advance_final, go, action)  # its final sweep
        model = mgnn.dense_resnet(6, 6, 3, 16, seed=0)
        opts = MGRITOptions(cf=2, max_levels=2, max_iter=2, tol=0.0)
        lp = mgnn.LayerParallel(model, fwd=opts, bwd=opts, comm=COMM, data_ranks=data_ranks,
                                backend="numba")
        rng = np.random.default_rng(lp.replica)
        x, y = rng.standard_normal((8, 6)), rng.integers(0, 3, 8)
        step = lambda: lp.loss_and_grad(x, y)  # noqa: E731
    step()
    _touch(os.path.join(workdir, f"ready.{RANK}"))
    t0 = time.monotonic()
    while time.monotonic() - t0 < LIMIT:
        if action == "uncaught" and RANK == victim and os.path.exists(go):
            raise KeyboardInterrupt  # between two mgnn calls: nothing catches it
        step()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
