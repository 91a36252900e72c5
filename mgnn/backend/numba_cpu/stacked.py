"""The stacked-state kernels (:data:`mgnn.backend.STACKED_KERNELS`): every chain of a relaxation
wave, residual and FAS right-hand side in one call on one ``(slots, *state)`` store."""

import numpy as np
import numba
from numba import prange

from ..blas_threads import one_blas_thread
from ..numpy_ref import check_stacked
from .conv import (_conv_geometry, _conv_offsets, _conv_run, _conv_sample_forward,
                   _conv_sample_vjp, _conv_work, _fwd_row, _kpack, _pad_flat)
from .dense import _dense_epilogue
from .activations import _sig, njit, overload


# --------------------------------------------------------------------- stacked-state kernels
# One njit call per Python call: each chain (first, length, out) runs its steps inside the kernel,
# chains in parallel (prange) when there are threads. A dense step writes straight into its output
# slot through the same per-element code (_combine) as the single-step kernels' epilogues, always
# on the fused np.dot path (never the NumPy route of WIDE); a conv step runs each sample through
# the single kernels' per-sample code, phi straight into the output slot (plain steps) or into a
# sample's scratch combined by _combine_row (residual and FAS modes).
stacked_states = True  #: has the stacked-state kernels (:data:`mgnn.backend.STACKED_KERNELS`)
#: its parallel dense drivers call BLAS from Numba's threads (:mod:`mgnn.backend.blas_threads`)
blas_in_threads = True


@njit(cache=True, inline="always")
def _combine(v, old, u, g, has_g, mode):
    """The output element from phi's element v (already rounded to the dtype: the single-step
    epilogues compute x + h sigma in float64 for float32 data, since ``_sig`` unifies to float64)
    and the old output element: mode 0 (v - u) [+ g], 1 (old + u) - v, 2 v [+ g]."""
    if mode == 1:
        return (old + u) - v
    r = v - u if mode == 0 else v
    return r + g if has_g else r


@njit(cache=True, fastmath={"reassoc"})
def _sumsq(a):
    """sum of a's squares accumulated in float64 (a C-contiguous). The sum may be reassociated
    (SIMD partial sums, 4x faster than a fixed order at B w = 2048: a residual norm is a
    diagnostic and a stopping test, never a state); every stacked path and the captured cycles
    use this one function, so they agree bit for bit with each other."""
    f = a.reshape(-1)
    total = 0.0
    for k in range(f.size):
        v = np.float64(f[k])
        total += v * v
    return total


@njit(cache=True, inline="always")
def _fwd_phi(x, z, b, h, act, r, k):
    return x[r, k] + h * _sig(z[r, k] + b[k], act)


@njit(cache=True, inline="always")
def _adj_phi(x, z, b, h, act, r, k):
    return x[r, k] + h * z[r, k]


def _dense_out(x, z, b, h, act, out, u, g, has_g, mode):
    """out (B, w) by mode from phi = x + h sigma(z + b) (``b`` an array: a forward step, z = x
    W^T) or x + h z (``b`` None: an adjoint step, z = (sigma' lam) W): mode 0 (phi - u) [+ g],
    1 (out + u) - phi, 2 phi [+ g] (the arithmetic of :func:`_combine`). phi is rounded to the
    dtype first (stored in z, which it overwrites), so the result equals Numba's single-step
    kernel followed by the FAS vector operation bit for bit (not the NumPy route of WIDE, the
    reference or the GPU: those round differently); one pass per element (the +g of
    mode 0 a second one: fused, that loop loses vectorisation)."""


@overload(_dense_out)
def _dense_out_impl(x, z, b, h, act, out, u, g, has_g, mode):
    phi = _adj_phi if isinstance(b, numba.types.NoneType) else _fwd_phi

    def impl(x, z, b, h, act, out, u, g, has_g, mode):
        B, w = z.shape
        if mode == 2 and not has_g:
            for r in range(B):
                for k in range(w):
                    out[r, k] = phi(x, z, b, h, act, r, k)
        elif mode == 2:
            for r in range(B):
                for k in range(w):
                    z[r, k] = phi(x, z, b, h, act, r, k)
                    out[r, k] = z[r, k] + g[r, k]
        elif mode == 1:
            for r in range(B):
                for k in range(w):
                    z[r, k] = phi(x, z, b, h, act, r, k)
                    out[r, k] = (out[r, k] + u[r, k]) - z[r, k]
        else:
            for r in range(B):
                for k in range(w):
                    z[r, k] = phi(x, z, b, h, act, r, k)
                    out[r, k] = z[r, k] - u[r, k]
            if has_g:
                _add_into(out, g)
    return impl


