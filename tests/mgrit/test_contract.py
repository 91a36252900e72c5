"""The propagator contract of MGRITSolver (its docstring): in-place steppers give the right
answer on every level, every step's output is checked (shape, dtype, array kind, None) in serial
solves as in distributed ones, `converged` and the not-converged warning, NumPy integer sizes,
tolerances meaningless for the dtype."""
import dataclasses
import re
import warnings

import numpy as np
import pytest

import mgnn
from mgnn.mgrit import MGRITOptions, MGRITSolver
from mgnn.mgrit.solver import NotConvergedWarning

CONFIGS = [(1, 2, 0, False, "V"), (2, 2, 1, False, "V"), (3, 3, [0, 1], True, "V"),
           (4, 2, 0, False, "F"), (3, 2, 1, True, "F")]


class Tanh:
    """u + (stop-start) h tanh(W_start u + b_start), a new array every step."""

    def __init__(self, n, w=3, seed=0):
        rng = np.random.default_rng(seed)
        self.W, self.b = rng.standard_normal((n, w, w)) * 0.6, rng.standard_normal((n, w))
        self.h = 1.0 / n

    def step(self, u, start, stop, level):
        return u + (stop - start) * self.h * np.tanh(u @ self.W[start].T + self.b[start])


class InPlaceTanh(Tanh):
    """The same step written HPC style: ``u += ...; return u``."""

    def step(self, u, start, stop, level):
        u += (stop - start) * self.h * np.tanh(u @ self.W[start].T + self.b[start])
        return u


class InPlaceBatched(InPlaceTanh):
    """Interval-batched, in place, with the right-hand side added in place too."""

    batched, fused_rhs = True, True

    def step_batch(self, us, starts, stops, level, rhs=None):
        for p, (u, a, b) in enumerate(zip(us, starts, stops)):
            self.step(u, a, b, level)
            if rhs is not None:
                u += rhs[p]
        return us


class Scale:
    """u *= a (the issue's example); ``a`` depends on the level's step size."""

    def step(self, u, start, stop, level):
        u *= 1 - 0.3 * (stop - start) / 8
        return u


class Reference(Scale):
    def step(self, u, start, stop, level):
        return (1 - 0.3 * (stop - start) / 8) * u


def _opts(levels, cf, nrelax, skip, cycle, **kw):
    kw.setdefault("tol", 0.0)
    kw.setdefault("max_iter", 3)
    return MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax, skip_downcycle=skip, cycle=cycle,
                        min_coarse=2, **kw)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("inplace, reference", [(InPlaceTanh, Tanh), (InPlaceBatched, Tanh),
                                                (Scale, Reference)])
def test_in_place_steppers_equal_out_of_place(config, inplace, reference, rng):
    n = 37
    opts = _opts(*config)
    u0 = rng.standard_normal(3)
    guesses = {c: rng.standard_normal(3) for c in range(0, n + 1)}
    kept = {c: g.copy() for c, g in guesses.items()}
    args = (n,) if reference is Tanh else ()
    want = MGRITSolver(reference(*args), n, opts).solve(u0.copy(), guesses.__getitem__)
    u0_before = u0.copy()
    got = MGRITSolver(inplace(*args), n, opts).solve(u0, guesses.__getitem__)
    np.testing.assert_array_equal(got.residuals, want.residuals)
    assert got.iterations == want.iterations
    for a, b in zip(got.states, want.states):
        np.testing.assert_array_equal(a, b)
    assert len({id(s) for s in got.states}) == n + 1  # no two states alias
    np.testing.assert_array_equal(u0, u0_before)  # the caller's arrays are never stepped
    for c, g in guesses.items():
        np.testing.assert_array_equal(g, kept[c])


class Recording(Tanh):
    def step(self, u, start, stop, level):
        self.seen.append(u)
        return super().step(u, start, stop, level)


class FreshRecording(Recording):
    fresh_outputs = True


