"""Whole-sequence recurrent sweeps (serial training: one backend call per sequence): the Numba
kernels against the NumPy reference built from the gate kernels, and the model's serial step
with the sweeps against the step-by-step protocol."""
import numpy as np
import pytest

import mgnn
from mgnn.backend import numba_cpu as NB, numpy_ref as REF


def _case(cell, L, B, nl, H, dtype, rng):
    G, C = (3, 4) if cell == 0 else (1, 1)
    f = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(dtype)  # noqa: E731
    return dict(gi0=f(B, L, G * H), WihT=f(nl, H, G * H, scale=0.4),
                WhhT=f(nl, H, G * H, scale=0.4), bih=f(nl, G * H), bhh=f(nl, G * H),
                u0=f(B, nl, H), lam=f(B, nl, H), C=C, G=G)


def _run(mod, cell, c, L, store, dt, mode):
    B, nl, H = c["u0"].shape
    U = np.zeros((L + 1, B, nl, H), c["u0"].dtype)
    U[0] = c["u0"]
    D = np.zeros((L if store else 0, nl, B, c["C"] * H), U.dtype)
    mod.recurrent_sweep_forward(cell, c["gi0"], U, c["WihT"], c["WhhT"], c["bih"], c["bhh"], D,
                                dt, mode)
    if not store:
        return U, None
    Wih = np.ascontiguousarray(c["WihT"].transpose(0, 2, 1))
    Whh = np.ascontiguousarray(c["WhhT"].transpose(0, 2, 1))
    DGI = np.zeros((L, nl, B, c["G"] * H), U.dtype)
    DGH = np.zeros_like(DGI)
    lam0 = mod.recurrent_sweep_backward(cell, c["lam"], U, D, Wih, Whh, dt, mode, DGI, DGH)
    return U, (D, lam0, DGI, DGH)


@pytest.mark.parametrize("cell, mode, dt", [(0, 0, 1.0), (0, 1, 1.0), (0, 0, 0.5), (0, 1, 3.0),
                                            (1, 0, 1.0), (1, 0, 0.5)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("nl, B, H", [(1, 3, 5), (3, 3, 5), (2, 8, 40)])
def test_numba_sweeps_equal_the_gate_kernel_reference(cell, mode, dt, dtype, nl, B, H, rng):
    """(B, H) = (8, 40): the GEMMs above numba_cpu.SMALL_GEMM multiply-adds (BLAS)."""
    L = 9
    c = _case(cell, L, B, nl, H, dtype, rng)
    tol = 1e-13 if dtype == np.float64 else 2e-5
    U_ref, back_ref = _run(REF, cell, c, L, True, dt, mode)
    U, back = _run(NB, cell, c, L, True, dt, mode)
    np.testing.assert_allclose(U, U_ref, rtol=tol, atol=tol)
    for got, want in zip(back, back_ref):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))
    U_only, _ = _run(NB, cell, c, L, False, dt, mode)  # no caches: the same states
    np.testing.assert_array_equal(U_only, U)
    assert back[1].dtype == dtype and np.abs(back[1]).max() > 0


def test_sweep_check_names_the_bad_array(rng):
    c = _case(0, 4, 2, 1, 3, np.float64, rng)
    U = np.zeros((5, 2, 1, 3))
    D = np.zeros((0, 1, 2, 12))
    with pytest.raises(ValueError, match=r"WhhT must be a C-contiguous float64 array of shape "
                                         r"\(1, 3, 9\), got float32"):
        NB.recurrent_sweep_forward(0, c["gi0"], U, c["WihT"], c["WhhT"].astype(np.float32),
                                   c["bih"], c["bhh"], D, 1.0, 0)
    with pytest.raises(ValueError, match="gi0 must be"):
        NB.recurrent_sweep_forward(0, c["gi0"][:, :3], U, c["WihT"], c["WhhT"], c["bih"],
                                   c["bhh"], D, 1.0, 0)
    with pytest.raises(ValueError, match="cell must be 0"):
        NB.recurrent_sweep_forward(2, c["gi0"], U, c["WihT"], c["WhhT"], c["bih"], c["bhh"], D,
                                   1.0, 0)


