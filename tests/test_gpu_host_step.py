"""The host side of a GPU training step (issue 11): the MGRIT step through the RawKernel backend
reads no device pointer and allocates nothing after its first step (counting launcher), reuses
the caller's gradient buffer (``loss_and_grad(..., out=)``), and gives the same results as the
list path it replaces. The counting launcher computes nothing, so these steps run unguarded
(``guard=None``): a guard check would compare zeros, and its buffers are allocated at the first
check by design (docs/design.md, the gradient guard)."""
import numpy as np
import pytest

import mgnn
import mgnn.network
from mgnn.backend.cupy_raw import RawBackend
from mgnn.studies.bench import CountingLauncher, bench_gpu_launches, format_gpu_launches
from mgnn.mgrit import MGRITOptions

FWD = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0)
BWD = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0)


def _model(kind, dtype="float64", n_layers=12):
    if kind == "dense":
        return mgnn.dense_resnet(5, 6, 3, n_layers, t_final=1.5, seed=2, dtype=dtype), (7, 5)
    return mgnn.conv_resnet(1, 2, (4, 4), 3, n_layers, t_final=1.5, seed=2, dtype=dtype), \
        (3, 1, 4, 4)


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_second_mgrit_step_allocates_nothing_and_reads_no_pointer(kind, rng):
    launcher = CountingLauncher()
    m, xshape = _model(kind, "float32")
    lp = mgnn.LayerParallel(m, FWD, BWD, backend=RawBackend(launcher, "counting"), guard=None)
    x, y = rng.standard_normal(xshape).astype(np.float32), rng.integers(0, 3, xshape[0])
    grads = m.params.zeros_like()
    assert lp.loss_and_grad(x, y, out=grads)[1] is grads
    launcher.allocations = launcher.pointers = 0
    launcher.launches.clear()
    assert lp.loss_and_grad(x, y, out=grads)[1] is grads
    assert launcher.allocations == 0 and launcher.pointers == 0
    assert launcher.launches[f"{kind}_deriv_stacked"] == 1
    assert launcher.launches["bias_grad_stacked"] == 1
    lp.loss_and_grad(x, y)  # without out: the new gradient buffer is the one allocation
    assert launcher.allocations == 1


def test_wide_layer_step_runs_gemms_and_epilogues_allocation_free(rng):
    """Dense layers at or above gemm_min_width: each stacked launch becomes a cuBLAS GEMM
    (counted as 'gemm') plus an epilogue kernel; the fused GEMM kernels do not run, and the
    second step still allocates nothing and reads no pointer."""
    launcher = CountingLauncher()
    m, xshape = _model("dense", "float32")
    bk = RawBackend(launcher, "counting")
    bk.gemm_min_width = 6
    lp = mgnn.LayerParallel(m, FWD, BWD, backend=bk, guard=None)
    x, y = rng.standard_normal(xshape).astype(np.float32), rng.integers(0, 3, xshape[0])
    grads = m.params.zeros_like()
    lp.loss_and_grad(x, y, out=grads)
    launcher.allocations = launcher.pointers = 0
    launcher.launches.clear()
    lp.loss_and_grad(x, y, out=grads)
    counts = launcher.launches
    assert launcher.allocations == 0 and launcher.pointers == 0
    for fused in ("dense_stacked_forward", "dense_stacked_adjoint", "dense_deriv_stacked",
                  "dense_weight_grad_stacked"):
        assert counts[fused] == 0, fused
    epilogues = (counts["dense_stacked_forward_epilogue"] + counts["dense_stacked_adjoint_epilogue"]
                 + counts["dense_bias_act"])
    assert epilogues > 0 and counts["gemm"] == epilogues + 1  # + the weight gradients
    assert counts["stacked_product"] == counts["dense_stacked_adjoint_epilogue"] + 1


def test_bench_reports_host_time_and_counts(rng):
    results = bench_gpu_launches(n_layers=32, width=8, batch=4, repeats=1)
    graphs, mgrit, serial = results
    assert mgrit["allocations"] == 0 and mgrit["pointers"] == 0
    assert graphs["allocations"] == 0 and graphs["pointers"] == 0
    assert mgrit["host_seconds"] > 0 and serial["host_seconds"] > 0
    text = format_gpu_launches(results)
    assert "host ms" in text and "host time MGRIT / serial" in text and "busy ms" in text
    assert all(r["busy_seconds"] <= r["host_seconds"] for r in results)