@njit(cache=True)
def _dense_fwd_step(x, Wl, bl, h, act, z, out, u, g, has_g, mode):
    np.dot(x, Wl.T, z)
    _dense_out(x, z, bl, h, act, out, u, g, has_g, mode)


@njit(cache=True)
def _add_into(out, g):
    """out (B, w) += g, elementwise."""
    for r in range(out.shape[0]):
        for k in range(out.shape[1]):
            out[r, k] = out[r, k] + g[r, k]


@njit(cache=True)
def _dense_adj_z(lam, Wl, Dl, s, z):
    """z = (sigma' * lam) W, the linear part of a dense adjoint step (s: scratch)."""
    for r in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[r, j] = Dl[r, j] * lam[r, j]
    np.dot(s, Wl, z)


@njit(cache=True)
def _dense_adj_step(lam, Wl, Dl, h, s, z, out, u, g, has_g, mode):
    _dense_adj_z(lam, Wl, Dl, s, z)
    _dense_out(lam, z, None, h, 0, out, u, g, has_g, mode)


@njit(cache=True, inline="always")
def _combine_row(v, o, u, g, has_g, mode):
    """o = the arithmetic of :func:`_combine` on a row of phi v (mode 0 (v - u) [+ g],
    1 (o + u) - v, 2 v [+ g]); the branches sit outside the loops, which vectorise."""
    if mode == 1:
        for k in range(v.size):
            o[k] = (o[k] + u[k]) - v[k]
    elif mode == 0 and has_g:
        for k in range(v.size):
            o[k] = (v[k] - u[k]) + g[k]
    elif mode == 0:
        for k in range(v.size):
            o[k] = v[k] - u[k]
    elif has_g:
        for k in range(v.size):
            o[k] = v[k] + g[k]
    else:
        for k in range(v.size):
            o[k] = v[k]


@njit(cache=True)
def _conv_sample_step(x, Dl, bi, Kp, bl, h, act, offs, geo, xp, work, out, adjoint, none):
    """out[bi] = phi of sample bi through the single kernels' per-sample code (forward:
    :func:`_conv_sample_forward`, x + h sigma(conv(x) + b) in float64 rounded once; adjoint:
    :func:`_conv_sample_vjp` of the input, x + h conv^T(Dl * x)); ``none`` = the empty
    (sigma', kernel-gradient, bias-gradient) outputs those take (:func:`_no_outputs`)."""
    if adjoint:
        _pad_flat(x, Dl, bi, xp, True, geo[0], geo[1], geo[2], geo[3])
        _conv_sample_vjp(xp, xp, bi, Kp, h, True, offs, geo, work, x, out, none[1], none[2],
                         True, False)
    else:
        _conv_sample_forward(x, bi, Kp, bl, h, act, True, offs, geo, xp, work, out, none[0])


@njit(cache=True)
def _no_outputs(x):
    """The empty outputs :func:`_conv_sample_step` passes on (allocated once per call)."""
    return (np.empty((0, 0, 0, 0), dtype=x.dtype), np.empty((0, 1, 1), dtype=x.dtype),
            np.empty(0))


@njit(cache=True)
def _conv_sample_shared(x, Dl, bi, Kp, bl, h, h2, act, offs, geo, xp, work, out, p, adjoint):
    """:func:`_conv_sample_step` with step sizes h into out[bi] and h2 into p[bi] from one
    convolution (the same rows' arithmetic as the single kernels: the same bits as two steps;
    p must not alias x)."""
    Hpl, RS, PS, q0 = geo[0], geo[1], geo[2], geo[3]
    nrows, Wd = x.shape[2], x.shape[3]
    if adjoint:
        _pad_flat(x, Dl, bi, xp, True, Hpl, RS, PS, q0)
    else:
        _pad_flat(x, x, bi, xp, False, Hpl, RS, PS, q0)
    z = _conv_run(xp, Kp, offs, geo, work)
    for c in range(z.shape[0]):
        bc = z.dtype.type(0) if adjoint else bl[c]  # (the adjoint's bl is a placeholder)
        for r in range(nrows):
            start = r * RS
            zr, xr = z[c, start:start + Wd], x[bi, c, r]
            yr, pr = out[bi, c, r], p[bi, c, r]
            if adjoint:  # p first: out may be x's own slot (x is read by both)
                for xx in range(Wd):
                    pr[xx] = xr[xx] + h2 * zr[xx]
                for xx in range(Wd):
                    yr[xx] = xr[xx] + h * zr[xx]
            elif act == 0:  # a constant act per loop: its branches fold, the loops vectorise
                _fwd_row(zr, xr, pr, zr[:0], bc, h2, 0, True)
                _fwd_row(zr, xr, yr, zr[:0], bc, h, 0, True)
            elif act == 1:
                _fwd_row(zr, xr, pr, zr[:0], bc, h2, 1, True)
                _fwd_row(zr, xr, yr, zr[:0], bc, h, 1, True)
            else:
                _fwd_row(zr, xr, pr, zr[:0], bc, h2, 2, True)
                _fwd_row(zr, xr, yr, zr[:0], bc, h, 2, True)


