"""The GPU backend's stacked-state kernels (RawBackend.{dense,conv}_{chains,points}_{forward,
adjoint}) under host emulation, against a loop of the same backend's single-step kernels, and
their host side under the counting launcher: launches per wave, no allocation after the first
call, no pointer reads."""
import copy

import numpy as np
import pytest

from mgnn.backend import get_backend
from mgnn.backend.cupy_raw import GPU_GEOMETRY, KERNEL_FILES, RawBackend
from mgnn.backend.host_emulation import EmulationLauncher
from mgnn.studies.bench import CountingLauncher

STATE = {"dense": (3, 5), "conv": (2, 3, 5, 6)}
M = 18  # slots
# irregular chains, out of order: firsts 1, 5, 9 (stride 4), 12, 14; lengths 3, 3, 2, 1, 3
CHAINS = np.array([[9, 2], [1, 3], [14, 3], [5, 3], [12, 1]])
SLOTS, OUTS = np.array([4, 8, 12, 13, 16, 2]), np.array([0, 1, 2, 3, 5, 4])
RTOL = {np.float32: 1e-6, np.float64: 1e-12}


@pytest.fixture(scope="module", params=["fused", "cublas"])
def bk(request):
    """The emulated GPU backend: dense GEMMs in the fused kernels, or (every width) on the
    launcher's cuBLAS stand-in (NumPy matmul) followed by the epilogue kernels."""
    if request.param == "fused":
        return get_backend("cuda-emulated")
    wide = RawBackend(get_backend("cuda-emulated").launcher, "cuda-emulated-cublas")
    wide.gemm_min_width = 1
    return wide


def _problem(kind, adjoint, dt, seed=0):
    """U (M, *state), G, params P (N, ...), X = b or D, d0, layer0, layer_step, act. The adjoint
    runs layers backwards (layer_step -1) and holds sigma' of layers 1.. only (d0 = 1)."""
    rng = np.random.default_rng(seed)
    state, N = STATE[kind], M - 1
    r = lambda *s: rng.standard_normal(s).astype(dt)  # noqa: E731
    C = state[1]
    P = r(N, C, C) * 0.4 if kind == "dense" else r(N, C, C, 3, 3) * 0.2
    if adjoint:
        X, d0, layer0, step = rng.uniform(0, 1, (N - 1,) + state).astype(dt), 1, M - 1, -1
    else:
        X, d0, layer0, step = r(N, C), 0, -1, 1
    return r(M, *state), r(M, *state), P, X, d0, layer0, step, 0 if kind == "dense" else 1


def _step(bk, kind, adjoint, x, P, X, d0, l, h, act):
    """One step of layer l through the backend's single-step kernels."""
    if adjoint:
        return getattr(bk, f"{kind}_vjp_input")(x, X[l - d0], P[l], h, True)
    return getattr(bk, f"{kind}_forward")(x, P[l], X[l], h, act, True)


def _close(got, want, dt):
    tol = RTOL[dt]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def _call(bk, kind, adjoint, what, U, G, P, X, d0, layer0, step, h, act, *rest):
    name = f"{kind}_{what}_{'adjoint' if adjoint else 'forward'}"
    if what == "chains":
        lead = (U, G, P, X, d0) if adjoint else (U, G, P, X)
        return getattr(bk, name)(*lead, rest[0], layer0, step, h, *(() if adjoint else (act,)))
    R, slots, outs, mode = rest
    lead = (U, G, R, P, X, d0) if adjoint else (U, G, R, P, X)
    return getattr(bk, name)(*lead, slots, outs, layer0, step, h,
                             *(() if adjoint else (act,)), mode)


