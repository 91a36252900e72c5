"""Numba CPU backend: ``@njit(cache=True)`` kernels with the signatures of :mod:`numpy_ref`.

Matrix products go to BLAS through ``np.dot`` inside the kernels with fused bias, activation and
residual epilogues; convolutions are direct loops parallel over the batch (``prange``). The layer
sweeps run a whole block of residual steps in one call, so the per-layer cost of a small network
is a few microseconds instead of a Python dispatch per layer.
"""
import numpy as np
from numba import njit, prange

name = "numba"
xp = np  #: array module of this backend
batched_relaxation = False  #: batching gains nothing on the CPU (see numpy_ref)


@njit(cache=True, inline="always")
def _sig(z, act):
    if act == 0:
        return np.tanh(z)
    if act == 1:
        return z if z > 0 else z * 0
    return z


@njit(cache=True, inline="always")
def _dsig(z, act):
    if act == 0:
        t = np.tanh(z)
        return 1 - t * t
    if act == 1:
        return z * 0 + 1 if z > 0 else z * 0
    return z * 0 + 1


# --------------------------------------------------------------------------------------- dense
@njit(cache=True)
def _dense_epilogue(x, z, b, h, act, residual, y, D, want_deriv):
    """y = [x +] h sigma(z + b) in place of y, optionally D = sigma'(z + b); z (B, o)."""
    B, o = z.shape
    for i in range(B):
        for j in range(o):
            zz = z[i, j] + b[j]
            v = h * _sig(zz, act)
            y[i, j] = x[i, j] + v if residual else v
            if want_deriv:
                D[i, j] = _dsig(zz, act)


@njit(cache=True)
def _dense_forward(x, W, b, h, act, residual, want_deriv):
    z = np.dot(x, W.T)
    y = np.empty_like(z)
    D = np.empty_like(z) if want_deriv else np.empty((0, 0), dtype=z.dtype)
    _dense_epilogue(x, z, b, h, act, residual, y, D, want_deriv)
    return y, D


@njit(cache=True)
def _dense_deriv(x, W, b, act):
    z = np.dot(x, W.T)
    B, o = z.shape
    for i in range(B):
        for j in range(o):
            z[i, j] = _dsig(z[i, j] + b[j], act)
    return z


@njit(cache=True)
def _dense_vjp(gy, D, x, W, h, residual, want_params):
    B, o = gy.shape
    s = np.empty_like(gy)
    for i in range(B):
        for j in range(o):
            s[i, j] = D[i, j] * gy[i, j]
    gx = np.dot(s, W)
    for i in range(B):
        for j in range(gx.shape[1]):
            gx[i, j] = gy[i, j] + h * gx[i, j] if residual else h * gx[i, j]
    if want_params:
        gW = np.dot(s.T, x)
        gW *= h
        gb = np.zeros(o, dtype=gy.dtype)
        for i in range(B):
            for j in range(o):
                gb[j] += s[i, j]
        gb *= h
    else:
        gW = np.empty((0, 0), dtype=gy.dtype)
        gb = np.empty(0, dtype=gy.dtype)
    return gx, gW, gb


@njit(cache=True)
def _dense_vjp_params(gy, D, x, h):
    B, o = gy.shape
    s = np.empty_like(gy)
    gb = np.zeros(o, dtype=gy.dtype)
    for i in range(B):
        for j in range(o):
            s[i, j] = D[i, j] * gy[i, j]
            gb[j] += s[i, j]
    gW = np.dot(s.T, x)
    gW *= h
    gb *= h
    return gW, gb


@njit(cache=True)
def _dense_sweep_forward(U, W, b, h, act, D):
    want = D.shape[0] > 0
    dummy = np.empty((0, 0), dtype=U.dtype)
    for n in range(W.shape[0]):
        z = np.dot(U[n], W[n].T)
        _dense_epilogue(U[n], z, b[n], h, act, True, U[n + 1], D[n] if want else dummy, want)


@njit(cache=True)
def _dense_sweep_backward(U, D, W, h, lam, gW, gb):
    for n in range(W.shape[0] - 1, -1, -1):
        lam, gWn, gbn = _dense_vjp(lam, D[n], U[n], W[n], h, True, True)
        gW[n] = gWn
        gb[n] = gbn
    return lam


