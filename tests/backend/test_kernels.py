"""Contract tests: every kernel x backend x dtype against the numpy reference."""
import numpy as np
import pytest

from mgnn.backend import KERNELS, available_backends, get_backend
from tests.conftest import assert_close

REF = get_backend("numpy")
# the GPU backend takes device arrays: its twins are in test_raw_kernels.py (marked gpu)
FAST = [b for b in available_backends() if b not in ("numpy", "cuda")]
RTOL_OF = {"float32": 1e-5, "float64": 1e-12}
DTYPES = ["float32", "float64"]
ACTS = [0, 1, 2]


def _backend(name):
    """The backend ``name``; GPU-code backends fill every new output with NaN before the launch,
    so an element a kernel does not write fails the comparison."""
    bk = get_backend(name)
    if hasattr(bk, "poison_outputs"):
        bk.poison_outputs = True
    return bk


def test_every_backend_provides_every_kernel():
    for name in available_backends():
        bk = get_backend(name)
        missing = [k for k in KERNELS if not callable(getattr(bk, k, None))]
        assert missing == [], (name, missing)


def test_unknown_backend_names_the_value():
    with pytest.raises(ValueError, match="'cudaa'"):
        get_backend("cudaa")


def _rand(rng, shape, dt):
    return rng.standard_normal(shape).astype(dt)


def _dense_case(rng, dt, B=5, i=7, o=7):
    return (_rand(rng, (B, i), dt), _rand(rng, (o, i), dt), _rand(rng, (o,), dt),
            _rand(rng, (B, o), dt), np.dtype(dt).type(0.37))


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("residual", [True, False])
def test_dense_kernels(backend, dtype, act, residual, rng):
    bk = _backend(backend)
    x, W, b, g, h = _dense_case(rng, dtype, o=7 if residual else 3)
    assert_close(bk.dense_forward(x, W, b, h, act, residual),
                 REF.dense_forward(x, W, b, h, act, residual), dtype, "forward")
    y, d = bk.dense_forward_deriv(x, W, b, h, act, residual)
    yr, dr = REF.dense_forward_deriv(x, W, b, h, act, residual)
    assert_close(y, yr, dtype, "forward_deriv y")
    assert_close(d, dr, dtype, "forward_deriv d")
    assert_close(bk.dense_deriv(x, W, b, act), dr, dtype, "deriv")
    assert_close(bk.dense_vjp_input(g, dr, W, h, residual),
                 REF.dense_vjp_input(g, dr, W, h, residual), dtype, "vjp_input")
    for a, r, n in zip(bk.dense_vjp(g, dr, x, W, h, residual),
                       REF.dense_vjp(g, dr, x, W, h, residual), ("gx", "gW", "gb")):
        assert_close(a, r, dtype, n)
    for a, r, n in zip(bk.dense_vjp_params(g, dr, x, h), REF.dense_vjp_params(g, dr, x, h),
                       ("gW", "gb")):
        assert_close(a, r, dtype, n)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("shape", [(6, 4, 5), (3, 128, 32)])  # B w >= WIDE: the NumPy route
def test_dense_sweeps(backend, dtype, act, store, shape, rng):
    bk = _backend(backend)
    N, B, w = shape
    W = (_rand(rng, (N, w, w), dtype) * 0.5).astype(dtype)
    b = _rand(rng, (N, w), dtype)
    h = np.dtype(dtype).type(0.2)
    U = np.full((N + 1, B, w), np.nan, dtype=dtype)
    U[0] = _rand(rng, (B, w), dtype)
    Ur = U.copy()
    D = np.full((N if store else 0, B, w), np.nan, dtype=dtype)
    Dr = D.copy()
    bk.dense_sweep_forward(U, W, b, h, act, D)
    REF.dense_sweep_forward(Ur, W, b, h, act, Dr)
    assert_close(U, Ur, dtype, "U")
    assert_close(D, Dr, dtype, "D")
    if not store:
        return
    lam = _rand(rng, (B, w), dtype)
    gW, gb = np.full_like(W, np.nan), np.full_like(b, np.nan)
    gWr, gbr = gW.copy(), gb.copy()
    lam0 = bk.dense_sweep_backward(Ur, Dr, W, h, lam.copy(), gW, gb)
    lam0r = REF.dense_sweep_backward(Ur, Dr, W, h, lam.copy(), gWr, gbr)
    assert_close(lam0, lam0r, dtype, "lam0")
    assert_close(gW, gWr, dtype, "gW")
    assert_close(gb, gbr, dtype, "gb")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("residual", [True, False])
