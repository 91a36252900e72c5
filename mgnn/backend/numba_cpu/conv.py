"""2D 3x3 convolution steps on the flat padded layout, by register-blocked SIMD tiles
(:mod:`mgnn.backend.conv_tiles`): forward, vjps, kernel gradients, sweeps."""

import numpy as np
import numba
from numba import prange

from ..blas_threads import one_blas_thread
from .. import conv_tiles as _tiles
from .activations import _dsig, _sig, njit


# ---------------------------------------------------------------------------------------- conv
# 2D (3x3) and 3D (3x3x3) convolutions share one core: direct convolution over a flat padded
# layout by register-blocked SIMD tiles (:mod:`mgnn.backend.conv_tiles`). A sample (C, rows, W)
# -- 2D: rows = H; 3D: rows = D H, the (B, C, D, H, W) state seen as (B, C, D H, W) -- is
# zero-padded by 1 and stored flat, xp (C, Np): row stride RS = W + 1 (one zero column between
# rows serves as the right border of one and the left of the next), plane stride PS = (H + 2) RS
# (3D); Np = (H + 2) RS + 1 (2D) or (D + 2) PS + 1 (3D), plus CONV_BLK positions of zero slack
# (a tile reads whole vectors). Output row r (plane r // H, row r % H) starts at run position
# j = (r // H) PS + (r % H) RS, and tap t reads xp[c, offs[t] + j + x] (offs: dy RS + dx, or
# dz PS + dy RS + dx). The run between two rows crosses only border positions, which are
# computed and dropped; the run of L positions is computed in whole tiles (Lz, L rounded up to
# CONV_BLK), so z has Lz columns:
#   forward      z (Co, Lz) = sum_{i, t} K[:, i, t] xp[i, offs[t] + j]: tiles of MR channels x
#                CONV_BLK positions, the weights packed per tile (:func:`_kpack`)
#   input vjp    z (Ci, Lz) the same on the padded cotangent sp with the flipped kernel
#                Kf[i, c, t] = K[c, i, T-1-t] (the transposed convolution as a correlation:
#                offs[T-1-t] = 2 q0 - offs[t])
#   kernel grad  gK[t, c, i] = sum_j sp[c, q0 + j] xp[i, offs[t] + j] over the whole run (border
#                positions of sp are zero): tiles of MR channels x NV taps
# and the bias / activation / residual / derivative epilogue is one pass over z's rows that
# writes the outputs. No im2col, no BLAS: the tiles reach OpenBLAS's large-GEMM rate at every
# channel count (36 GFLOP/s on an AVX2 Zen core whose sgemm peaks at 37; the BLAS GEMMs per
# tap ran at 8-22 there), whatever OPENBLAS_CORETYPE says. Every path (single kernels, sweeps,
# stacked chains, captured tapes, shared steps) runs a sample through the same functions, so
# their results agree bit for bit; threads work on blocks of samples and the kernel gradient is
# summed per sample, then over samples in order: the same bits for any thread count.
CONV_MR = _tiles.MR  #: output channels per tile
CONV_BLK = _tiles.blk(np.dtype(np.float32))  #: run positions per float32 tile (2 float64 tiles)