@pytest.mark.parametrize("with_g", [False, True])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("adjoint", [False, True])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_chains_match_single_steps(bk, kind, adjoint, dt, with_g):
    U, G, P, X, d0, layer0, step, act = _problem(kind, adjoint, dt)
    G = G if with_g else None
    h = dt(0.3)
    want = U.copy()
    for first, length in CHAINS:
        for i in range(first, first + length):
            want[i] = _step(bk, kind, adjoint, want[i - 1], P, X, d0, layer0 + i * step, h, act)
            if G is not None:
                want[i] += G[i]
    _call(bk, kind, adjoint, "chains", U, G, P, X, d0, layer0, step, h, act, CHAINS)
    _close(U, want, dt)
    untouched = [0, 4, 8, 11, 13, 17]  # slots no chain writes
    np.testing.assert_array_equal(U[untouched], want[untouched])


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("with_g", [False, True])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("adjoint", [False, True])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_points_match_single_steps(bk, kind, adjoint, dt, with_g, mode):
    U, G, P, X, d0, layer0, step, act = _problem(kind, adjoint, dt, seed=1)
    G = G if with_g else None
    h = dt(0.25)
    R = np.random.default_rng(2).standard_normal((7,) + U.shape[1:]).astype(dt)
    want, U0 = R.copy(), U.copy()
    for i, o in zip(SLOTS, OUTS):
        phi = _step(bk, kind, adjoint, U[i - 1], P, X, d0, layer0 + i * step, h, act)
        if mode == 1:
            want[o] = (want[o] + U[i]) - phi
            continue
        want[o] = phi - U[i] if mode == 0 else phi
        if G is not None:
            want[o] += G[i]
    norm = _call(bk, kind, adjoint, "points", U, G, P, X, d0, layer0, step, h, act, R, SLOTS,
                 OUTS, mode)
    _close(R, want, dt)
    np.testing.assert_array_equal(R[6], want[6])  # no output slot: untouched
    np.testing.assert_array_equal(U, U0)  # only read
    assert isinstance(norm, float)
    expect = float(np.sum(want[OUTS].astype(np.float64) ** 2)) if mode == 0 else 0.0
    assert norm == pytest.approx(expect, rel=RTOL[dt], abs=0.0)


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_gpu_geometry_and_device_norm(kind):
    """256-thread blocks (the GPU's block_sum widths) and several elementwise blocks; a launcher
    on a device gets the norm as a 0-d float64 array (here a NumPy one)."""
    geo = dict(GPU_GEOMETRY, MAX_GRID=4)
    launcher = copy.copy(EmulationLauncher(list(KERNEL_FILES), KERNEL_FILES, geo))
    launcher.on_device = True
    bk = RawBackend(launcher, "cuda-emulated")
    dt = np.float64
    for adjoint in (False, True):
        U, G, P, X, d0, layer0, step, act = _problem(kind, adjoint, dt, seed=3)
        R = np.zeros((6,) + U.shape[1:], dt)
        norm = _call(bk, kind, adjoint, "points", U, G, P, X, d0, layer0, step, 0.5, act, R,
                     SLOTS, OUTS, 0)
        want = [(_step(bk, kind, adjoint, U[i - 1], P, X, d0, layer0 + i * step, 0.5, act)
                 - U[i]) + G[i] for i in SLOTS]
        _close(R[OUTS], np.stack(want), dt)
        assert isinstance(norm, np.ndarray) and norm.shape == () and norm.dtype == np.float64
        assert float(norm) == pytest.approx(float(np.sum(R ** 2)), rel=1e-12)
        ref = U.copy()
        _call(bk, kind, adjoint, "chains", U, None, P, X, d0, layer0, step, 0.5, act, CHAINS)
        for first, length in CHAINS:
            for i in range(first, first + length):
                ref[i] = _step(bk, kind, adjoint, ref[i - 1], P, X, d0, layer0 + i * step, 0.5,
                               act)
        _close(U, ref, dt)


def test_launches_per_wave_and_no_allocation_after_the_first_call():
    """Counting launcher, GPU geometry: one launch per wave (per arithmetic run of a wave), one
    per point run (+ the norm's reduction in mode 0); no allocation and no pointer read on the
    second call."""
    launcher = CountingLauncher()
    bk = RawBackend(launcher, "counting")
    B, w, cf = 64, 64, 4
    m = 4 * cf + 1
    U, G = np.zeros((m, B, w), np.float32), np.zeros((m, B, w), np.float32)
    W, b, D = np.zeros((m, w, w), np.float32), np.zeros((m, w), np.float32), np.zeros_like(U)
    R = np.zeros((4, B, w), np.float32)
    regular = np.array([[1 + cf * c, cf - 1] for c in range(4)])  # F-relaxation: 3 waves
    cpoints, outs = np.arange(cf, m, cf), np.arange(4)
    calls = [  # (call, expected launches)
        (lambda: bk.dense_chains_forward(U, G, W, b, regular, -1, 1, 0.1, 0), 3),
        (lambda: bk.dense_chains_adjoint(U, None, W, D, 0, regular, m - 1, -1, 0.1), 3),
        (lambda: bk.dense_chains_forward(U, None, W, b, CHAINS, -1, 1, 0.1, 0), 6),  # 3 waves
        (lambda: bk.dense_points_forward(U, G, R, W, b, cpoints, outs, -1, 1, 0.1, 0, 0), 2),
        (lambda: bk.dense_points_adjoint(U, G, R, W, D, 0, cpoints, outs, m - 1, -1, 0.1, 1), 1),
    ]
    for call, expect in calls:
        call()
        launcher.launches.clear()
        launcher.allocations = launcher.pointers = 0
        call()
        assert sum(launcher.launches.values()) == expect, dict(launcher.launches)
        assert launcher.allocations == 0 and launcher.pointers == 0
    assert launcher.launches == {"dense_stacked_adjoint": 1}  # the last call's