@njit(cache=True)
def _conv_planes(x, Kl, bl, Dl, h, act, xp, work, out, u, g, has_g, mode, h2, p, share,
                 adjoint):
    """One conv step of every sample into out by mode (forward: x + h sigma(conv(x) + b);
    adjoint: x + h conv^T(Dl * x); bl is not read then); Kl (C, C, 3, 3) the layer's kernel,
    grouped (flipped for the adjoint) by :func:`_kpack`; with ``share`` (mode 2) also the same
    with h2, plain, into p. The samples run through the single kernels' per-sample code (the
    same bits): phi straight into out (a plain step; + g after it), or into one sample's
    scratch combined by :func:`_combine_row` (residual and FAS modes)."""
    geo = _conv_geometry(2, (x.shape[2], x.shape[3]))
    offs = _conv_offsets(2, geo[1], geo[2])
    Kp = _kpack(Kl.reshape((Kl.shape[0], Kl.shape[1] * 9)), 9, adjoint)
    v = np.empty((1 if mode != 2 else 0,) + x.shape[1:], dtype=x.dtype)  # phi of one sample
    vf = v.reshape(-1)  # (residual / FAS modes)
    none = _no_outputs(x)
    for bi in range(x.shape[0]):
        if mode == 2:
            if share:
                _conv_sample_shared(x, Dl, bi, Kp, bl, h, h2, act, offs, geo, xp, work, out,
                                    p, adjoint)
            else:
                _conv_sample_step(x, Dl, bi, Kp, bl, h, act, offs, geo, xp, work, out,
                                  adjoint, none)
            if has_g:  # phi rounded in out, then + g: the bits of _combine_row
                o, gb = out[bi].reshape(-1), g[bi].reshape(-1)
                for k in range(o.size):
                    o[k] = o[k] + gb[k]
            continue
        _conv_sample_step(x[bi:bi + 1], Dl[bi:bi + 1], 0, Kp, bl, h, act, offs, geo, xp,
                          work, v, adjoint, none)
        _combine_row(vf, out[bi].reshape(-1), u[bi].reshape(-1), g[bi].reshape(-1), has_g,
                     mode)


@njit(cache=True)
def _conv_fwd_planes(x, Kl, bl, h, act, xp, work, out, u, g, has_g, mode, h2, p, share):
    """The conv step into out by mode; with ``share`` also x + h2 sigma(conv) plain into p."""
    _conv_planes(x, Kl, bl, x, h, act, xp, work, out, u, g, has_g, mode, h2, p, share, False)


@njit(cache=True)
def _conv_adj_planes(lam, Kl, Dl, h, sp, work, out, u, g, has_g, mode, h2, p, share):
    """The conv adjoint step into out by mode; with ``share`` also lam + h2 conv^T plain into p."""
    _conv_planes(lam, Kl, Kl[0, 0, 0], Dl, h, 0, sp, work, out, u, g, has_g, mode, h2, p, share,
                 True)


@njit(cache=True)
def _conv_fwd_step(x, Kl, bl, h, act, xp, work, out, u, g, has_g, mode):
    _conv_fwd_planes(x, Kl, bl, h, act, xp, work, out, u, g, has_g, mode, h, out, False)


@njit(cache=True)
def _conv_adj_step(lam, Kl, Dl, h, sp, work, out, u, g, has_g, mode):
    _conv_adj_planes(lam, Kl, Dl, h, sp, work, out, u, g, has_g, mode, h, out, False)