def test_only_the_fresh_outputs_path_steps_the_solvers_own_arrays(rng):
    """fresh_outputs: step gets the solver's arrays (no copy); otherwise private copies."""
    for cls, own in ((FreshRecording, True), (Recording, False)):
        prop = cls(16)
        prop.seen = []
        res = MGRITSolver(prop, 16, _opts(2, 2, 0, False, "V", max_iter=1)).solve(
            rng.standard_normal(3))
        held = {id(s) for s in res.states}
        assert any(id(u) in held for u in prop.seen) == own


def test_broken_promises_are_errors(rng):
    class LyingFresh(InPlaceTanh):
        fresh_outputs = True

    with pytest.raises(TypeError, match=r"returned the u it was given.*fresh_outputs"):
        MGRITSolver(LyingFresh(8), 8, _opts(2, 2, 0, False, "V")).solve(rng.standard_normal(3))

    class ReusedBuffer(Tanh):
        """Writes every result into one buffer it keeps (the solver would alias every state)."""

        def step(self, u, start, stop, level):
            if not hasattr(self, "buf"):
                self.buf = np.empty_like(u)
            self.buf[...] = super().step(u, start, stop, level)
            return self.buf

    with pytest.raises(TypeError, match=r"step\(u, 1, 2, level=0\).*fine index 1.*reused"):
        MGRITSolver(ReusedBuffer(8), 8, _opts(1, 2, 0, False, "V")).solve(rng.standard_normal(3))


class BadAt(Tanh):
    """Returns ``bad(u)`` instead of the state on one level only."""

    def __init__(self, n, level, bad, batched=False):
        super().__init__(n)
        self.level, self.bad, self.batched = level, bad, batched

    def step(self, u, start, stop, level):
        out = super().step(u, start, stop, level)
        return self.bad(out) if level == self.level else out

    def step_batch(self, us, starts, stops, level):
        return [self.step(u, a, b, level) for u, a, b in zip(us, starts, stops)]


class NotAnArray:
    """Has the shape and dtype of a state but is no NumPy array (another array library)."""

    def __init__(self, a):
        self.shape, self.dtype = a.shape, a.dtype


BAD = {"None": (lambda u: None, r"returned None"),
       "shape": (lambda u: u[:2], r"shape \(2,\)"),
       "dtype": (lambda u: u.astype(np.float32), r"dtype float32"),
       "list": (lambda u: list(u), r"builtins list"),
       "kind": (NotAnArray, r"tests NotAnArray")}


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("batched", [False, True])
def test_serial_solves_check_every_step_output_on_every_level(level, bad, batched, rng):
    fn, msg = BAD[bad]
    prop = BadAt(32, level, fn, batched)
    solver = MGRITSolver(prop, 32, _opts(4, 2, 1, False, "V"))
    with pytest.raises(TypeError, match=rf"BadAt\.step(_batch)?\(u, \d+, \d+, level={level}\) "
                                        rf"{msg if bad == 'None' else 'returned .*' + msg}"
                                        r".*but u0 is numpy ndarray of shape \(3,\) and dtype "
                                        r"float64: every state must match u0"):
        solver.solve(rng.standard_normal(3))


def test_step_batch_must_return_one_state_per_input(rng):
    class Short(Tanh):
        batched = True

        def step_batch(self, us, starts, stops, level):
            return [self.step(u, a, b, level) for u, a, b in zip(us, starts, stops)][:-1]

    with pytest.raises(TypeError, match=r"step_batch.*level=0\) returned .* list of one state"):
        MGRITSolver(Short(16), 16, _opts(2, 2, 0, False, "V")).solve(rng.standard_normal(3))


