"""Captured cycles of the recurrent kinds (GRU with implicit or rediscretised coarse steps, the
implicit GRU cell, 2-layer GRU, tanh RNN) over sequence time: replayed in one Numba call per
cycle (mgnn.backend.numba_cpu.tapes' recurrent drivers), bit for bit the uncaptured engine
calls, forward and adjoint."""
import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions

CASES = {
    "gru": lambda: mgnn.gru_classifier(3, 5, 3, 16, seed=2),
    "gru, 2 layers, rediscretised": lambda: mgnn.gru_classifier(3, 5, 3, 16, n_layers=2,
                                                                coarse="rediscretise", seed=2),
    "implicit gru": lambda: mgnn.gru_classifier(3, 5, 3, 16, cell="implicit_gru", seed=2),
    "rnn": lambda: mgnn.rnn_classifier(3, 5, 3, 16, seed=2),
}


def _steps(build, capture, steps=4):
    model = build()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 16, 3)), rng.integers(0, 3, 4)
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None, capture=capture)
    out = []
    for _ in range(steps):  # the second step captures, later ones replay
        loss, g = lp.loss_and_grad(x, y)
        out.append((loss, {k: v.copy() for k, v in g.items()},
                    [list(lp.stats[p]["residuals"]) for p in ("forward", "adjoint")]))
    tapes = [lp._solver(k, o)._tapes for k, o in (("forward", fwd), ("adjoint", bwd))]
    return out, tapes


@pytest.mark.parametrize("case", list(CASES))
def test_recurrent_cycles_replay_the_engine_calls_bit_for_bit(case):
    got, tapes = _steps(CASES[case], True)
    want, none = _steps(CASES[case], False)
    assert all(tapes) and not any(none), (tapes, none)
    assert all(t is not None for d in tapes for t in d.values())  # every capture replayable
    for (l1, g1, r1), (l0, g0, r0) in zip(got, want):
        assert l1 == l0 and r1 == r0
        for k in g0:
            np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