# Shared steps (captured cycles, mgnn.backend.tape SHARE): a fine step and the coarse step out of
# the same state through the same layer differ only in h, so one GEMM / convolution gives both:
# the fine one into out (+ g), the coarse one plain into p. Each output by the epilogue the
# single-step kernels use, so both are bit-identical to computing them apart.
@njit(cache=True)
def _dense_fwd_shared(x, Wl, bl, h, h2, act, z, out, g, has_g, p):
    np.dot(x, Wl.T, z)
    _dense_epilogue(x, z, bl, h, act, True, out, z, False)
    _dense_epilogue(x, z, bl, h2, act, True, p, z, False)
    if has_g:
        _add_into(out, g)


@njit(cache=True)
def _dense_adj_shared(lam, Wl, Dl, h, h2, s, z, out, g, has_g, p):
    _dense_adj_z(lam, Wl, Dl, s, z)
    for r in range(z.shape[0]):
        for j in range(z.shape[1]):
            out[r, j] = lam[r, j] + h * z[r, j]
            p[r, j] = lam[r, j] + h2 * z[r, j]
    if has_g:
        _add_into(out, g)


@njit(cache=True)
def _conv_fwd_shared(x, Kl, bl, h, h2, act, xp, work, out, g, has_g, p):
    _conv_fwd_planes(x, Kl, bl, h, act, xp, work, out, out, g, has_g, 2, h2, p, True)


@njit(cache=True)
def _conv_adj_shared(lam, Kl, Dl, h, h2, sp, work, out, g, has_g, p):
    _conv_adj_planes(lam, Kl, Dl, h, sp, work, out, out, g, has_g, 2, h2, p, True)


# Each chain body runs one chain (first, n, o): o >= 0 writes R[o] (a point), o < 0 writes U[i].
# It returns sum ||out||^2 in mode 0. Its scratch comes from the driver: once per call (serial),
# once per chain (parallel: one per thread's work).
@njit(cache=True)
def _dense_fwd_scratch(U, mode):
    z = np.empty(U.shape[1:], dtype=U.dtype)
    return z, z  # the GEMM result (phi overwrites it in place: no second array)


@njit(cache=True)
def _dense_fwd_chain(U, G, has_g, R, W, P, d0, first, n, o, layer0, layer_step, h, act, mode,
                     z, z2):
    total = 0.0
    if mode == 2 and o < 0:  # a relaxation chain: the serial sweep's loop (the same arithmetic
        for i in range(first, first + n):  # as the general one below, fewer views per step)
            l = layer0 + i * layer_step
            x, y = U[i - 1], U[i]
            np.dot(x, W[l].T, z)
            _dense_out(x, z, P[l], h, act, y, y, G[i], has_g, 2)
        return total
    for i in range(first, first + n):
        l = layer0 + i * layer_step
        out = R[o] if o >= 0 else U[i]
        _dense_fwd_step(U[i - 1], W[l], P[l], h, act, z, out, U[i], G[i], has_g, mode)
        total += _sumsq(out) if mode == 0 else 0.0
    return total


# The final sweep of a forward solve that keeps its linearisation (LayerParallel): the relaxation
# chains' steps, bit for bit (the single kernels' epilogue: the shared steps rely on the same
# equality), each also writing sigma'(z + b) of its layer into D and marking it done.
@njit(cache=True)
def _dense_deriv_chain(U, W, b, first, n, layer0, layer_step, h, act, z, D, d_lo, done):
    for i in range(first, first + n):
        l = layer0 + i * layer_step
        x, y = U[i - 1], U[i]
        np.dot(x, W[l].T, z)
        p = l - d_lo
        if 0 <= p < D.shape[0]:  # one pass: the step (phi's arithmetic) and sigma'
            _dense_epilogue(x, z, b[l], h, act, True, y, D[p], True)
            done[p] = 1
        else:
            _dense_out(x, z, b[l], h, act, y, y, y, False, 2)


@njit(cache=True)
def _dense_deriv_chains(U, W, b, idx, l0, ls, h, act, D, d_lo, done):
    z = np.empty(U.shape[1:], dtype=U.dtype)
    for c in range(idx.shape[0]):
        _dense_deriv_chain(U, W, b, idx[c, 0], idx[c, 1], l0, ls, h, act, z, D, d_lo, done)


@njit(cache=True, parallel=True)
def _dense_deriv_chains_par(U, W, b, idx, l0, ls, h, act, D, d_lo, done):
    for c in prange(idx.shape[0]):
        z = np.empty(U.shape[1:], dtype=U.dtype)
        _dense_deriv_chain(U, W, b, idx[c, 0], idx[c, 1], l0, ls, h, act, z, D, d_lo, done)