def test_conv_counts():
    """Conv: one launch per wave, the reduction in mode 0, nothing allocated on a second call."""
    launcher = CountingLauncher()
    bk = RawBackend(launcher, "counting")
    U = np.zeros((9, 2, 4, 8, 8), np.float64)
    K, b = np.zeros((8, 4, 4, 3, 3)), np.zeros((8, 4))
    chains = np.array([[1, 3], [5, 3]])
    R = np.zeros((2,) + U.shape[1:])
    for _ in range(2):
        launcher.launches.clear()
        launcher.allocations = 0
        bk.conv_chains_forward(U, None, K, b, chains, -1, 1, 0.1, 1)
        bk.conv_points_forward(U, None, R, K, b, [4, 8], [0, 1], -1, 1, 0.1, 1, 0)
    assert launcher.launches == {"conv_stacked_forward": 4, "sum_partials": 1}
    assert launcher.allocations == 0


def test_bad_input_is_a_clear_error(bk):
    U, G, P, X, d0, layer0, step, act = _problem("dense", True, np.float64)
    R = np.zeros((6, 3, 5))
    with pytest.raises(ValueError, match="overlap or depend"):
        bk.dense_chains_adjoint(U, G, P, X, d0, [[1, 3], [4, 2]], layer0, step, 0.1)
    with pytest.raises(ValueError, match="out of range 0..16"):
        bk.dense_chains_adjoint(U, G, P, X, d0, [[1, 3]], layer0 + 1, step, 0.1)
    with pytest.raises(ValueError, match="no sigma' in D"):
        bk.dense_chains_adjoint(U, G, P, X, d0, [[16, 2]], layer0, step, 0.1)
    with pytest.raises(ValueError, match="slots 0..2 out of range"):
        bk.dense_points_adjoint(U, G, R, P, X, d0, [0, 2], [0, 1], layer0, step, 0.1, 0)
    with pytest.raises(ValueError, match="out_slots must be distinct"):
        bk.dense_points_adjoint(U, G, R, P, X, d0, [1, 2], [0, 0], layer0, step, 0.1, 0)
    with pytest.raises(ValueError, match="mode must be"):
        bk.dense_points_adjoint(U, G, R, P, X, d0, [1, 2], [0, 1], layer0, step, 0.1, 3)
    with pytest.raises(ValueError, match="R shares memory with U"):
        bk.dense_points_adjoint(U, G, U[2:8], P, X, d0, [1, 2], [0, 1], layer0, step, 0.1, 0)
    with pytest.raises(ValueError, match="act=7"):
        bk.dense_points_forward(U, G, R, P, np.zeros((17, 5)), [1, 2], [0, 1], -1, 1, 0.1, 7, 0)
    with pytest.raises(ValueError, match="shape"):
        bk.dense_points_adjoint(U, G, R[:, :2], P, X, d0, [1, 2], [0, 1], layer0, step, 0.1, 0)


def test_gemm_min_width_from_the_environment(monkeypatch):
    from mgnn.backend import cupy_raw
    monkeypatch.delenv(cupy_raw.GEMM_MIN_WIDTH_ENV, raising=False)
    assert cupy_raw.gemm_min_width_default() == cupy_raw.GEMM_MIN_WIDTH
    monkeypatch.setenv(cupy_raw.GEMM_MIN_WIDTH_ENV, "256")
    assert RawBackend(CountingLauncher(), "counting").gemm_min_width == 256
    for bad in ("0", "-3", "wide"):
        monkeypatch.setenv(cupy_raw.GEMM_MIN_WIDTH_ENV, bad)
        with pytest.raises(ValueError, match=f"MGNN_GEMM_MIN_WIDTH={bad!r}"):
            cupy_raw.gemm_min_width_default()


def test_state_run_views_every_stride():
    from mgnn.backend.cupy_raw import state_run
    X = np.arange(10)
    for first, step, count in ((3, 2, 3), (8, -3, 3), (2, -1, 3), (5, 4, 1), (0, 1, 10),
                               (5, 0, 3)):
        assert state_run(X, first, step, count).tolist() == [first + p * step
                                                             for p in range(count)]


def test_repeated_slot_on_both_paths():
    """A points call may read one slot twice (only out_slots must be distinct): a zero stride,
    which the cuBLAS path takes as a broadcast view."""
    U, G, P, X, d0, layer0, step, act = _problem("dense", False, np.float64, seed=4)
    outs = []
    for width in (1 << 30, 1):
        bk = RawBackend(get_backend("cuda-emulated").launcher, "cuda-emulated")
        bk.gemm_min_width = width
        R = np.zeros((3,) + U.shape[1:])
        norm = bk.dense_points_forward(U, G, R, P, X, np.array([5, 5, 5]), np.array([0, 1, 2]),
                                       layer0, step, 0.3, act, 0)
        outs.append((R, norm))
    _close(outs[1][0], outs[0][0], np.float64)
    np.testing.assert_array_equal(outs[0][0][0], outs[0][0][2])
    assert outs[1][1] == pytest.approx(outs[0][1], rel=1e-12)
