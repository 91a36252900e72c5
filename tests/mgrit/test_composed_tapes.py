"""Captured cycles of the composed dense kinds (batch norm, dropout, both; train and eval
mode): replayed in one Numba call per cycle (mgnn.backend.numba_cpu.tapes' composed drivers),
bit for bit the uncaptured engine calls, forward and adjoint, with the serial and the threaded
driver."""
import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions
from mgnn.backend.numba_cpu import tapes as numba_tapes

CASES = [(True, 0.0), (False, 0.2), (True, 0.2)]


def _steps(bn, drop, capture, steps=4):
    model = mgnn.dense_resnet(5, 6, 3, 16, batch_norm=bn, dropout=drop, seed=2)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None, capture=capture)
    out = []
    for _ in range(steps):  # the second step captures, later ones replay
        loss, g = lp.loss_and_grad(x, y)
        out.append((loss, {k: v.copy() for k, v in g.items()},
                    [list(lp.stats[p]["residuals"]) for p in ("forward", "adjoint")]))
    tapes = [lp._solver(k, o)._tapes for k, o in (("forward", fwd), ("adjoint", bwd))]
    return out, tapes, lp, x


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("bn, drop", CASES)
def test_composed_cycles_replay_the_engine_calls_bit_for_bit(bn, drop, threaded, monkeypatch):
    if threaded:  # the threaded drivers (each engine call's rows on Numba's threads)
        monkeypatch.setattr(numba_tapes.numba, "get_num_threads", lambda: 2)
    got, tapes, lp, x = _steps(bn, drop, True)
    want, none, lp0, _ = _steps(bn, drop, False)
    assert all(tapes) and not any(none), (tapes, none)  # captured both ways; nothing without
    assert all(t is not None for d in tapes for t in d.values())  # every capture replayable
    for (l1, g1, r1), (l0, g0, r0) in zip(got, want):
        assert l1 == l0 and r1 == r0
        for k in g0:
            np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
    if bn:  # eval mode (running statistics): inference's forward solves, replayed after the
        lp.model.eval()  # first, equal the uncaptured ones
        lp0.model.eval()
        want = lp0.logits(x)
        for _ in range(3):
            np.testing.assert_array_equal(lp.logits(x), want)


def test_composed_tapes_keep_chains_and_coarse_steps_apart():
    """The composed kinds' tapes have no shared first steps (their replay runs rows as the
    engine's calls); the fused kinds' tapes still fold them."""
    from mgnn.backend import tape as T
    _, tapes, _, _ = _steps(True, 0.2, True, steps=2)
    rows = [t.rows for d in tapes for t in d.values() if t.rows is not None]
    assert rows and all((r[:, T.SHARE_R] < 0).all() for r in rows)
    model = mgnn.dense_resnet(5, 6, 3, 16, seed=2)
    opts = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    lp = mgnn.LayerParallel(model, opts, opts, backend="numba", guard=None)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    for _ in range(2):
        lp.loss_and_grad(x, y)
    dense = [t.rows for t in lp._solver("forward", opts)._tapes.values() if t.rows is not None]
    assert any((r[:, T.SHARE_R] >= 0).any() for r in dense)