@njit(cache=True)
def _conv_deriv_chain(U, W, b, first, n, layer0, layer_step, h, act, xp, work, D, d_lo, done):
    geo = _conv_geometry(2, (U.shape[3], U.shape[4]))
    offs = _conv_offsets(2, geo[1], geo[2])
    none = np.empty((0, 0, 0, 0), dtype=U.dtype)
    for i in range(first, first + n):  # a plain conv step (_conv_planes' per-sample path)
        l = layer0 + i * layer_step
        Kl = W[l]
        Kp = _kpack(Kl.reshape((Kl.shape[0], Kl.shape[1] * 9)), 9, False)
        p = l - d_lo
        keep = 0 <= p < D.shape[0]
        Dp = D[p] if keep else none
        for bi in range(U.shape[1]):
            _conv_sample_forward(U[i - 1], bi, Kp, b[l], h, act, True, offs, geo, xp, work,
                                 U[i], Dp)
        if keep:
            done[p] = 1


@njit(cache=True)
def _conv_deriv_chains(U, W, b, idx, l0, ls, h, act, D, d_lo, done):
    xp, work = _conv_scratch(U, 2)
    for c in range(idx.shape[0]):
        _conv_deriv_chain(U, W, b, idx[c, 0], idx[c, 1], l0, ls, h, act, xp, work, D, d_lo,
                          done)


@njit(cache=True, parallel=True)
def _conv_deriv_chains_par(U, W, b, idx, l0, ls, h, act, D, d_lo, done):
    for c in prange(idx.shape[0]):
        xp, work = _conv_scratch(U, 2)
        _conv_deriv_chain(U, W, b, idx[c, 0], idx[c, 1], l0, ls, h, act, xp, work, D, d_lo,
                          done)


_DERIV_DRIVERS = {"dense": (_dense_deriv_chains, _dense_deriv_chains_par),
                  "conv": (_conv_deriv_chains, _conv_deriv_chains_par)}


@njit(cache=True)
def _dense_adj_scratch(U, mode):
    return np.empty(U.shape[1:], dtype=U.dtype), np.empty(U.shape[1:], dtype=U.dtype)


@njit(cache=True)
def _dense_adj_chain(U, G, has_g, R, W, P, d0, first, n, o, layer0, layer_step, h, act, mode,
                     s, z):
    total = 0.0
    if mode == 2 and o < 0:  # a relaxation chain (as in _dense_fwd_chain)
        for i in range(first, first + n):
            l = layer0 + i * layer_step
            lam, y = U[i - 1], U[i]
            _dense_adj_z(lam, W[l], P[l - d0], s, z)
            _dense_out(lam, z, None, h, 0, y, y, G[i], has_g, 2)
        return total
    for i in range(first, first + n):
        l = layer0 + i * layer_step
        out = R[o] if o >= 0 else U[i]
        _dense_adj_step(U[i - 1], W[l], P[l - d0], h, s, z, out, U[i], G[i], has_g, mode)
        total += _sumsq(out) if mode == 0 else 0.0
    return total


@njit(cache=True)
def _conv_scratch(U, mode):
    """(padded sample (C, Np) whose border stays zero: reusable across chains, the GEMM result
    z (C, L) of one sample) for stores U (slots, B, C, H, W)."""
    _, _, C, H, Wd = U.shape
    geo = _conv_geometry(2, (H, Wd))
    return np.zeros((C, geo[4]), dtype=U.dtype), _conv_work(C, geo, U)


@njit(cache=True)
def _conv_fwd_chain(U, G, has_g, R, W, P, d0, first, n, o, layer0, layer_step, h, act, mode,
                    xp, work):
    total = 0.0
    for i in range(first, first + n):
        l = layer0 + i * layer_step
        out = R[o] if o >= 0 else U[i]
        _conv_fwd_step(U[i - 1], W[l], P[l], h, act, xp, work, out, U[i], G[i], has_g, mode)
        total += _sumsq(out) if mode == 0 else 0.0
    return total


@njit(cache=True)
def _conv_adj_chain(U, G, has_g, R, W, P, d0, first, n, o, layer0, layer_step, h, act, mode,
                    sp, work):
    total = 0.0
    for i in range(first, first + n):
        l = layer0 + i * layer_step
        out = R[o] if o >= 0 else U[i]
        _conv_adj_step(U[i - 1], W[l], P[l - d0], h, sp, work, out, U[i], G[i], has_g, mode)
        total += _sumsq(out) if mode == 0 else 0.0
    return total


