"""The stacked gradient kernels (mgnn.backend.STACKED_GRAD_KERNELS: k_deriv_stacked,
k_vjp_params_stacked) of every backend against the same backend's single kernels (numba:
bit-identical), their argument checks, and their host side on the GPU backend (counting
launcher: one launch for sigma', two for the parameter gradients, no pointer reads, no
allocations)."""
import numpy as np
import pytest

from mgnn.backend import STACKED_GRAD_KERNELS, get_backend
from mgnn.backend.cupy_raw import RawBackend
from mgnn.studies.bench import CountingLauncher

STATE = {"dense": (3, 5), "conv": (2, 3, 4, 5)}
RTOL = {np.float32: 2e-6, np.float64: 1e-13}


def _problem(kind, dt, state=None, m=9, n_layers=7, seed=0):
    rng = np.random.default_rng(seed)
    state = STATE[kind] if state is None else state
    c = state[1]
    r = lambda *s: rng.standard_normal(s).astype(dt)  # noqa: E731
    W = r(n_layers, c, c) * 0.4 if kind == "dense" else r(n_layers, c, c, 3, 3) * 0.3
    return r(m, *state), r(m, *state), W, r(n_layers, c)


def _close(got, want, dt, exact):
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        tol = RTOL[dt]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def _backend(name):
    """``name``, or 'cuda-emulated-cublas': the emulated GPU backend with every dense GEMM on the
    launcher's cuBLAS stand-in (NumPy matmul) and the epilogue kernels."""
    if name != "cuda-emulated-cublas":
        return get_backend(name)
    bk = RawBackend(get_backend("cuda-emulated").launcher, name)
    bk.gemm_min_width = 1
    return bk


@pytest.mark.parametrize("name", ["numpy", "numba", "cuda-emulated", "cuda-emulated-cublas"])
@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("l_stride", [-1, 1])
def test_stacked_grads_equal_the_single_kernels(name, kind, dt, l_stride):
    bk = _backend(name)
    exact = not name.startswith("cuda-emulated")  # loops / njit calls run the single kernels
    U, L, W, b = _problem(kind, dt)
    first, count, layer0, act, h = 2, 4, 1, 0 if kind == "dense" else 1, dt(0.3)
    D = np.full((count + 1,) + U.shape[1:], 7.0, dt)  # a spare row: must stay untouched
    getattr(bk, f"{kind}_deriv_stacked")(U, first, count, W, b, layer0, act, D)
    for p in range(count):
        want = getattr(bk, f"{kind}_deriv")(U[first + p], W[layer0 + p], b[layer0 + p], act)
        _close(D[p], want, dt, exact)
    assert (D[count] == 7).all()
    gW, gb = np.full_like(W, 5.0), np.full_like(b, 5.0)
    l_first = 7 if l_stride == -1 else 3
    getattr(bk, f"{kind}_vjp_params_stacked")(L, l_first, l_stride, D, U, first, count, layer0,
                                              h, gW, gb)
    for p in range(count):
        wW, wb = getattr(bk, f"{kind}_vjp_params")(L[l_first + p * l_stride], D[p],
                                                   U[first + p], h)
        _close(gW[layer0 + p], wW, dt, exact)
        _close(gb[layer0 + p], wb, dt, exact)
    untouched = [n for n in range(W.shape[0]) if not layer0 <= n < layer0 + count]
    assert (gW[untouched] == 5).all() and (gb[untouched] == 5).all()


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_numba_wide_layers_are_bit_identical_too(dt):
    """At B w >= WIDE the single dense kernels take NumPy's route; the stacked ones follow."""
    bk = get_backend("numba")
    U, L, W, b = _problem("dense", dt, state=(64, 64), m=4, n_layers=3)
    D = np.empty((3, 64, 64), dt)
    bk.dense_deriv_stacked(U, 1, 3, W, b, 0, 0, D)
    gW, gb = np.empty_like(W), np.empty_like(b)
    bk.dense_vjp_params_stacked(L, 3, -1, D, U, 0, 3, 0, dt(0.1), gW, gb)
    for p in range(3):
        np.testing.assert_array_equal(D[p], bk.dense_deriv(U[1 + p], W[p], b[p], 0))
        wW, wb = bk.dense_vjp_params(L[3 - p], D[p], U[p], dt(0.1))
        np.testing.assert_array_equal(gW[p], wW)
        np.testing.assert_array_equal(gb[p], wb)


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_count_zero_writes_nothing_and_bad_arguments_are_clear_errors(name):
    bk = get_backend(name)
    U, L, W, b = _problem("dense", np.float64)
    D = np.zeros((3,) + U.shape[1:])
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    bk.dense_deriv_stacked(U, 0, 0, W, b, 0, 0, D)
    bk.dense_vjp_params_stacked(L, 0, -1, D, U, 0, 0, 0, 0.1, gW, gb)
    assert not D.any() and not gW.any() and not gb.any()
    with pytest.raises(ValueError, match="first: 7..9 out of range of the 9 slots of U"):
        bk.dense_deriv_stacked(U, 7, 3, W, b, 0, 0, D)
    with pytest.raises(ValueError, match="layer0: 5..7 out of range of the 7 layers"):
        bk.dense_deriv_stacked(U, 0, 3, W, b, 5, 0, D)
    with pytest.raises(ValueError, match="count: 0..3 out of range of the 3 rows of D"):
        bk.dense_deriv_stacked(U, 0, 4, W, b, 0, 0, D)
    with pytest.raises(ValueError, match=r"l_first: -1..1 out of range .* \(l_stride=-1\)"):
        bk.dense_vjp_params_stacked(L, 1, -1, D, U, 0, 3, 0, 0.1, gW, gb)
    with pytest.raises(ValueError, match="D must be a C-contiguous float64"):
        bk.dense_deriv_stacked(U, 0, 3, W, b, 0, 0, D.astype(np.float32))
    with pytest.raises(ValueError, match="count must be >= 0"):
        bk.dense_deriv_stacked(U, 0, -1, W, b, 0, 0, D)
    with pytest.raises(TypeError, match="layer0 must be an integer"):
        bk.dense_deriv_stacked(U, 0, 1, W, b, 0.5, 0, D)


def test_every_backend_has_them():
    for name in ("numpy", "numba", "cuda-emulated"):
        bk = get_backend(name)
        assert all(callable(getattr(bk, k, None)) for k in STACKED_GRAD_KERNELS), name


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_gpu_host_side_one_launch_per_kind_no_pointers_no_allocations(kind):
    launcher = CountingLauncher()
    bk = RawBackend(launcher, "counting")
    U, L, W, b = _problem(kind, np.float32, m=40, n_layers=32)
    D = np.zeros((32,) + U.shape[1:], np.float32)
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    for _ in range(2):  # the second call: the conv gradient's split-K scratch is cached
        launcher.launches.clear()
        launcher.allocations = 0
        getattr(bk, f"{kind}_deriv_stacked")(U, 1, 32, W, b, 0, 0, D)
        getattr(bk, f"{kind}_vjp_params_stacked")(L, 33, -1, D, U, 1, 32, 0, 0.1, gW, gb)
    grad = {"dense_weight_grad_stacked": 1} if kind == "dense" else {
        "conv_kernel_grad_stacked": 1, "conv_kernel_grad_sum": 1}  # partials, their sum
    assert launcher.launches == {f"{kind}_deriv_stacked": 1, **grad, "bias_grad_stacked": 1}
    assert launcher.pointers == 0 and launcher.allocations == 0
