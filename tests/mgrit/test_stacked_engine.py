"""The stacked-state engine (one array per level, whole sweeps per propagator call) against the
list engine and the XBraid reference cases, through a propagator whose stacked methods are plain
loops over its ``step`` (so any difference is the engine's orchestration, not a kernel's)."""
import tracemalloc

import numpy as np
import pytest

from mgnn import MGRITOptions, MGRITSolver
from mgnn.backend import vector_ops
from tests.mgrit.test_solver import CASES, TanhResNet, _case


class Stacked:
    """``prop``'s steps through the stacked protocol (advance / points), in the list engine's
    arithmetic order; records every call."""

    stacked = True

    def __init__(self, prop):
        self.prop, self.calls = prop, []

    def step(self, u, start, stop, level):
        return self.prop.step(u, start, stop, level)

    def _phi(self, U, i, origin, stride, level):
        return self.prop.step(U[i - 1].copy(), origin + (i - 1) * stride, origin + i * stride,
                              level)

    def advance(self, U, G, chains, origin, stride, level):
        self.calls.append(("advance", level, len(chains)))
        for first, length in chains:
            for i in range(first, first + length):
                v = self._phi(U, i, origin, stride, level)
                U[i] = v if G is None else v + G[i]

    def points(self, U, G, R, slots, out_slots, origin, stride, level, mode):
        self.calls.append(("points", level, len(slots)))
        r2 = 0.0
        for i, o in zip(slots, out_slots):
            phi = self._phi(U, i, origin, stride, level)
            if mode == 0:
                r = phi - U[i]
                if G is not None:
                    r += G[i]
                R[o] = r
                flat = r.reshape(-1)
                r2 += float(np.vdot(flat, flat).real)
            elif mode == 1:
                R[o] += U[i]
                R[o] -= phi
            else:
                R[o] = phi if G is None else phi + G[i]
        return r2


@pytest.mark.skipif(not CASES, reason="../shared/reference/mgrit is not on this machine")
@pytest.mark.parametrize("path", CASES[:12], ids=lambda p: p.rsplit("/", 1)[-1])
def test_reference_cases_through_stacked_storage(path):
    d, opts, prop, n, u0 = _case(path)
    solver = MGRITSolver(Stacked(prop), n, opts)
    res = solver.solve(u0)
    assert solver.engine.stacked
    ref = d["xbraid"]
    assert res.iterations == ref["iterations"]
    np.testing.assert_allclose(res.residuals, ref["rnorms"], rtol=0, atol=1e-13)
    np.testing.assert_allclose(res.final, ref["final_state"], rtol=0, atol=1e-13)


@pytest.mark.parametrize("levels, cf, nrelax, skip, cycle", [
    (2, 2, 1, False, "V"), (3, 4, [0, 1], True, "V"), (4, 2, [0, 1, 2], True, "F"),
    (3, 3, 0, False, "F"), (1, 2, 0, False, "V")])
