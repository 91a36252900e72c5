"""mgnn's CuPy code paths on a fake ``cupy`` (tests/fakegpu/cupy): run by tests/test_fake_gpu.py
in a subprocess with this folder first on sys.path and NUMBA_ENABLE_CUDASIM=1. Not collected by
the outer pytest (the file name does not start with test_)."""
import numpy as np
import pytest

import cupy

if not getattr(cupy, "__version__", "").endswith("fake"):
    pytest.skip("needs the fake cupy of tests/fakegpu first on sys.path", allow_module_level=True)

import mgnn  # noqa: E402
from mgnn import MGRITOptions  # noqa: E402
from mgnn.backend import get_backend, numpy_ref as REF, to_host  # noqa: E402

# the training cases run the emulated kernels with tiny tiles (fast; several blocks even on tiny
# inputs); the first test keeps the real GPU geometry
import mgnn.backend as _backend  # noqa: E402
from mgnn.backend.cupy_raw import CupyLauncher, RawBackend  # noqa: E402
from mgnn.backend.host_emulation import EMULATION_GEOMETRY  # noqa: E402
from tests.test_device_inputs import DLPackOnly as _DLPackOnly  # noqa: E402

_backend._instances["cuda"] = RawBackend(CupyLauncher(EMULATION_GEOMETRY), "cuda")

FWD = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0)
BWD = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0)


def _model(kind, dtype="float64", n=8):
    if kind == "dense":
        return mgnn.dense_resnet(5, 4, 3, n, t_final=1.5, seed=4, dtype=dtype)
    return mgnn.conv_resnet(1, 2, (4, 4), 3, n, t_final=1.5, seed=4, dtype=dtype)


def _data(kind, rng, batch=4, dtype="float64"):
    shape = (batch, 5) if kind == "dense" else (batch, 1, 4, 4)
    return rng.standard_normal(shape).astype(dtype), rng.integers(0, 3, batch)