# Drivers, serial and parallel (the same chain bodies, so the two agree to the last bit): they
# return the sum of the chains' norms (mode 0), added in chain order.
@njit(cache=True)
def _sum(a):
    total = 0.0
    for k in range(a.size):
        total += a[k]
    return total


@njit(cache=True)
def _dense_fwd(U, G, has_g, R, W, P, d0, idx, outs, l0, ls, h, act, mode):
    a, b = _dense_fwd_scratch(U, mode)
    total = 0.0
    for c in range(idx.shape[0]):
        total += _dense_fwd_chain(
            U, G, has_g, R, W, P, d0, idx[c, 0], idx[c, 1] if idx.shape[1] == 2 else 1,
            outs[c] if outs.size else -1, l0, ls, h, act, mode, a, b)
    return total


@njit(cache=True, parallel=True)
def _dense_fwd_par(U, G, has_g, R, W, P, d0, idx, outs, l0, ls, h, act, mode):
    norms = np.zeros(idx.shape[0])
    for c in prange(idx.shape[0]):
        a, b = _dense_fwd_scratch(U, mode)
        norms[c] = _dense_fwd_chain(
            U, G, has_g, R, W, P, d0, idx[c, 0], idx[c, 1] if idx.shape[1] == 2 else 1,
            outs[c] if outs.size else -1, l0, ls, h, act, mode, a, b)
    return _sum(norms)


@njit(cache=True)
def _dense_adj(U, G, has_g, R, W, P, d0, idx, outs, l0, ls, h, act, mode):
    a, b = _dense_adj_scratch(U, mode)
    total = 0.0
    for c in range(idx.shape[0]):
        total += _dense_adj_chain(
            U, G, has_g, R, W, P, d0, idx[c, 0], idx[c, 1] if idx.shape[1] == 2 else 1,
            outs[c] if outs.size else -1, l0, ls, h, act, mode, a, b)
    return total


@njit(cache=True, parallel=True)
def _dense_adj_par(U, G, has_g, R, W, P, d0, idx, outs, l0, ls, h, act, mode):
    norms = np.zeros(idx.shape[0])
    for c in prange(idx.shape[0]):
        a, b = _dense_adj_scratch(U, mode)
        norms[c] = _dense_adj_chain(
            U, G, has_g, R, W, P, d0, idx[c, 0], idx[c, 1] if idx.shape[1] == 2 else 1,
            outs[c] if outs.size else -1, l0, ls, h, act, mode, a, b)
    return _sum(norms)


@njit(cache=True)
def _conv_fwd(U, G, has_g, R, W, P, d0, idx, outs, l0, ls, h, act, mode):
    a, b = _conv_scratch(U, mode)
    total = 0.0
    for c in range(idx.shape[0]):
        total += _conv_fwd_chain(
            U, G, has_g, R, W, P, d0, idx[c, 0], idx[c, 1] if idx.shape[1] == 2 else 1,
            outs[c] if outs.size else -1, l0, ls, h, act, mode, a, b)
    return total


@njit(cache=True, parallel=True)
def _conv_fwd_par(U, G, has_g, R, W, P, d0, idx, outs, l0, ls, h, act, mode):
    norms = np.zeros(idx.shape[0])
    for c in prange(idx.shape[0]):
        a, b = _conv_scratch(U, mode)
        norms[c] = _conv_fwd_chain(
            U, G, has_g, R, W, P, d0, idx[c, 0], idx[c, 1] if idx.shape[1] == 2 else 1,
            outs[c] if outs.size else -1, l0, ls, h, act, mode, a, b)
    return _sum(norms)


@njit(cache=True)
def _conv_adj(U, G, has_g, R, W, P, d0, idx, outs, l0, ls, h, act, mode):
    a, b = _conv_scratch(U, mode)
    total = 0.0
    for c in range(idx.shape[0]):
        total += _conv_adj_chain(
            U, G, has_g, R, W, P, d0, idx[c, 0], idx[c, 1] if idx.shape[1] == 2 else 1,
            outs[c] if outs.size else -1, l0, ls, h, act, mode, a, b)
    return total


