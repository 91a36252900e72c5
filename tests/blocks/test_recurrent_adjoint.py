"""The stacked adjoint of recurrent models (the MGRIT adjoint solve over sequence time, one
backend call per sweep): the Numba kernels against the NumPy reference built from the gate
kernels, the kernels' contracts tied to the backward sweep, their input checks, and the
model's stacked adjoint against the list engine."""
import numpy as np
import pytest

import mgnn
from mgnn.backend import numba_cpu as NB, numpy_ref as REF


def _case(cell, L, B, nl, H, dtype, rng):
    G, C = (3, 4) if cell == 0 else (1, 1)
    f = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(dtype)  # noqa: E731
    c = dict(gi0=f(B, L, G * H), WihT=f(nl, H, G * H, scale=0.4),
             WhhT=f(nl, H, G * H, scale=0.4), bih=f(nl, G * H), bhh=f(nl, G * H), C=C, G=G)
    c["Wih"] = np.ascontiguousarray(c["WihT"].transpose(0, 2, 1))
    c["Whh"] = np.ascontiguousarray(c["WhhT"].transpose(0, 2, 1))
    return c


def _forward(mod, cell, c, U0, dt, mode):
    """A sweep from U0: the states (L + 1, B, nl, H) and the caches (L, nl, B, C H)."""
    L = c["gi0"].shape[1]
    U = np.zeros((L + 1,) + U0.shape, U0.dtype)
    U[0] = U0
    D = np.zeros((L,) + (U0.shape[1], U0.shape[0], c["C"] * U0.shape[2]), U0.dtype)
    mod.recurrent_sweep_forward(cell, c["gi0"], U, c["WihT"], c["WhhT"], c["bih"], c["bhh"], D,
                                dt, mode)
    return U, D


@pytest.mark.parametrize("cell, mode, dt", [(0, 0, 1.0), (0, 1, 1.0), (0, 1, 4.0), (0, 0, 2.0),
                                            (1, 0, 1.0), (1, 0, 2.0)])
