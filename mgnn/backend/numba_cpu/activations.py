"""mgnn's ``njit``/``overload`` for the CPU kernels (NumPy's error model, cache-race safe) and the
activations sigma, sigma' they inline (the float32 rational tanh, the float64 expm1 tanh, relu)."""
import math

import numpy as np
import numba
from numba.extending import overload as _overload

from ..jit import njit as _cache_safe_njit


def njit(*args, **options):
    """``numba.njit`` with NumPy's error model (a float division by zero gives inf/nan instead
    of raising): without the per-element ZeroDivisionError branch the element loops that
    divide (the float32 tanh's rational fit) vectorise -- 5x faster at B w = 8192."""
    options.setdefault("error_model", "numpy")
    return _cache_safe_njit(*args, **options)


def overload(fn, **options):
    """``numba.extending.overload`` with the same error model as :func:`njit`."""
    options.setdefault("jit_options", {"error_model": "numpy"})
    return _overload(fn, **options)


#: tanh(x) ~ x P(x^2) / Q(x^2) on |x| <= 7.9053 (clamped outside; the float32 minimax fit of
#: Eigen's ``ptanh``), evaluated in float64 and rounded, exactly +-1 from |z| >= 9: at most 4
#: ulp from tanh in float32, NaN propagates. ~5 ns an element against ~25 ns for libm's tanhf
#: (NumPy's SIMD tanh: ~3 ns; a Numba loop cannot call it).
_TANH_P = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05,
           5.12229709037114e-08, -8.60467152213735e-11, 2.00018790482477e-13,
           -2.76076847742355e-16)
_TANH_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04,
           1.19825839466702e-06)
_TANH_CLAMP = 7.90531110763549805


@njit(cache=True)
def _tanh_rational(z):
    x = np.float64(z)
    if x > _TANH_CLAMP:
        x = _TANH_CLAMP
    if x < -_TANH_CLAMP:
        x = -_TANH_CLAMP
    a1, a3, a5, a7, a9, a11, a13 = _TANH_P
    b0, b2, b4, b6 = _TANH_Q
    x2 = x * x
    p = x * ((((((x2 * a13 + a11) * x2 + a9) * x2 + a7) * x2 + a5) * x2 + a3) * x2 + a1)
    q = ((x2 * b6 + b4) * x2 + b2) * x2 + b0
    r = p / q
    if z >= 9:  # tanh rounds to +-1 in float32 from |z| ~ 8.3 on; the clamped fit stops short
        r = 1.0
    if z <= -9:
        r = -1.0
    return r


#: float64 tanh by expm1: ln 2 split for the range reduction, 1/n! for n = 2 .. 15
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_INV_LN2 = 1.4426950408889634
_EXPM1_C = tuple(1.0 / math.factorial(n) for n in range(2, 16))


@njit(cache=True)
def _tanh64(x):
    """tanh(x) for float64 without libm, branch-free so that element loops vectorise (libm's
    tanh is a call per element: 5x slower at B w = 8192): tanh|x| = e / (e + 2) with
    e = expm1(2|x|) = 2^k expm1(r) + (2^k - 1), 2|x| = k ln 2 + r, |r| <= ln 2 / 2, expm1(r) by
    its Taylor series to r^15/15! (< 1e-18), 2^k by exact products of powers of two; |x|
    clamped at 19.5 (tanh rounds to 1 from 19.06). At most 3 ulp from NumPy's tanh; signed
    zeros and NaN propagate."""
    a = min(abs(x), 19.5)
    y = a + a
    k = np.floor(y * _INV_LN2 + 0.5)
    r = (y - k * _LN2_HI) - k * _LN2_LO
    p = _EXPM1_C[13]
    for j in range(12, -1, -1):
        p = p * r + _EXPM1_C[j]
    em_r = r + r * r * p
    ki = np.int64(k)
    t = 1.0
    t = t * (2.0 if ki & 1 else 1.0)
    t = t * (4.0 if ki & 2 else 1.0)
    t = t * (16.0 if ki & 4 else 1.0)
    t = t * (256.0 if ki & 8 else 1.0)
    t = t * (65536.0 if ki & 16 else 1.0)
    t = t * (4294967296.0 if ki & 32 else 1.0)
    em = t * em_r + (t - 1.0)
    v = math.copysign(em / (em + 2.0), x)
    return x if x != x else v


def _tanh(z):
    """tanh of a float scalar inside njit: :func:`_tanh_rational` for float32, :func:`_tanh64`
    for float64 (both vectorise in element loops; libm's do not)."""


@overload(_tanh)
def _tanh_impl(z):
    if isinstance(z, numba.types.Float) and z.bitwidth == 32:
        return lambda z: np.float32(_tanh_rational(z))
    return lambda z: _tanh64(np.float64(z))


@njit(cache=True, inline="always")
def _sig(z, act):
    if act == 0:
        return _tanh(z)
    if act == 1:
        return z if z > 0 else z * 0
    return z


@njit(cache=True, inline="always")
def _dsig(z, act):
    if act == 0:
        t = _tanh(z)
        return 1 - t * t
    if act == 1:
        return z * 0 + 1 if z > 0 else z * 0
    return z * 0 + 1