def test_backend_is_the_cupy_launcher_and_refuses_host_arrays(rng):
    assert get_backend("cuda").launcher.name == "cupy"
    bk = RawBackend(CupyLauncher(), "cuda")  # the GPU geometry: 256-thread blocks
    assert bk.xp is cupy
    x, W, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 4)), rng.standard_normal(4)
    with pytest.raises(TypeError, match="host numpy array"):
        bk.dense_forward(x, cupy.asarray(W), cupy.asarray(b), 0.5, 0, True)
    y = bk.dense_forward(cupy.asarray(x), cupy.asarray(W), cupy.asarray(b), 0.5, 0, True)
    assert isinstance(y, cupy.ndarray)
    np.testing.assert_allclose(y.get(), REF.dense_forward(x, W, b, 0.5, 0, True), rtol=1e-12)
    logits, labels = rng.standard_normal((4, 3)), rng.integers(0, 3, 4)
    loss, g = bk.softmax_xent(cupy.asarray(logits), cupy.asarray(labels))
    loss_r, g_r = REF.softmax_xent(logits, labels)
    assert abs(float(loss) - loss_r) <= 1e-12 * abs(loss_r)
    np.testing.assert_allclose(g.get(), g_r, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("inputs", ["numpy", "cupy", "dlpack-cpu", "dlpack-device"])
def test_layer_parallel_on_the_device_equals_numba(kind, inputs, rng):
    x, y = _data(kind, rng)
    loss0, g0 = mgnn.LayerParallel(_model(kind), FWD, BWD, backend="numba").loss_and_grad(x, y)
    m = _model(kind)
    lp = mgnn.LayerParallel(m, FWD, BWD, backend="cuda")
    assert isinstance(m.params.flat, cupy.ndarray)
    assert all(isinstance(v, cupy.ndarray) for v in m.params.values())
    xd = cupy.asarray(x)
    xi = {"numpy": x, "cupy": xd, "dlpack-cpu": _DLPackOnly(x),
          "dlpack-device": _DLPackOnly(xd)}[inputs]
    yi = cupy.asarray(y) if inputs in ("cupy", "dlpack-device") else y
    if inputs in ("cupy", "dlpack-device"):  # device inputs are used where they are, no copy
        assert np.shares_memory(lp.to_device(xi).view(np.ndarray), xd.view(np.ndarray))
    loss, g = lp.loss_and_grad(xi, yi)
    assert isinstance(loss, float) and isinstance(g.flat, cupy.ndarray)
    assert abs(loss - loss0) <= 1e-10 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(to_host(g[k]), g0[k], rtol=1e-10,
                                   atol=1e-10 * np.abs(g0[k]).max(), err_msg=k)
    pred = lp.predict(xi)
    assert isinstance(pred, cupy.ndarray)


@pytest.mark.parametrize("size, spatial, interp, restrict", [
    ((8, 8), (0,), "linear", "full"), ((7, 7), (0, 1), "nearest", "injection"),
    ((4, 4, 4), (0,), "linear", "full"), ((5, 4, 5), (0,), "nearest", "full")])
def test_spatial_coarsening_on_the_device_equals_numba(size, spatial, interp, restrict, rng):
    """MGRIT with spatial coarsening (2D fused conv steps, 3D composed ones; vertex- and
    cell-centred grids) keeps every state, transfer and coarse step on the device and equals
    the numba run."""
    def model():
        return mgnn.conv_resnet(1, 2, size, 3, 8, t_final=1.5, seed=4, dtype="float64")

    x, y = rng.standard_normal((3, 1) + size), rng.integers(0, 3, 3)
    kw = dict(spatial_levels=spatial, interp=interp, restrict=restrict)
    host = mgnn.LayerParallel(model(), FWD, BWD, backend="numba", **kw)
    loss0, g0 = host.loss_and_grad(x, y)
    m = model()
    lp = mgnn.LayerParallel(m, FWD, BWD, backend="cuda", **kw)
    loss, g = lp.loss_and_grad(cupy.asarray(x), cupy.asarray(y))
    assert isinstance(g.flat, cupy.ndarray)
    assert abs(loss - loss0) <= 1e-10 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(to_host(g[k]), g0[k], rtol=1e-10,
                                   atol=1e-10 * np.abs(g0[k]).max(), err_msg=k)
    for part in ("forward", "adjoint"):  # (a converged solve ends at round-off: absolute)
        want = host.stats[part]["residuals"]
        np.testing.assert_allclose(lp.stats[part]["residuals"], want, rtol=1e-10,
                                   atol=1e-12 * max(want, default=0.0))
    assert lp.stats["guard"]["action"] == host.stats["guard"]["action"]  # the same decision


def test_wide_layer_path_through_cublas_equals_numba(rng):
    """Every dense GEMM of the step as one cuBLAS strided-batched call on views of the stacked
    states (the fake cuBLAS computes cuBLAS's column-major pointer contract on host memory) plus
    mgnn's epilogue kernels (gemm_min_width 1): the numba step's loss and gradients, with no
    fallback to CuPy's copying matmul."""
    from cupy_backends.cuda.libs import cublas
    x, y = _data("dense", rng)
    loss0, g0 = mgnn.LayerParallel(_model("dense"), FWD, BWD, backend="numba").loss_and_grad(x, y)
    bk = RawBackend(CupyLauncher(EMULATION_GEOMETRY), "cuda")
    bk.gemm_min_width = 1
    matmul, used = cupy.matmul, []
    cupy.matmul = lambda *a, **k: used.append(1)  # must not be reached
    cublas.calls.clear()
    try:
        loss, g = mgnn.LayerParallel(_model("dense"), FWD, BWD, backend=bk).loss_and_grad(x, y)
    finally:
        cupy.matmul = matmul
    assert cublas.calls and not used
    assert abs(loss - loss0) <= 1e-10 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(to_host(g[k]), g0[k], rtol=1e-10,
                                   atol=1e-10 * np.abs(g0[k]).max(), err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cublas_gemm_views_strides_and_transposes(dtype, rng):
    """cublas_gemm against NumPy on every kind of operand view the wide path passes: spaced
    state runs, weights walked backwards (negative batch stride), one matrix broadcast to every
    problem (stride 0), both transposes; a non-contiguous matrix is refused (False)."""
    from mgnn.backend.cupy_raw import cublas_gemm, state_run
    tol = 1e-5 if dtype == "float32" else 1e-12
    X = cupy.asarray(rng.standard_normal((9, 5, 4)).astype(dtype))
    W = cupy.asarray(rng.standard_normal((9, 4, 4)).astype(dtype))
    host = lambda a: a.view(np.ndarray)  # noqa: E731
    for (xf, xs), (wf, ws) in [((1, 3), (2, 3)), ((8, -2), (7, -1)), ((3, 0), (4, 0)),
                               ((0, 1), (8, -4))]:
        A, B = state_run(X, xf, xs, 3, cupy), state_run(W, wf, ws, 3, cupy)
        for trans_b in (False, True):
            C = cupy.empty((3, 5, 4), dtype)
            assert cublas_gemm(A, B, C, trans_b=trans_b)
            want = host(A) @ (np.swapaxes(host(B), 1, 2) if trans_b else host(B))
            np.testing.assert_allclose(host(C), want, rtol=tol, atol=tol)
        G = cupy.empty((3, 4, 4), dtype)
        assert cublas_gemm(A, A, G, trans_a=True)
        np.testing.assert_allclose(host(G), np.swapaxes(host(A), 1, 2) @ host(A), rtol=tol,
                                   atol=tol)
    assert not cublas_gemm(X[:3, :, :2], W[:3, :2], cupy.empty((3, 5, 2), dtype))


def test_bad_device_input_is_a_clear_error(rng):
    lp = mgnn.LayerParallel(_model("dense"), FWD, BWD, backend="cuda")
    x, y = _data("dense", rng)
    bad = x.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        lp.loss_and_grad(cupy.asarray(bad), y)
    with pytest.raises(ValueError, match="out of range"):
        lp.loss_and_grad(cupy.asarray(x), cupy.asarray(y + 5))
    with pytest.raises(TypeError, match="dtype"):
        lp.loss_and_grad(cupy.asarray(x.astype(np.float32)), y)
    with pytest.raises(TypeError, match="list"):
        lp.loss_and_grad(x.tolist(), y)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fit_checkpoint_and_resume_on_the_device(optimizer, rng, tmp_path):
    """Training on the device (fused Numba CUDA optimizer updates under the simulator) gives
    the numba run's history; a device checkpoint restores into a fresh device model."""
    from mgnn.optim import make_optimizer
    from mgnn.train import fit, load_checkpoint, restore
    x, y = _data("dense", rng, batch=24)
    xt, yt = _data("dense", rng, batch=8)
    hist = {}
    for backend in ("numba", "cuda"):
        m = _model("dense")
        lp = mgnn.LayerParallel(m, FWD, BWD, backend=backend)
        opt = make_optimizer(optimizer, m.params.flat, 0.05, momentum=0.9, weight_decay=1e-3)
        assert opt.device == (backend == "cuda")
        ck = str(tmp_path / f"{backend}.npz")
        hist[backend] = fit(lp, opt, x, y, xt, yt, epochs=2, batch_size=8,
                            rng=np.random.default_rng(1), checkpoint=ck, progress=False)
    for a, b in zip(hist["numba"], hist["cuda"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(a["loss"])
        assert a["test_accuracy"] == b["test_accuracy"]
    fresh = _model("dense", n=8)
    lp = mgnn.LayerParallel(fresh, FWD, BWD, backend="cuda")
    opt = make_optimizer(optimizer, fresh.params.flat, 0.05, momentum=0.9)
    restore(load_checkpoint(str(tmp_path / "cuda.npz")), fresh, opt, np.random.default_rng(0))
    ref = load_checkpoint(str(tmp_path / "numba.npz"))
    for k, v in fresh.params.items():
        assert isinstance(v, cupy.ndarray)
        np.testing.assert_allclose(to_host(v), ref["params"][k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_optimizer_warm_up_changes_nothing(optimizer, rng):
    """warm_up() runs the device update on scratch copies: parameters, buffers and the step count
    stay as they were, and the next steps equal the NumPy optimizer's."""
    from mgnn.optim import SGD, Adam
    p0 = rng.standard_normal(37)
    make = (lambda p: SGD(p, lr=0.1, momentum=0.9)) if optimizer == "sgd" else \
        (lambda p: Adam(p, lr=0.01, weight_decay=0.1))
    ref, dev = make(p0.copy()), make(cupy.asarray(p0))
    before = {k: to_host(v) for k, v in dev.state_dict().items()}
    dev.warm_up()
    assert dev.t == 0 and np.array_equal(to_host(dev.params), p0)
    for k, v in dev.state_dict().items():
        np.testing.assert_array_equal(to_host(v), before[k], err_msg=k)
    for _ in range(2):
        g = rng.standard_normal(37)
        ref.step(g)
        dev.step(cupy.asarray(g))
    np.testing.assert_allclose(to_host(dev.params), ref.params, rtol=1e-13, atol=0)
