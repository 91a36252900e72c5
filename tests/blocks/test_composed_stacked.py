"""The composed dense step's stacked kernels (:mod:`mgnn.backend.numba_cpu.composed`) against
the block-by-block single steps of :class:`mgnn.blocks.composed.ComposedStep` (the reference,
itself checked against PyTorch): relaxation chains, residual / FAS / plain points, the kept
linearisation, the adjoint's chains and points, the parameter gradients and the serial sweeps,
for batch norm, dropout and both, train and eval mode; then whole training steps on the
stacked kernels against the stepped protocol."""
import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions
from mgnn.backend import get_backend
from mgnn.backend.counter_rng import dropout_mask
from mgnn.blocks.composed import ComposedLinearization, ComposedStep, StepContext
from tests.conftest import sgd_steps

BK = get_backend("numba")
PATTERNS = {
    "bn relu": dict(batch_norm=True, activation="relu"),
    "bn tanh": dict(batch_norm=True, activation="tanh"),
    "dropout relu": dict(dropout=0.3, activation="relu"),
    "bn tanh dropout": dict(batch_norm=True, dropout=0.2, activation="tanh"),
}
N, B, W = 9, 7, 5


def _setup(pattern, dtype="float64", training=True, seed=0):
    model = mgnn.dense_resnet(W, W, 3, N, dtype=dtype, seed=seed, **PATTERNS[pattern])
    kind, P = model.step, model.step_params()
    rng = np.random.default_rng(seed + 1)
    bufs = model.group_buffers()
    if bufs:  # running statistics away from their initial 0 / 1
        bufs["running_mean"][...] = rng.standard_normal(bufs["running_mean"].shape)
        bufs["running_var"][...] = rng.uniform(0.5, 2.0, bufs["running_var"].shape)
    ctx = StepContext(training=training, step=3, sample0=11, seed=5, buffers=bufs)
    U = rng.standard_normal((N + 1, B, W)).astype(dtype)
    return model, kind, P, ctx, U, rng


def _phi(kind, P, ctx, u, t, h):
    return kind.forward_layer(P, t, u, h, BK, ctx)


def _tol(dtype):
    return dict(rtol=1e-12, atol=1e-12) if dtype == "float64" else dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_forward_chains_and_points_equal_the_single_steps(pattern, training, dtype):
    model, kind, P, ctx, U, rng = _setup(pattern, dtype, training)
    assert kind.can_stack(BK, ctx)
    h = np.dtype(dtype).type(0.3)
    G = rng.standard_normal(U.shape).astype(dtype)
    # two chains, coarse layer indices (stride 2 from layer 0): slot i applies layer 2 (i - 1)
    chains = np.array([[1, 2], [4, 1]])
    for with_g in (False, True):
        got = U.copy()
        kind.chains_forward_layers(P, got, G if with_g else None, chains, -2, 2, h, BK, ctx)
        want = U.copy()
        for first, n in chains:
            for i in range(first, first + n):
                want[i] = _phi(kind, P, ctx, want[i - 1], 2 * (i - 1), h)
                if with_g:
                    want[i] += G[i]
        np.testing.assert_allclose(got, want, **_tol(dtype))
    slots, outs = np.array([2, 5, 4]), np.array([0, 2, 1])
    for mode in (0, 1, 2):
        for with_g in (False, True):
            R0 = rng.standard_normal((3, B, W)).astype(dtype)
            R = R0.copy()
            norm = kind.points_forward_layers(P, U, G if with_g else None, R, slots, outs, -2, 2,
                                              h, mode, BK, ctx)
            want, total = R0.copy(), 0.0
            for i, o in zip(slots, outs):
                phi = _phi(kind, P, ctx, U[i - 1], 2 * (i - 1), h)
                if mode == 1:
                    want[o] = (R0[o] + U[i]) - phi
                    continue
                want[o] = (phi - U[i] if mode == 0 else phi) + (G[i] if with_g else 0)
                total += float((want[o].astype(np.float64) ** 2).sum())
            np.testing.assert_allclose(R, want, **_tol(dtype))
            if mode == 0:
                assert norm == pytest.approx(total, rel=1e-10 if dtype == "float64" else 1e-5)


