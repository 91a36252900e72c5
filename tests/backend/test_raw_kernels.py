"""The GPU RawKernels (kernels/*.cu) on a machine without a GPU: nvcc compiles every one for
sm_90 without warnings, the host emulation runs every one (the contract tests of test_kernels.py
compare them with the reference on tiny tiles), and the real-GPU twins run where CuPy sees one."""
import shutil

import numpy as np
import pytest

from mgnn.backend import get_backend, gpu_available, numpy_ref as REF
from mgnn.backend.cupy_raw import GPU_GEOMETRY, KERNEL_FILES, RawBackend, compile_with_nvcc
from mgnn.backend.host_emulation import EMULATION_GEOMETRY, EmulationLauncher
from mgnn.backend import counter_rng
from mgnn.backend import cupy_raw as raw
from tests.backend.test_bn_kernels import bn_chain
from tests.backend.test_recurrent_kernels import recurrent_chain
from tests.conftest import assert_close

ALL_KERNELS = {k for names in KERNEL_FILES.values() for k in names}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_90"])
def test_nvcc_compiles_every_kernel_without_warnings(arch):
    out = compile_with_nvcc(arch)
    assert "warning" not in out.lower(), out


def test_nvrtc_compiles_every_kernel_as_cupy_will():
    """CuPy compiles RawModules with NVRTC (no host headers): the same sources, options and name
    expressions go through CuPy's own compile path here, for sm_90, without a GPU."""
    from mgnn.backend.cupy_raw import compile_with_nvrtc
    logs = compile_with_nvrtc("90")
    assert set(logs) == set(KERNEL_FILES)


def test_nvrtc_check_fails_on_an_error(tmp_path, monkeypatch):
    import mgnn.backend.cupy_raw as raw
    (tmp_path / "common.cuh").write_text("")
    (tmp_path / "bad.cu").write_text(
        "#include <vector>\ntemplate <typename T> __global__ void bad(T *x) { x[0] = 1; }\n")
    monkeypatch.setattr(raw.launch, "KERNEL_FILES", {"bad.cu": ("bad",)})
    monkeypatch.setattr(raw.launch, "kernel_dir", lambda: str(tmp_path))
    with pytest.raises(RuntimeError, match="bad.cu"):
        raw.compile_with_nvrtc()