def test_counting_launcher_counts_every_allocator():
    c = CountingLauncher()
    a = c.empty((2, 3), np.dtype("float32"))
    for arr in (a, c.zeros(3, dtype=np.int32), c.ones((2,)), c.full((2,), 3.0, np.float32),
                c.zeros_like(a), c.empty_like(a), c.ones_like(a)):
        assert not arr.any()
    assert a.dtype == np.float32 and c.full((1,), 1, np.float32).dtype == np.float32
    assert c.allocations == 8 and c.ptr(a) == a.__array_interface__["data"][0]


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_stacked_gradients_equal_the_list_path_bitwise(kind, rng, monkeypatch):
    """numba, float64: the stacked sigma' / parameter gradients run the single kernels' code."""
    m, xshape = _model(kind)
    x, y = rng.standard_normal(xshape), rng.integers(0, 3, xshape[0])
    loss, g = mgnn.LayerParallel(m, FWD, BWD, backend="numba").loss_and_grad(x, y)
    monkeypatch.setattr(mgnn.network, "_has_stacked_grads", lambda bk: False)
    loss0, g0 = mgnn.LayerParallel(m, FWD, BWD, backend="numba").loss_and_grad(x, y)
    assert loss == loss0
    for k in g0:
        np.testing.assert_array_equal(g[k], g0[k], err_msg=k)


@pytest.mark.parametrize("mgrit", [True, False])
def test_out_is_filled_and_returned(mgrit, rng):
    m, xshape = _model("dense")
    lp = mgnn.LayerParallel(m, *((FWD, BWD) if mgrit else (None, None)), backend="numba")
    x, y = rng.standard_normal(xshape), rng.integers(0, 3, xshape[0])
    loss0, g0 = lp.loss_and_grad(x, y)
    out = m.params.zeros_like()
    out.flat[:] = np.nan  # every entry must be overwritten
    loss, g = lp.loss_and_grad(x, y, out=out)
    assert g is out and loss == loss0
    np.testing.assert_array_equal(out.flat, g0.flat)


def test_bad_out_is_a_clear_error(rng):
    m, xshape = _model("dense")
    lp = mgnn.LayerParallel(m, FWD, BWD, backend="numba")
    x, y = rng.standard_normal(xshape), rng.integers(0, 3, xshape[0])
    with pytest.raises(TypeError, match="out must be a ParamDict"):
        lp.loss_and_grad(x, y, out=m.params.flat.copy())
    other = mgnn.dense_resnet(5, 6, 3, 8, dtype="float64").params
    with pytest.raises(ValueError, match="out has parameters"):
        lp.loss_and_grad(x, y, out=other)
    f32 = mgnn.dense_resnet(5, 6, 3, 12, dtype="float32").params
    with pytest.raises(TypeError, match="out holds ndarray float32"):
        lp.loss_and_grad(x, y, out=f32)
    with pytest.raises(ValueError, match="out is model.params itself"):
        lp.loss_and_grad(x, y, out=m.params)


def test_emulated_steps_reuse_buffers_without_aliasing(rng):
    """Two MGRIT steps on different batches through the GPU kernels (host emulation, workspace
    buffers reused by the second step) each equal the numba backend."""
    m, xshape = _model("dense", n_layers=8)
    lp_ref = mgnn.LayerParallel(m, FWD, BWD, backend="numba")
    lp = mgnn.LayerParallel(m, FWD, BWD, backend="cuda-emulated")
    out = m.params.zeros_like()
    for _ in range(2):
        x, y = rng.standard_normal(xshape), rng.integers(0, 3, xshape[0])
        loss0, g0 = lp_ref.loss_and_grad(x, y)
        loss, g = lp.loss_and_grad(x, y, out=out)
        assert abs(loss - loss0) <= 1e-10 * abs(loss0)
        np.testing.assert_allclose(g.flat, g0.flat, rtol=1e-10,
                                   atol=1e-10 * np.abs(g0.flat).max())


def test_graphs_are_recaptured_when_the_backend_scratch_moves(rng):
    """A graph reads the backend's norm scratch at a fixed address: a batch that grows the
    scratch (reallocating it) makes the solver capture new graphs for the old batch size too."""
    launcher = CountingLauncher()
    m, xshape = _model("dense", "float32")
    lp = mgnn.LayerParallel(m, FWD, BWD, backend=RawBackend(launcher, "counting"), guard=None)
    y = rng.integers(0, 3, 64)
    for B in (4, 4, 4, 64, 4, 4):
        lp.loss_and_grad(rng.standard_normal((B, 5)).astype(np.float32), y[:B])
    keys = {k[-1][-1] for s in lp._solvers.values() for k in s._graphs}  # buffer generations
    assert len(keys) >= 2
    assert launcher.launches["graph"] > 0
