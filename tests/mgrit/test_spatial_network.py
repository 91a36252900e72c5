"""LayerParallel with spatial coarsening (spatial_levels): exact at convergence, the adjoint
uses the transposes of the forward's coarse-grid operators, clear errors."""
import numpy as np
import pytest

import mgnn
from mgnn import LayerParallel, MGRITOptions
from mgnn.backend import activation_code, get_backend, grid_transfer
from mgnn.network import SpatialAdjointPropagator, SpatialForwardPropagator


def _converged(cf=2, levels=3, iters=60):
    return MGRITOptions(cf=cf, max_levels=levels, tol=1e-13, max_iter=iters,
                        warn_not_converged=False)


def _max_rel(g, ref):
    return max(float(np.abs(g[k] - ref[k]).max() / max(np.abs(ref[k]).max(), 1e-300))
               for k in ref.keys())


@pytest.mark.parametrize("size, spatial, interp, restrict", [
    ((15, 15), (0,), "linear", "full"), ((16, 16), (0, 1), "nearest", "full"),
    ((16, 15), (0,), "linear", "injection"), ((14, 12), (1,), "nearest", "injection")])
def test_converged_solves_equal_serial_backprop_2d(size, spatial, interp, restrict):
    m = mgnn.conv_resnet(1, 3, size, 5, 16, seed=1)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((3, 1) + size), np.array([0, 2, 4])
    loss, ref = LayerParallel(m, backend="numpy").loss_and_grad(x, y)
    lp = LayerParallel(m, fwd=_converged(), bwd=_converged(), backend="numpy",
                       spatial_levels=spatial, interp=interp, restrict=restrict)
    l2, g = lp.loss_and_grad(x, y)
    assert lp.stats["forward"]["converged"] and lp.stats["adjoint"]["converged"]
    assert abs(l2 - loss) <= 1e-12 * abs(loss)
    assert _max_rel(g, ref) < 1e-10


def test_coarse_steps_run_on_coarse_images():
    m = mgnn.conv_resnet(1, 2, (15, 15), 3, 8, seed=0)
    seen = set()
    fp = SpatialForwardPropagator(m, get_backend("numpy"), spatial_levels=(0, 1))
    step = fp.step

    def recording(u, start, stop, level):
        seen.add((level, u.shape[2:]))
        return step(u, start, stop, level)

    def wrap(name):  # the stacked relaxation: stores (slots, B, C, *spatial)
        inner = getattr(fp, name)

        def recorded(U, *args):
            seen.add((args[-1] if name == "advance" else args[-2], U.shape[3:]))
            return inner(U, *args)
        setattr(fp, name, recorded)

    fp.step = recording
    wrap("advance")
    wrap("points")
    from mgnn import MGRITSolver
    solver = MGRITSolver(fp, 8, MGRITOptions(cf=2, max_levels=3, max_iter=1, tol=0.0,
                                             warn_not_converged=False))
    solver.solve(np.ones((2, 2, 15, 15)))
    assert seen == {(0, (15, 15)), (1, (7, 7)), (2, (3, 3))}
    assert solver.engine.stacked  # the stacked relaxation ran on the coarse stores


@pytest.mark.parametrize("size, interp, restrict", [
    ((7, 7), "linear", "full"), ((8, 6), "nearest", "full"), ((7, 8), "linear", "injection")])
def test_adjoint_coarse_chain_is_the_transpose_of_the_forward_one(size, interp, restrict):
    """With linear steps (identity activation, zero bias), two coarse forward steps through the
    coarse grid, P Phi_c Phi_c R, and the adjoint propagator's counterpart, R^T Psi_c Psi_c P^T
    (its restrict, steps on level 1 and interpolate), are transposes: <C a, b> = <a, C^T b>."""
    N = 8
    m = mgnn.conv_resnet(1, 3, size, 3, N, seed=2)
    m.step.act = activation_code("identity")  # linear steps: the transpose is exact
    m.params["steps.bias"][...] = 0
    bk = get_backend("numpy")
    fp = SpatialForwardPropagator(m, bk, spatial_levels=(0,), interp=interp, restrict=restrict)
    ap = SpatialAdjointPropagator(m, None, None, bk, spatial_levels=(0,), interp=interp,
                                  restrict=restrict)
    rng = np.random.default_rng(3)
    shape = (2, 3) + size
    ap.reset([rng.standard_normal(shape) for _ in range(N + 1)], [None] * N)
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    # forward: fine index 2 -> 6 on level 1 (layers 2 and 4 with step 2h), restricted/interpolated
    v = fp.restrict(a, 0)
    v = fp.step(fp.step(v, 2, 4, 1), 4, 6, 1)
    Ca = fp.interpolate(v, 0)
    # adjoint: reversed index N - 6 -> N - 2 (the same layers, transposed, in reverse order)
    w = ap.restrict(b, 0)
    w = ap.step(ap.step(w, N - 6, N - 4, 1), N - 4, N - 2, 1)
    Ctb = ap.interpolate(w, 0)
    lhs, rhs = float(np.vdot(Ca, b)), float(np.vdot(a, Ctb))
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0)
    # the coarse adjoint is linearised at the restricted forward state
    np.testing.assert_array_equal(ap._coarse_cache(4, 1)[0],
                                  grid_transfer.restrict(ap.U[4], interp, restrict))
    # and the transfer pairs themselves
    assert abs(np.vdot(fp.restrict(a, 0), w) - np.vdot(a, ap.interpolate(w, 0))) < 1e-12 * (
        1 + abs(np.vdot(a, ap.interpolate(w, 0))))


def test_spatial_coarsening_bad_input_is_clear():
    m = mgnn.conv_resnet(1, 2, (3, 3), 3, 8)
    o = MGRITOptions(cf=2, max_levels=3)
    with pytest.raises(ValueError, match=r"image size \(3, 3\) cannot be coarsened 2 times"):
        LayerParallel(m, fwd=o, bwd=o, spatial_levels=(0, 1))  # 3 -> 1 -> 0
    with pytest.raises(ValueError, match="interp must be one of"):
        LayerParallel(m, fwd=o, bwd=o, spatial_levels=(0,), interp="cubic")
    with pytest.raises(ValueError, match="restrict must be one of"):
        LayerParallel(m, fwd=o, bwd=o, spatial_levels=(0,), restrict="average")
    with pytest.raises(ValueError, match=r"spatial_levels \[2\] do not exist in the fwd"):
        LayerParallel(m, fwd=o, bwd=o, spatial_levels=(2,))
    with pytest.raises(TypeError, match="spatial_levels must be a tuple of ints"):
        LayerParallel(m, fwd=o, bwd=o, spatial_levels="0")
    dense = mgnn.dense_resnet(4, 4, 3, 8)
    with pytest.raises(ValueError, match="needs a conv model"):
        LayerParallel(dense, fwd=o, bwd=o, spatial_levels=(0,))