def test_nvcc_check_fails_on_a_warning(tmp_path, monkeypatch):
    """The compile check can fail: a kernel with an unused variable is rejected."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    import mgnn.backend.cupy_raw as raw
    src = tmp_path / "bad.cu"
    src.write_text("template <typename T> __global__ void bad(T *x) { int unused = 3; x[0] = 1; }\n")
    monkeypatch.setattr(raw.launch, "KERNEL_FILES", {"bad.cu": ("bad",)})
    monkeypatch.setattr(raw.launch, "kernel_dir", lambda: str(tmp_path))
    with pytest.raises(RuntimeError, match="unused"):
        raw.compile_with_nvcc("sm_90")


def _exercise(bk, rng, dt, B=9, w=10):
    """Call every RawBackend entry point once; returns {kernel method: (result, reference)}."""
    r = lambda *s: rng.standard_normal(s).astype(dt)  # noqa: E731
    h = np.dtype(dt).type(0.3)
    x, W, b, g = r(B, w), r(w, w), r(w), r(B, w)
    d = REF.dense_deriv(x, W, b, 0)
    u, K, cb, gu = r(2, 3, 4, 4), r(3, 3, 3, 3), r(3), r(2, 3, 4, 4)
    cd = REF.conv_deriv(u, K, cb, 0)
    logits, y = r(5, 7), rng.integers(0, 7, 5)
    U = np.zeros((4, B, w), dt)
    U[0] = x
    D = np.zeros((3, B, w), dt)
    Ws, bs = r(3, w, w) * 0.5, r(3, w)
    Ur, Dr = U.copy(), D.copy()
    bk.dense_sweep_forward(U, Ws, bs, h, 0, D)
    REF.dense_sweep_forward(Ur, Ws, bs, h, 0, Dr)
    gW, gb, gWr, gbr = np.zeros_like(Ws), np.zeros_like(bs), np.zeros_like(Ws), np.zeros_like(bs)
    v, K3, cb3, gv = r(2, 2, 3, 4, 2), r(2, 2, 3, 3, 3), r(2), r(2, 2, 3, 4, 2)
    cd3 = REF.conv3d_deriv(v, K3, cb3, 0)
    out = {
        "dense_forward_deriv": (bk.dense_forward_deriv(x, W, b, h, 0, True),
                                REF.dense_forward_deriv(x, W, b, h, 0, True)),
        "dense_vjp": (bk.dense_vjp(g, d, x, W, h, True), REF.dense_vjp(g, d, x, W, h, True)),
        "dense_sweeps": ((U, D, bk.dense_sweep_backward(U, D, Ws, h, g, gW, gb), gW, gb),
                         (Ur, Dr, REF.dense_sweep_backward(Ur, Dr, Ws, h, g, gWr, gbr), gWr,
                          gbr)),
        "dense_batched": ((bk.dense_forward_batched([x, g], Ws, bs, [2, 0], h, 0, True),
                           bk.dense_vjp_input_batched([g], [d], Ws, [1], h)),
                          (REF.dense_forward_batched([x, g], Ws, bs, [2, 0], h, 0, True),
                           REF.dense_vjp_input_batched([g], [d], Ws, [1], h))),
        "conv_forward_deriv": (bk.conv_forward_deriv(u, K, cb, h, 1, True),
                               REF.conv_forward_deriv(u, K, cb, h, 1, True)),
        "conv_vjp": (bk.conv_vjp(gu, cd, u, K, h, True), REF.conv_vjp(gu, cd, u, K, h, True)),
        "conv3d": ((bk.conv3d_forward_deriv(v, K3, cb3, h, 0, True),
                    bk.conv3d_vjp(gv, cd3, v, K3, h, True)),
                   (REF.conv3d_forward_deriv(v, K3, cb3, h, 0, True),
                    REF.conv3d_vjp(gv, cd3, v, K3, h, True))),
        "conv_batched": ((bk.conv_forward_batched([u], K[None], cb[None], [0], h, 0, False)[0],
                          bk.conv_vjp_input_batched([gu], [cd], K[None], [0], h)),
                         (REF.conv_forward_batched([u], K[None], cb[None], [0], h, 0, False)[0],
                          REF.conv_vjp_input_batched([gu], [cd], K[None], [0], h))),
        "dense_params_batched": (_params_batched(bk, "dense", [g], [d], [x], Ws, bs, h),
                                 _params_batched(REF, "dense", [g], [d], [x], Ws, bs, h)),
        "conv_params_batched": (_params_batched(bk, "conv", [gu], [cd], [u], K[None], cb[None], h),
                                _params_batched(REF, "conv", [gu], [cd], [u], K[None], cb[None],
                                                h)),
        "fas_vectors": (_fas(bk, [x, g], [g, x], [d, d]), _fas(None, [x, g], [g, x], [d, d])),
        "avgpool": ((bk.avgpool_forward(u, 2), bk.avgpool_vjp(gu[:, :, :2, :2].copy(), 4, 4)),
                    (REF.avgpool_forward(u, 2), REF.avgpool_vjp(gu[:, :, :2, :2], 4, 4))),
        "softmax_xent": (bk.softmax_xent(logits, y), REF.softmax_xent(logits, y)),
        "stacked": (_stacked(bk, dt, B, w), _stacked(REF, dt, B, w)),
        "stacked_grads": (_stacked_grads(bk, dt, B, w), _stacked_grads(REF, dt, B, w)),
        "bn": (bn_chain(bk, dt, B, w), bn_chain(REF, dt, B, w)),
        "recurrent": (recurrent_chain(bk, dt, B, w), recurrent_chain(REF, dt, B, w)),
        "dropout_mask": (bk.dropout_mask(2**40 + 3, 2, 5, 2**31 + 1, B, w, 2**23),
                         counter_rng.dropout_mask(2**40 + 3, 2, 5, 2**31 + 1, B, w, 2**23)),
    }
    return out


def _stacked(bk, dt, B, w):
    """Every stacked-state kernel of ``bk`` once (both kinds, G given/None, modes 0 and 1, a
    negative layer step) on fixed inputs: [U, R, norms] per kind."""
    rng = np.random.default_rng(5)
    r = lambda *s: rng.standard_normal(s).astype(dt)  # noqa: E731
    h, chains, out = np.dtype(dt).type(0.3), np.array([[1, 2], [4, 1]]), []
    for kind, state, P, X in (("dense", (B, w), r(4, w, w) * 0.5, r(4, w)),
                              ("conv", (2, 3, 4, 4), r(4, 3, 3, 3, 3) * 0.3, r(4, 3))):
        U, G, R, D = r(5, *state), r(5, *state), r(2, *state), np.abs(r(4, *state))
        f = lambda name: getattr(bk, f"{kind}_{name}")  # noqa: E731
        f("chains_forward")(U, G, P, X, chains, -1, 1, h, 0)
        f("chains_adjoint")(U, None, P, D, 0, chains, 4, -1, h)
        norms = [f("points_forward")(U, G, R, P, X, [2, 4], [0, 1], -1, 1, h, 0, 0),
                 f("points_adjoint")(U, None, R, P, D, 0, [3, 1], [1, 0], 4, -1, h, 1)]
        out += [U, R, norms]
    return out


def _stacked_grads(bk, dt, B, w):
    """The stacked gradient kernels of ``bk`` once per kind (an adjoint store read backwards):
    [D, gW, gb] per kind."""
    rng = np.random.default_rng(6)
    r = lambda *s: rng.standard_normal(s).astype(dt)  # noqa: E731
    out = []
    for kind, state, P in (("dense", (B, w), r(4, w, w) * 0.5),
                           ("conv", (2, 3, 4, 4), r(4, 3, 3, 3, 3) * 0.3)):
        U, L, b = r(5, *state), r(5, *state), r(4, state[1])
        D, gW, gb = np.zeros((3,) + state, dt), np.zeros_like(P), np.zeros_like(b)
        getattr(bk, f"{kind}_deriv_stacked")(U, 1, 3, P, b, 1, 0, D)
        getattr(bk, f"{kind}_vjp_params_stacked")(L, 4, -1, D, U, 0, 3, 1, dt.type(0.3), gW, gb)
        out += [D, gW, gb]
    return out


def _params_batched(bk, kind, gys, derivs, xs, W, b, h):
    """(derivs, gW, gb) of the batched deriv + parameter-gradient kernels (layer 0 of W, b)."""
    ds = getattr(bk, f"{kind}_deriv_batched")(xs, W, b, [0] * len(xs), 1)
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    getattr(bk, f"{kind}_vjp_params_batched")(gys, derivs, xs, [0] * len(xs), h, gW, gb)
    return ds, gW, gb


def _fas(bk, xs, ys, zs):
    """The batched FAS vector kernels (bk) or their point-by-point reference (None)."""
    if bk is None:
        rs = [(x - y) + z for x, y, z in zip(xs, ys, zs)]
        total = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in rs)
        return (rs, np.float64(total), [(x + y) - z for x, y, z in zip(xs, ys, zs)],
                [x + (y - z) for x, y, z in zip(xs, ys, zs)], [x + y for x, y in zip(xs, ys)])
    rs, total = bk.residual_batched(xs, ys, zs)
    return (rs, total, bk.combine_batched(0, None, xs, ys, zs),
            bk.combine_batched(1, None, xs, ys, zs), bk.combine_batched(2, None, xs, ys))


def _flatten(a):
    if isinstance(a, (tuple, list)):
        return [z for v in a for z in _flatten(v)]
    return [a]


def _compare(results, dt):
    for name, (got, want) in results.items():
        got, want = _flatten(got), _flatten(want)
        assert len(got) == len(want), name
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(np.asarray(a, dtype=dt), np.asarray(b), dt, f"{name}[{i}]")


@pytest.mark.parametrize("geometry, dtype", [("emulation", "float32"), ("emulation", "float64"),
                                             ("gpu", "float32")])
def test_every_kernel_runs_under_host_emulation(geometry, dtype, rng):
    """Every kernel template of every .cu file is launched (tiny tiles, and the real GPU tile
    sizes with 256-thread blocks) and matches the reference; outputs are poisoned with NaN. The
    GPU geometry runs in float32 only (~80 s per dtype on a 2-core VM: 256 OS threads per
    emulated block); the tile arithmetic does not depend on the dtype, and the double
    instantiations at that geometry are compiled by the nvcc and NVRTC checks above."""
    geo = EMULATION_GEOMETRY if geometry == "emulation" else dict(GPU_GEOMETRY, MAX_GRID=4)
    bk = RawBackend(EmulationLauncher(list(KERNEL_FILES), KERNEL_FILES, geo), "cuda-emulated")
    bk.poison_outputs = True
    seen = set()
    launch = bk.launcher.launch
    bk.launcher.launch = lambda name, *a: (seen.add(name), launch(name, *a))
    B, w = (9, 10) if geometry == "emulation" else (70, 67)  # several blocks either way
    _compare(_exercise(bk, rng, np.dtype(dtype), B, w), np.dtype(dtype))
    bk.gemm_min_width = w  # the wide-layer path: cuBLAS stand-in GEMMs + epilogue kernels
    bk.kgrad_split = 7  # and conv kernel gradients summed over several splits, the last ragged
    _compare(_exercise(bk, rng, np.dtype(dtype), B, w), np.dtype(dtype))
    assert seen == ALL_KERNELS  # the epilogue kernels ran: the second pass took the wide path


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_conv_gemm_tiles_seams_and_splits_under_emulation(dtype, rng, monkeypatch):
    """The implicit-GEMM conv kernels where channels span several tiles and neither channels,
    positions nor the kernel gradient's splits divide evenly (tiny emulation tiles: 8 x 8, depth
    4): 2D Ci 11 -> Co 10 on odd images, B = 1, and 3D Ci 9 -> Co 10, against the reference."""
    dt = np.dtype(dtype)
    bk = RawBackend(EmulationLauncher(list(KERNEL_FILES), KERNEL_FILES), "cuda-emulated")
    bk.poison_outputs = True
    bk.kgrad_split = 13
    r = lambda *s: rng.standard_normal(s).astype(dt)  # noqa: E731
    h = dt.type(0.3)
    for B, Ci, Co, H, W in ((2, 11, 10, 5, 3), (1, 10, 10, 3, 7)):
        x, K, b, gy = r(B, Ci, H, W), r(Co, Ci, 3, 3) * 0.3, r(Co), r(B, Co, H, W)
        d = REF.conv_deriv(x, K, b, 0)
        name = f"conv B{B} {Ci}->{Co} {H}x{W}"
        for got, want in zip(bk.conv_forward_deriv(x, K, b, h, 0, Ci == Co),
                             REF.conv_forward_deriv(x, K, b, h, 0, Ci == Co)):
            assert_close(got, want, dt, name + " forward")
        for got, want in zip(bk.conv_vjp(gy, d, x, K, h, Ci == Co),
                             REF.conv_vjp(gy, d, x, K, h, Ci == Co)):
            assert_close(got, want, dt, name + " vjp")
    # the partials' cap (2 of them): 2 splits of 15 positions instead of 13, 13 and 4
    monkeypatch.setattr(raw.base, "KGRAD_PART_MAX", 2 * 10 * 11 * 9)  # where it is read
    launches = []
    real = bk.launcher.launch
    bk.launcher.launch = lambda name, dt, grid, *a: (launches.append((name, grid)),
                                                     real(name, dt, grid, *a))
    x, K, gy = r(1, 11, 5, 6), r(10, 11, 3, 3) * 0.3, r(1, 10, 5, 6)
    d = REF.conv_deriv(x, K, b, 2)
    for got, want in zip(bk.conv_vjp_params(gy, d, x, h), REF.conv_vjp_params(gy, d, x, h)):
        assert_close(got, want, dt, "conv kernel gradient, capped partials")
    assert launches[0] == ("conv_kernel_grad", (2 * 13, 2, 1))  # 2 splits x 13 tiles of 99
    bk.launcher.launch = real
    with pytest.raises(ValueError, match="kgrad_split=0"):
        bk.kgrad_split = 0
        bk.conv_vjp_params(gy, d, x, h)
    bk.kgrad_split = 13
    v, K3, b3, gv = r(2, 9, 3, 4, 3), r(10, 9, 3, 3, 3) * 0.2, r(10), r(2, 10, 3, 4, 3)
    d3 = REF.conv3d_deriv(v, K3, b3, 1)
    for got, want in zip(bk.conv3d_forward_deriv(v, K3, b3, h, 1, False),
                         REF.conv3d_forward_deriv(v, K3, b3, h, 1, False)):
        assert_close(got, want, dt, "conv3d forward")
    for got, want in zip(bk.conv3d_vjp(gv, d3, v, K3, h, False),
                         REF.conv3d_vjp(gv, d3, v, K3, h, False)):
        assert_close(got, want, dt, "conv3d vjp")


def test_poisoned_outputs_catch_an_unwritten_element(rng):
    """The poison makes a kernel that skips work fail the comparison."""
    bk = RawBackend(EmulationLauncher(list(KERNEL_FILES), KERNEL_FILES), "cuda-emulated")
    bk.poison_outputs = True
    x = rng.standard_normal((9, 10))
    W, b = rng.standard_normal((10, 10)), rng.standard_normal(10)
    real = bk.launcher.launch

    def first_block_only(name, dtype, grid, block, args):
        real(name, dtype, (1, 1, 1), block, args)

    bk.launcher.launch = first_block_only
    y = bk.dense_forward(x, W, b, 0.5, 0, True)
    assert np.isnan(y).any()
    with pytest.raises(AssertionError):
        assert_close(y, REF.dense_forward(x, W, b, 0.5, 0, True), "float64")


def test_emulation_build_is_cached_and_warning_free(tmp_path, monkeypatch):
    monkeypatch.setenv("MGNN_CACHE_DIR", str(tmp_path))
    from mgnn.backend import host_emulation
    host_emulation.build_library(list(KERNEL_FILES), KERNEL_FILES, EMULATION_GEOMETRY)
    libs = list((tmp_path / "host_emulation").glob("*.so"))
    assert len(libs) == 1
    mtime = libs[0].stat().st_mtime_ns
    host_emulation.build_library(list(KERNEL_FILES), KERNEL_FILES, EMULATION_GEOMETRY)
    assert libs[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_cuda_backend_without_gpu_is_a_clear_error():
    from mgnn.backend import BackendUnavailableError
    if gpu_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BackendUnavailableError, match="cuda-emulated"):
        get_backend("cuda")
    with pytest.raises(ValueError, match="'cuda'"):
        get_backend("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU (cupy.cuda.is_available())")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_kernel_on_the_gpu(dtype, rng):
    """The GPU twin of the emulation test: CuPy arrays, RawModule launches, same tolerances."""
    import cupy
    bk = get_backend("cuda")
    bk.poison_outputs = True

    class Host:
        """Calls the GPU backend with host arrays: uploads, runs, downloads."""

        def __getattr__(self, name):
            fn = getattr(bk, name)

            def call(*args):
                dev = [_to_dev(a) for a in args]
                out = fn(*dev)
                for a, d in zip(args, dev):  # in-place outputs (sweeps) back to the host
                    if isinstance(a, np.ndarray) and isinstance(d, cupy.ndarray):
                        a[...] = cupy.asnumpy(d)
                return _to_host(out)
            return call

    def _to_dev(a):
        if isinstance(a, np.ndarray):
            return cupy.asarray(a)
        if isinstance(a, list):
            return [_to_dev(v) for v in a]
        return a

    def _to_host(a):
        if isinstance(a, (tuple, list)):
            return type(a)(_to_host(v) for v in a)
        return cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a

    _compare(_exercise(Host(), rng, np.dtype(dtype), 70, 67), np.dtype(dtype))