@njit(cache=True, inline="always")
def _row_start(r, Hpl, RS, PS):
    """Run position of output row r (plane r // Hpl, row r % Hpl)."""
    return (r // Hpl) * PS + (r % Hpl) * RS


@njit(cache=True)
def _conv_geometry(nd, shape):
    """(Hpl, RS, PS, q0, Np, L, Lz) of the flat padded layout of a sample of spatial ``shape``:
    (H, W) for nd = 2, (D, H, W) for nd = 3; q0 is the padded position of output (0, 0[, 0]),
    Np the padded length with CONV_BLK of slack, L the run's length, Lz L rounded up to
    CONV_BLK. Rows share their zero border column (RS = W + 1): 1/W extra work in the run."""
    Hpl, Wd = shape[nd - 2], shape[nd - 1]
    RS = Wd + 1
    PS = (Hpl + 2) * RS
    nrows = Hpl if nd == 2 else shape[0] * Hpl
    L = _row_start(nrows - 1, Hpl, RS, PS) + Wd
    Lz = (L + CONV_BLK - 1) // CONV_BLK * CONV_BLK
    if nd == 2:
        return Hpl, RS, PS, RS + 1, PS + 1 + CONV_BLK, L, Lz
    return Hpl, RS, PS, PS + RS + 1, (shape[0] + 2) * PS + 1 + CONV_BLK, L, Lz


@njit(cache=True)
def _conv_offsets(nd, RS, PS):
    """Tap offsets (9 or 27,) int64 in the order of K's trailing axes (dz,) dy, dx."""
    T = 9 if nd == 2 else 27
    offs = np.empty(T, dtype=np.int64)
    for t in range(T):
        dz, dy, dx = t // 9, (t // 3) % 3, t % 3
        offs[t] = dz * PS + dy * RS + dx
    return offs


@njit(cache=True)
def _kpack(Kmat, T, flip):
    """Kmat (Co, Ci T) -> the tiles' weights (ceil(Co / MR), Ci T MR), [b, (i T + t) MR + r] =
    K[b MR + r, i, t] (zero past Co); with ``flip`` those of the transposed convolution,
    (ceil(Ci / MR), Co T MR), [b, (c T + t) MR + r] = K[c, b MR + r, T-1-t]."""
    Co, Ci = Kmat.shape[0], Kmat.shape[1] // T
    n_out, n_red = (Ci, Co) if flip else (Co, Ci)
    nb = (n_out + CONV_MR - 1) // CONV_MR
    out = np.zeros((nb, n_red * T * CONV_MR), dtype=Kmat.dtype)
    for o in range(n_out):
        bk, r = o // CONV_MR, o % CONV_MR
        for i in range(n_red):
            for t in range(T):
                if flip:
                    out[bk, (i * T + t) * CONV_MR + r] = Kmat[i, o * T + T - 1 - t]
                else:
                    out[bk, (i * T + t) * CONV_MR + r] = Kmat[o, i * T + t]
    return out


@njit(cache=True)
def _conv_work(Co, geo, dtype_of):
    """A 1-D scratch for the result z (Co, Lz) of one sample's convolution with Co outputs."""
    return np.empty(Co * geo[6], dtype=dtype_of.dtype)


@njit(cache=True, inline="always")
def _pad_flat(x, d, bi, xp, times_d, Hpl, RS, PS, q0):
    """Interior of xp (C, Np) = x[bi] (C, rows, W) [* d[bi] when ``times_d``]; the border and
    the slack are untouched (zero)."""
    for c in range(x.shape[1]):
        for r in range(x.shape[2]):
            base = q0 + _row_start(r, Hpl, RS, PS)
            row = xp[c, base:base + x.shape[3]]
            for xx in range(x.shape[3]):
                row[xx] = d[bi, c, r, xx] * x[bi, c, r, xx] if times_d else x[bi, c, r, xx]


@njit(cache=True)
def _conv_run(xp, Kp, offs, geo, work):
    """z (Co, Lz) = the convolution of the padded sample xp (Ci, Np) over its whole run, Kp the
    packed weights (:func:`_kpack`) of Co = work.size // Lz outputs, by tiles of CONV_MR
    channels x one SIMD block of positions (positions outer: a block's inputs stay in L1 for
    every channel tile); z lives in ``work``."""
    Lz = geo[6]
    Co = work.size // Lz
    Ci, T = xp.shape[0], offs.size
    xf, kf = xp.reshape(xp.size), Kp.reshape(Kp.size)
    step = CONV_BLK * 4 // xp.itemsize
    per_blk = Ci * T * CONV_MR
    for j in range(0, geo[5], step):
        for bk in range(Kp.shape[0]):
            _tiles.conv_tile(work, bk * CONV_MR * Lz + j, Lz, Co - bk * CONV_MR, xf, j,
                             xp.shape[1], kf, bk * per_blk, offs, T, Ci)
    return work.reshape((Co, Lz))


@njit(cache=True)
def _conv_kgrad(sp, xp, offs, geo, gKt):
    """gKt (T, Co, Ci) = sum_j sp[c, q0 + j] xp[i, offs[t] + j] over the run (rounded up to a
    vector: sp's border and slack are zero), by tiles of CONV_MR channels x NV taps."""
    T, Co, Ci = gKt.shape
    q0, Np = geo[3], geo[4]
    vec = _tiles.VBYTES // sp.itemsize
    n = (geo[5] + vec - 1) // vec * vec
    spf, xpf, gf = sp.reshape(sp.size), xp.reshape(xp.size), gKt.reshape(gKt.size)
    for bk in range((Co + CONV_MR - 1) // CONV_MR):
        c0 = bk * CONV_MR
        for i in range(Ci):
            for t0 in range(0, T, _tiles.NV):
                _tiles.kgrad_tile(gf, (t0 * Co + c0) * Ci + i, Ci, Co * Ci, Co - c0, T - t0,
                                  spf, c0 * Np + q0, Np, xpf, i * Np, offs, t0, n)


@njit(cache=True, fastmath={"reassoc"})
def _sum64(a):
    """sum of a (1-D) in float64, reassociated into SIMD partial sums (a fixed order for a
    given length: the same bits on every call)."""
    t = 0.0
    for j in range(a.size):
        t += np.float64(a[j])
    return t


@njit(cache=True, inline="always")
def _fwd_row(zr, xr, yr, Dr, bc, h, act, residual):
    """One output row in one pass: v = zr + bc, yr = [xr +] h sigma(v) and Dr = sigma'(v), each
    when non-empty (the flags are loop-invariant: the loop is unswitched and vectorises). x + h
    sigma is evaluated in float64 and rounded once, as the dense stacked epilogue
    (stacked._fwd_phi) does: sigma's type may differ between a constant and a variable act (branch pruning),
    float64 arithmetic on its value does not, so the bits agree."""
    want_y, want_d = yr.size > 0, Dr.size > 0
    for xx in range(zr.size):
        v = zr[xx] + bc
        if want_y:
            if residual:
                yr[xx] = xr[xx] + h * np.float64(_sig(v, act))
            else:
                yr[xx] = h * np.float64(_sig(v, act))
        if want_d:
            Dr[xx] = _dsig(v, act)


@njit(cache=True)
def _conv_sample_forward(x, bi, Kp, b, h, act, residual, offs, geo, xp, work, y, D):
    """y[bi] = [x[bi] +] h sigma(conv(x[bi]) + b) and D[bi] = sigma'(.) (each when non-empty);
    x, y, D seen as (B, C, rows, W); Kp the packed weights (:func:`_kpack`)."""
    Hpl, RS, PS, q0 = geo[0], geo[1], geo[2], geo[3]
    nrows, Wd = x.shape[2], x.shape[3]
    _pad_flat(x, x, bi, xp, False, Hpl, RS, PS, q0)
    z = _conv_run(xp, Kp, offs, geo, work)
    for c in range(z.shape[0]):
        bc = b[c]
        for r in range(nrows):
            start = _row_start(r, Hpl, RS, PS)
            zr = z[c, start:start + Wd]
            xr = x[bi, c, r] if x.shape[1] == z.shape[0] else zr
            yr = y[bi, c, r] if y.shape[0] else zr[:0]
            Dr = D[bi, c, r] if D.shape[0] else zr[:0]
            if act == 0:  # a constant act per loop: its branches fold, the loops vectorise
                _fwd_row(zr, xr, yr, Dr, bc, h, 0, residual)
            elif act == 1:
                _fwd_row(zr, xr, yr, Dr, bc, h, 1, residual)
            else:
                _fwd_row(zr, xr, yr, Dr, bc, h, 2, residual)


@njit(cache=True)
def _conv_sample_vjp(sp, xp, bi, Kf, h, residual, offs, geo, work, gy, gx, gKt, gb,
                     want_input, want_params):
    """Of sample bi, from its padded cotangent sp (Co, Np) and padded input xp (Ci, Np): gx[bi]
    = [gy[bi] +] h conv^T(s) (``want_input``; Kf the flipped packed weights, :func:`_kpack`),
    and (``want_params``) gKt (T, Co, Ci) by :func:`_conv_kgrad` and gb (Co,) float64 = sum of
    s (its border positions are zero)."""
    Hpl, RS, PS, q0, L = geo[0], geo[1], geo[2], geo[3], geo[5]
    nrows, Wd = gy.shape[2], gy.shape[3]
    if want_params:
        for c in range(sp.shape[0]):
            gb[c] = _sum64(sp[c, q0:q0 + L])
        _conv_kgrad(sp, xp, offs, geo, gKt)
    if want_input:
        z = _conv_run(sp, Kf, offs, geo, work)
        for c in range(z.shape[0]):
            for r in range(nrows):
                start = _row_start(r, Hpl, RS, PS)
                zr, gr, gyr = z[c, start:start + Wd], gx[bi, c, r], gy[bi, c, r]
                if residual:
                    for xx in range(Wd):
                        gr[xx] = gyr[xx] + h * zr[xx]
                else:
                    for xx in range(Wd):
                        gr[xx] = h * zr[xx]


@njit(cache=True, parallel=True)
def _conv_forward_into(x, Kmat, b, h, act, residual, y, D, nd, shape, nblk):
    """y = [x +] h sigma(conv(x) + b), D = sigma'(.) of every sample into the given arrays (an
    output of shape (0, 0, 0, 0) is not computed), x, y, D (B, C, rows, W): ``nblk`` blocks of
    samples on Numba's threads (:func:`_blocks`; the bits do not depend on it)."""
    B, Co = x.shape[0], Kmat.shape[0]
    geo = _conv_geometry(nd, shape)
    offs = _conv_offsets(nd, geo[1], geo[2])
    Kp = _kpack(Kmat, offs.size, False)
    nblk = max(1, min(B, nblk))
    for blk in prange(nblk):  # a block of samples per thread: its scratch allocated once
        xp = np.zeros((x.shape[1], geo[4]), dtype=x.dtype)
        work = _conv_work(Co, geo, x)
        for bi in range(blk * B // nblk, (blk + 1) * B // nblk):
            _conv_sample_forward(x, bi, Kp, b, h, act, residual, offs, geo, xp, work, y, D)


@njit(cache=True)
def _conv_forward_all(x, Kmat, b, h, act, residual, want_y, want_deriv, nd, shape, nblk):
    """(y, sigma') of every sample into new arrays (each empty when not wanted)."""
    out_shape = (x.shape[0], Kmat.shape[0], x.shape[2], x.shape[3])
    y = np.empty(out_shape if want_y else (0, 0, 0, 0), dtype=x.dtype)
    D = np.empty(out_shape if want_deriv else (0, 0, 0, 0), dtype=x.dtype)
    _conv_forward_into(x, Kmat, b, h, act, residual, y, D, nd, shape, nblk)
    return y, D


@njit(cache=True, parallel=True)
def _conv_vjp_into(gy, deriv, x, Kmat, h, residual, want_input, want_params, nd, shape, nblk,
                   gx, gK, gb):
    """gx (B, Ci, rows, W) [= gy +] h conv^T(s) (``want_input``), gK (Co, Ci T) and gb (Co,)
    (``want_params``) of every sample into the given arrays, s = deriv * gy: blocks of samples
    on threads, gK and gb summed over samples in order."""
    B, Co, nrows, Wd = gy.shape
    T = 9 if nd == 2 else 27
    Ci = Kmat.shape[1] // T
    geo = _conv_geometry(nd, shape)
    offs = _conv_offsets(nd, geo[1], geo[2])
    Kf = _kpack(Kmat, T, True)
    gKts = np.empty((B if want_params else 0, T, Co, Ci), dtype=gy.dtype)
    gbs = np.empty((B if want_params else 0, Co))
    nblk = max(1, min(B, nblk))
    for blk in prange(nblk):  # a block of samples per thread: its scratch allocated once
        sp = np.zeros((Co, geo[4]), dtype=gy.dtype)
        xp = np.zeros((Ci if want_params else 0, geo[4]), dtype=gy.dtype)
        work = _conv_work(Ci, geo, gy)
        gKt0 = np.empty((0, Co, Ci), dtype=gy.dtype)
        gb0 = np.empty(0)
        for bi in range(blk * B // nblk, (blk + 1) * B // nblk):
            _pad_flat(gy, deriv, bi, sp, True, geo[0], geo[1], geo[2], geo[3])
            if want_params:
                _pad_flat(x, x, bi, xp, False, geo[0], geo[1], geo[2], geo[3])
            _conv_sample_vjp(sp, xp, bi, Kf, h, residual, offs, geo, work, gy, gx,
                             gKts[bi] if want_params else gKt0,
                             gbs[bi] if want_params else gb0, want_input, want_params)
    if want_params:
        tK = np.zeros((T, Co, Ci), dtype=gy.dtype)
        tb = np.zeros(Co)
        for bi in range(B):
            for c in range(Co):
                tb[c] += gbs[bi, c]
            for t in range(T):
                for c in range(Co):
                    for i in range(Ci):
                        tK[t, c, i] += gKts[bi, t, c, i]
        for c in range(Co):
            gb[c] = h * tb[c]
            for i in range(Ci):
                for t in range(T):
                    gK[c, i * T + t] = h * tK[t, c, i]


@njit(cache=True)
def _conv_vjp_all(gy, deriv, x, Kmat, h, residual, want_input, want_params, nd, shape, nblk):
    """(gx, gK (Co, Ci T), gb (Co,)) of every sample into new arrays (gx empty when not
    wanted, gK and gb zero), by :func:`_conv_vjp_into`."""
    B, Co, nrows, Wd = gy.shape
    gx = np.empty((B, Kmat.shape[1] // (9 if nd == 2 else 27), nrows, Wd) if want_input
                  else (0, 0, 0, 0), dtype=gy.dtype)
    gK = np.zeros((Co, Kmat.shape[1]), dtype=gy.dtype)
    gb = np.zeros(Co, dtype=gy.dtype)
    _conv_vjp_into(gy, deriv, x, Kmat, h, residual, want_input, want_params, nd, shape, nblk,
                   gx, gK, gb)
    return gx, gK, gb


def _kmat(K):
    """K (Co, Ci, 3, 3[, 3]) as the C-contiguous weight matrix (Co, Ci T)."""
    K = np.ascontiguousarray(K)
    return K.reshape(K.shape[0], -1)


def _rows4(a):
    """a (B, C, *spatial) C-contiguous, seen as (B, C, rows, W)."""
    a = np.ascontiguousarray(a)
    return a.reshape(a.shape[0], a.shape[1], -1, a.shape[-1])


def _blocks():
    """Sample blocks of the conv drivers: one per Numba thread (numba.get_num_threads inside
    an njit function would make it uncacheable)."""
    return numba.get_num_threads()


def _conv_fwd_call(x, K, b, h, act, residual, want_y, want_deriv):
    """Both outputs of the forward core for a 2D or 3D x, shaped as the states (or empty)."""
    nd = x.ndim - 2
    with one_blas_thread():
        y, D = _conv_forward_all(_rows4(x), _kmat(K), np.ascontiguousarray(b), h, int(act),
                                 bool(residual), want_y, want_deriv, nd, tuple(x.shape[2:]),
                                 _blocks())
    shape = (x.shape[0], K.shape[0]) + x.shape[2:]
    return (y.reshape(shape) if want_y else y), (D.reshape(shape) if want_deriv else D)


def _conv_vjp_call(gy, deriv, x, K, h, residual, want_input, want_params):
    """(gx, gK, gb) of the core for a 2D or 3D cotangent gy (each empty when not wanted)."""
    nd = gy.ndim - 2
    Kmat = _kmat(K)
    with one_blas_thread():
        gx, gK, gb = _conv_vjp_all(_rows4(gy), _rows4(deriv), _rows4(x), Kmat, h,
                                   bool(residual), want_input, want_params, nd,
                                   tuple(gy.shape[2:]), _blocks())
    if want_input:
        gx = gx.reshape((gy.shape[0], K.shape[1]) + gy.shape[2:])
    return gx, gK.reshape(K.shape), gb


def conv_forward(x, K, b, h, act, residual):
    return _conv_fwd_call(x, K, b, h, act, residual, True, False)[0]


def conv_forward_deriv(x, K, b, h, act, residual):
    return _conv_fwd_call(x, K, b, h, act, residual, True, True)


def conv_deriv(x, K, b, act):
    return _conv_fwd_call(x, K, b, x.dtype.type(1), act, False, False, True)[1]


def conv_vjp_input(gy, deriv, K, h, residual):
    return _conv_vjp_call(gy, deriv, gy, K, h, residual, True, False)[0]


def conv_vjp(gy, deriv, x, K, h, residual):
    return _conv_vjp_call(gy, deriv, x, K, h, residual, True, True)


def conv_vjp_params(gy, deriv, x, h):
    K = np.empty((gy.shape[1], x.shape[1], 3, 3), dtype=gy.dtype)  # shape only
    return _conv_vjp_call(gy, deriv, x, K, h, False, False, True)[1:]


def conv_sweep_forward(U, W, b, h, act, D):
    """Numba: U[n+1] = U[n] + h sigma(conv3x3(U[n], W[n]) + b[n]) for n < len(W), in place, and
    D[n] = sigma'(.) when D has length N (0: not stored); U (N+1, B, C, H, W) C-contiguous with
    U[0] set. The single kernels' core writing straight into the stores (no copies)."""
    nblk = _blocks()
    want_d = D.shape[0] > 0
    none = np.empty((0, 0, 0, 0), dtype=U.dtype)
    with one_blas_thread():
        for n in range(W.shape[0]):
            _conv_forward_into(U[n], _kmat(W[n]), b[n], h, int(act), True, U[n + 1],
                               D[n] if want_d else none, 2, tuple(U.shape[3:]), nblk)


def conv_sweep_backward(U, D, W, h, lam, gW, gb):
    """Numba: the adjoint of :func:`conv_sweep_forward`, lam_0 from lam = lam_N; U (N+1, B, C,
    H, W) and D (N, B, C, H, W) C-contiguous from the forward sweep; gW (N, C, C, 3, 3) and gb
    (N, C) are overwritten. The single kernels' core (the same bits as :func:`conv_vjp` layer
    by layer); the cotangents alternate between two arrays allocated once (a fresh state per
    layer cost ~0.6 ms of page faults at C 16, B 32, 28x28)."""
    nblk = _blocks()
    shape = tuple(U.shape[3:])
    bufs = (np.empty_like(U[0]), np.empty_like(U[0]))
    gK = np.empty((W.shape[1], W.shape[2] * 9), dtype=U.dtype)
    g = np.empty(W.shape[1], dtype=U.dtype)
    with one_blas_thread():
        for n in range(W.shape[0] - 1, -1, -1):
            out = bufs[n % 2]
            _conv_vjp_into(np.ascontiguousarray(lam), D[n], U[n], _kmat(W[n]), h, True, True,
                           True, 2, shape, nblk, out, gK, g)
            gW[n] = gK.reshape(W.shape[1:])
            gb[n] = g
            lam = out
    return lam


for _f, _ref in ((conv_forward, "conv_forward"), (conv_vjp_params, "conv_vjp_params"),
                 (conv_forward_deriv, "conv_forward_deriv"), (conv_deriv, "conv_deriv"),
                 (conv_vjp_input, "conv_vjp_input"), (conv_vjp, "conv_vjp")):
    _f.__doc__ = (f"Numba kernel (SIMD register tiles, threads over samples); contract of "
                  f":func:`mgnn.backend.numpy_ref.{_ref}`.")