#: At and above this many output elements (B * o) a single dense step uses BLAS through NumPy and
#: NumPy's SIMD activation ufuncs; below it the fused Numba kernels win because call overhead
#: dominates.
WIDE = 4096
#: The same threshold for tanh in float32: Numba's scalar ``tanhf`` costs ~25 ns an element against
#: ~3 ns for NumPy's SIMD tanh, so NumPy wins from ~512 elements on (measured: B=128, w=16 steps
#: 64 us fused against 34 us; float64 tanh has no such gap, relu and identity need no libm).
WIDE_TANH_F32 = 512


def _wide(n, dtype, act):
    """Whether a dense step with ``n`` output elements goes through NumPy (see :data:`WIDE`)."""
    return n >= (WIDE_TANH_F32 if act == 0 and dtype == np.float32 else WIDE)


def _wide_forward(x, W, b, h, act, residual, want_deriv):
    z = np.matmul(x, W.T)
    z += b
    D = None
    if act == 0:
        t = np.tanh(z, out=z)
        if want_deriv:
            D = 1 - t * t
    elif act == 1:
        if want_deriv:
            D = (z > 0).astype(z.dtype)
        t = np.maximum(z, 0, out=z)
    else:
        t = z
        if want_deriv:
            D = np.ones_like(z)
    t *= h
    if residual:
        t += x
    return t, D


def _wide_vjp(gy, D, x, W, h, residual, want_params):
    s = D * gy
    gx = np.matmul(s, W)
    gx *= h
    if residual:
        gx += gy
    if not want_params:
        return gx, None, None
    gW = np.matmul(s.T, x)
    gW *= h
    gb = s.sum(axis=0)
    gb *= h
    return gx, gW, gb


def dense_forward(x, W, b, h, act, residual):
    if _wide(x.shape[0] * W.shape[0], x.dtype, act):
        return _wide_forward(x, W, b, h, act, residual, False)[0]
    return _dense_forward(x, W, b, h, act, residual, False)[0]


def dense_forward_deriv(x, W, b, h, act, residual):
    if _wide(x.shape[0] * W.shape[0], x.dtype, act):
        return _wide_forward(x, W, b, h, act, residual, True)
    return _dense_forward(x, W, b, h, act, residual, True)


def dense_deriv(x, W, b, act):
    if _wide(x.shape[0] * W.shape[0], x.dtype, act):
        return _wide_forward(x, W, b, x.dtype.type(1), act, False, True)[1]
    return _dense_deriv(x, W, b, act)


def dense_vjp_input(gy, deriv, W, h, residual):
    if gy.size >= WIDE:
        return _wide_vjp(gy, deriv, gy, W, h, residual, False)[0]
    return _dense_vjp(gy, deriv, gy, W, h, residual, False)[0]


def dense_vjp(gy, deriv, x, W, h, residual):
    if gy.size >= WIDE:
        return _wide_vjp(gy, deriv, x, W, h, residual, True)
    return _dense_vjp(gy, deriv, x, W, h, residual, True)


def dense_vjp_params(gy, deriv, x, h):
    if gy.size >= WIDE:
        s = deriv * gy
        gW = np.matmul(s.T, x)
        gW *= h
        gb = s.sum(axis=0)
        gb *= h
        return gW, gb
    return _dense_vjp_params(gy, deriv, x, h)


def dense_sweep_forward(U, W, b, h, act, D):
    if not _wide(U.shape[1] * W.shape[1], U.dtype, act):
        return _dense_sweep_forward(U, W, b, h, act, D)
    for n in range(W.shape[0]):  # layer by layer through NumPy's SIMD activations
        U[n + 1], d = _wide_forward(U[n], W[n], b[n], h, act, True, D.shape[0] > 0)
        if d is not None:
            D[n] = d


def dense_sweep_backward(U, D, W, h, lam, gW, gb):
    return _dense_sweep_backward(U, D, W, h, lam, gW, gb)


for _f, _ref in ((dense_forward, "dense_forward"), (dense_forward_deriv, "dense_forward_deriv"),
                 (dense_deriv, "dense_deriv"), (dense_vjp_input, "dense_vjp_input"),
                 (dense_vjp, "dense_vjp"), (dense_vjp_params, "dense_vjp_params"),
                 (dense_sweep_forward, "dense_sweep_forward"),
                 (dense_sweep_backward, "dense_sweep_backward")):
    _f.__doc__ = f"Numba kernel; contract of :func:`mgnn.backend.numpy_ref.{_ref}`."


