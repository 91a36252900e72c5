"""The numba backend's tanh, branch-free so that its element loops vectorise (libm's scalar tanh
is a call per element, 5-10x slower): float32 by a rational approximation evaluated in float64
(at most 4 ulp of float32 from tanh in float64), float64 by expm1 with range reduction (at most
3 ulp from NumPy's tanh); NaN, the infinities and signed zeros handled; and the element loop of a
fused kernel compiles to SIMD (ymm registers) where the machine has them."""
import math
import os

import numpy as np
import numba
import pytest
from numba import njit

from mgnn.backend import numba_cpu


@njit(cache=False)
def _sig_all(z, act, out):
    for i in range(z.size):
        out[i] = numba_cpu._sig(z[i], act)


@njit(cache=False)
def _dsig_all(z, act, out):
    for i in range(z.size):
        out[i] = numba_cpu._dsig(z[i], act)


def _grid():
    x = np.linspace(-12, 12, 400_001).astype(np.float32)
    tiny = (10.0 ** np.linspace(-38, 1, 20_000)).astype(np.float32)
    return np.concatenate([x, tiny, -tiny, [0.0, 7.905311, 7.9053116, 80.0, -80.0]]).astype(
        np.float32)


def test_float32_tanh_within_4_ulp():
    x = _grid()
    got = np.empty_like(x)
    _sig_all(x, 0, got)
    ref = np.tanh(x.astype(np.float64))
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    err = np.abs(got.astype(np.float64) - ref) / ulp
    assert err.max() <= 4.0, (err.max(), x[err.argmax()])
    assert np.all(np.abs(got) <= 1) and np.array_equal(np.sign(got), np.sign(x))
    d = np.empty_like(x)
    _dsig_all(x, 0, d)
    np.testing.assert_array_equal(d, np.float32(1) - got * got)  # sigma' from the same tanh


def test_float32_tanh_special_values():
    x = np.array([np.nan, np.inf, -np.inf, -0.0], dtype=np.float32)
    got = np.empty_like(x)
    _sig_all(x, 0, got)
    assert np.isnan(got[0]) and got[1] == 1 and got[2] == -1 and got[3] == 0


def test_float64_tanh_within_3_ulp_of_numpy():
    rng = np.random.default_rng(0)
    scales = (1e-9, 1e-3, 0.2, 0.5, 1, 3, 10, 40)
    x = np.concatenate([rng.standard_normal(50_000) * s for s in scales]
                       + [np.linspace(-20, 20, 100_001), [0.3465735902799726, 19.06, 19.5, 700.0]])
    got = np.empty_like(x)
    _sig_all(x, 0, got)
    ref = np.tanh(x)
    err = np.abs(got - ref) / np.spacing(np.abs(ref))
    assert err.max() <= 3.0, (err.max(), x[err.argmax()])
    d = np.empty_like(x)
    _dsig_all(x, 0, d)
    np.testing.assert_array_equal(d, 1.0 - got * got)  # sigma' from the same tanh
    s = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 5e-324])
    out = np.empty_like(s)
    _sig_all(s, 0, out)
    assert np.isnan(out[0]) and out[1] == 1 and out[2] == -1 and out[5] == 5e-324
    assert np.signbit(out[3]) and not np.signbit(out[4])


@numba_cpu.njit(cache=False)  # the backend's compile options (NumPy's error model)
def _probe(x, out):
    for i in range(x.size):
        out[i] = numba_cpu._sig(x[i], 0)


def test_tanh_element_loops_vectorise():
    import llvmlite.binding as llvm
    features = llvm.get_host_cpu_features()
    if os.environ.get("NUMBA_CPU_NAME") or not features.get("avx2", False):
        pytest.skip("checks x86 AVX2 registers (this CPU or NUMBA_CPU_NAME has none)")
    for dt in (np.float32, np.float64):
        x = np.linspace(-3, 3, 64).astype(dt)
        out = np.empty_like(x)
        _probe(x, out)
        np.testing.assert_allclose(out, np.tanh(x), rtol=4 * np.finfo(dt).eps)
        probe = _probe
        sig = next(s for s in probe.signatures if s[0].dtype == numba.from_dtype(np.dtype(dt)))
        asm = probe.inspect_asm(sig)
        assert "ymm" in asm or "zmm" in asm, dt
