"""The numba backend's float32 tanh (a rational approximation evaluated in float64: libm's scalar
tanhf costs ~25 ns an element) against tanh in float64: at most 4 ulp of float32, NaN and the
infinities handled; float64 keeps libm's tanh exactly."""
import math

import numpy as np
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


def test_float64_tanh_is_libm():
    x = _grid()[::40].astype(np.float64) * 1.37
    got = np.empty_like(x)
    _sig_all(x, 0, got)
    np.testing.assert_array_equal(got, [math.tanh(v) for v in x])
