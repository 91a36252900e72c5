"""The forward solve's last sweep keeps the linearisation: the final F-relaxation steps out of
every layer whose next point is an F-point at the final states, so LayerParallel evaluates again
only the layers that step into C-points (or none after a sequential sweep). Composed kinds (batch
norm, dropout) keep their caches; fused kinds (dense) on the Numba backend write sigma' from the
final sweep's chains (``dense_chains_forward_derivs``). The training step is bit for bit the one
that evaluates every layer again, whatever the hierarchy, cycle, engine or number of steps."""
import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions
from mgnn import network as network_module
from mgnn.blocks.composed import ComposedStep
from mgnn.propagators import ForwardPropagator
from tests.conftest import sgd_steps

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
        # the block-by-block protocol (the stacked kernels' kept rows: the test below)
        m.setattr(type(model.step), "can_stack", lambda self, bk, ctx=None: False)
        if not keep:
            m.setattr(network_module, "ComposedStep", _NotComposed)
        step = model.step
        original = type(step).linearize

        def counting(self, *a, **k):
            counts[keep] = counts.get(keep, 0) + 1
            return original(self, *a, **k)

        m.setattr(type(step), "linearize", counting)
        lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None)
        return sgd_steps(lp, model, x, y)


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


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_stacked_composed_kinds_keep_the_final_sweeps_linearisation(setting, monkeypatch):
    """Batch norm + dropout on the composed stacked kernels: the final sweep's rows kept (only
    the layers stepping into C-points linearised again) give the training steps, running
    statistics included, bit for bit of linearising every layer again."""
    fwd, bwd = SETTINGS[setting]
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    runs, missing = {}, {True: [], False: []}
    for keep in (True, False):
        model = mgnn.dense_resnet(5, 6, 3, 16, batch_norm=True, dropout=0.2, seed=2)
        with monkeypatch.context() as m:
            if not keep:
                m.setattr(ForwardPropagator, "can_keep_derivs", lambda self: False)
            original = ComposedStep.linearize_stacked

            def counting(self, P, U, first, count, t0, bk, ctx, scratch, done=None, _k=keep):
                missing[_k].append(count if done is None else int((done == 0).sum()))
                return original(self, P, U, first, count, t0, bk, ctx, scratch, done)

            m.setattr(ComposedStep, "linearize_stacked", counting)
            lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None)
            assert lp._solver("forward", lp.fwd).prop._layered
            runs[keep] = sgd_steps(lp, model, x, y)
    for (l1, g1, b1), (l2, g2, b2) in zip(runs[True], runs[False]):
        assert l1 == l2
        np.testing.assert_array_equal(g1, g2)
        np.testing.assert_array_equal(b1, b2)
    assert np.abs(runs[True][-1][2]).max() > 0  # the running statistics did move
    assert missing[False] == [16] * 3
    expect = 0 if fwd.max_levels == 1 else 16 // fwd.cf
    assert missing[True] == [expect] * 3


def _fused_steps(model, fwd, bwd, x, y, keep, monkeypatch, calls, **kw):
    with monkeypatch.context() as m:
        if not keep:
            m.setattr(ForwardPropagator, "can_keep_derivs", lambda self: False)
        for name in ("deriv_stacked", "deriv_missing"):
            original = getattr(type(model.step), name)

            def counting(self, *a, _name=name, _original=original, **k):
                calls.append((keep, _name))
                return _original(self, *a, **k)

            m.setattr(type(model.step), name, counting)
        return _three_steps(mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None,
                                               **kw), model, x, y)


def _three_steps(lp, model, x, y):
    """Three SGD steps of ``lp``: [(loss, gradient)], and per step how many of the 16 layers'
    linearisations the forward solve kept (None: none kept)."""
    opt = mgnn.optim.SGD(model.params, lr=0.1)
    out, done = [], []
    for _ in range(3):
        loss, g = lp.loss_and_grad(x, y)
        out.append((loss, g.flat.copy()))
        flags = lp._arrays.get(("derivs_done", (16,), np.dtype(np.int8).str))
        done.append(None if flags is None else int(flags.sum()))
        opt.step(g)
    return out, done


def _fused_model(kind, activation):
    if kind == "dense":
        return mgnn.dense_resnet(5, 6, 3, 16, activation=activation, seed=2), (6, 5)
    return mgnn.conv_resnet(1, 2, (5, 4), 3, 16, activation=activation, seed=2), (6, 1, 5, 4)


