"""The two MGRIT engines agree for every model kind: every kind runs the stacked engine (one
array per level; captured cycles where they apply; dense composed kinds on their stacked kernels,
conv composed kinds and conv3d through the stacked protocol over single steps), and the list engine (the adapter that runs any propagator with
``step``) gives the same inexact (fixed 2/1 cycles) loss, gradients and residual histories to
round-off, forward and adjoint, for dense, conv 2D/3D, batch norm + dropout, GRU, RNN and
spatially coarsened conv models. The list engine is forced by building every solver's engine as
a :class:`mgnn.mgrit.engines.ListEngine`."""
import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions
from mgnn.mgrit import solver as solver_module
from mgnn.mgrit.engines import ListEngine


def _case(kind):
    """(model, x shape, LayerParallel keyword arguments)."""
    if kind == "dense":
        return mgnn.dense_resnet(5, 6, 3, 16, t_final=1.5, seed=2), (4, 5), {}
    if kind == "conv":
        return mgnn.conv_resnet(1, 2, (4, 4), 3, 16, t_final=1.5, seed=2), (3, 1, 4, 4), {}
    if kind == "conv3d":
        return mgnn.conv_resnet(1, 2, (4, 4, 4), 3, 8, seed=2), (2, 1, 4, 4, 4), {}
    if kind == "batch norm + dropout":
        return (mgnn.dense_resnet(5, 6, 3, 16, batch_norm=True, dropout=0.2, seed=2), (6, 5),
                {})
    if kind == "gru":
        return mgnn.gru_classifier(3, 5, 3, 16, n_layers=2, seed=2), (4, 16, 3), {}
    if kind == "rnn":
        return mgnn.rnn_classifier(3, 5, 3, 16, seed=2), (4, 16, 3), {}
    if kind == "spatial conv":
        return (mgnn.conv_resnet(1, 2, (7, 7), 3, 8, seed=3), (3, 1, 7, 7),
                {"spatial_levels": (0, 1)})
    raise AssertionError(kind)


KINDS = ["dense", "conv", "conv3d", "batch norm + dropout", "gru", "rnn", "spatial conv"]


def _run(kind, list_engine, monkeypatch, rng_seed=0):
    model, xshape, kw = _case(kind)
    rng = np.random.default_rng(rng_seed)
    x = rng.standard_normal(xshape).astype(model.dtype)
    y = rng.integers(0, 3, xshape[0])
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0, skip_downcycle=False,
                       warn_not_converged=False)
    with monkeypatch.context() as m:
        if list_engine:
            def engine_for(self, u0):
                self.engine = self._engines.setdefault("list", ListEngine(self))
                return self.engine
            m.setattr(solver_module.MGRITSolver, "_engine_for", engine_for)
        lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None, **kw)
        losses, grads = [], None
        for _ in range(2):  # the second step replays captured cycles where they apply
            loss, grads = lp.loss_and_grad(x, y)
            losses.append(loss)
        engines = {type(lp._solver(k, o).engine).__name__
                   for k, o in (("forward", fwd), ("adjoint", bwd))}
    return losses, grads, lp.stats, engines


@pytest.mark.parametrize("kind", KINDS)
def test_list_and_stacked_engines_agree(kind, monkeypatch):
    losses_s, g_s, stats_s, engines_s = _run(kind, False, monkeypatch)
    losses_l, g_l, stats_l, engines_l = _run(kind, True, monkeypatch)
    assert engines_l == {"ListEngine"}
    assert engines_s == {"StackedEngine"}, engines_s  # every kind, forward and adjoint
    np.testing.assert_allclose(losses_s, losses_l, rtol=1e-12)
    for k in g_l:
        np.testing.assert_allclose(g_s[k], g_l[k], rtol=1e-9, atol=1e-12, err_msg=k)
    for part in ("forward", "adjoint"):
        r_s, r_l = stats_s[part]["residuals"], stats_l[part]["residuals"]
        assert len(r_s) == len(r_l) >= 1, (part, r_s, r_l)
        np.testing.assert_allclose(r_s, r_l, rtol=1e-9)


@pytest.mark.parametrize("size", [(7, 7), (8, 8), (5, 5, 5)])
def test_batched_spatial_transfers_equal_one_state_at_a_time(size, monkeypatch):
    """The stacked engine restricts / interpolates every C-point of a call as one batch
    (``batched_transfers``): bit for bit the state-by-state transfers, forward and adjoint."""
    from mgnn.propagators import _SpatialLevels
    model = mgnn.conv_resnet(1, 2, size, 3, 16, seed=3)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 1) + size)
    y = rng.integers(0, 3, 3)
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    out = []
    for batched in (True, False):
        monkeypatch.setattr(_SpatialLevels, "batched_transfers", batched)
        lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None,
                                spatial_levels=(0, 1))
        loss, g = lp.loss_and_grad(x, y)
        out.append((loss, g, lp.stats))
    (l1, g1, s1), (l0, g0, s0) = out
    assert l1 == l0
    for k in g0:
        np.testing.assert_array_equal(g1[k], g0[k], err_msg=k)
    for part in ("forward", "adjoint"):
        assert s1[part]["residuals"] == s0[part]["residuals"]


@pytest.mark.parametrize("spatial", [True, False])
def test_adjoint_reset_takes_the_new_states_on_every_level(spatial):
    """After ``reset(new states)`` a stacked adjoint propagator linearises at the new states on
    every level (no sigma' of the previous solve left over): equal to a fresh propagator."""
    from mgnn.backend import get_backend
    from mgnn.mgrit import MGRITSolver
    from mgnn.propagators import AdjointPropagator, SpatialAdjointPropagator
    bk, N, shape = get_backend("numpy"), 8, (2, 2, 7, 7)
    model = mgnn.conv_resnet(1, 2, (7, 7), 3, N, seed=3)
    U1, U2 = ([np.tanh(r.standard_normal(shape)) for _ in range(N + 1)]
              for r in (np.random.default_rng(1), np.random.default_rng(2)))
    lam = np.random.default_rng(0).standard_normal(shape)
    opts = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    cls, kw = ((SpatialAdjointPropagator, {"spatial_levels": (0,)}) if spatial
               else (AdjointPropagator, {}))
    prop = cls(model, U1, [None] * N, bk, **kw)
    solver = MGRITSolver(prop, N, opts)
    solver.solve(lam)
    assert solver.engine.stacked
    prop.reset(U2, [None] * N)
    reused = solver.solve(lam)
    fresh = MGRITSolver(cls(model, U2, [None] * N, bk, **kw), N, opts).solve(lam)
    for a, b in zip(reused.states, fresh.states):
        np.testing.assert_array_equal(a, b)