def _caught(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, [x for x in w if issubclass(x.category, NotConvergedWarning)]


def test_converged_and_the_not_converged_warning(rng):
    u0 = rng.standard_normal(3)
    def solve(skip=False, **kw):
        return MGRITSolver(Tanh(32), 32, _opts(3, 2, 1, skip, "V", **kw)).solve(u0)

    res, w = _caught(lambda: solve(tol=1e-12, max_iter=30))
    assert res.converged and res.residuals[-1] < 1e-12 and res.tol == 1e-12 and not w
    res, w = _caught(lambda: solve(tol=1e-12, max_iter=2))
    assert not res.converged and res.iterations == 2 and len(w) == 1
    assert "tol=1e-12 in max_iter=2 cycles" in str(w[0].message)
    assert w[0].filename == __file__  # points at the caller of solve (here: solve() above)
    res, w = _caught(lambda: solve(tol=1e-12, max_iter=2, warn_not_converged=False))
    assert not res.converged and not w
    res, w = _caught(lambda: solve(tol=0.0, max_iter=2))  # a fixed budget: nothing to warn of
    assert not res.converged and not w
    res, w = _caught(lambda: solve(True, tol=1e-3, max_iter=1))  # cascadic only: no residual
    assert not res.converged and res.residuals == [] and len(w) == 1
    res = MGRITSolver(Tanh(32), 32, MGRITOptions(max_levels=1)).solve(u0)
    assert res.converged  # sequential stepping is exact
    assert mgnn.DivergenceError is mgnn.mgrit.DivergenceError
    with pytest.raises(TypeError, match="warn_not_converged"):
        MGRITOptions(warn_not_converged=1)


def test_n_steps_accepts_numpy_integers(rng):
    u0 = rng.standard_normal(3)
    want = MGRITSolver(Tanh(24), 24, _opts(3, 2, 1, False, "V")).solve(u0)
    from mgnn.mgrit.partition import Partition
    for n in (np.int64(24), np.int32(24), np.uint16(24)):
        solver = MGRITSolver(Tanh(24), n, _opts(3, 2, 1, False, "V"),
                             partition=Partition(n, (0,), (0,)))
        assert type(solver.n_steps) is int and solver.sizes == [24, 12, 6]
        assert type(solver.partition.n_steps) is int
        np.testing.assert_array_equal(solver.solve(u0).final, want.final)
    with pytest.raises(ValueError, match="Partition n_steps must be an int >= 1, got 24.0"):
        Partition(24.0, (0,), (0,))
    for bad in (24.0, True, np.float64(24), "24", 0, np.int64(-1)):
        msg = re.escape(f"n_steps must be an int >= 1, got {bad!r}")
        with pytest.raises(ValueError, match=msg):
            MGRITSolver(Tanh(24), bad, _opts(3, 2, 1, False, "V"))


def test_tolerance_adapted_or_rejected_for_the_dtype(rng):
    u0 = rng.standard_normal(3).astype(np.float32)
    prop = Scale()
    res = MGRITSolver(prop, 16, MGRITOptions(max_iter=30)).solve(u0)
    eps32 = float(np.finfo(np.float32).eps)
    assert res.tol == pytest.approx(1000 * eps32) and res.converged  # default adapted
    assert MGRITSolver(prop, 16).solve(u0.astype(np.float64)).tol == 1e-10
    with pytest.raises(ValueError, match=r"tol=1e-10 is below what float32 states resolve "
                                         r"\(10 eps = 1.2e-06\)"):
        MGRITSolver(prop, 16, MGRITOptions(tol=1e-10)).solve(u0)
    assert MGRITSolver(prop, 16, MGRITOptions(tol=0.0, max_iter=2)).solve(u0).tol == 0.0
    opts = MGRITOptions(tol=1e-14)
    assert opts.for_dtype(np.float64) is opts and opts.for_dtype(np.int64) is opts
    with pytest.raises(ValueError, match="complex64"):
        opts.for_dtype(np.complex64)
    assert MGRITOptions().for_dtype("float32").tol == pytest.approx(1000 * eps32)
    assert dataclasses.replace(MGRITOptions(), cf=4).for_dtype("float32").tol > 1e-4