@pytest.mark.parametrize("nl", [1, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_caches_at_given_states_equal_the_sweeps(cell, mode, dt, nl, dtype, rng):
    """recurrent_caches at a sweep's own states gives the sweep's caches and next states, on
    both backends (any offset between states, caches and time steps)."""
    L, B, H = 8, 3, 4
    c = _case(cell, L, B, nl, H, dtype, rng)
    U, D = _forward(REF, cell, c, rng.standard_normal((B, nl, H)).astype(dtype), dt, mode)
    tol = 1e-13 if dtype == np.float64 else 2e-6
    w = (c["WihT"], c["WhhT"], c["bih"], c["bhh"])
    for mod in (NB, REF):
        Dc = np.full((5, nl, B, c["C"] * H), np.nan, dtype)
        Y = np.full((5, B, nl, H), np.nan, dtype)
        mod.recurrent_caches(cell, c["gi0"], U, 2, 5, 2, *w, Dc, Y, dt, mode)  # steps 2..6
        np.testing.assert_allclose(Dc, D[2:7], rtol=tol, atol=tol)
        np.testing.assert_allclose(Y, U[3:8], rtol=tol, atol=tol)
        Dn = np.full_like(Dc, np.nan)
        mod.recurrent_caches(cell, c["gi0"], U, 2, 5, 2, *w, Dn, np.empty((0, B, nl, H), dtype),
                             dt, mode)
        np.testing.assert_array_equal(Dn, Dc)


@pytest.mark.parametrize("cell, mode, dt", [(0, 0, 1.0), (0, 1, 1.0), (0, 1, 4.0), (1, 0, 1.0)])
@pytest.mark.parametrize("nl", [1, 2])
@pytest.mark.parametrize("mod", [NB, REF], ids=["numba", "numpy"])
def test_adjoint_chain_over_the_sequence_is_the_backward_sweep(cell, mode, dt, nl, mod, rng):
    """One adjoint chain through every time step, backwards (layer_step -1, the adjoint's
    reversed indexing), equals recurrent_sweep_backward's cotangent of u_0, and the gate
    cotangents of every step equal the sweep's DGI / DGH (float64)."""
    L, B, H = 7, 2, 3
    c = _case(cell, L, B, nl, H, np.float64, rng)
    U, D = _forward(mod, cell, c, rng.standard_normal((B, nl, H)), dt, mode)
    lam = rng.standard_normal((B, nl, H))
    DGI = np.zeros((L, nl, B, c["G"] * H))
    DGH = np.zeros_like(DGI)
    lam0 = mod.recurrent_sweep_backward(cell, lam, U, D, c["Wih"], c["Whh"], dt, mode, DGI, DGH)
    Lm = np.zeros((L + 1, B, nl, H))
    Lm[0] = lam  # slot i is the cotangent of u_{L - i}; the step into slot i is time step L - i
    mod.recurrent_chains_adjoint(cell, Lm, None, np.array([[1, L]]), L, -1, U, 0, D, 0, c["Wih"],
                                 c["Whh"], dt, mode)
    np.testing.assert_allclose(Lm[L], lam0, rtol=1e-12, atol=1e-14)
    # lam_{t+1} of step t is slot L - t - 1: one run backwards from slot L - 1 (step 0)
    gi, gh = np.full_like(DGI, np.nan), np.full_like(DGH, np.nan)
    mod.recurrent_gate_cotangents(cell, Lm, L - 1, -1, U, 0, D, 0, L, c["Wih"], c["Whh"], dt,
                                  mode, gi, gh, 0)
    np.testing.assert_allclose(gi, DGI, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(gh, DGH, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cell, mode, dt", [(0, 0, 1.0), (0, 1, 2.0), (0, 0, 4.0), (1, 0, 1.0),
                                            (1, 0, 2.0)])
@pytest.mark.parametrize("B, nl, H", [(1, 2, 4), (3, 3, 4), (8, 2, 40)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numba_adjoint_kernels_equal_the_reference(cell, mode, dt, B, nl, H, dtype, rng):
    """recurrent_chains_adjoint / recurrent_points_adjoint (every point mode, with and without
    G, layer_step -2 as on a coarse adjoint level, and +2) and recurrent_gate_cotangents
    (stride 0: one slot for every step) against the NumPy reference; (B, H) = (8, 40): GEMMs
    above numba_cpu.SMALL_GEMM (BLAS)."""
    L = 12
    c = _case(cell, L, B, nl, H, dtype, rng)
    U = rng.standard_normal((L + 2, B, nl, H)).astype(dtype)  # state of step t: U[t + 1]
    D = np.zeros((L, nl, B, c["C"] * H), dtype)
    REF.recurrent_caches(cell, c["gi0"], U, 1, L, 0, c["WihT"], c["WhhT"], c["bih"], c["bhh"], D,
                         np.empty((0, B, nl, H), dtype), 1.0, 0)
    lin = (U, 1, D, 0, c["Wih"], c["Whh"], dt, mode)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    L0 = rng.standard_normal((6, B, nl, H)).astype(dtype)
    G = rng.standard_normal(L0.shape).astype(dtype)
    chains = np.array([[1, 2], [4, 2]])
    for layer0, ls in ((12, -2), (-2, 2)):
        for g in (None, G):
            L1, L2 = L0.copy(), L0.copy()
            NB.recurrent_chains_adjoint(cell, L1, g, chains, layer0, ls, *lin)
            REF.recurrent_chains_adjoint(cell, L2, g, chains, layer0, ls, *lin)
            np.testing.assert_allclose(L1, L2, rtol=tol, atol=tol)
            assert not np.array_equal(L1, L0)
            for pm in (0, 1, 2):
                R1 = rng.standard_normal((4, B, nl, H)).astype(dtype)
                R2 = R1.copy()
                slots, outs = np.array([1, 3, 5]), np.array([2, 0, 3])
                r1 = NB.recurrent_points_adjoint(cell, L0, g, R1, slots, outs, layer0, ls, *lin,
                                                 pm)
                r2 = REF.recurrent_points_adjoint(cell, L0, g, R2, slots, outs, layer0, ls, *lin,
                                                  pm)
                np.testing.assert_allclose(R1, R2, rtol=tol, atol=tol)
                assert r1 == pytest.approx(r2, rel=tol) and (r1 > 0) == (pm == 0)
    out = [np.full((L, nl, B, c["G"] * H), np.nan, dtype) for _ in range(4)]
    for mod, (gi, gh) in ((NB, out[:2]), (REF, out[2:])):
        mod.recurrent_gate_cotangents(cell, L0, 3, 0, U, 1, D, 0, L, *lin[4:], gi, gh, 0)
    for a, b in ((out[0], out[2]), (out[1], out[3])):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
        assert np.isfinite(a).all()


def test_adjoint_kernels_check_their_arguments(rng):
    c = _case(0, 4, 2, 1, 3, np.float64, rng)
    U = np.zeros((5, 2, 1, 3))
    D = np.zeros((4, 1, 2, 12))
    Lm = np.zeros((3, 2, 1, 3))
    W = (c["Wih"], c["Whh"], 1.0, 0)
    for mod in (NB, REF):
        with pytest.raises(ValueError, match="time step 4 reads cache row 4"):
            mod.recurrent_chains_adjoint(0, Lm, None, np.array([[1, 2]]), 5, -1, U, 0, D, 0, *W)
        with pytest.raises(ValueError, match="time step -1 reads state row -1"):
            mod.recurrent_chains_adjoint(0, Lm, None, np.array([[1, 2]]), 1, -1, U, 0, D, 0, *W)
        with pytest.raises(ValueError, match=r"D must be a C-contiguous float64 array of shape "
                                             r"\(4, 1, 2, 12\)"):
            mod.recurrent_chains_adjoint(0, Lm, None, np.array([[1, 1]]), 2, -1, U, 0,
                                         D[:, :, :, :9].copy(), 0, *W)
        with pytest.raises(ValueError, match="R shares memory with L"):
            mod.recurrent_points_adjoint(0, Lm, None, Lm[1:], np.array([1]), np.array([0]), 2,
                                         -1, U, 0, D, 0, *W, 0)
        with pytest.raises(ValueError, match="bad slots"):
            mod.recurrent_points_adjoint(0, Lm, None, np.zeros((1, 2, 1, 3)), np.array([3]),
                                         np.array([0]), 2, -1, U, 0, D, 0, *W, 0)
        with pytest.raises(ValueError, match="dt must be a finite real > 0"):
            mod.recurrent_chains_adjoint(0, Lm, None, np.array([[1, 1]]), 2, -1, U, 0, D, 0,
                                         *W[:2], -1.0, 0)
        with pytest.raises(ValueError, match="slots 3..5 are not slots 0..4 of U"):
            mod.recurrent_caches(0, c["gi0"], U, 3, 3, 0, c["WihT"], c["WhhT"], c["bih"],
                                 c["bhh"], np.zeros((3, 1, 2, 12)), np.zeros((0, 2, 1, 3)),
                                 1.0, 0)
        with pytest.raises(ValueError, match=r"time steps 2..4 are not in 0..3"):
            mod.recurrent_caches(0, c["gi0"], U, 0, 3, 2, c["WihT"], c["WhhT"], c["bih"],
                                 c["bhh"], np.zeros((3, 1, 2, 12)), np.zeros((0, 2, 1, 3)),
                                 1.0, 0)
        with pytest.raises(ValueError, match=r"L row 3 is not in 0..2"):
            mod.recurrent_gate_cotangents(0, Lm, 1, 1, U, 0, D, 0, 3, *W, np.zeros((4, 1, 2, 9)),
                                          np.zeros((4, 1, 2, 9)), 0)
        with pytest.raises(ValueError, match=r"DGH must be a C-contiguous"):
            mod.recurrent_gate_cotangents(0, Lm, 0, 0, U, 0, D, 0, 1, *W, np.zeros((4, 1, 2, 9)),
                                          np.zeros((3, 1, 2, 9)), 0)
        # outputs that alias each other or an input; repeated out slots; no array
        gi = np.zeros((4, 1, 2, 9))
        with pytest.raises(ValueError, match="DGI shares memory with DGH"):
            mod.recurrent_gate_cotangents(0, Lm, 0, 0, U, 0, D, 0, 1, *W, gi, gi, 0)
        with pytest.raises(ValueError, match="L shares memory with U"):
            mod.recurrent_chains_adjoint(0, U[:3], None, np.array([[1, 1]]), 2, -1, U, 0, D, 0,
                                         *W)
        with pytest.raises(ValueError, match="L shares memory with G"):
            mod.recurrent_chains_adjoint(0, Lm, Lm, np.array([[1, 1]]), 2, -1, U, 0, D, 0, *W)
        with pytest.raises(ValueError, match="R shares memory with D"):
            mod.recurrent_points_adjoint(0, Lm, None, D.reshape(-1)[:6].reshape(1, 2, 1, 3),
                                         np.array([1]), np.array([0]), 2, -1, U, 0, D, 0, *W, 0)
        with pytest.raises(ValueError, match=r"bad out_slots: \[0, 0\] repeats slot 0 of R"):
            mod.recurrent_points_adjoint(0, Lm, None, np.zeros((2, 2, 1, 3)), np.array([1, 2]),
                                         np.array([0, 0]), 2, -1, U, 0, D, 0, *W, 0)
        with pytest.raises(TypeError, match="L must be a NumPy array, got list"):
            mod.recurrent_chains_adjoint(0, Lm.tolist(), None, np.array([[1, 1]]), 2, -1, U, 0,
                                         D, 0, *W)
        with pytest.raises(ValueError, match="unknown mode True"):
            mod.recurrent_points_adjoint(0, Lm, None, np.zeros((1, 2, 1, 3)), np.array([1]),
                                         np.array([0]), 2, -1, U, 0, D, 0, *W, True)
        with pytest.raises(ValueError, match="Y shares memory with U"):
            mod.recurrent_caches(0, c["gi0"], U, 0, 2, 0, c["WihT"], c["WhhT"], c["bih"],
                                 c["bhh"], np.zeros((2, 1, 2, 12)), U[2:4], 1.0, 0)
        with pytest.raises(ValueError, match="count must be >= 0, got -1"):
            mod.recurrent_caches(0, c["gi0"], U, 0, -1, 0, c["WihT"], c["WhhT"], c["bih"],
                                 c["bhh"], np.zeros((0, 1, 2, 12)), np.zeros((0, 2, 1, 3)),
                                 1.0, 0)


def test_numba_adjoint_chains_flush_subnormal_cotangents(rng):
    c = _case(0, 4, 2, 1, 3, np.float32, rng)
    U, D = _forward(REF, 0, c, rng.standard_normal((2, 1, 3)).astype(np.float32), 1.0, 0)
    Lm = np.zeros((5, 2, 1, 3), np.float32)
    Lm[0] = 3e-39
    L2 = Lm.copy()
    NB.recurrent_chains_adjoint(0, Lm, None, np.array([[1, 4]]), 4, -1, U, 0, D, 0, c["Wih"],
                                c["Whh"], 1.0, 0)
    REF.recurrent_chains_adjoint(0, L2, None, np.array([[1, 4]]), 4, -1, U, 0, D, 0, c["Wih"],
                                 c["Whh"], 1.0, 0)
    assert not Lm[1:].any() and np.abs(L2[1]).max() > 0


@pytest.mark.parametrize("make", [
    lambda: mgnn.gru_classifier(3, 4, 5, 13, n_layers=2, seed=1),
    lambda: mgnn.gru_classifier(3, 4, 5, 13, n_layers=2, cell="implicit_gru", coarse="implicit",
                                seed=1),
    lambda: mgnn.rnn_classifier(3, 4, 5, 13, n_layers=3, seed=1)])
def test_stacked_adjoint_equals_the_list_adjoint_with_a_stacked_forward(make, rng, monkeypatch):
    """Only the adjoint taken off the stacked engine (the forward stays stacked): the same
    loss, gradients and adjoint residuals (3 levels, cf 2, FCF, 2/2 cycles, float64)."""
    from mgnn.blocks.recurrent import RecurrentStep
    x, y = rng.standard_normal((5, 13, 3)), rng.integers(0, 5, 5)
    o = dict(cf=2, max_levels=3, tol=0.0, warn_not_converged=False, nrelax=[1])
    fwd, bwd = mgnn.MGRITOptions(max_iter=2, **o), mgnn.MGRITOptions(max_iter=2, **o)
    model = make()
    lp = mgnn.LayerParallel(model, fwd, bwd, backend="numba")
    loss, g = lp.loss_and_grad(x, y)
    assert lp._solver("adjoint", bwd).engine.stacked
    monkeypatch.setattr(RecurrentStep, "can_stack_adjoint", lambda self, bk, ctx=None: False)
    ref = mgnn.LayerParallel(model, fwd, bwd, backend="numba")
    loss0, g0 = ref.loss_and_grad(x, y)
    assert ref._solver("forward", fwd).engine.stacked
    assert ref._solver("adjoint", bwd).prop._stepped  # one step call per state
    assert loss == loss0
    for k in g0:
        np.testing.assert_allclose(g[k], g0[k], rtol=1e-11, atol=1e-13, err_msg=k)
    np.testing.assert_allclose(lp.stats["adjoint"]["residuals"], ref.stats["adjoint"]["residuals"],
                               rtol=1e-11)


def test_hand_built_adjoint_propagator_with_list_caches(rng):
    """An AdjointPropagator built by hand with the single-state protocol's states and caches
    (lists, as an embedding code has them) runs the stacked engine on a linearisation it
    builds itself; a converged MGRIT solve equals the serial adjoint (float64)."""
    from mgnn import MGRITOptions, MGRITSolver
    from mgnn.backend import get_backend
    from mgnn.blocks.composed import StepContext
    from mgnn.network import AdjointPropagator, ForwardPropagator
    bk = get_backend("numba")
    model = mgnn.gru_classifier(3, 4, 5, 13, n_layers=2, seed=1)
    x = rng.standard_normal((5, 13, 3))
    ctx = StepContext(buffers=model.group_buffers())
    ctx.begin(x)
    fp = ForwardPropagator(model, bk, ctx)
    u = [np.zeros(model.step.state_shape(5))]
    for n in range(13):
        u.append(fp.step(u[-1], n, n + 1, 0))
    D = [model.step.linearize(model.step_params(), n, u[n], bk, ctx) for n in range(13)]
    lam = rng.standard_normal(u[0].shape)
    want = lam
    ap = AdjointPropagator(model, u, D, bk, ctx)
    for m in range(13):  # the serial adjoint, single states
        want = ap.step(want, m, m + 1, 0)
    solver = MGRITSolver(AdjointPropagator(model, u, D, bk, ctx), 13,
                         MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=30))
    res = solver.solve(lam)
    assert solver.engine.stacked and res.converged
    np.testing.assert_allclose(res.states[-1], want, rtol=1e-10, atol=1e-13)
    # new states in the same list (a new training step): reset() drops the old linearisation
    ctx.begin(rng.standard_normal((5, 13, 3)))
    for n in range(13):
        u[n + 1] = fp.step(u[n], n, n + 1, 0)
    D[:] = [model.step.linearize(model.step_params(), n, u[n], bk, ctx) for n in range(13)]
    ref = AdjointPropagator(model, list(u), list(D), bk, ctx)
    want2 = lam
    for m in range(13):
        want2 = ref.step(want2, m, m + 1, 0)
    solver.prop.reset(u, D)
    res2 = solver.solve(lam)
    np.testing.assert_allclose(res2.states[-1], want2, rtol=1e-10, atol=1e-13)
    assert not np.allclose(want2, want)
    with pytest.raises(ValueError, match="consecutive steps; got states of steps \\[0, 2\\]"):
        MGRITSolver(AdjointPropagator(model, {0: u[0], 2: u[2]}, {}, bk, ctx), 13,
                    MGRITOptions(cf=2, max_levels=2, max_iter=1)).solve(lam)


def test_weight_gradients_of_no_steps_are_zero():
    """A rank that owns no steps contributes zeros to the sum over the steps."""
    model = mgnn.gru_classifier(3, 4, 5, 13, n_layers=2, seed=1)
    G = {k: np.full(v, np.nan) for k, v in model.step.param_shapes().items()}
    z = np.zeros((0, 2, 5, 12))
    model.step._weight_grads(G, z, z, np.zeros((5, 0, 3)), np.zeros((0, 5, 2, 4)),
                             np.zeros((0, 5, 2, 4)))
    assert all(not v.any() for v in G.values()) and len(G) == 8
