"""MGRIT solver: the shared reference cases (XBraid), exactness properties, option errors."""
import glob
import json
import math
import os

import numpy as np
import pytest

from mgnn.mgrit import DivergenceError, MGRITOptions, MGRITSolver, intervals, level_sizes
from tests.conftest import SHARED

REF = os.path.join(SHARED, "reference", "mgrit")
CASES = sorted(p for p in glob.glob(os.path.join(REF, "*.json")) if "ex01" not in p)


class Dahlquist:
    """y' = lam y: forward (FE) or backward (BE) Euler, rediscretised with dt = (stop-start) h."""

    def __init__(self, lam, h, method):
        self.lam, self.h, self.method = lam, h, method

    def step(self, u, start, stop, level):
        dt = (stop - start) * self.h
        return (1 + self.lam * dt) * u if self.method == "FE" else u / (1 - self.lam * dt)


class TanhResNet:
    """u + (stop-start) h tanh(W_start u + b_start) (column-vector convention of the npz)."""

    def __init__(self, W, b, h):
        self.W, self.b, self.h = W, b, h

    def step(self, u, start, stop, level):
        return u + (stop - start) * self.h * np.tanh(self.W[start] @ u + self.b[start])


def _case(path):
    d = json.load(open(path))
    p, o = d["problem"], d["xbraid"]["options"]
    opts = MGRITOptions(cf=o["cfactor"], max_levels=o["max_levels"], nrelax=o["nrelax"],
                        tol=o["abs_tol"], max_iter=o["max_iter"], skip_downcycle=bool(o["skip"]),
                        min_coarse=o["min_coarse"])
    if p["type"] == "dahlquist":
        return d, opts, Dahlquist(p["lam"], p["h"], p["method"]), p["nt_steps"], np.array([1.0])
    z = np.load(os.path.join(REF, p["weights_npz"]))
    return d, opts, TanhResNet(z["W"], z["b"], p["h"]), p["N_layers"], z["u0"].astype(float)


@pytest.mark.skipif(not CASES, reason="../shared/reference/mgrit is not on this machine")
@pytest.mark.parametrize("path", CASES, ids=os.path.basename)
def test_reference_cases(path):
    d, opts, prop, n, u0 = _case(path)
    res = MGRITSolver(prop, n, opts).solve(u0)
    ref = d["xbraid"]
    assert res.iterations == ref["iterations"]
    assert len(res.residuals) == len(ref["rnorms"])
    np.testing.assert_allclose(res.residuals, ref["rnorms"], rtol=0, atol=1e-13)
    np.testing.assert_allclose(res.final, ref["final_state"], rtol=0, atol=1e-13)
    np.testing.assert_allclose(res.final, d["serial"]["final_state"], rtol=0, atol=1e-10)


@pytest.mark.skipif(not os.path.exists(os.path.join(REF, "xbraid_ex01.json")),
                    reason="../shared/reference/mgrit is not on this machine")
def test_xbraid_example_01_with_skip_and_initial_guess():
    d = json.load(open(os.path.join(REF, "xbraid_ex01.json")))
    drv = d["driver_same_settings"]
    opts = MGRITOptions(cf=2, max_levels=2, nrelax=1, tol=1e-6, max_iter=100,
                        skip_downcycle=True)
    res = MGRITSolver(Dahlquist(-1.0, 0.5, "BE"), 10, opts).solve(
        np.array([1.0]), initial_guess=lambda i: np.array([0.456]))
    assert res.iterations == drv["niter"] == 4
    np.testing.assert_allclose(res.residuals, drv["rnorms_raw"][1:4], rtol=0, atol=1e-13)
    np.testing.assert_allclose(res.final, drv["final_u"], rtol=0, atol=1e-13)


def _serial(prop, n, u0):
    u = [u0]
    for i in range(n):
        u.append(prop.step(u[-1], i, i + 1, 0))
    return u