@pytest.mark.parametrize("capture", [True, False])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fused_kinds_keep_sigma_prime_of_the_final_sweep(setting, kind, activation, capture,
                                                          monkeypatch):
    fwd, bwd = SETTINGS[setting]
    runs, dones, calls = {}, {}, []
    for keep in (True, False):
        model, shape = _fused_model(kind, activation)
        rng = np.random.default_rng(5)
        x, y = rng.standard_normal(shape), rng.integers(0, 3, 6)
        runs[keep], dones[keep] = _fused_steps(model, fwd, bwd, x, y, keep, monkeypatch, calls,
                                               capture=capture)
    for (l1, g1), (l2, g2) in zip(runs[True], runs[False]):
        assert l1 == l2
        np.testing.assert_array_equal(g1, g2)
    # kept: one call for the rows the final sweep did not write; not kept: every row again
    assert [c for c in calls if c[0]] == [(True, "deriv_missing")] * 3
    assert [c for c in calls if not c[0]] == [(False, "deriv_stacked")] * 3
    expect = 16 if fwd.max_levels == 1 else 16 - 16 // fwd.cf
    assert dones[True] == [expect] * 3


def test_kept_sigma_prime_where_a_dense_step_takes_the_numpy_route(monkeypatch):
    """At B w >= WIDE the layers the final sweep did not write take the single kernels' NumPy
    route (as dense_deriv_stacked does): the step equals the one that evaluates every layer
    again to rounding (tanh) and bit for bit (relu, a 0/1 derivative)."""
    fwd, bwd = SETTINGS["2 levels cf 4, skipped down-cycle"]
    for activation in ("relu", "tanh"):
        rng = np.random.default_rng(6)
        x, y = rng.standard_normal((128, 40)).astype(np.float32), rng.integers(0, 3, 128)
        runs, dones = {}, {}
        for keep in (True, False):
            model = mgnn.dense_resnet(40, 40, 3, 16, activation=activation, dtype="float32",
                                      seed=2)
            runs[keep], dones[keep] = _fused_steps(model, fwd, bwd, x, y, keep, monkeypatch, [])
        assert dones[True] == [16 - 16 // fwd.cf] * 3  # (kept: 128 x 40 is past WIDE)
        for (l1, g1), (l2, g2) in zip(runs[True], runs[False]):
            if activation == "relu":
                assert l1 == l2
                np.testing.assert_array_equal(g1, g2)
            else:
                np.testing.assert_allclose(l1, l2, rtol=1e-6)
                np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-6)


def test_chains_forward_derivs_against_the_reference():
    """The kernel itself: the same states as dense_chains_forward bit for bit, sigma' of every
    layer it stepped (and only those) as dense_deriv computes it, their flags set; bad D / done
    / d_lo are errors naming them."""
    from mgnn.backend import get_backend
    nb, ref = get_backend("numba"), get_backend("numpy")
    rng = np.random.default_rng(7)
    W = rng.standard_normal((12, 5, 5)).astype(np.float32) * 0.5
    b = rng.standard_normal((12, 5)).astype(np.float32)
    U = rng.standard_normal((14, 3, 5)).astype(np.float32)
    chains = np.array([[1, 3], [6, 2], [10, 3]], dtype=np.int64)
    h = np.float32(0.3)
    for act in (0, 1, 2):
        V = U.copy()
        nb.dense_chains_forward(V, None, W, b, chains, -1, 1, h, act)
        X, D, done = U.copy(), np.full((8, 3, 5), 7, np.float32), np.zeros(8, np.int8)
        nb.dense_chains_forward_derivs(X, W, b, chains, -1, 1, h, act, D, 2, done)
        np.testing.assert_array_equal(X, V)
        stepped = [f - 1 + q for f, n in chains.tolist() for q in range(n)]  # layers l
        for p in range(8):
            l = p + 2
            if l in stepped:
                assert done[p] == 1
                np.testing.assert_array_equal(D[p], nb.dense_deriv(X[l], W[l], b[l], act))
                np.testing.assert_allclose(D[p], ref.dense_deriv(X[l], W[l], b[l], act),
                                           rtol=1e-5, atol=1e-6)
            else:
                assert done[p] == 0 and (D[p] == 7).all()
        # the rows not written, then: every row equals dense_deriv_stacked's
        nb.dense_deriv_missing(X, 2, 8, W, b, 2, act, D, done)
        full = np.empty_like(D)
        nb.dense_deriv_stacked(X, 2, 8, W, b, 2, act, full)
        np.testing.assert_array_equal(D, full)
    D, done = np.zeros((8, 3, 5), np.float32), np.zeros(8, np.int8)
    with pytest.raises(ValueError, match="D must be"):
        nb.dense_chains_forward_derivs(U.copy(), W, b, chains, -1, 1, h, 0, D[:, :, :4], 2, done)
    with pytest.raises(ValueError, match="done must be"):
        nb.dense_chains_forward_derivs(U.copy(), W, b, chains, -1, 1, h, 0, D, 2,
                                       done.astype(np.int64))
    with pytest.raises(TypeError, match="d_lo must be"):
        nb.dense_chains_forward_derivs(U.copy(), W, b, chains, -1, 1, h, 0, D, 2.0, done)
    with pytest.raises(ValueError, match="done must be"):
        nb.dense_deriv_missing(U, 2, 8, W, b, 2, 0, D, done[:3])