def _caches_equal(kind, got, want, dtype):
    """Block caches ``got`` (from a ComposedLinearization) against ``kind.linearize``'s."""
    for blk, g, w in zip(kind.blocks, got, want):
        if w is None:
            assert g is None or np.all(g == 1)  # eval-mode dropout: no mask (or ones)
            continue
        if isinstance(w, tuple):  # batch norm: ((xhat, invstd, count, mean, var), sigma')
            (xh, inv, cnt, mu, var), d = w
            (gxh, ginv, gcnt, gmu, gvar), gd = g
            assert gcnt == cnt
            for a, b in ((gxh, xh), (ginv, inv), (gmu, mu), (gvar, var), (gd, d)):
                np.testing.assert_allclose(a, b, **_tol(dtype))
        else:
            np.testing.assert_allclose(g, w, **_tol(dtype))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_kept_and_computed_linearisations_equal_the_block_caches(pattern, training):
    model, kind, P, ctx, U, rng = _setup(pattern, training=training)
    h = 0.25
    kept = kind.kept_arrays((B, W), 6, U.dtype, lambda name, shape, dt: np.full(shape, np.nan, dt))
    done = np.zeros(6, np.int8)
    states = U.copy()
    # a final sweep over slots 1..N keeping layers 2..7 (rows 0..5): the others are not rows
    kind.chains_forward_layers_keep(P, states, np.array([[1, N]]), -1, 1, h, kept, 2, done, BK,
                                    ctx)
    assert done.tolist() == [1] * 6
    lin = ComposedLinearization(kind, states, 0, kept, 2, 1 if training else 2)
    for t in range(2, 8):
        _caches_equal(kind, lin[t], kind.linearize(P, t, states[t], BK, ctx), "float64")
    assert lin[1] is None and lin[8] is None
    # computed at given states, the rows flagged done left alone
    part = np.array([1, 0, 0, 1, 0, 1], np.int8)
    lin2 = kind.linearize_stacked(P, states, 2, 6, 2, BK, ctx,
                                  lambda name, shape, dt: np.full(shape, -7.0, dt), part)
    for p in range(6):
        if part[p]:
            assert np.all(lin2.arrays[1][p] == -7.0)
        else:
            _caches_equal(kind, lin2[2 + p], kind.linearize(P, 2 + p, states[2 + p], BK, ctx),
                          "float64")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_adjoint_chains_points_and_gradients_equal_the_single_vjps(pattern, dtype):
    model, kind, P, ctx, U, rng = _setup(pattern, dtype)
    lin = kind.linearize_stacked(P, U, 0, N, 0, BK, ctx, lambda n, s, d: np.empty(s, d))
    caches = [kind.linearize(P, t, U[t], BK, ctx) for t in range(N)]
    h = np.dtype(dtype).type(0.3)
    L = rng.standard_normal((N + 1, B, W)).astype(dtype)
    G = rng.standard_normal(L.shape).astype(dtype)
    # reversed index: the step into slot i is the vjp of layer N - 1 - 2 (i - 1) (stride 2)
    chains = np.array([[1, 3], [5, 1]])
    for with_g in (False, True):
        got = L.copy()
        kind.chains_adjoint_layers(P, got, G if with_g else None, chains, N + 1, -2, h, lin, BK,
                                   ctx)
        want = L.copy()
        for first, n in chains:
            for i in range(first, first + n):
                t = N + 1 - 2 * i
                want[i] = kind.vjp_state_layer(P, t, caches[t], want[i - 1], h, BK, ctx)
                if with_g:
                    want[i] += G[i]
        np.testing.assert_allclose(got, want, **_tol(dtype))
    slots, outs = np.array([3, 1]), np.array([1, 0])
    for mode in (0, 1, 2):
        R0 = rng.standard_normal((2, B, W)).astype(dtype)
        R = R0.copy()
        kind.points_adjoint_layers(P, L, G, R, slots, outs, N + 1, -2, h, mode, lin, BK, ctx)
        want = R0.copy()
        for i, o in zip(slots, outs):
            t = N + 1 - 2 * i
            phi = kind.vjp_state_layer(P, t, caches[t], L[i - 1], h, BK, ctx)
            want[o] = ((R0[o] + L[i]) - phi if mode == 1 else
                       (phi - L[i] if mode == 0 else phi) + G[i])
        np.testing.assert_allclose(R, want, **_tol(dtype))
    # parameter gradients: lam_{t+1} = L[t + 1]; two runs, the second one a callable
    grads = {k: np.full_like(v, np.nan) for k, v in P.items()}
    kind.vjp_params_stacked_layers(P, [(L, 1, 1, 4), lambda: (L, 5, 1, N - 4)], lin, BK, ctx,
                                   grads, None, h=h)
    want = {k: np.zeros_like(v) for k, v in P.items()}
    kind.vjp_params_steps(P, range(N), U, caches, L, h, BK, ctx, want)
    for k in P:
        scale = max(np.abs(want[k]).max(), 1.0)
        np.testing.assert_allclose(grads[k] / scale, want[k] / scale, **_tol(dtype))
    with pytest.raises(ValueError, match="cover 4 layers"):
        kind.vjp_params_stacked_layers(P, [(L, 1, 1, 4)], lin, BK, ctx, grads, None, h=h)