# ---------------------------------------------------------------------------------------- conv
@njit(cache=True)
def _pad_sample(x, bi):
    """x[bi] (C, H, W) copied into a zero border of width 1: (C, H+2, W+2)."""
    C, H, Wd = x.shape[1], x.shape[2], x.shape[3]
    xp = np.zeros((C, H + 2, Wd + 2), dtype=x.dtype)
    for c in range(C):
        for yy in range(H):
            for xx in range(Wd):
                xp[c, yy + 1, xx + 1] = x[bi, c, yy, xx]
    return xp


@njit(cache=True, inline="always")
def _conv_plane(xp, K, co, acc):
    """acc (H, W) += sum_ci cross-correlation of the padded sample xp (ci, H+2, W+2) with K[co].

    All indices are sums of non-negative loop counters, so the inner loop vectorises.
    """
    H, Wd = acc.shape
    for ci in range(xp.shape[0]):
        for dy in range(3):
            for dx in range(3):
                k = K[co, ci, dy, dx]
                for yy in range(H):
                    for xx in range(Wd):
                        acc[yy, xx] += k * xp[ci, yy + dy, xx + dx]


@njit(cache=True, parallel=True)
def _conv_forward(x, K, b, h, act, residual, want_deriv):
    B, _, H, Wd = x.shape
    co_n = K.shape[0]
    y = np.empty((B, co_n, H, Wd), dtype=x.dtype)
    D = np.empty((B, co_n, H, Wd) if want_deriv else (0, 0, 0, 0), dtype=x.dtype)
    for bi in prange(B):
        xp = _pad_sample(x, bi)
        acc = np.empty((H, Wd), dtype=x.dtype)
        for co in range(co_n):
            acc[:] = b[co]
            _conv_plane(xp, K, co, acc)
            for yy in range(H):
                for xx in range(Wd):
                    z = acc[yy, xx]
                    v = h * _sig(z, act)
                    y[bi, co, yy, xx] = x[bi, co, yy, xx] + v if residual else v
                    if want_deriv:
                        D[bi, co, yy, xx] = _dsig(z, act)
    return y, D


@njit(cache=True, parallel=True)
def _conv_vjp_input(s, gy, K, h, residual, ci_n):
    """[gy +] h conv3x3^T(s, K); s (B, co, H, W) -> (B, ci, H, W).

    gx[ci, y, x] = sum_{co, dy, dx} K[co, ci, dy, dx] s[co, y + 1 - dy, x + 1 - dx]; with the
    padded sp and r = 2 - d this reads sp[co, y + r, x + r'] (non-negative indices).
    """
    B, co_n, H, Wd = s.shape
    gx = np.empty((B, ci_n, H, Wd), dtype=s.dtype)
    for bi in prange(B):
        sp = _pad_sample(s, bi)
        acc = np.empty((H, Wd), dtype=s.dtype)
        for ci in range(ci_n):
            acc[:] = 0
            for co in range(co_n):
                for ry in range(3):
                    for rx in range(3):
                        k = K[co, ci, 2 - ry, 2 - rx]
                        for yy in range(H):
                            for xx in range(Wd):
                                acc[yy, xx] += k * sp[co, yy + ry, xx + rx]
            for yy in range(H):
                for xx in range(Wd):
                    gx[bi, ci, yy, xx] = gy[bi, ci, yy, xx] + h * acc[yy, xx] if residual \
                        else h * acc[yy, xx]
    return gx


@njit(cache=True, parallel=True)
def _pad_all(x):
    B, C, H, Wd = x.shape
    xp = np.zeros((B, C, H + 2, Wd + 2), dtype=x.dtype)
    for bi in prange(B):
        for c in range(C):
            for yy in range(H):
                for xx in range(Wd):
                    xp[bi, c, yy + 1, xx + 1] = x[bi, c, yy, xx]
    return xp


