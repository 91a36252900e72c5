"""Composed kinds (batch norm, dropout) keep the linearisation caches of the forward solve's last
sweep: the final F-relaxation steps out of every layer whose next point is an F-point at the
final states, so LayerParallel evaluates again only the layers that step into C-points (or none
after a sequential sweep). The training step is bit for bit the one that evaluates every layer
again, whatever the hierarchy, cycle, engine or number of steps."""
import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions
from mgnn import network as network_module
from mgnn.blocks.composed import ComposedStep

SETTINGS = {
    "3 levels cf 2, F-cycles": (MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0,
                                             cycle="F", warn_not_converged=False),
                                MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0,
                                             warn_not_converged=False)),
    "2 levels cf 4, skipped down-cycle": (MGRITOptions(cf=4, max_levels=2, max_iter=2, tol=0.0,
                                                       skip_downcycle=True,
                                                       warn_not_converged=False),
                                          MGRITOptions(cf=4, max_levels=2, max_iter=2, tol=0.0,
                                                       warn_not_converged=False)),
    "converged": (MGRITOptions(cf=2, max_levels=3, tol=1e-12, max_iter=50),
                  MGRITOptions(cf=2, max_levels=3, tol=1e-12, max_iter=50)),
    "one level (a sequential sweep)": (MGRITOptions(max_levels=1), MGRITOptions(max_levels=1)),
}


class _NotComposed:
    """Stands in for ComposedStep in mgnn.network: the caches are then never kept."""


def _steps(model, fwd, bwd, x, y, keep, monkeypatch, counts):
    with monkeypatch.context() as m:
        if not keep:
            m.setattr(network_module, "ComposedStep", _NotComposed)
        step = model.step
        original = type(step).linearize

        def counting(self, *a, **k):
            counts[keep] = counts.get(keep, 0) + 1
            return original(self, *a, **k)

        m.setattr(type(step), "linearize", counting)
        lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None)
        opt = mgnn.optim.SGD(model.params, lr=0.1)
        out = []
        for _ in range(3):  # parameters, running statistics and dropout masks move
            loss, g = lp.loss_and_grad(x, y)
            out.append((loss, g.flat.copy(), model.buffers.flat.copy()))
            opt.step(g)
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_kept_caches_give_the_same_training_steps_bit_for_bit(setting, monkeypatch):
    fwd, bwd = SETTINGS[setting]
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    runs, counts = {}, {}
    for keep in (True, False):
        model = mgnn.dense_resnet(5, 6, 3, 16, batch_norm=True, dropout=0.2, seed=2)
        assert isinstance(model.step, ComposedStep)
        runs[keep] = _steps(model, fwd, bwd, x, y, keep, monkeypatch, counts)
    for (l1, g1, b1), (l2, g2, b2) in zip(runs[True], runs[False]):
        assert l1 == l2
        np.testing.assert_array_equal(g1, g2)
        np.testing.assert_array_equal(b1, b2)  # the running statistics committed from them
    assert counts[False] == 3 * 16  # every layer, every step
    if fwd.max_levels == 1:  # one sequential sweep: every cache kept
        assert counts.get(True, 0) == 0
    else:  # only the layers that step into C-points are evaluated again
        assert counts[True] == 3 * (16 // fwd.cf)
