"""Interval-batched relaxation: one propagator call advances every F-interval of a rank by one
step; results equal point-by-point relaxation, and a sweep costs cf calls instead of N."""
import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions, MGRITSolver
from tests.mgrit.test_solver import TanhResNet


class Batched(TanhResNet):
    """TanhResNet with step_batch; records the size and level of every call."""

    batched = True

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def step(self, u, start, stop, level):
        self.calls.append((level, 1))
        return super().step(u, start, stop, level)

    def step_batch(self, us, starts, stops, level):
        assert len({b - a for a, b in zip(starts, stops)}) == 1  # one level, one step size
        self.calls.append((level, len(us)))
        return [TanhResNet.step(self, u, a, b, level) for u, a, b in zip(us, starts, stops)]


class BatchedFused(Batched):
    """Batched with the right-hand side added by step_batch (one call instead of two)."""

    fused_rhs = True

    def step_batch(self, us, starts, stops, level, rhs=None):
        out = super().step_batch(us, starts, stops, level)
        return out if rhs is None else [v + g for v, g in zip(out, rhs)]


def _resnet(rng, n, w=3):
    return (rng.standard_normal((n, w, w)) * 0.6, rng.standard_normal((n, w)), 1.0 / n)


@pytest.mark.parametrize("levels, cf, nrelax, skip, cycle", [
    (2, 2, 1, False, "V"), (3, 4, [0, 1], False, "V"), (4, 2, [0, 1, 2], True, "F"),
    (3, 3, 0, True, "V")])
def test_batched_solve_equals_pointwise(levels, cf, nrelax, skip, cycle, rng):
    n = 73
    args = _resnet(rng, n)
    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax, tol=0.0, max_iter=3,
                        skip_downcycle=skip, cycle=cycle)
    u0 = rng.standard_normal(3)
    plain = MGRITSolver(TanhResNet(*args), n, opts).solve(u0)
    for cls in (Batched, BatchedFused):
        prop = cls(*args)
        batched = MGRITSolver(prop, n, opts).solve(u0)
        assert max(size for _, size in prop.calls) > 1  # batching really happened
        np.testing.assert_array_equal(batched.residuals, plain.residuals)
        for a, b in zip(batched.states, plain.states):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cf", [2, 4, 8])