def test_batch_masks_are_the_reference_masks_and_bad_indices_are_refused():
    model, kind, P, ctx, U, rng = _setup("dropout relu")
    args = kind.kernel_args(P, ctx, U, BK)
    masks, lo = args[-2], args[-1]
    assert masks.shape == (N, B, W) and lo == 0
    thr = kind.blocks[2].threshold
    for t in (0, 4, N - 1):
        want = dropout_mask(ctx.seed, ctx.step, t, ctx.sample0, B, W, thr)
        np.testing.assert_array_equal(masks[t], want)
    # a rank's layers only: the masks of the others are drawn in the kernel, the same bits
    ctx.steps = (3, 6)
    ctx.memo.clear()
    got = U.copy()
    kind.chains_forward_layers(P, got, None, np.array([[1, N]]), -1, 1, 0.5, BK, ctx)
    assert kind.kernel_args(P, ctx, U, BK)[-2].shape[0] == 3
    ctx.steps = None
    ctx.memo.clear()
    want = U.copy()
    kind.chains_forward_layers(P, want, None, np.array([[1, N]]), -1, 1, 0.5, BK, ctx)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="slots"):
        kind.chains_forward_layers(P, U.copy(), None, np.array([[0, 2]]), -1, 1, 0.5, BK, ctx)
    with pytest.raises(ValueError, match="layers"):
        kind.chains_forward_layers(P, U.copy(), None, np.array([[1, N]]), 0, 1, 0.5, BK, ctx)
    with pytest.raises(ValueError, match="chains"):
        kind.chains_forward_layers(P, U.copy(), None, np.array([1, 2, 3]), -1, 1, 0.5, BK, ctx)


def test_which_compositions_run_the_stacked_kernels():
    dense = mgnn.dense_resnet(4, 4, 3, 5, batch_norm=True).step
    conv = mgnn.conv_resnet(1, 2, (4, 4), 3, 5, batch_norm=True).step
    drop = mgnn.dense_resnet(4, 4, 3, 5, dropout=0.1).step
    assert isinstance(dense, ComposedStep) and dense.can_stack(BK)
    assert not conv.can_stack(BK)  # conv affines step one state per call
    assert not dense.can_stack(get_backend("numpy"))  # no composed kernels there

    class Replicas:  # synchronised batch norm: an allgather per evaluation
        pass
    sync = StepContext(replicas=Replicas())
    assert not dense.can_stack(BK, sync)
    assert drop.can_stack(BK, sync)  # dropout alone needs no statistics


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_training_steps_on_the_stacked_kernels_equal_the_stepped_protocol(pattern,
                                                                           monkeypatch):
    """Serial (one sweep each way) and MGRIT training steps, three SGD steps (the running
    statistics and dropout masks move), on the stacked kernels and on single steps."""
    fixed = (MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False),
             MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0, warn_not_converged=False))
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((B, W)), rng.integers(0, 3, B)
    for opts in ((None, None), fixed):
        runs = {}
        for stacked in (True, False):
            model = mgnn.dense_resnet(W, W, 3, 12, seed=4, **PATTERNS[pattern])
            with monkeypatch.context() as m:
                if not stacked:
                    m.setattr(ComposedStep, "can_stack", lambda self, bk, ctx=None: False)
                lp = mgnn.LayerParallel(model, *opts, backend="numba", guard=None)
                out = sgd_steps(lp, model, x, y)
                out.append(lp.logits(x))  # eval mode
            runs[stacked] = out
        for a, b in zip(runs[True][:3], runs[False][:3]):
            assert a[0] == pytest.approx(b[0], rel=1e-13)
            np.testing.assert_allclose(a[1], b[1], rtol=1e-11, atol=1e-12)
            np.testing.assert_allclose(a[2], b[2], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(runs[True][3], runs[False][3], rtol=1e-12, atol=1e-12)


def test_chains_on_threads_give_the_same_bits():
    """Several chains on Numba's threads (prange, one BLAS thread each) against one thread."""
    import numba
    model, kind, P, ctx, U, rng = _setup("bn tanh dropout")
    lin = kind.linearize_stacked(P, U, 0, N, 0, BK, ctx, lambda n, s, d: np.empty(s, d))
    chains = np.array([[1, 2], [4, 3], [8, 2]])
    out = {}
    saved = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            V, L = U.copy(), U[::-1].copy()
            kind.chains_forward_layers(P, V, None, chains, -1, 1, 0.5, BK, ctx)
            kind.chains_adjoint_layers(P, L, None, chains, N, -1, 0.5, lin, BK, ctx)
            out[threads] = (V, L)
    finally:
        numba.set_num_threads(saved)
    for a, b in zip(out[1], out[max(out)]):
        np.testing.assert_array_equal(a, b)