def test_conv_kernels(backend, dtype, act, residual, rng):
    bk = _backend(backend)
    ci, co = (3, 3) if residual else (2, 4)
    B, H, Wd = 3, 5, 6
    x = _rand(rng, (B, ci, H, Wd), dtype)
    K = _rand(rng, (co, ci, 3, 3), dtype)
    b = _rand(rng, (co,), dtype)
    g = _rand(rng, (B, co, H, Wd), dtype)
    h = np.dtype(dtype).type(0.3)
    assert_close(bk.conv_forward(x, K, b, h, act, residual),
                 REF.conv_forward(x, K, b, h, act, residual), dtype, "forward")
    y, d = bk.conv_forward_deriv(x, K, b, h, act, residual)
    yr, dr = REF.conv_forward_deriv(x, K, b, h, act, residual)
    assert_close(y, yr, dtype, "forward_deriv y")
    assert_close(d, dr, dtype, "forward_deriv d")
    assert_close(bk.conv_deriv(x, K, b, act), dr, dtype, "deriv")
    assert_close(bk.conv_vjp_input(g, dr, K, h, residual),
                 REF.conv_vjp_input(g, dr, K, h, residual), dtype, "vjp_input")
    for a, r, n in zip(bk.conv_vjp(g, dr, x, K, h, residual),
                       REF.conv_vjp(g, dr, x, K, h, residual), ("gx", "gK", "gb")):
        assert_close(a, r, dtype, n)
    for a, r, n in zip(bk.conv_vjp_params(g, dr, x, h), REF.conv_vjp_params(g, dr, x, h),
                       ("gK", "gb")):
        assert_close(a, r, dtype, n)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [1, 2, 3])
def test_avgpool(backend, dtype, p, rng):
    bk = _backend(backend)
    u = _rand(rng, (2, 3, 6, 6), dtype)
    assert_close(bk.avgpool_forward(u, p), REF.avgpool_forward(u, p), dtype, "pool")
    g = _rand(rng, (2, 3, p, p), dtype)
    assert_close(bk.avgpool_vjp(g, 6, 6), REF.avgpool_vjp(g, 6, 6), dtype, "pool vjp")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_xent(backend, dtype, rng):
    bk = _backend(backend)
    logits = (_rand(rng, (6, 10), dtype) * 5).astype(dtype)
    logits[0, 3] = 80  # large values: the stable formulation must not overflow
    y = rng.integers(0, 10, 6)
    loss, g = bk.softmax_xent(logits, y)
    loss_r, g_r = REF.softmax_xent(logits, y)
    assert np.isfinite(loss)
    assert_close(np.asarray(loss, dtype=dtype), np.asarray(loss_r), dtype, "loss")
    assert_close(g, g_r, dtype, "dlogits")


