"""The 3x3x3 convolution kernels (``conv3d_*``, NCDHW, K (co, ci, 3, 3, 3)): every backend x dtype
against the NumPy reference, the reference against the textbook sum and the 2D kernels, central
differences for its vjps (float64), the RawKernels of kernels/conv3d.cu under host emulation at
both launch geometries, and the argument checks every backend shares."""
import numpy as np
import pytest

from mgnn.backend import available_backends, get_backend, numpy_ref as REF
from mgnn.blocks.gradcheck import gradcheck
from tests.conftest import assert_close

# the GPU backend takes device arrays: it is covered through cuda-emulated (same launch code)
FAST = [b for b in available_backends() if b not in ("numpy", "cuda")]
EMULATED = ["cuda-emulated"] if "cuda-emulated" in available_backends() else []
DTYPES = ["float32", "float64"]
ACTS = [0, 1, 2]
KERNEL_NAMES = ("conv3d_forward", "conv3d_forward_deriv", "conv3d_deriv", "conv3d_vjp_input",
                "conv3d_vjp", "conv3d_vjp_params")


def _backend(name):
    """GPU-code backends fill every new output with NaN first: an unwritten element fails."""
    bk = get_backend(name)
    if hasattr(bk, "poison_outputs"):
        bk.poison_outputs = True
    return bk


def _case(rng, dtype, B, ci, co, size):
    r = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    x, K, b, g = r(B, ci, *size), r(co, ci, 3, 3, 3), r(co), r(B, co, *size)
    return x, K, b, g, np.dtype(dtype).type(0.3)


def check_against_reference(bk, x, K, b, g, h, act, residual, dtype):
    """All six conv3d kernels of ``bk`` against the reference on one input."""
    assert_close(bk.conv3d_forward(x, K, b, h, act, residual),
                 REF.conv3d_forward(x, K, b, h, act, residual), dtype, "forward")
    y, d = bk.conv3d_forward_deriv(x, K, b, h, act, residual)
    yr, dr = REF.conv3d_forward_deriv(x, K, b, h, act, residual)
    assert_close(y, yr, dtype, "forward_deriv y")
    assert_close(d, dr, dtype, "forward_deriv d")
    assert_close(bk.conv3d_deriv(x, K, b, act), dr, dtype, "deriv")
    # a deriv with varied entries (relu / identity give 0/1 only)
    dr = np.abs(dr + np.linspace(0.1, 1.0, dr.size).reshape(dr.shape).astype(dtype))
    assert_close(bk.conv3d_vjp_input(g, dr, K, h, residual),
                 REF.conv3d_vjp_input(g, dr, K, h, residual), dtype, "vjp_input")
    for a, r, n in zip(bk.conv3d_vjp(g, dr, x, K, h, residual),
                       REF.conv3d_vjp(g, dr, x, K, h, residual), ("gx", "gK", "gb")):
        assert_close(a, r, dtype, n)
    for a, r, n in zip(bk.conv3d_vjp_params(g, dr, x, h), REF.conv3d_vjp_params(g, dr, x, h),
                       ("gK", "gb")):
        assert_close(a, r, dtype, n)


def test_every_backend_provides_the_conv3d_kernels():
    for name in available_backends():
        bk = get_backend(name)
        assert [k for k in KERNEL_NAMES if not callable(getattr(bk, k, None))] == [], name


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("residual", [True, False])
def test_conv3d_kernels(backend, dtype, act, residual, rng):
    """Residual steps (ci == co) and openings (ci != co) on an uneven volume."""
    ci, co = (3, 3) if residual else (2, 4)
    x, K, b, g, h = _case(rng, dtype, 2, ci, co, (4, 5, 3))
    check_against_reference(_backend(backend), x, K, b, g, h, act, residual, dtype)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 2), (3, 2, 1, 2, 1, 1), (1, 1, 2, 2, 1, 6)])
