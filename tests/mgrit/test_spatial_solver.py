"""The solver with spatial coarsening (propagator.restrict / interpolate): per-level state
shapes, XBraid's FAS with restricted residuals and interpolated corrections."""
import numpy as np
import pytest

from mgnn import MGRITOptions, MGRITSolver
from tests.mgrit.spatial_cases import StackedStencil, Stencil, serial, two_level_reference


def _opts(**kw):
    base = dict(cf=4, max_levels=2, tol=0.0, max_iter=6, warn_not_converged=False)
    base.update(kw)
    return MGRITOptions(**base)


@pytest.mark.parametrize("n", [15, 16])
def test_two_level_history_equals_the_reference_written_from_the_definitions(n):
    N, cf = 32, 4
    prop = Stencil(N).shapes(n, 2)
    u0 = np.random.default_rng(1).standard_normal((3, n))
    hist, states = two_level_reference(prop, u0, N, cf, 5)
    res = MGRITSolver(prop, N, _opts(cf=cf, max_iter=5)).solve(u0)
    np.testing.assert_allclose(res.residuals, hist, rtol=1e-12, atol=0)
    for j in range(N + 1):
        np.testing.assert_allclose(res.states[j], states[j], rtol=1e-12, atol=1e-14)
    assert hist[-1] < 1e-2 * hist[0]  # spatial coarsening still converges here


@pytest.mark.parametrize("levels, cf, cycle, spatial", [
    (3, 2, "V", (0,)), (3, 2, "F", (0, 1)), (4, 2, "V", (0, 2)), (3, 4, "V", (1,))])
@pytest.mark.parametrize("kind", [Stencil, StackedStencil])
def test_converged_solve_equals_the_serial_sweep(levels, cf, cycle, spatial, kind):
    N, n = 64, 31
    prop = kind(N, spatial).shapes(n, levels)
    u0 = np.random.default_rng(2).standard_normal((2, n))
    ref = serial(prop, u0, N)
    res = MGRITSolver(prop, N, _opts(cf=cf, max_levels=levels, cycle=cycle, tol=1e-11,
                                     max_iter=60, min_coarse=2)).solve(u0)
    assert res.converged
    for j in range(N + 1):
        np.testing.assert_allclose(res.states[j], ref[j], rtol=1e-10, atol=1e-10)
    assert prop.calls["restrict"] > 0 and prop.calls["interpolate"] > 0


def test_coarse_levels_really_hold_smaller_states():
    N = 16
    seen = {}

    class Recording(Stencil):
        def step(self, u, start, stop, level):
            seen.setdefault(level, set()).add(u.shape)
            return super().step(u, start, stop, level)

    prop = Recording(N, (0, 1)).shapes(31, 3)
    MGRITSolver(prop, N, _opts(cf=2, max_levels=3, max_iter=2)).solve(np.ones((2, 31)))
    assert seen == {0: {(2, 31)}, 1: {(2, 15)}, 2: {(2, 7)}}


def test_without_restrict_and_interpolate_nothing_changes():
    """A propagator with only one of the two methods is an ordinary one (same history as with
    neither)."""
    N = 32

    class Plain(Stencil):
        restrict = None

    plain = Plain(N, ()).shapes(9, 2)
    u0 = np.random.default_rng(3).standard_normal((2, 9))
    a = MGRITSolver(plain, N, _opts()).solve(u0)
    # identity restriction/interpolation: the same arithmetic as injection
    ident = Stencil(N, ()).shapes(9, 2)
    b = MGRITSolver(ident, N, _opts()).solve(u0)
    np.testing.assert_allclose(a.residuals, b.residuals, rtol=1e-13)
    assert plain.calls["interpolate"] == 0 and ident.calls["interpolate"] > 0


def test_bad_restrict_output_is_a_type_error_naming_the_call():
    N = 16

    class BadDtype(Stencil):
        def restrict(self, u, level):
            return super().restrict(u, level).astype(np.float32)

    prop = BadDtype(N).shapes(15, 2)
    with pytest.raises(TypeError, match=r"BadDtype\.restrict\(u, level=0\) returned numpy "
                                        r"ndarray of shape \(2, 7\) and dtype float32"):
        MGRITSolver(prop, N, _opts()).solve(np.ones((2, 15)))

    class BadShape(Stencil):
        calls_ = 0

        def restrict(self, u, level):
            BadShape.calls_ += 1
            out = super().restrict(u, level)
            return out if BadShape.calls_ == 1 else out[:, :-1]  # the template, then wrong

    prop = BadShape(N).shapes(15, 2)
    with pytest.raises(TypeError, match=r"restrict\(u, level=0\) returned .* shape \(2, 6\).*"
                                        r"level-1 state"):
        MGRITSolver(prop, N, _opts()).solve(np.ones((2, 15)))


def test_stacked_engine_equals_list_engine_cycle_by_cycle():
    N, n = 40, 16
    u0 = np.random.default_rng(4).standard_normal((2, n))
    opts = _opts(cf=2, max_levels=3, max_iter=4, cycle="F")
    a = MGRITSolver(Stencil(N, (0, 1)).shapes(n, 3), N, opts).solve(u0)
    solver = MGRITSolver(StackedStencil(N, (0, 1)).shapes(n, 3), N, opts)
    b = solver.solve(u0)
    assert solver.engine.stacked
    np.testing.assert_allclose(b.residuals, a.residuals, rtol=1e-13)
    for j in range(N + 1):
        np.testing.assert_allclose(b.states[j], a.states[j], rtol=1e-13, atol=1e-15)