def test_f_relaxation_sweep_costs_cf_minus_one_calls(cf, rng):
    n = 16 * cf
    prop = Batched(*_resnet(rng, n))
    solver = MGRITSolver(prop, n, MGRITOptions(cf=cf, max_levels=2))
    U = [None] + [rng.standard_normal(3) for _ in range(n + 1)] + [None]  # slot j + 1: point j
    solver._template = U[1]
    solver._engine_for(U[1])
    solver._f_relax(U, None, 0)
    assert prop.calls == [(0, n // cf)] * (cf - 1)  # cf - 1 waves of all 16 intervals
    prop.calls.clear()
    solver._c_relax(U, None, 0)
    assert prop.calls == [(0, n // cf)]  # every C-point at once


def _models(kind, n):
    if kind == "dense":
        return mgnn.dense_resnet(5, 6, 3, n, t_final=1.5, seed=2), (4, 5)
    return mgnn.conv_resnet(1, 2, (4, 4), 3, n, t_final=1.5, seed=2), (3, 1, 4, 4)


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_network_batched_and_stacked_equal_unbatched(kind, rng, monkeypatch):
    """LayerParallel on the numba backend: the list engine point by point, the list engine with
    batching forced on (bit-identical: batching reorders independent steps only) and the stacked
    engine (one array per level, one kernel call per sweep; equal to round-off) give the same
    inexact (2/1 cycles) loss and gradients."""
    from mgnn import propagators
    from mgnn.backend import numba_cpu
    m, xshape = _models(kind, 24)
    x, y = rng.standard_normal(xshape), rng.integers(0, 3, xshape[0])
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0)
    stacked = mgnn.LayerParallel(m, fwd, bwd, backend="numba")
    loss_s, g_s = stacked.loss_and_grad(x, y)
    assert stacked._solver("forward", fwd).engine.stacked
    monkeypatch.setattr(propagators, "_has_stacked", lambda bk: False)
    loss0, g0 = mgnn.LayerParallel(m, fwd, bwd, backend="numba").loss_and_grad(x, y)
    monkeypatch.setattr(numba_cpu, "batched_relaxation", True)
    lp = mgnn.LayerParallel(m, fwd, bwd, backend="numba")
    loss, g = lp.loss_and_grad(x, y)
    for kind_, opts in (("forward", fwd), ("adjoint", bwd)):
        engine = lp._solver(kind_, opts).engine
        assert engine.batched and not engine.stacked
    assert loss == loss0
    assert abs(loss_s - loss0) <= 1e-13 * abs(loss0)
    for k in g0:
        np.testing.assert_array_equal(g[k], g0[k], err_msg=k)
        np.testing.assert_allclose(g_s[k], g0[k], rtol=1e-11, atol=1e-13, err_msg=k)


@pytest.mark.parametrize("size, spatial", [((8, 8), (0,)), ((7, 7), (0, 1))])
def test_spatial_stacked_forward_equals_the_list_engine(size, spatial, rng, monkeypatch):
    """With spatial coarsening the forward solve keeps the stacked engine (per-level stores of
    the coarse shapes); at a fixed cycle budget (2/1 cycles: a wrong coarse correction would
    show) it equals the list engine to round-off, loss, gradients and residuals; batched waves
    on every level equal the list engine exactly."""
    from mgnn import propagators
    m = mgnn.conv_resnet(1, 2, size, 3, 8, seed=3)
    x, y = rng.standard_normal((3, 1) + size), rng.integers(0, 3, 3)
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0, warn_not_converged=False)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0, warn_not_converged=False)
    stacked = mgnn.LayerParallel(m, fwd, bwd, backend="numba", spatial_levels=spatial)
    loss_s, g_s = stacked.loss_and_grad(x, y)
    assert stacked._solver("forward", fwd).engine.stacked
    monkeypatch.setattr(propagators, "_has_stacked", lambda bk: False)
    listed = mgnn.LayerParallel(m, fwd, bwd, backend="numba", spatial_levels=spatial)
    loss0, g0 = listed.loss_and_grad(x, y)
    assert not listed._solver("forward", fwd).engine.stacked
    assert abs(loss_s - loss0) <= 1e-13 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(g_s[k], g0[k], rtol=1e-11, atol=1e-13, err_msg=k)
    for part in ("forward", "adjoint"):
        np.testing.assert_allclose(stacked.stats[part]["residuals"],
                                   listed.stats[part]["residuals"], rtol=1e-12)
    # batched waves (the GPU's relaxation), forward and adjoint, coarse levels included:
    # bit-identical to the list engine step by step (batching reorders independent steps only)
    from mgnn.backend import numba_cpu
    monkeypatch.setattr(numba_cpu, "batched_relaxation", True)
    batched = mgnn.LayerParallel(m, fwd, bwd, backend="numba", spatial_levels=spatial)
    loss_b, g_b = batched.loss_and_grad(x, y)
    for part, opts in (("forward", fwd), ("adjoint", bwd)):
        assert batched._solver(part, opts).engine.batched
    assert loss_b == loss0
    for k in g0:
        np.testing.assert_array_equal(g_b[k], g0[k], err_msg=k)


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_emulated_gpu_training_step_equals_numba(kind, rng):
    """The whole MGRIT training step through the GPU kernels and their stacked launches (host
    emulation) equals the numba backend: float64 rtol 1e-10."""
    from mgnn.backend import get_backend
    m, xshape = _models(kind, 12)
    x, y = rng.standard_normal(xshape), rng.integers(0, 3, xshape[0])
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0)
    loss0, g0 = mgnn.LayerParallel(m, fwd, bwd, backend="numba").loss_and_grad(x, y)
    bk = get_backend("cuda-emulated")
    seen = []
    launch = bk.launcher.launch
    bk.launcher.launch = lambda name, *a: (seen.append(name), launch(name, *a))
    try:
        loss, g = mgnn.LayerParallel(m, fwd, bwd, backend="cuda-emulated").loss_and_grad(x, y)
    finally:
        bk.launcher.launch = launch
    assert f"{kind}_stacked_forward" in seen and f"{kind}_stacked_adjoint" in seen
    assert abs(loss - loss0) <= 1e-10 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(g[k], g0[k], rtol=1e-10, atol=1e-10 * np.abs(g0[k]).max(),
                                   err_msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_training_step_equals_numba(kind, dtype, rng):
    """The GPU twin of the emulated test: CuPy arrays end to end (parameters moved to the
    device, inputs given as CuPy arrays), float64 rtol 1e-10, float32 1e-4 (MGRIT sums)."""
    from mgnn.backend import gpu_available, to_host
    if not gpu_available():
        pytest.skip("needs a CUDA GPU (cupy.cuda.is_available())")
    import cupy
    xshape = _models(kind, 12)[1]
    m_cpu = (mgnn.dense_resnet(5, 6, 3, 12, t_final=1.5, seed=2, dtype=dtype) if kind == "dense"
             else mgnn.conv_resnet(1, 2, (4, 4), 3, 12, t_final=1.5, seed=2, dtype=dtype))
    m_gpu = (mgnn.dense_resnet(5, 6, 3, 12, t_final=1.5, seed=2, dtype=dtype) if kind == "dense"
             else mgnn.conv_resnet(1, 2, (4, 4), 3, 12, t_final=1.5, seed=2, dtype=dtype))
    x = rng.standard_normal(xshape).astype(dtype)
    y = rng.integers(0, 3, xshape[0])
    fwd = MGRITOptions(cf=2, max_levels=3, max_iter=2, tol=0.0)
    bwd = MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0)
    loss0, g0 = mgnn.LayerParallel(m_cpu, fwd, bwd, backend="numba").loss_and_grad(x, y)
    lp = mgnn.LayerParallel(m_gpu, fwd, bwd, backend="cuda")
    assert isinstance(m_gpu.params.flat, cupy.ndarray)
    loss, g = lp.loss_and_grad(cupy.asarray(x), cupy.asarray(y))
    assert isinstance(g.flat, cupy.ndarray)
    rtol = 1e-10 if dtype == "float64" else 1e-4
    assert abs(loss - loss0) <= rtol * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(to_host(g[k]), g0[k], rtol=rtol,
                                   atol=rtol * np.abs(g0[k]).max(), err_msg=k)
