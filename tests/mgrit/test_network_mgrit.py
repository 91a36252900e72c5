"""MGRIT behind LayerParallel: converged solves equal serial backpropagation, the inexact regime,
warm start, the work model, the DKPS two-level bound, and option errors."""
import math

import numpy as np
import pytest

import mgnn
from mgnn import MGRITOptions, MGRITSolver
from mgnn.mgrit import cycle_work, level_sizes
from tests.mgrit.test_solver import Dahlquist


def _model(kind, n, dtype="float64"):
    if kind == "dense":
        return mgnn.dense_resnet(5, 4, 3, n, t_final=1.5, seed=1, dtype=dtype)
    return mgnn.conv_resnet(1, 2, (4, 4), 3, n, t_final=1.5, seed=1, dtype=dtype)


def _data(kind, rng, batch=4):
    x = rng.standard_normal((batch, 5) if kind == "dense" else (batch, 1, 4, 4))
    return x, rng.integers(0, 3, batch)


@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("levels, cf, n", [(2, 2, 17), (3, 2, 23), (4, 2, 37), (2, 4, 21),
                                           (3, 4, 70)])
def test_converged_mgrit_equals_serial_backprop(kind, levels, cf, n, rng):
    if kind == "conv" and n > 30:
        n = n // 2 + 1  # keep the conv reference cheap; still uneven
    m = _model(kind, n)
    x, y = _data(kind, rng)
    serial = mgnn.LayerParallel(m, backend="numpy")
    loss0, g0 = serial.loss_and_grad(x, y)
    assert len(level_sizes(n, cf, levels, 2)) == levels  # every case really has `levels` levels
    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=[0, 1], tol=1e-13, max_iter=80)
    lp = mgnn.LayerParallel(m, fwd=opts, bwd=opts, backend="numba")
    loss, g = lp.loss_and_grad(x, y)
    assert lp.stats["forward"]["residuals"][-1] < 1e-13
    assert lp.stats["adjoint"]["residuals"][-1] < 1e-13
    assert abs(loss - loss0) <= 1e-10 * abs(loss0)
    for k in g0:
        np.testing.assert_allclose(g[k], g0[k], rtol=1e-10, atol=1e-10 * np.abs(g0[k]).max(),
                                   err_msg=k)


def test_states_and_adjoints_equal_serial(rng):
    """The converged forward states and adjoints themselves (not only the gradients)."""
    from mgnn.backend import get_backend
    from mgnn.network import AdjointPropagator, ForwardPropagator
    m = _model("dense", 29)
    bk = get_backend("numba")
    u0 = rng.standard_normal((3, 4))
    opts = MGRITOptions(cf=4, max_levels=3, nrelax=1, tol=1e-13, max_iter=60, min_coarse=1)
    fw = MGRITSolver(ForwardPropagator(m, bk), 29, opts).solve(u0)
    lp = mgnn.LayerParallel(m, backend="numpy")
    U, D = lp._serial_states(u0, store=True)
    for a, b in zip(fw.states, U):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    lamN = rng.standard_normal((3, 4))
    adj = MGRITSolver(AdjointPropagator(m, U, D, bk), 29, opts).solve(lamN)
    lam = lamN
    st = m.group("steps")
    for n in range(28, -1, -1):
        lam = m.step.vjp_state(st["weight"][n], st["bias"][n], U[n], m.h, lam, bk)
        np.testing.assert_allclose(adj.states[29 - n], lam, rtol=1e-10, atol=1e-12)


def test_inexact_adjoint_improves_with_cycles(rng):
    """Exact forward, 1..4 adjoint cycles (3 levels, cf 2, F then FCF): the gradient error against
    serial backpropagation falls at every added cycle. Measured (N = 32, this seed): about
    9.8e-2, 1.9e-2, 1.4e-3, 8.7e-5 relative error (2-norm over all parameters); the test asserts
    each within a factor 2 of that, so a change in the adjoint solver's behaviour shows up."""
    m = _model("dense", 32)
    x, y = _data("dense", rng, batch=6)
    _, g0 = mgnn.LayerParallel(m, backend="numpy").loss_and_grad(x, y)
    errs = []
    for cycles in (1, 2, 3, 4):
        bwd = MGRITOptions(cf=2, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=cycles)
        _, g = mgnn.LayerParallel(m, bwd=bwd, backend="numba").loss_and_grad(x, y)
        errs.append(np.linalg.norm(g.flat - g0.flat) / np.linalg.norm(g0.flat))
    measured = [9.8e-2, 1.9e-2, 1.4e-3, 8.7e-5]
    assert all(b < 0.5 * a for a, b in zip(errs, errs[1:])), errs
    assert all(0.5 * m < e < 2 * m for e, m in zip(errs, measured)), errs