@njit(cache=True, parallel=True)
def _conv_adj_par(U, G, has_g, R, W, P, d0, idx, outs, l0, ls, h, act, mode):
    norms = np.zeros(idx.shape[0])
    for c in prange(idx.shape[0]):
        a, b = _conv_scratch(U, mode)
        norms[c] = _conv_adj_chain(
            U, G, has_g, R, W, P, d0, idx[c, 0], idx[c, 1] if idx.shape[1] == 2 else 1,
            outs[c] if outs.size else -1, l0, ls, h, act, mode, a, b)
    return _sum(norms)


_DRIVERS = {("dense", False): (_dense_fwd, _dense_fwd_par),
            ("dense", True): (_dense_adj, _dense_adj_par),
            ("conv", False): (_conv_fwd, _conv_fwd_par),
            ("conv", True): (_conv_adj, _conv_adj_par)}


@njit(cache=True)
def _index_check(idx, outs, m, n_out):
    """Compiled twin of :func:`mgnn.backend.numpy_ref.index_check` (same codes, same k)."""
    n, chains = idx.shape[0], idx.shape[1] == 2
    for k in range(n):
        if chains and idx[k, 1] < 0:
            return 1, k, 0, -1
    lo, hi = m + 1, 0  # lo > hi: no step
    for k in range(n):
        ln = idx[k, 1] if chains else 1
        if ln > 0:
            if idx[k, 0] < 1 or idx[k, 0] + ln > m:
                return (2 if chains else 4), k, 0, -1
            lo, hi = min(lo, idx[k, 0]), max(hi, idx[k, 0] + ln - 1)
    for k in range(outs.size):
        if outs[k] < 0 or outs[k] >= n_out:
            return 5, k, 0, -1
    if chains and n > 1:
        order = np.argsort(idx[:, 0], kind="mergesort")
        end = -1
        for k in order:
            if idx[k, 1] > 0:
                if end >= 0 and idx[k, 0] <= end:
                    return 3, k, 0, -1
                end = idx[k, 0] + idx[k, 1]
    if outs.size > 1:
        srt = np.sort(outs)
        for k in range(1, srt.size):
            if srt[k] == srt[k - 1]:
                return 6, srt[k], 0, -1
    return 0, 0, lo, hi


#: Arguments already validated by :func:`check_stacked` (the solver passes the same stores and
#: index arrays every cycle): key -> (result, the arrays, kept alive so their ids stay theirs).
_VALIDATED = {}


def _check(*args, **kw):
    """:func:`check_stacked`, memoised on the arrays' identities, shapes, strides and dtypes and
    the index arrays' contents (a few us instead of ~25 us per call)."""
    key = []
    for a in args + tuple(kw.values()):
        if type(a) is np.ndarray:
            key += (id(a), a.shape, a.strides, a.dtype.char)
            if a.dtype.kind in "iu":  # index arrays: their contents matter
                key.append(a.tobytes())
        else:
            key.append(a)
    try:
        key = tuple(key)
        hit = _VALIDATED.get(key)
    except TypeError:  # an unhashable argument (a list of slots): check every time
        return check_stacked(*args, index_check=_index_check, **kw)
    if hit is not None:
        return hit[0]
    out = check_stacked(*args, index_check=_index_check, **kw)
    if len(_VALIDATED) >= 512:
        _VALIDATED.clear()
    _VALIDATED[key] = (out, args, kw)
    return out


def _run(kind, adjoint, U, G, R, W, P, d0, idx, outs, layer0, layer_step, h, act, mode,
         parallel=None):
    """One driver call; ``parallel`` None: the prange variant iff threads and > 1 chain."""
    if parallel is None:
        parallel = idx.shape[0] > 1 and numba.get_num_threads() > 1
    return _call_driver(_DRIVERS[kind, adjoint][bool(parallel)], parallel or kind == "conv",
                        U, U if G is None else G, G is not None, U if R is None else R, W, P, d0,
                        idx, outs, layer0, layer_step, h, act, mode)


def _call_driver(driver, blas_in_threads, *args):
    """``driver(*args)``; with ``blas_in_threads`` (a prange driver whose threads call np.dot,
    or any conv driver) under one BLAS thread, since BLAS threads of its own would
    oversubscribe the cores (and a conv's bits must not depend on the thread counts)."""
    if not blas_in_threads:
        return driver(*args)
    with one_blas_thread():
        return driver(*args)