@njit(cache=True, parallel=True)
def _conv_param_grad(s, x, h):
    """(h * dK (co, ci, 3, 3), h * db (co,)) of conv3x3 at input x for output cotangent s."""
    B, co_n, H, Wd = s.shape
    ci_n = x.shape[1]
    xp = _pad_all(x)
    gK = np.empty((co_n, ci_n, 3, 3), dtype=s.dtype)
    gb = np.empty(co_n, dtype=s.dtype)
    for co in prange(co_n):
        tb = s.dtype.type(0)
        for bi in range(B):
            for yy in range(H):
                for xx in range(Wd):
                    tb += s[bi, co, yy, xx]
        gb[co] = h * tb
        for ci in range(ci_n):
            for dy in range(3):
                for dx in range(3):
                    t = s.dtype.type(0)
                    for bi in range(B):
                        for yy in range(H):
                            for xx in range(Wd):
                                t += s[bi, co, yy, xx] * xp[bi, ci, yy + dy, xx + dx]
                    gK[co, ci, dy, dx] = h * t
    return gK, gb


@njit(cache=True, parallel=True)
def _mul(a, b):
    out = np.empty_like(a)
    fa = a.reshape(-1)
    fb = b.reshape(-1)
    fo = out.reshape(-1)
    for i in prange(fa.size):
        fo[i] = fa[i] * fb[i]
    return out


def conv_forward(x, K, b, h, act, residual):
    return _conv_forward(x, K, b, h, act, residual, False)[0]


def conv_forward_deriv(x, K, b, h, act, residual):
    return _conv_forward(x, K, b, h, act, residual, True)


def conv_deriv(x, K, b, act):
    return _conv_forward(x, K, b, x.dtype.type(1), act, False, True)[1]


def conv_vjp_input(gy, deriv, K, h, residual):
    return _conv_vjp_input(_mul(deriv, gy), gy, K, h, residual, K.shape[1])


def conv_vjp(gy, deriv, x, K, h, residual):
    s = _mul(deriv, gy)
    gK, gb = _conv_param_grad(s, x, h)
    return _conv_vjp_input(s, gy, K, h, residual, K.shape[1]), gK, gb


def conv_vjp_params(gy, deriv, x, h):
    return _conv_param_grad(_mul(deriv, gy), x, h)


for _f, _ref in ((conv_forward, "conv_forward"), (conv_vjp_params, "conv_vjp_params"),
                 (conv_forward_deriv, "conv_forward_deriv"), (conv_deriv, "conv_deriv"),
                 (conv_vjp_input, "conv_vjp_input"), (conv_vjp, "conv_vjp")):
    _f.__doc__ = f"Numba kernel; contract of :func:`mgnn.backend.numpy_ref.{_ref}`."


# ------------------------------------------------------------------------------ pooling, loss
@njit(cache=True)
def _avgpool_forward(u, p):
    B, C, H, Wd = u.shape
    ph, pw = H // p, Wd // p
    out = np.zeros((B, C, p, p), dtype=u.dtype)
    scale = u.dtype.type(1.0 / (ph * pw))
    for bi in range(B):
        for c in range(C):
            for yy in range(H):
                for xx in range(Wd):
                    out[bi, c, yy // ph, xx // pw] += u[bi, c, yy, xx]
            for i in range(p):
                for j in range(p):
                    out[bi, c, i, j] *= scale
    return out


@njit(cache=True)
def _avgpool_vjp(g, H, Wd):
    B, C, p, _ = g.shape
    ph, pw = H // p, Wd // p
    out = np.empty((B, C, H, Wd), dtype=g.dtype)
    scale = g.dtype.type(1.0 / (ph * pw))
    for bi in range(B):
        for c in range(C):
            for yy in range(H):
                for xx in range(Wd):
                    out[bi, c, yy, xx] = g[bi, c, yy // ph, xx // pw] * scale
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


def avgpool_forward(u, p):
    """Numba kernel; contract of :func:`mgnn.backend.numpy_ref.avgpool_forward`."""
    return _avgpool_forward(u, p)


def avgpool_vjp(g, H, Wd):
    """Numba kernel; contract of :func:`mgnn.backend.numpy_ref.avgpool_vjp`."""
    return _avgpool_vjp(g, H, Wd)


def softmax_xent(logits, y):
    """Numba kernel; contract of :func:`mgnn.backend.numpy_ref.softmax_xent`."""
    return _softmax_xent(logits, y)


# ------------------------------------------------------------------- interval-batched steps
def _export_batched():
    import sys
    from .batched_loops import batched_kernels
    globals().update(batched_kernels(sys.modules[__name__]))


_export_batched()