def test_warm_start_reuses_previous_states(rng):
    m = _model("dense", 32)
    x, y = _data("dense", rng)
    fwd = MGRITOptions(cf=2, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=1)
    cold = mgnn.LayerParallel(m, fwd=fwd, backend="numba")
    warm = mgnn.LayerParallel(m, fwd=fwd, backend="numba", warm_start=True)
    cold.loss_and_grad(x, y)
    warm.loss_and_grad(x, y)
    assert cold.stats["forward"]["residuals"] == warm.stats["forward"]["residuals"]
    cold.loss_and_grad(x, y)
    warm.loss_and_grad(x, y)  # same batch again: starts from the previous call's states
    r_cold, r_warm = cold.stats["forward"]["residuals"][0], warm.stats["forward"]["residuals"][0]
    assert r_warm < 0.3 * r_cold, (r_warm, r_cold)  # measured: 0.36 against 2.0
    warm.loss_and_grad(x, y)  # every call refines the same states once more
    assert warm.stats["forward"]["residuals"][0] < 0.3 * r_warm


@pytest.mark.parametrize("levels, cf, nrelax, skip", [(3, 4, [0, 1], False), (2, 2, 1, False),
                                                      (4, 2, [0, 1, 2], True), (1, 2, 0, False)])
@pytest.mark.parametrize("cycle", ["V", "F"])
def test_cycle_work_model_counts_every_step(levels, cf, nrelax, skip, cycle, rng):
    calls = []

    class Count(Dahlquist):
        def step(self, u, start, stop, level):
            calls.append(level)
            return super().step(u, start, stop, level)

    n = 67
    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax, tol=0.0, max_iter=3,
                        skip_downcycle=skip, cycle=cycle)
    MGRITSolver(Count(-1.0, 0.01, "BE"), n, opts).solve(np.array([1.0]))
    sizes = level_sizes(n, cf, levels, 2)
    if len(sizes) == 1:
        assert len(calls) == n
        return
    want = (cycle_work(sizes, cf, opts.nrelax_on, skip=skip, cycle=cycle)
            + 2 * cycle_work(sizes, cf, opts.nrelax_on, cycle=cycle) + sizes[0] - sizes[1])
    assert len(calls) == want


@pytest.mark.parametrize("lam", [-0.5, -2.0, -10.0, 1j * 3 - 1])
@pytest.mark.parametrize("cf", [2, 4, 8])
@pytest.mark.parametrize("nrelax", [0, 1])
def test_two_level_dkps_bound(lam, cf, nrelax):
    """||E|| (2-norm of the C-point error propagator of one two-level cycle) for y' = lam y with
    backward Euler obeys Dobrev-Kolev-Petersson-Schroder: |l^m - mu| (1 - |mu|^(Nc-1)) / (1 - |mu|)
    (times |l|^m for FCF), l and mu the fine and coarse amplification factors, m = cf."""
    n, h = 16 * cf, 0.05
    nc = n // cf
    prop = Dahlquist(lam, h, "BE")
    opts = MGRITOptions(cf=cf, max_levels=2, nrelax=nrelax, tol=0.0, max_iter=1, min_coarse=1)
    E = np.zeros((nc, nc), dtype=complex)
    for j in range(1, nc + 1):  # exact solution 0 (u0 = 0): the iterate is the error
        res = MGRITSolver(prop, n, opts).solve(
            np.zeros(1, complex), initial_guess=lambda i: np.ones(1, complex) * (i == cf * j))
        E[:, j - 1] = [res.states[cf * i][0] for i in range(1, nc + 1)]
    l_f = 1 / (1 - lam * h)
    mu = 1 / (1 - lam * cf * h)
    bound = abs(l_f ** cf - mu) * (1 - abs(mu) ** (nc - 1)) / (1 - abs(mu))
    if nrelax == 1:
        bound *= abs(l_f) ** cf
    norm = np.linalg.norm(E, 2)
    assert 0 < norm <= bound * (1 + 1e-12), (norm, bound)
    assert norm >= 0.6 * bound  # the bound is sharp here (measured ratios 0.67 .. 0.99)


def test_bad_network_options_name_the_value():
    m = _model("dense", 6)
    with pytest.raises(ValueError, match="n_steps=6"):
        mgnn.LayerParallel(m, fwd=MGRITOptions(cf=4, max_levels=3))
    with pytest.raises(TypeError, match="MGRITOptions"):
        mgnn.LayerParallel(m, fwd={"cf": 2})
    with pytest.raises(TypeError, match="warm_start"):
        mgnn.LayerParallel(m, warm_start="yes")


@pytest.mark.parametrize("levels, cf, nrelax", [(3, 4, [0, 1]), (2, 2, 1), (4, 2, [0, 1, 2])])
def test_critical_path_model(levels, cf, nrelax):
    """On one rank the critical path is all the work and no messages; more ranks shorten it but
    never below the sequential coarsest solve; the whole-solve path adds the final F-relaxation."""
    from mgnn.mgrit import cycle_critical_path, solve_critical_path
    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax)
    sizes = level_sizes(256, cf, levels, 2)
    work = cycle_work(sizes, cf, opts.nrelax_on)
    assert cycle_critical_path(sizes, opts.nrelax_on, 1) == (work, 0)
    previous = work
    for ranks in (2, 4, 8, 64):
        steps, msgs = cycle_critical_path(sizes, opts.nrelax_on, ranks)
        assert sizes[-1] <= steps < previous and msgs > 0
        previous = steps
    steps, _ = solve_critical_path(sizes, opts.nrelax_on, 1, cycles=2)
    assert steps == 2 * work + sizes[0] - sizes[1]