def test_stacked_equals_list_engine_bit_for_bit(levels, cf, nrelax, skip, cycle, rng):
    n = 57
    W, b = rng.standard_normal((n, 4, 4)) * 0.6, rng.standard_normal((n, 4))
    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax, tol=0.0, max_iter=3,
                        skip_downcycle=skip, cycle=cycle)
    u0 = rng.standard_normal(4)
    plain = MGRITSolver(TanhResNet(W, b, 1 / n), n, opts).solve(u0)
    prop = Stacked(TanhResNet(W, b, 1 / n))
    solver = MGRITSolver(prop, n, opts)
    stacked = solver.solve(u0, initial_guess=lambda c: u0 * 0)
    np.testing.assert_array_equal(stacked.residuals, plain.residuals)
    for a, c in zip(stacked.states, plain.states):
        np.testing.assert_array_equal(a, c)
    if levels > 1:  # one call per sweep: an F-relaxation is one advance of all its intervals
        assert ("advance", 0, -(-n // cf)) in prop.calls
    else:  # sequential stepping: one chain of n steps
        assert prop.calls == [("advance", 0, 1)]


class InPlace:
    """u_{i} = tanh(u_{i-1}) written straight into the stores, as mgnn's kernels do."""

    stacked = True

    def step(self, u, start, stop, level):
        return np.tanh(u)

    def advance(self, U, G, chains, origin, stride, level):
        for first, length in chains:
            for i in range(first, first + length):
                np.tanh(U[i - 1], out=U[i])
                if G is not None:
                    U[i] += G[i]

    def points(self, U, G, R, slots, out_slots, origin, stride, level, mode):
        for i, o in zip(slots, out_slots):
            np.tanh(U[i - 1], out=R[o])
        return 0.0


@pytest.mark.parametrize("reuse", [True, False])
def test_no_state_storage_allocated_inside_solves(reuse, rng):
    """With ``reuse_states`` the stores are allocated by the first solve only: the peak memory
    of later solves stays far below one level-0 store ((N + 2) states); without it every solve
    allocates a new level-0 store (its results stay valid). With the numba vector operations
    (NumPy's strided in-place add would buffer through the heap)."""
    n, u0 = 64, rng.standard_normal(512)
    solver = MGRITSolver(InPlace(), n, MGRITOptions(cf=4, max_levels=3, tol=0.0, max_iter=2),
                         reuse_states=reuse, ops=vector_ops("numba"))
    solver.solve(u0)
    tracemalloc.start()
    for _ in range(3):
        res = solver.solve(u0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    store = (n + 2) * u0.nbytes
    assert res.states[n] is not None
    assert (peak < store // 4) if reuse else (peak > store)


def test_results_survive_the_next_solve_unless_reused(rng):
    n = 16
    prop = Stacked(TanhResNet(rng.standard_normal((n, 3, 3)), rng.standard_normal((n, 3)), 0.1))
    opts = MGRITOptions(cf=2, max_levels=2, tol=0.0, max_iter=1)
    solver = MGRITSolver(prop, n, opts)
    first = solver.solve(np.ones(3))
    kept = first.final.copy()
    solver.solve(np.full(3, 5.0))
    np.testing.assert_array_equal(first.final, kept)


def test_coarsest_option_errors():
    prop = TanhResNet(np.zeros((8, 2, 2)), np.zeros((8, 2)), 0.1)
    with pytest.raises(ValueError, match="coarsest must be"):
        MGRITSolver(prop, 8, MGRITOptions(cf=2, max_levels=2), coarsest="fast")
    with pytest.raises(ValueError, match=r"coarse_replica\(level\)"):
        MGRITSolver(prop, 8, MGRITOptions(cf=2, max_levels=2), coarsest="redundant")


def test_sequential_solve_on_a_reused_store_reads_no_stale_point(rng):
    """A sequential solve (max_levels=1) leaves its C-points unzeroed (every point is written
    before it is read): on a reused store holding another solve's states -- poisoned with NaN
    here -- it still equals a fresh solve's stepping, point for point."""
    n = 13
    prop = Stacked(TanhResNet(rng.standard_normal((n, 3, 3)), rng.standard_normal((n, 3)), 0.1))
    solver = MGRITSolver(prop, n, MGRITOptions(cf=2, max_levels=1), reuse_states=True)
    solver.solve(np.ones(3))
    solver._states[2:] = np.nan
    u0 = np.full(3, -0.5)
    res = solver.solve(u0)
    fresh = MGRITSolver(prop, n, MGRITOptions(cf=2, max_levels=1)).solve(u0)
    for a, b in zip(res.states, fresh.states):
        np.testing.assert_array_equal(a, b)
    u = u0
    for k in range(n):  # and the plain recursion
        u = prop.step(u, k, k + 1, 0)
        np.testing.assert_array_equal(res.states[k + 1], u)