def test_reference_conv_matches_direct_definition(rng):
    """The reference itself against the textbook sum (independent of its einsum formulation)."""
    x = rng.standard_normal((2, 2, 4, 5))
    K = rng.standard_normal((3, 2, 3, 3))
    b = np.zeros(3)
    y = REF.conv_forward(x, K, b, 1.0, 2, False)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.zeros((2, 3, 4, 5))
    for n in range(2):
        for o in range(3):
            for i in range(4):
                for j in range(5):
                    want[n, o, i, j] = np.sum(xp[n, :, i:i + 3, j:j + 3] * K[o])
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_dense_kernels_wide_path(backend, dtype, act, rng):
    """Shapes at or above the numba backend's WIDE threshold take its BLAS path."""
    from mgnn.backend.numba_cpu import WIDE
    bk = _backend(backend)
    B = WIDE // 64
    x, W, b, g, h = _dense_case(rng, dtype, B=B, i=64, o=64)
    y, d = bk.dense_forward_deriv(x, W, b, h, act, True)
    yr, dr = REF.dense_forward_deriv(x, W, b, h, act, True)
    assert_close(y, yr, dtype, "y")
    assert_close(d, dr, dtype, "d")
    assert_close(bk.dense_forward(x, W, b, h, act, False), REF.dense_forward(x, W, b, h, act, False),
                 dtype, "forward")
    assert_close(bk.dense_deriv(x, W, b, act), dr, dtype, "deriv")
    assert_close(bk.dense_vjp_input(g, dr, W, h, True), REF.dense_vjp_input(g, dr, W, h, True),
                 dtype, "vjp_input")
    for a, r, n in zip(bk.dense_vjp(g, dr, x, W, h, False), REF.dense_vjp(g, dr, x, W, h, False),
                       ("gx", "gW", "gb")):
        assert_close(a, r, dtype, n)
    for a, r, n in zip(bk.dense_vjp_params(g, dr, x, h), REF.dense_vjp_params(g, dr, x, h),
                       ("gW", "gb")):
        assert_close(a, r, dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_g", [True, False])
def test_vector_ops_numba_against_generic(dtype, with_g, rng):
    from mgnn.backend import vector_ops
    ref, fast = vector_ops("numpy"), vector_ops("numba")
    phi, u, g, v, pc = (_rand(rng, (5, 3, 4), dtype) for _ in range(5))
    r_ref, n_ref = ref.residual(phi, u, g if with_g else None)
    r, n = fast.residual(phi, u, g if with_g else None)
    assert_close(r, r_ref, dtype, "residual")
    assert abs(n - n_ref) <= 10 * RTOL_OF[dtype] * n_ref and isinstance(n, float)
    assert_close(fast.fas_rhs(r.copy(), v, pc), ref.fas_rhs(r_ref.copy(), v, pc), dtype, "fas")
    assert_close(fast.correct(u, v, pc), ref.correct(u, v, pc), dtype, "correct")
    assert_close(fast.add(u, v), ref.add(u, v), dtype, "add")
    # anything the fused kernels do not cover falls back to the generic code
    z = (rng.standard_normal(4) + 1j * rng.standard_normal(4))
    assert fast.residual(z, z * 0, None)[1] == pytest.approx(float(np.vdot(z, z).real))
    assert_close(fast.add(u, v[..., :1] * 0 + v), ref.add(u, v), dtype, "add broadcast")


def test_vector_ops_unknown_backend():
    from mgnn.backend import vector_ops
    with pytest.raises(ValueError, match="'cuda9'"):
        vector_ops("cuda9")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("store", [True, False])
def test_batched_steps(backend, dtype, act, store, rng):
    """One batched call = the single steps of each (state, layer) pair, layers repeated and out
    of order, for dense and conv."""
    bk = _backend(backend)
    L, B, w = 5, 9, 10
    layers = [3, 0, 3, 4]
    h = np.dtype(dtype).type(0.4)
    W, b = _rand(rng, (L, w, w), dtype), _rand(rng, (L, w), dtype)
    xs = [_rand(rng, (B, w), dtype) for _ in layers]
    ys, ds = bk.dense_forward_batched(xs, W, b, layers, h, act, store)
    assert (ds is None) != store
    for p, l in enumerate(layers):
        yr, dr = REF.dense_forward_deriv(xs[p], W[l], b[l], h, act, True)
        assert_close(ys[p], yr, dtype, f"dense y[{p}]")
        if store:
            assert_close(ds[p], dr, dtype, f"dense d[{p}]")
    rhs = [_rand(rng, (B, w), dtype) for _ in layers]
    ys_g, _ = bk.dense_forward_batched(xs, W, b, layers, h, act, store, rhs)
    for p, l in enumerate(layers):
        assert_close(ys_g[p], REF.dense_forward(xs[p], W[l], b[l], h, act, True) + rhs[p],
                     dtype, f"dense y+g[{p}]")
    derivs = [REF.dense_deriv(x, W[l], b[l], act) for x, l in zip(xs, layers)]
    gs_g = bk.dense_vjp_input_batched(xs, derivs, W, layers, h, rhs)
    for p, l in enumerate(layers):
        assert_close(gs_g[p], REF.dense_vjp_input(xs[p], derivs[p], W[l], h, True) + rhs[p],
                     dtype, f"dense vjp+g[{p}]")
    gs = bk.dense_vjp_input_batched(xs, derivs, W, layers, h)
    for p, l in enumerate(layers):
        assert_close(gs[p], REF.dense_vjp_input(xs[p], derivs[p], W[l], h, True), dtype,
                     f"dense vjp[{p}]")
    C, H, Wd = 2, 4, 5
    K, cb = _rand(rng, (L, C, C, 3, 3), dtype), _rand(rng, (L, C), dtype)
    us = [_rand(rng, (2, C, H, Wd), dtype) for _ in layers]
    ys, ds = bk.conv_forward_batched(us, K, cb, layers, h, act, store)
    for p, l in enumerate(layers):
        yr, dr = REF.conv_forward_deriv(us[p], K[l], cb[l], h, act, True)
        assert_close(ys[p], yr, dtype, f"conv y[{p}]")
        if store:
            assert_close(ds[p], dr, dtype, f"conv d[{p}]")
    rhs = [_rand(rng, (2, C, H, Wd), dtype) for _ in layers]
    ys_g, _ = bk.conv_forward_batched(us, K, cb, layers, h, act, store, rhs)
    for p, l in enumerate(layers):
        assert_close(ys_g[p], REF.conv_forward(us[p], K[l], cb[l], h, act, True) + rhs[p],
                     dtype, f"conv y+g[{p}]")
    derivs = [REF.conv_deriv(u, K[l], cb[l], act) for u, l in zip(us, layers)]
    gs_g = bk.conv_vjp_input_batched(us, derivs, K, layers, h, rhs)
    for p, l in enumerate(layers):
        assert_close(gs_g[p], REF.conv_vjp_input(us[p], derivs[p], K[l], h, True) + rhs[p],
                     dtype, f"conv vjp+g[{p}]")
    gs = bk.conv_vjp_input_batched(us, derivs, K, layers, h)
    for p, l in enumerate(layers):
        assert_close(gs[p], REF.conv_vjp_input(us[p], derivs[p], K[l], h, True), dtype,
                     f"conv vjp[{p}]")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_batched_derivs_and_parameter_gradients(backend, dtype, act, rng):
    """sigma' of many layers at once, and the parameter gradients of many layers written into
    the stacked gradient arrays (rows of other layers untouched)."""
    bk = _backend(backend)
    L, B, w = 6, 7, 9
    layers = [4, 1, 2]
    h = np.dtype(dtype).type(0.3)
    W, b = _rand(rng, (L, w, w), dtype), _rand(rng, (L, w), dtype)
    xs = [_rand(rng, (B, w), dtype) for _ in layers]
    gys = [_rand(rng, (B, w), dtype) for _ in layers]
    ds = bk.dense_deriv_batched(xs, W, b, layers, act)
    for p, l in enumerate(layers):
        assert_close(ds[p], REF.dense_deriv(xs[p], W[l], b[l], act), dtype, f"dense d[{p}]")
    gW, gb = np.full_like(W, 7.0), np.full_like(b, 7.0)
    bk.dense_vjp_params_batched(gys, ds, xs, layers, h, gW, gb)
    for l in range(L):
        if l in layers:
            p = layers.index(l)
            rW, rb = REF.dense_vjp_params(gys[p], ds[p], xs[p], h)
            assert_close(gW[l], rW, dtype, f"gW[{l}]")
            assert_close(gb[l], rb, dtype, f"gb[{l}]")
        else:
            assert (gW[l] == 7).all() and (gb[l] == 7).all()
    C, H, Wd = 2, 3, 5
    K, cb = _rand(rng, (L, C, C, 3, 3), dtype), _rand(rng, (L, C), dtype)
    us = [_rand(rng, (2, C, H, Wd), dtype) for _ in layers]
    gus = [_rand(rng, (2, C, H, Wd), dtype) for _ in layers]
    ds = bk.conv_deriv_batched(us, K, cb, layers, act)
    for p, l in enumerate(layers):
        assert_close(ds[p], REF.conv_deriv(us[p], K[l], cb[l], act), dtype, f"conv d[{p}]")
    gK, gcb = np.full_like(K, 7.0), np.full_like(cb, 7.0)
    bk.conv_vjp_params_batched(gus, ds, us, layers, h, gK, gcb)
    for l in range(L):
        if l in layers:
            p = layers.index(l)
            rK, rb = REF.conv_vjp_params(gus[p], ds[p], us[p], h)
            assert_close(gK[l], rK, dtype, f"gK[{l}]")
            assert_close(gcb[l], rb, dtype, f"gcb[{l}]")
        else:
            assert (gK[l] == 7).all() and (gcb[l] == 7).all()


@pytest.mark.parametrize("backend", ["numpy", "numba"] + [b for b in FAST if "cuda" in b])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_g", [True, False])
def test_batched_vector_ops(backend, dtype, with_g, rng):
    """The MGRIT vector operations of many points at once equal the generic reference point by
    point (in-place forms included)."""
    from mgnn.backend import vector_ops
    ref, ops = vector_ops("numpy"), vector_ops(backend)
    k, shape = 5, (3, 7)
    phis, us, gs, vs = ([_rand(rng, shape, dtype) for _ in range(k)] for _ in range(4))
    rs, total = ops.residual_batch(phis, us, gs if with_g else None)
    want = [ref.residual(phi, u, g if with_g else None) for phi, u, g in zip(phis, us, gs)]
    for r, (wr, _) in zip(rs, want):
        assert_close(r, wr, dtype, "residual")
    exact = sum(float(np.sum(wr.astype(np.float64) ** 2)) for wr, _ in want)
    assert abs(float(total) - exact) <= 10 * RTOL_OF[dtype] * exact
    rs2 = [r.copy() for r in rs]
    ops.fas_rhs_batch(rs2, vs, phis)
    for r2, r, v, phi in zip(rs2, rs, vs, phis):
        assert_close(r2, ref.fas_rhs(r.copy(), v, phi), dtype, "fas_rhs")
    for c, u, g, v in zip(ops.correct_batch(us, gs, vs), us, gs, vs):
        assert_close(c, ref.correct(u, g, v), dtype, "correct")
    for a, u, g in zip(ops.add_batch(us, gs), us, gs):
        assert_close(a, ref.add(u, g), dtype, "add")
    xs = [u.copy() for u in us]
    ops.add_batch(xs, gs, in_place=True)
    for x, u, g in zip(xs, us, gs):
        assert_close(x, ref.add(u, g), dtype, "add in place")


@pytest.mark.parametrize("p", [0, 3, -1])
def test_numba_avgpool_refuses_a_grid_that_does_not_tile(p):
    """The numba kernels divide integers under NumPy's error model (no ZeroDivisionError): a
    bad grid is refused before they run, by name."""
    bk = get_backend("numba")
    with pytest.raises(ValueError, match=f"avgpool: a {p} x {p} grid must tile the 4 x 4"):
        bk.avgpool_forward(np.ones((1, 1, 4, 4)), p)
    if p >= 0:
        with pytest.raises(ValueError, match=f"a {p} x {p} grid must tile the 4 x 4"):
            bk.avgpool_vjp(np.ones((1, 1, p, p)), 4, 4)