@pytest.mark.parametrize("make", [
    lambda: mgnn.gru_classifier(3, 4, 5, 11, n_layers=2, seed=1),
    lambda: mgnn.gru_classifier(3, 4, 5, 11, cell="implicit_gru", coarse="implicit", seed=1),
    lambda: mgnn.rnn_classifier(3, 4, 5, 11, n_layers=2, seed=1)])
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_serial_step_with_sweeps_equals_the_step_by_step_protocol(make, backend, rng,
                                                                 monkeypatch):
    """LayerParallel's serial path runs the sweeps (one call per sequence); with the sweeps
    taken away it steps layer after layer: same loss, gradients and predictions (float64)."""
    from mgnn.blocks.recurrent import RecurrentStep
    x, y = rng.standard_normal((6, 11, 3)), rng.integers(0, 5, 6)
    model = make()
    calls = []
    fwd, back = RecurrentStep.sweep_forward_layers, RecurrentStep.sweep_backward_layers
    monkeypatch.setattr(RecurrentStep, "sweep_forward_layers",
                        lambda self, *a, **k: calls.append("f") or fwd(self, *a, **k))
    monkeypatch.setattr(RecurrentStep, "sweep_backward_layers",
                        lambda self, *a, **k: calls.append("b") or back(self, *a, **k))
    lp = mgnn.LayerParallel(model, backend=backend)
    loss, g = lp.loss_and_grad(x, y)
    assert calls == ["f", "b"]
    pred = lp.predict(x)
    monkeypatch.setattr(RecurrentStep, "sweep_forward_layers", lambda self, *a, **k: None)
    ref = mgnn.LayerParallel(model, backend=backend)
    loss0, g0 = ref.loss_and_grad(x, y)
    assert abs(loss - loss0) <= 1e-13 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(g[k], g0[k], rtol=1e-12, atol=1e-14, err_msg=k)
    np.testing.assert_array_equal(pred, ref.predict(x))


@pytest.mark.parametrize("make", [
    lambda: mgnn.gru_classifier(3, 4, 5, 13, n_layers=2, seed=1),
    lambda: mgnn.gru_classifier(3, 4, 5, 13, cell="implicit_gru", coarse="implicit", seed=1),
    lambda: mgnn.gru_classifier(3, 4, 5, 13, coarse="implicit", seed=2),
    lambda: mgnn.gru_classifier(3, 4, 5, 13, n_layers=2, coarse="implicit", seed=3),
    lambda: mgnn.rnn_classifier(3, 4, 5, 13, n_layers=2, seed=1)])
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_stacked_mgrit_forward_equals_the_list_engine(make, backend, rng, monkeypatch):
    """MGRIT over sequence time with the stacked forward relaxation (one kernel call per sweep)
    equals the list engine step by step at a fixed cycle budget (3 levels, cf 2, 2/1 cycles):
    loss, gradients and both residual histories (float64)."""
    from mgnn.blocks.recurrent import RecurrentStep
    from mgnn import MGRITOptions
    x, y = rng.standard_normal((6, 13, 3)), rng.integers(0, 5, 6)
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0, warn_not_converged=False)
    model = make()
    lp = mgnn.LayerParallel(model, fwd, bwd, backend=backend)
    loss, g = lp.loss_and_grad(x, y)
    assert lp._solver("forward", fwd).engine.stacked and lp._solver("adjoint", bwd).engine.stacked
    monkeypatch.setattr(RecurrentStep, "can_stack", lambda self, bk, ctx=None: False)
    ref = mgnn.LayerParallel(model, fwd, bwd, backend=backend)
    loss0, g0 = ref.loss_and_grad(x, y)
    # without its kernels the step runs one call per state (the stacked protocol over step)
    assert ref._solver("forward", fwd).prop._stepped
    assert abs(loss - loss0) <= 1e-13 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(g[k], g0[k], rtol=1e-11, atol=1e-13, err_msg=k)
    for part in ("forward", "adjoint"):
        np.testing.assert_allclose(lp.stats[part]["residuals"], ref.stats[part]["residuals"],
                                   rtol=1e-11)


@pytest.mark.parametrize("cell, mode, dt", [(0, 0, 1.0), (0, 1, 2.0), (0, 0, 4.0), (1, 0, 1.0),
                                            (1, 0, 2.0)])
