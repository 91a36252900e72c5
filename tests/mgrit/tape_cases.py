"""Shared by the captured-cycle tests of the kinds with kernels of their own: training steps of
one model with cycles captured or not, and the checks that the two agree bit for bit."""
import numpy as np

import mgnn
from mgnn import MGRITOptions


def training_steps(model, x, y, capture, steps=4):
    """``steps`` MGRIT training steps (fixed 2/2 cycles, cf 2, 3 levels; the second step
    captures, later ones replay): ([(loss, gradients, residual histories)], [forward tapes,
    adjoint tapes] (the solvers' dicts), the LayerParallel)."""
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None, capture=capture)
    out = []
    for _ in range(steps):
        loss, g = lp.loss_and_grad(x, y)
        out.append((loss, {k: v.copy() for k, v in g.items()},
                    [list(lp.stats[p]["residuals"]) for p in ("forward", "adjoint")]))
    tapes = [lp._solver(k, o)._tapes for k, o in (("forward", fwd), ("adjoint", bwd))]
    return out, tapes, lp


def assert_replays_match(captured, uncaptured):
    """Both runs of :func:`training_steps` (captured first): tapes on both solves, every one
    replayable, none without capture, and every step's loss, gradients and residuals equal."""
    (got, tapes, _), (want, none, _) = captured, uncaptured
    assert all(tapes) and not any(none), (tapes, none)
    assert all(t is not None for d in tapes for t in d.values())
    # replayed, not only captured (a key that changed every step would recapture each time)
    assert all(any(t.replays >= 1 for t in d.values()) for d in tapes), tapes
    for (l1, g1, r1), (l0, g0, r0) in zip(got, want):
        assert l1 == l0 and r1 == r0
        for k in g0:
            np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