def _stacked_kind(kind):
    def chains_forward(U, G, W, b, chains, layer0, layer_step, h, act, parallel=None):
        s, o, h = _check(kind, U, G, W, b, chains, layer0, layer_step, h, act)
        _run(kind, False, U, G, None, W, b, 0, s, o, layer0, layer_step, h, act, 2, parallel)

    def points_forward(U, G, R, W, b, slots, out_slots, layer0, layer_step, h, act, mode,
                       parallel=None):
        s, o, h = _check(kind, U, G, W, b, slots, layer0, layer_step, h, act, R, out_slots, mode)
        return _run(kind, False, U, G, R, W, b, 0, s, o, layer0, layer_step, h, act, mode,
                    parallel)

    def chains_adjoint(L, G, W, D, d0, chains, layer0, layer_step, h, parallel=None):
        s, o, h = _check(kind, L, G, W, D, chains, layer0, layer_step, h, d0=d0)
        _run(kind, True, L, G, None, W, D, d0, s, o, layer0, layer_step, h, 2, 2, parallel)

    def points_adjoint(L, G, R, W, D, d0, slots, out_slots, layer0, layer_step, h, mode,
                       parallel=None):
        s, o, h = _check(kind, L, G, W, D, slots, layer0, layer_step, h, None, R, out_slots,
                         mode, d0)
        return _run(kind, True, L, G, R, W, D, d0, s, o, layer0, layer_step, h, 2, mode,
                    parallel)

    def chains_forward_derivs(U, W, b, chains, layer0, layer_step, h, act, D, d_lo, done,
                              parallel=None):
        s, o, h = _check(kind, U, None, W, b, chains, layer0, layer_step, h, act)
        _check_derivs(U, D, d_lo, done)
        if parallel is None:
            parallel = s.shape[0] > 1 and numba.get_num_threads() > 1
        _call_driver(_DERIV_DRIVERS[kind][bool(parallel)], bool(parallel) or kind == "conv", U,
                     W, b, s, layer0, layer_step, h, act, D, int(d_lo), done)

    fns = {}
    for fn in (chains_forward, points_forward, chains_adjoint, points_adjoint):
        fn.__name__ = fn.__qualname__ = f"{kind}_{fn.__name__}"
        fn.__doc__ = (f"Numba kernel, one call for all chains / points; contract of "
                      f":data:`mgnn.backend.STACKED_KERNELS`. ``parallel`` (None: threads and "
                      f"more than one chain) picks the prange variant.")
        fns[fn.__name__] = fn
    chains_forward_derivs.__name__ = chains_forward_derivs.__qualname__ = \
        f"{kind}_chains_forward_derivs"
    chains_forward_derivs.__doc__ = (
        f"Numba kernel (optional, Numba only; :meth:`mgnn.blocks.layers._StepKind."
        f"chains_forward_derivs`): ``{kind}_chains_forward`` without right-hand sides, the same "
        f"states bit for bit, each step out of slot i - 1 through layer l also writing sigma'(z "
        f"+ b) into D[l - d_lo] (0 <= l - d_lo < len(D)) and setting the int8 flag "
        f"done[l - d_lo]. D (rows, *state) of U's dtype; ``parallel`` as the stacked kernels.")
    fns[chains_forward_derivs.__name__] = chains_forward_derivs
    return fns


def _check_derivs(U, D, d_lo, done):
    """The linearisation store of ``<kind>_chains_forward_derivs``: D (rows, *state) of U's
    dtype, C-contiguous; the flags and d_lo as :func:`check_kept`."""
    if (getattr(D, "dtype", None) != U.dtype or D.shape[1:] != U.shape[1:]
            or not D.flags.c_contiguous):
        raise ValueError(f"D must be a C-contiguous {U.dtype} array of shape (*, "
                         f"{', '.join(map(str, U.shape[1:]))}), got {getattr(D, 'dtype', None)} "
                         f"{getattr(D, 'shape', type(D).__name__)}")
    check_kept(done, D.shape[0], d_lo)


def check_kept(done, rows, d_lo=0):
    """The int8 flags ``done`` (1-D, at least ``rows``) of a kept linearisation
    (``KEEP_KERNELS``), and the first layer ``d_lo`` (an int): ValueError / TypeError."""
    if getattr(done, "dtype", None) != np.int8 or done.ndim != 1 or done.shape[0] < rows:
        raise ValueError(f"done must be an int8 array of at least {rows} flags, got "
                         f"{getattr(done, 'dtype', None)} {getattr(done, 'shape', None)}")
    if isinstance(d_lo, bool) or not isinstance(d_lo, (int, np.integer)):
        raise TypeError(f"d_lo must be an int, got {type(d_lo).__name__}")


globals().update(_stacked_kind("dense"))
globals().update(_stacked_kind("conv"))