def test_conv3d_kernels_edge_sizes(backend, dtype, shape, rng):
    """Sizes 1 along D, H, W (every tap out of range on some side), one channel, one sample."""
    B, ci, co, *size = shape
    x, K, b, g, h = _case(rng, dtype, B, ci, co, size)
    check_against_reference(_backend(backend), x, K, b, g, h, 0, ci == co, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_conv3d_on_a_larger_volume(dtype, rng):
    """Many (sample, channel) tasks on Numba's threads, 8 channels, a 9 x 10 x 11 volume."""
    if "numba" not in FAST:
        pytest.skip("numba backend unavailable")
    x, K, b, g, h = _case(rng, dtype, 3, 8, 8, (9, 10, 11))
    check_against_reference(_backend("numba"), x, K, b, g, h, 0, True, dtype)


@pytest.mark.parametrize("backend", EMULATED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv3d_rawkernels_at_gpu_geometry(backend, dtype, rng):
    """kernels/conv3d.cu at the GPU's launch geometry (256-thread blocks, grid capped at 4 blocks
    so the grid-stride loops take several passes) under host emulation; every conv3d kernel
    (and bias_grad) is launched."""
    from mgnn.backend.cupy_raw import GPU_GEOMETRY, KERNEL_FILES, RawBackend
    from mgnn.backend.host_emulation import EmulationLauncher
    bk = RawBackend(EmulationLauncher(list(KERNEL_FILES), KERNEL_FILES,
                                      dict(GPU_GEOMETRY, MAX_GRID=4)), backend)
    bk.poison_outputs = True
    seen = set()
    launch = bk.launcher.launch
    bk.launcher.launch = lambda name, *a: (seen.add(name), launch(name, *a))
    x, K, b, g, h = _case(rng, dtype, 3, 2, 2, (5, 6, 7))  # 1260 outputs > 4 * 256 threads
    for residual in (True, False):
        y, d = bk.conv3d_forward_deriv(x, K, b, h, 0, residual)
        yr, dr = REF.conv3d_forward_deriv(x, K, b, h, 0, residual)
        assert_close(y, yr, dtype, "y")
        assert_close(d, dr, dtype, "d")
        for a, r, n in zip(bk.conv3d_vjp(g, dr, x, K, h, residual),
                           REF.conv3d_vjp(g, dr, x, K, h, residual), ("gx", "gK", "gb")):
            assert_close(a, r, dtype, n)
    assert set(KERNEL_FILES["conv3d.cu"]) | {"bias_grad"} <= seen


def _naive_conv3d(x, K):
    """The textbook sum, one output element at a time."""
    B, ci, D, H, W = x.shape
    co = K.shape[0]
    out = np.zeros((B, co, D, H, W))
    for n in range(B):
        for o in range(co):
            for z in range(D):
                for y in range(H):
                    for xx in range(W):
                        acc = 0.0
                        for c in range(ci):
                            for dz in range(3):
                                for dy in range(3):
                                    for dx in range(3):
                                        zz, yy, xi = z + dz - 1, y + dy - 1, xx + dx - 1
                                        if 0 <= zz < D and 0 <= yy < H and 0 <= xi < W:
                                            acc += K[o, c, dz, dy, dx] * x[n, c, zz, yy, xi]
                        out[n, o, z, y, xx] = acc
    return out


def test_reference_conv3d_matches_the_textbook_sum(rng):
    x = rng.standard_normal((2, 2, 3, 4, 2))
    K = rng.standard_normal((3, 2, 3, 3, 3))
    b = rng.standard_normal(3)
    want = _naive_conv3d(x, K) + b[None, :, None, None, None]
    np.testing.assert_allclose(REF.conv3d_forward(x, K, b, 1.0, 2, False), want, rtol=1e-12,
                               atol=1e-12)


def test_reference_conv3d_of_a_flat_kernel_is_the_2d_conv(rng):
    """A 3x3x3 kernel that is zero outside its middle plane acts on each depth slice as the 2D
    kernel K[:, :, 1]: state and parameter gradients included."""
    B, C, D, H, W = 2, 3, 4, 5, 6
    x, g = rng.standard_normal((B, C, D, H, W)), rng.standard_normal((B, C, D, H, W))
    K2, b = rng.standard_normal((C, C, 3, 3)), rng.standard_normal(C)
    K3 = np.zeros((C, C, 3, 3, 3))
    K3[:, :, 1] = K2

    def per_slice(a):  # (B, C, D, H, W) -> (B D, C, H, W): the depth slices as a 2D batch
        return np.ascontiguousarray(a.transpose(0, 2, 1, 3, 4).reshape(B * D, C, H, W))

    y3, d3 = REF.conv3d_forward_deriv(x, K3, b, 0.4, 0, True)
    y2, d2 = REF.conv_forward_deriv(per_slice(x), K2, b, 0.4, 0, True)
    np.testing.assert_allclose(per_slice(y3), y2, rtol=1e-12, atol=1e-12)
    gx3, gK3, gb3 = REF.conv3d_vjp(g, d3, x, K3, 0.4, True)
    gx2, gK2, gb2 = REF.conv_vjp(per_slice(g), d2, per_slice(x), K2, 0.4, True)
    np.testing.assert_allclose(per_slice(gx3), gx2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gK3[:, :, 1], gK2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gb3, gb2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act", [0, 2])
@pytest.mark.parametrize("residual", [True, False])
def test_reference_conv3d_vjps_gradcheck(act, residual, rng):
    """Central differences (float64) and <J v, w> = <v, J^T w> for the state and parameter
    vjps of the reference; vjp_input and vjp_params agree with vjp."""
    ci, co = (2, 2) if residual else (2, 3)
    inputs = {"x": rng.standard_normal((2, ci, 3, 4, 3)),
              "K": rng.standard_normal((co, ci, 3, 3, 3)) * 0.3,
              "b": rng.standard_normal(co) * 0.3}
    h = 0.7

    def forward(p):
        return REF.conv3d_forward(p["x"], p["K"], p["b"], h, act, residual)

    def vjp(p, gy):
        _, d = REF.conv3d_forward_deriv(p["x"], p["K"], p["b"], h, act, residual)
        gx, gK, gb = REF.conv3d_vjp(gy, d, p["x"], p["K"], h, residual)
        np.testing.assert_allclose(REF.conv3d_vjp_input(gy, d, p["K"], h, residual), gx,
                                   rtol=1e-14, atol=1e-14)
        for a, r in zip(REF.conv3d_vjp_params(gy, d, p["x"], h), (gK, gb)):
            np.testing.assert_allclose(a, r, rtol=1e-14, atol=1e-14)
        return {"x": gx, "K": gK, "b": gb}

    res = gradcheck(forward, vjp, inputs, max_entries=40)
    assert res.ok, res.failures


def test_gradcheck_catches_a_wrong_conv3d_vjp(rng):
    """The check above can fail: a kernel gradient with two taps swapped is rejected."""
    inputs = {"K": rng.standard_normal((2, 2, 3, 3, 3))}
    x, b = rng.standard_normal((1, 2, 3, 3, 3)), np.zeros(2)

    def vjp(p, gy):
        _, d = REF.conv3d_forward_deriv(x, p["K"], b, 1.0, 0, False)
        gK = REF.conv3d_vjp_params(gy, d, x, 1.0)[0]
        return {"K": np.ascontiguousarray(gK[:, :, ::-1])}

    res = gradcheck(lambda p: REF.conv3d_forward(x, p["K"], b, 1.0, 0, False), vjp, inputs,
                    raise_on_fail=False)
    assert not res.ok


# ------------------------------------------------------------------------------ bad input
def _bad_calls(dtype="float64"):
    """(kernel, args, exception, message pattern) of invalid calls."""
    r = lambda *s: np.random.default_rng(0).standard_normal(s).astype(dtype)  # noqa: E731
    x, K, b, g = r(2, 3, 4, 4, 4), r(3, 3, 3, 3, 3), r(3), r(2, 3, 4, 4, 4)
    return [
        ("conv3d_forward", (r(2, 3, 4, 4), K, b, 0.1, 0, True), ValueError,
         r"x has shape \(2, 3, 4, 4\).*NCDHW"),
        ("conv3d_forward", (x, r(3, 3, 3, 3), b, 0.1, 0, True), ValueError,
         r"K has shape \(3, 3, 3, 3\)"),
        ("conv3d_forward", (x, r(3, 2, 3, 3, 3), b, 0.1, 0, False), ValueError,
         r"K has shape \(3, 2, 3, 3, 3\), expected \(3, 3, 3, 3, 3\)"),
        ("conv3d_forward", (x, r(3, 3, 3, 3, 2), b, 0.1, 0, False), ValueError,
         r"K has shape \(3, 3, 3, 3, 2\)"),
        ("conv3d_forward", (x, K, r(4), 0.1, 0, True), ValueError, r"b has shape \(4,\)"),
        ("conv3d_forward", (x, r(4, 3, 3, 3, 3), r(4), 0.1, 0, True), ValueError,
         "residual=True.*ci=3, co=4"),
        ("conv3d_forward", (x, K.astype(np.float32 if dtype == "float64" else np.float64), b,
                            0.1, 0, True), TypeError, "K has dtype"),
        ("conv3d_forward", (x.astype(np.int64), K, b, 0.1, 0, True), TypeError,
         "x has dtype int64"),
        ("conv3d_forward", (x.tolist(), K, b, 0.1, 0, True), TypeError, "x must be an array"),
        ("conv3d_forward", (x.transpose(0, 1, 2, 4, 3), K, b, 0.1, 0, True), ValueError,
         "x must be C-contiguous"),
        ("conv3d_forward", (x, K, b, "0.1", 0, True), TypeError, "h must be a real scalar"),
        ("conv3d_forward_deriv", (x, K, b, 0.1, 5, True), ValueError, "act=5"),
        ("conv3d_deriv", (x, K, b, 1.5), ValueError, "act=1.5"),
        ("conv3d_vjp_input", (g, r(2, 3, 4, 4, 3), K, 0.1, True), ValueError,
         r"deriv has shape \(2, 3, 4, 4, 3\), expected \(2, 3, 4, 4, 4\)"),
        ("conv3d_vjp", (g, g, r(2, 3, 4, 4, 5), K, 0.1, True), ValueError,
         r"batch and \(D, H, W\) must agree"),
        ("conv3d_vjp", (g, g, r(1, 3, 4, 4, 4), K, 0.1, True), ValueError,
         r"batch and \(D, H, W\) must agree"),
        ("conv3d_vjp_params", (r(2, 5, 4, 4, 4), r(2, 5, 4, 4, 4), x[:, :2].copy(), 0.1),
         None, None),  # ci != co is fine without K
    ]


@pytest.mark.parametrize("backend", ["numpy"] + FAST)
@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_conv3d_bad_input_names_the_value(backend, case):
    name, args, exc, pattern = _bad_calls()[case]
    fn = getattr(get_backend(backend), name)
    if exc is None:
        gK, gb = fn(*args)
        assert gK.shape == (5, 2, 3, 3, 3) and gb.shape == (5,)
        return
    with pytest.raises(exc, match=pattern):
        fn(*args)


def test_rawkernels_refuse_volumes_beyond_32_bit_indices():
    """The launch code checks that conv3d.cu's int indices hold the state plus the grid."""
    if not EMULATED:
        pytest.skip("no C++ compiler for the host emulation")
    from mgnn.backend.cupy_raw import KERNEL_FILES, RawBackend
    from mgnn.backend.host_emulation import EMULATION_GEOMETRY, EmulationLauncher
    launcher = EmulationLauncher(list(KERNEL_FILES), KERNEL_FILES, dict(EMULATION_GEOMETRY))
    launcher.geometry["MAX_GRID"] = 2**31 // launcher.geometry["ELEM"]  # a grid of 2^31 threads
    bk = RawBackend(launcher, "cuda-emulated")
    x, K, b = np.zeros((1, 1, 1, 1, 1)), np.zeros((1, 1, 3, 3, 3)), np.zeros(1)
    for call in (lambda: bk.conv3d_forward(x, K, b, 0.1, 0, True),
                 lambda: bk.conv3d_vjp_input(x, x, K, 0.1, True),
                 lambda: bk.conv3d_vjp_params(x, x, x, 0.1)):
        with pytest.raises(ValueError, match="32-bit"):
            call()


# ------------------------------------------------------------------------------- benchmark
@pytest.mark.parametrize("dtype", DTYPES)
def test_bench_conv3d_step_and_its_im2col_baseline_compute_the_reference(dtype):
    """Both sides of the ``bench kernels`` conv3d row compute the same step as the reference."""
    from mgnn.studies.bench import conv3d_step_case
    step, baseline = conv3d_step_case(channels=3, batch=2, size=4, dtype=dtype)
    got_step, got_base = step(), baseline()
    rng = np.random.default_rng(0)  # conv3d_step_case's draws, in its order
    dt = np.dtype(dtype)
    u, lam = (rng.standard_normal((2, 3, 4, 4, 4)).astype(dt) for _ in range(2))
    K = (rng.standard_normal((3, 3, 3, 3, 3)) / np.sqrt(81)).astype(dt)
    b = rng.standard_normal(3).astype(dt)
    y, d = REF.conv3d_forward_deriv(u, K, b, dt.type(0.1), 0, True)
    want = (y, d, *REF.conv3d_vjp(lam, d, u, K, dt.type(0.1), True))
    for name, a, c, r in zip(("y", "deriv", "gx", "gK", "gb"), got_step, got_base, want):
        assert_close(a, r, dtype, f"step {name}")
        assert_close(np.asarray(c, dtype=dtype), r, dtype, f"im2col {name}")


def test_bench_conv3d_row_reports_a_ratio():
    """The row's fields (timings are reported, never asserted)."""
    from mgnn.studies.bench import bench_conv3d_kernel
    row = bench_conv3d_kernel(channels=2, batch=1, size=4)
    assert row["ratio"] == pytest.approx(row["gflops"] / row["baseline_gflops"])
    assert row["gflops"] > 0 and "im2col" in row["baseline"]