def test_conv_chains_forward_derivs_against_the_single_kernels():
    """The conv kernel: the same states as conv_chains_forward bit for bit, sigma' of every
    layer it stepped as conv_deriv computes it (the same bits), flags set, other rows untouched;
    conv_deriv_missing then completes what conv_deriv_stacked gives."""
    from mgnn.backend import get_backend
    nb = get_backend("numba")
    rng = np.random.default_rng(8)
    W = (rng.standard_normal((12, 3, 3, 3, 3)) * 0.3).astype(np.float32)
    b = rng.standard_normal((12, 3)).astype(np.float32)
    U = rng.standard_normal((14, 2, 3, 5, 6)).astype(np.float32)
    chains = np.array([[1, 3], [6, 2], [10, 3]], dtype=np.int64)
    h = np.float32(0.3)
    for act in (0, 1, 2):
        for parallel in (False, True):
            V = U.copy()
            nb.conv_chains_forward(V, None, W, b, chains, -1, 1, h, act, parallel=parallel)
            X = U.copy()
            D, done = np.full((8,) + U.shape[1:], 7, np.float32), np.zeros(8, np.int8)
            nb.conv_chains_forward_derivs(X, W, b, chains, -1, 1, h, act, D, 2, done,
                                          parallel=parallel)
            np.testing.assert_array_equal(X, V)
            stepped = [f - 1 + q for f, n in chains.tolist() for q in range(n)]
            for p in range(8):
                if p + 2 in stepped:
                    assert done[p] == 1
                    np.testing.assert_array_equal(
                        D[p], nb.conv_deriv(X[p + 2], W[p + 2], b[p + 2], act))
                else:
                    assert done[p] == 0 and (D[p] == 7).all()
            nb.conv_deriv_missing(X, 2, 8, W, b, 2, act, D, done)
            full = np.empty_like(D)
            nb.conv_deriv_stacked(X, 2, 8, W, b, 2, act, full)
            np.testing.assert_array_equal(D, full)


@pytest.mark.parametrize("capture", [True, False])
@pytest.mark.parametrize("cell", ["gru", "rnn"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_recurrent_kinds_keep_the_final_sweeps_caches(setting, cell, capture, monkeypatch):
    """GRU / RNN over sequence time (2 layers: the outputs are kept too): the final sweep's gate
    caches (recurrent_chains_forward_keep) and then only the steps left
    (recurrent_caches_missing) give the training steps bit for bit."""
    fwd, bwd = SETTINGS[setting]
    runs, dones = {}, {}
    for keep in (True, False):
        build = mgnn.gru_classifier if cell == "gru" else mgnn.rnn_classifier
        model = build(3, 4, 3, 16, n_layers=2, seed=1)
        rng = np.random.default_rng(9)
        x, y = rng.standard_normal((6, 16, 3)), rng.integers(0, 3, 6)
        with monkeypatch.context() as m:
            if not keep:
                m.setattr(ForwardPropagator, "can_keep_derivs", lambda self: False)
            lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba", guard=None,
                                    capture=capture)
            runs[keep], dones[keep] = _three_steps(lp, model, x, y)
    for (l1, g1), (l2, g2) in zip(runs[True], runs[False]):
        assert l1 == l2
        np.testing.assert_array_equal(g1, g2)
    expect = 16 if fwd.max_levels == 1 else 16 - 16 // fwd.cf
    assert dones[True] == [expect] * 3 and dones[False] == [None] * 3


def test_keep_kernels_are_numba_only_and_the_others_evaluate_whole():
    """Numba has every KEEP_KERNELS entry; the NumPy reference has none, so its propagators do
    not keep (and a step there evaluates the linearisation whole, as before)."""
    from mgnn.backend import KEEP_KERNELS, get_backend
    nb, ref = get_backend("numba"), get_backend("numpy")
    assert all(callable(getattr(nb, k, None)) for k in KEEP_KERNELS)
    assert not any(hasattr(ref, k) for k in KEEP_KERNELS)
    for build in (lambda: mgnn.dense_resnet(5, 6, 3, 8, seed=2),
                  lambda: mgnn.gru_classifier(3, 4, 3, 8, seed=1)):
        model = build()
        assert ForwardPropagator(model, nb).can_keep_derivs()
        assert not ForwardPropagator(model, ref).can_keep_derivs()