@pytest.mark.parametrize("B, nl, H", [(1, 2, 4), (3, 3, 4), (8, 2, 40)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numba_stacked_kernels_equal_the_reference(cell, mode, dt, B, nl, H, dtype, rng):
    """recurrent_chains_forward / recurrent_points_forward (every point mode, with and without
    G, layer_step > 1, backwards steps) against the NumPy reference; (B, H) = (8, 40): GEMMs
    above numba_cpu.SMALL_GEMM (BLAS)."""
    L = 12
    c = _case(cell, L, B, nl, H, dtype, rng)
    w = (c["WihT"], c["WhhT"], c["bih"], c["bhh"], dt, mode)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    U0 = rng.standard_normal((6, B, nl, H)).astype(dtype)
    G = rng.standard_normal(U0.shape).astype(dtype)
    chains = np.array([[1, 2], [4, 2]])
    for layer0, ls in ((-2, 2), (11, -2)):  # forward in time, stride 2; and backwards
        for g in (None, G):
            U1, U2 = U0.copy(), U0.copy()
            NB.recurrent_chains_forward(cell, c["gi0"], U1, g, chains, layer0, ls, *w)
            REF.recurrent_chains_forward(cell, c["gi0"], U2, g, chains, layer0, ls, *w)
            np.testing.assert_allclose(U1, U2, rtol=tol, atol=tol)
            assert not np.array_equal(U1, U0)
            for pm in (0, 1, 2):
                R1 = rng.standard_normal((4, B, nl, H)).astype(dtype)
                R2 = R1.copy()
                slots, outs = np.array([1, 3, 5]), np.array([2, 0, 3])
                r1 = NB.recurrent_points_forward(cell, c["gi0"], U0, g, R1, slots, outs, layer0,
                                                 ls, *w, pm)
                r2 = REF.recurrent_points_forward(cell, c["gi0"], U0, g, R2, slots, outs,
                                                  layer0, ls, *w, pm)
                np.testing.assert_allclose(R1, R2, rtol=tol, atol=tol)
                assert r1 == pytest.approx(r2, rel=tol) and (r1 > 0) == (pm == 0)


def test_stacked_recurrent_kernels_check_their_indices(rng):
    c = _case(0, 4, 2, 1, 3, np.float64, rng)
    U = np.zeros((5, 2, 1, 3))
    args = (c["WihT"], c["WhhT"], c["bih"], c["bhh"], 1.0, 0)
    R = np.zeros((2, 2, 1, 3))
    for mod in (NB, REF):
        with pytest.raises(ValueError, match=r"out_slots has shape \(1,\), slots \(3,\)"):
            mod.recurrent_points_forward(0, c["gi0"], U, None, R, np.array([1, 2, 3]),
                                         np.array([0]), -1, 1, *args, 0)
        with pytest.raises(ValueError, match="R shares memory with U"):
            mod.recurrent_points_forward(0, c["gi0"], U, None, U[:2], np.array([1]),
                                         np.array([0]), -1, 1, *args, 0)
        with pytest.raises(ValueError, match=r"gi0 must be a C-contiguous float64 array of "
                                             r"shape \(2, 4, 9\)"):
            mod.recurrent_chains_forward(0, c["gi0"][:1], U, None, np.array([[1, 2]]), -1, 1,
                                         *args)
        with pytest.raises(ValueError, match="dt must be a finite real > 0"):
            mod.recurrent_chains_forward(0, c["gi0"], U, None, np.array([[1, 2]]), -1, 1,
                                         *args[:4], 0.0, 0)
        with pytest.raises(ValueError, match=r"DGH must be a C-contiguous"):
            D = np.zeros((4, 1, 2, 12))
            W = np.zeros((1, 9, 3))
            mod.recurrent_sweep_backward(0, np.zeros((2, 1, 3)), U, D, W, W, 1.0, 0,
                                         np.zeros((4, 1, 2, 9)), np.zeros((4, 1, 2, 8)))
        with pytest.raises(ValueError, match="uses time step 4 .* not in 0..3"):
            mod.recurrent_chains_forward(0, c["gi0"], U, None, np.array([[1, 4]]), 0, 1, *args)
        with pytest.raises(ValueError, match="bad chains"):
            mod.recurrent_chains_forward(0, c["gi0"], U, None, np.array([[1, 9]]), -1, 1, *args)
        with pytest.raises(ValueError, match="unknown mode 3"):
            mod.recurrent_points_forward(0, c["gi0"], U, None, np.zeros((2, 2, 1, 3)),
                                         np.array([1]), np.array([0]), -1, 1, *args, 3)
        with pytest.raises(ValueError, match=r"bad out_slots: \[1, 1\] repeats slot 1 of R"):
            mod.recurrent_points_forward(0, c["gi0"], U, None, np.zeros((2, 2, 1, 3)),
                                         np.array([1, 2]), np.array([1, 1]), -1, 1, *args, 0)
        with pytest.raises(ValueError, match="U shares memory with G"):
            mod.recurrent_chains_forward(0, c["gi0"], U, U, np.array([[1, 2]]), -1, 1, *args)
        with pytest.raises(ValueError, match="DGI shares memory with DGH"):
            D = np.zeros((4, 1, 2, 12))
            W = np.zeros((1, 9, 3))
            gi = np.zeros((4, 1, 2, 9))
            mod.recurrent_sweep_backward(0, np.zeros((2, 1, 3)), U, D, W, W, 1.0, 0, gi, gi)
        with pytest.raises(TypeError, match="U must be a NumPy array, got list"):
            mod.recurrent_chains_forward(0, c["gi0"], U.tolist(), None, np.array([[1, 2]]), -1,
                                         1, *args)
        for bad in (True, 2):
            with pytest.raises(ValueError, match=f"mode must be 0 .* got {bad}"):
                mod.recurrent_chains_forward(0, c["gi0"], U, None, np.array([[1, 2]]), -1, 1,
                                             *args[:5], bad)


def test_numba_backward_sweep_flushes_subnormal_cotangents(rng):
    """Cotangents below the smallest normal float32 (1.2e-38) are flushed to zero (subnormal
    arithmetic is several times slower); the reference keeps them."""
    c = _case(0, 6, 2, 1, 3, np.float32, rng)
    c["lam"] = np.full_like(c["lam"], 3e-39)  # subnormal already
    _, (D, lam0, DGI, DGH) = _run(NB, 0, c, 6, True, 1.0, 0)
    assert not lam0.any() and not DGI.any() and not DGH.any()
    _, (_, lam_ref, DGI_ref, _) = _run(REF, 0, c, 6, True, 1.0, 0)
    assert np.abs(DGI_ref[-1]).max() > 0  # gradual underflow there
    np.testing.assert_allclose(lam0, lam_ref, atol=np.finfo(np.float32).tiny)
