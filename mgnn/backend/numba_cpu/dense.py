"""Dense residual steps ``u + h sigma(u W^T + b)``: single kernels, derivatives, vjps and the
layer sweeps (contracts: :mod:`mgnn.backend.numpy_ref`)."""

import numpy as np

from .activations import _dsig, _sig, njit


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
#: The threshold for tanh in float32. It was 512 while Numba's tanh was a scalar libm call per
#: element (~25 ns against ~3 ns for NumPy's SIMD tanh); the vectorising :func:`_tanh` made the
#: fused kernels faster than the NumPy route at every size measured (B = 128 forward sweeps,
#: us per step, fused / NumPy: w = 16 3.3 / 7.5, w = 64 19.7 / 25.6, w = 256 199 / 220), so tanh
#: now takes the common threshold.
WIDE_TANH_F32 = WIDE


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
