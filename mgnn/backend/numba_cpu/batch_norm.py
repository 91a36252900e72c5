"""Batch norm + activation (:data:`mgnn.backend.BN_KERNELS`) and the dropout mask."""

import numpy as np
from numba import prange

from ..numpy_ref import _int, bn_dims
from .activations import _tanh, njit


# ------------------------------------------------------------ batch norm + activation
# Contract: mgnn.backend.numpy_ref (BN_KERNELS). z (B, C, *spatial) is seen as (B, C, S) for the
# per-channel sums -- one thread per channel (prange over C), float64 accumulators over each row
# of S and then over the rows, so the result is the same for any thread count -- and as (B*C, S)
# rows for the elementwise kernels (prange over rows; channel = row % C).
@njit(cache=True, parallel=True)
def _bn_stats(z):
    B, C, S = z.shape
    mean = np.empty(C, dtype=z.dtype)
    m2 = np.empty(C, dtype=z.dtype)
    for c in prange(C):
        s = 0.0
        for b in range(B):
            t = 0.0
            for i in range(S):
                t += z[b, c, i]
            s += t
        mu = s / (B * S)
        q = 0.0
        for b in range(B):
            t = 0.0
            for i in range(S):
                e = z[b, c, i] - mu
                t += e * e
            q += t
        mean[c] = mu
        m2[c] = q
    return mean, m2


@njit(cache=True, parallel=True)
def _bn_act_forward(z, mean, invstd, gamma, beta, act, C):
    a, xhat, deriv = np.empty_like(z), np.empty_like(z), np.empty_like(z)
    for r in prange(z.shape[0]):
        c = r % C
        mu, k, g, be = mean[c], invstd[c], gamma[c], beta[c]
        for i in range(z.shape[1]):
            x = (z[r, i] - mu) * k
            y = g * x + be
            xhat[r, i] = x
            if act == 0:
                t = _tanh(y)
                a[r, i] = t
                deriv[r, i] = 1 - t * t
            elif act == 1:
                a[r, i] = y if y > 0 else 0
                deriv[r, i] = 1 if y > 0 else 0
            else:
                a[r, i] = y
                deriv[r, i] = 1
    return a, xhat, deriv


@njit(cache=True, parallel=True)
def _bn_act_vjp_sums(ga, deriv, xhat):
    B, C, S = ga.shape
    s1 = np.empty(C, dtype=ga.dtype)
    s2 = np.empty(C, dtype=ga.dtype)
    for c in prange(C):
        p, q = 0.0, 0.0
        for b in range(B):
            tp, tq = 0.0, 0.0
            for i in range(S):
                gy = ga[b, c, i] * deriv[b, c, i]
                tp += gy
                tq += gy * xhat[b, c, i]
            p += tp
            q += tq
        s1[c] = p
        s2[c] = q
    return s1, s2


@njit(cache=True, parallel=True)
def _bn_act_vjp_input(ga, deriv, xhat, invstd, gamma, s1, s2, count, C):
    gz = np.empty_like(ga)
    for r in prange(ga.shape[0]):
        c = r % C
        k, m1, m2 = gamma[c] * invstd[c], s1[c] / count, s2[c] / count
        for i in range(ga.shape[1]):
            gz[r, i] = k * ((ga[r, i] * deriv[r, i] - m1) - xhat[r, i] * m2)
    return gz


def bn_stats(z):
    B, C, S = bn_dims(z)
    return _bn_stats(z.reshape(B, C, S))


def bn_act_forward(z, mean, invstd, gamma, beta, act):
    B, C, S = bn_dims(z)
    return tuple(v.reshape(z.shape) for v in _bn_act_forward(
        z.reshape(B * C, S), mean, invstd, gamma, beta, act, C))


def bn_act_vjp_sums(ga, deriv, xhat):
    B, C, S = bn_dims(ga)
    return _bn_act_vjp_sums(*(v.reshape(B, C, S) for v in (ga, deriv, xhat)))


def bn_act_vjp_input(ga, deriv, xhat, invstd, gamma, s1, s2, count):
    B, C, S = bn_dims(ga)
    count = ga.dtype.type(_int("count", count))
    return _bn_act_vjp_input(*(v.reshape(B * C, S) for v in (ga, deriv, xhat)), invstd, gamma,
                             s1, s2, count, C).reshape(ga.shape)


for _f in (bn_stats, bn_act_forward, bn_act_vjp_sums, bn_act_vjp_input):
    _f.__doc__ = f"Numba kernel; contract of :func:`mgnn.backend.numpy_ref.{_f.__name__}`."


def dropout_mask(seed, step, layer, sample0, batch, n_elements, threshold, out=None):
    """Numba kernel (parallel over samples); contract of
    :func:`mgnn.backend.numpy_ref.dropout_mask`, bit-identical."""
    from ..counter_rng import dropout_mask_numba
    return dropout_mask_numba(seed, step, layer, sample0, batch, n_elements, threshold, out=out)