def test_one_level_is_sequential_stepping(rng):
    prop = TanhResNet(rng.standard_normal((13, 3, 3)), rng.standard_normal((13, 3)), 0.1)
    u0 = rng.standard_normal(3)
    res = MGRITSolver(prop, 13, MGRITOptions(max_levels=1)).solve(u0)
    for a, b in zip(res.states, _serial(prop, 13, u0)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n, cf", [(16, 2), (17, 2), (19, 4), (64, 4)])
@pytest.mark.parametrize("nrelax", [0, 1])
def test_two_level_exact_after_nc_or_half_nc_cycles(n, cf, nrelax, rng):
    """Two-level F is exact after N_c cycles, FCF after ceil(N_c / 2) (and not one cycle before)."""
    prop = TanhResNet(rng.standard_normal((n, 3, 3)), rng.standard_normal((n, 3)), 0.5)
    u0 = rng.standard_normal(3)
    nc = n // cf
    exact_after = nc if nrelax == 0 else math.ceil(nc / 2)
    serial = _serial(prop, n, u0)
    opts = MGRITOptions(cf=cf, max_levels=2, nrelax=nrelax, tol=0.0, max_iter=exact_after,
                        min_coarse=1)
    res = MGRITSolver(prop, n, opts).solve(u0)
    for a, b in zip(res.states, serial):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    if exact_after > 1:
        opts = MGRITOptions(cf=cf, max_levels=2, nrelax=nrelax, tol=0.0,
                            max_iter=exact_after - 1, min_coarse=1)
        before = MGRITSolver(prop, n, opts).solve(u0)
        assert np.abs(before.final - serial[-1]).max() > 1e-8


@pytest.mark.parametrize("levels, cf, n", [(3, 2, 37), (4, 2, 64), (3, 4, 70)])
@pytest.mark.parametrize("cycle", ["V", "F"])
def test_multilevel_converges_to_serial(levels, cf, n, cycle, rng):
    prop = TanhResNet(rng.standard_normal((n, 4, 4)) * 0.5, rng.standard_normal((n, 4)), 1.0 / n)
    u0 = rng.standard_normal(4)
    res = MGRITSolver(prop, n, MGRITOptions(cf=cf, max_levels=levels, tol=1e-13, max_iter=50,
                                            cycle=cycle)).solve(u0)
    assert res.residuals[-1] < 1e-13 and res.iterations < 50
    for a, b in zip(res.states, _serial(prop, n, u0)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("lam, v_its, f_its", [(-1.0, 11, 7), (-10.0, 20, 11)])
def test_f_cycle_converges_faster_than_v_cycle(lam, v_its, f_its):
    """Six levels, F-relaxation, N = 128: F-cycles need far fewer cycles (measured counts)."""
    its = {}
    for cycle in "VF":
        opts = MGRITOptions(cf=2, max_levels=6, nrelax=0, tol=1e-10, max_iter=80, cycle=cycle)
        res = MGRITSolver(Dahlquist(lam, 0.05, "BE"), 128, opts).solve(np.array([1.0]))
        assert res.residuals[-1] < 1e-10
        its[cycle] = res.iterations
    assert its == {"V": v_its, "F": f_its}


def test_intervals_and_c_points():
    assert list(intervals(10, 4)) == [(0, 4), (4, 8), (8, 11)]
    assert list(intervals(8, 4)) == [(0, 4), (4, 8), (8, 9)]
    assert list(intervals(3, 2)) == [(0, 2), (2, 4)]


def test_level_sizes():
    assert level_sizes(64, 4, 3, 2) == [64, 16, 4]
    assert level_sizes(64, 4, 5, 2) == [64, 16, 4]
    assert level_sizes(10, 2, 5, 2) == [10, 5, 2]
    assert level_sizes(7, 2, 1, 2) == [7]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bad_options_and_divergence():
    with pytest.raises(ValueError, match="cf"):
        MGRITOptions(cf=1)
    with pytest.raises(ValueError, match="max_levels"):
        MGRITOptions(max_levels=0)
    with pytest.raises(ValueError, match="nrelax"):
        MGRITOptions(nrelax=[1, -1])
    with pytest.raises(ValueError, match="'W'"):
        MGRITOptions(cycle="W")
    with pytest.raises(TypeError, match="unexpected keyword"):
        MGRITOptions(cfactor=2)
    with pytest.raises(TypeError, match="step"):
        MGRITSolver(object(), 8)
    with pytest.raises(DivergenceError, match="cycle 0"):
        MGRITSolver(Dahlquist(-1.0, 0.5, "BE"), 8, MGRITOptions(max_levels=2, tol=0.0)).solve(
            np.array([1.0]), initial_guess=lambda i: np.array([np.inf]) if i == 4 else
            np.array([0.0]))


def test_partition_and_state_validation():
    from mgnn.mgrit.partition import Partition
    with pytest.raises(ValueError, match="increase strictly"):
        Partition(10, (0, 6, 3), (0, 1, 2))
    with pytest.raises(ValueError, match="one rank per block"):
        Partition(10, (0, 5), (0,))
    with pytest.raises(ValueError, match="begin at 0"):
        Partition(10, (1, 5), (0, 1))
    opts = MGRITOptions(cf=2, max_levels=2)
    with pytest.raises(TypeError, match=r"initial_guess\(2\).*float32"):
        MGRITSolver(Dahlquist(-1.0, 0.1, "BE"), 8, opts).solve(
            np.ones(1, np.float32), initial_guess=lambda i: np.ones(1))
    with pytest.raises(TypeError, match="u0 must be an array"):
        MGRITSolver(Dahlquist(-1.0, 0.1, "BE"), 8, opts).solve([1.0])


def test_numba_vector_ops_give_the_generic_histories(rng):
    from mgnn.backend import vector_ops
    prop = TanhResNet(rng.standard_normal((45, 3, 3)), rng.standard_normal((45, 3)), 0.05)
    u0 = rng.standard_normal(3)
    opts = MGRITOptions(cf=3, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=4)
    a = MGRITSolver(prop, 45, opts).solve(u0)
    b = MGRITSolver(prop, 45, opts, ops=vector_ops("numba")).solve(u0)
    np.testing.assert_allclose(b.residuals, a.residuals, rtol=1e-12)
    for x, y in zip(a.states, b.states):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14)
    assert b.timings["vector"] > 0
