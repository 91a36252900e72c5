"""Average pooling and the softmax cross-entropy of the closing layer."""

import numpy as np

from ..numpy_ref import _int
from .conv import _sum64
from .activations import njit


# ------------------------------------------------------------------------------ pooling, loss
@njit(cache=True)
def _avgpool_forward(u, p):
    """Mean over each of the p x p cells of u (B, C, H, W) -> (B, C, p, p): every cell summed
    row segment by row segment in float64 (:func:`_sum64`, SIMD), then scaled."""
    B, C, H, Wd = u.shape
    ph, pw = H // p, Wd // p
    out = np.empty((B, C, p, p), dtype=u.dtype)
    scale = 1.0 / (ph * pw)
    for bi in range(B):
        for c in range(C):
            for i in range(p):
                for j in range(p):
                    t = 0.0
                    for yy in range(i * ph, (i + 1) * ph):
                        t += _sum64(u[bi, c, yy, j * pw:(j + 1) * pw])
                    out[bi, c, i, j] = t * scale
    return out


@njit(cache=True)
def _avgpool_vjp(g, H, Wd):
    """The cotangent of :func:`_avgpool_forward`: every element of a cell gets g / cell size
    (row segments filled with one value: unit-stride loops)."""
    B, C, p, _ = g.shape
    ph, pw = H // p, Wd // p
    out = np.empty((B, C, H, Wd), dtype=g.dtype)
    scale = g.dtype.type(1.0 / (ph * pw))
    for bi in range(B):
        for c in range(C):
            for i in range(p):
                for yy in range(i * ph, (i + 1) * ph):
                    row = out[bi, c, yy]
                    for j in range(p):
                        v = g[bi, c, i, j] * scale
                        for xx in range(j * pw, (j + 1) * pw):
                            row[xx] = v
    return out


@njit(cache=True)
def _softmax_xent(logits, y):
    B, K = logits.shape
    g = np.empty_like(logits)
    total = 0.0
    invB = logits.dtype.type(1.0 / B)
    for i in range(B):
        m = logits[i, 0]
        for k in range(1, K):
            m = max(m, logits[i, k])
        ssum = logits.dtype.type(0)
        for k in range(K):
            g[i, k] = np.exp(logits[i, k] - m)
            ssum += g[i, k]
        total += np.log(ssum) + m - logits[i, y[i]]
        for k in range(K):
            g[i, k] = g[i, k] / ssum * invB
        g[i, y[i]] -= invB
    return logits.dtype.type(total / B), g


def _check_pool(p, H, Wd):
    """The kernels' integer divisions run under NumPy's error model (no ZeroDivisionError):
    refuse a grid that does not tile the image before they run."""
    p = _int("p", p)
    if p < 1 or H % p or Wd % p:
        raise ValueError(f"avgpool: a {p} x {p} grid must tile the {H} x {Wd} image (p >= 1 "
                         "dividing both sizes)")
    return p


def avgpool_forward(u, p):
    """Numba kernel; contract of :func:`mgnn.backend.numpy_ref.avgpool_forward`."""
    return _avgpool_forward(u, _check_pool(p, u.shape[2], u.shape[3]))


def avgpool_vjp(g, H, Wd):
    """Numba kernel; contract of :func:`mgnn.backend.numpy_ref.avgpool_vjp`."""
    _check_pool(g.shape[2], H, Wd)
    return _avgpool_vjp(g, H, Wd)


def softmax_xent(logits, y):
    """Numba kernel; contract of :func:`mgnn.backend.numpy_ref.softmax_xent`."""
    return _softmax_xent(logits, y)
