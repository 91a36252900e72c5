"""Numba CPU backend: ``@njit(cache=True)`` kernels with the signatures of :mod:`numpy_ref`.

Matrix products go to BLAS through ``np.dot`` inside the kernels with fused bias, activation and
residual epilogues; convolutions are direct loops parallel over the batch (``prange``). The layer
sweeps run a whole block of residual steps in one call, so the per-layer cost of a small network
is a few microseconds instead of a Python dispatch per layer. The stacked-state kernels
(:data:`mgnn.backend.STACKED_KERNELS`) run every chain of a relaxation wave in one call, chains on
Numba's threads (``prange``) when it has more than one.
"""
import math

import numpy as np
import numba
from numba import prange
from numba.extending import overload as _overload

from .jit import njit as _cache_safe_njit


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

from .blas_threads import one_blas_thread
from . import conv_tiles as _tiles
from . import tape as _T
from .numpy_ref import (_int, bn_dims, check_stacked, conv3d_check, gate_check,
                        recurrent_adjoint_check, recurrent_caches_check,
                        recurrent_cotangents_check, recurrent_stacked_check,
                        recurrent_sweep_back_check, recurrent_sweep_check)

name = "numba"
xp = np  #: array module of this backend
batched_relaxation = False  #: batching gains nothing on the CPU (see numpy_ref)


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
    sigma is evaluated in float64 and rounded once, as the chain epilogue (:func:`_phi_row`)
    does: sigma's type may differ between a constant and a variable act (branch pruning),
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


# -------------------------------------------------------------------------------------- conv3d
# The 3x3x3 convolutions run the same core (27 taps, rows = D H).
def conv3d_forward(x, K, b, h, act, residual):
    h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
    return _conv_fwd_call(x, K, b, h, act, residual, True, False)[0]


def conv3d_forward_deriv(x, K, b, h, act, residual):
    h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
    return _conv_fwd_call(x, K, b, h, act, residual, True, True)


def conv3d_deriv(x, K, b, act):
    conv3d_check(x=x, K=K, b=b, act=act)
    return _conv_fwd_call(x, K, b, x.dtype.type(1), act, False, False, True)[1]


def conv3d_vjp_input(gy, deriv, K, h, residual):
    h = conv3d_check(K=K, gy=gy, deriv=deriv, h=h, residual=residual)
    return _conv_vjp_call(gy, deriv, gy, K, h, residual, True, False)[0]


def conv3d_vjp(gy, deriv, x, K, h, residual):
    h = conv3d_check(x=x, K=K, gy=gy, deriv=deriv, h=h, residual=residual)
    return _conv_vjp_call(gy, deriv, x, K, h, residual, True, True)


def conv3d_vjp_params(gy, deriv, x, h):
    h = conv3d_check(x=x, gy=gy, deriv=deriv, h=h)
    K = np.empty((gy.shape[1], x.shape[1], 3, 3, 3), dtype=gy.dtype)  # shape only
    return _conv_vjp_call(gy, deriv, x, K, h, False, False, True)[1:]


for _f in (conv3d_forward, conv3d_forward_deriv, conv3d_deriv, conv3d_vjp_input, conv3d_vjp,
           conv3d_vjp_params):
    _f.__doc__ = (f"Numba kernel (the conv core with 27 taps); contract of "
                  f":func:`mgnn.backend.numpy_ref.{_f.__name__}`.")

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


# ------------------------------------------------------------------- interval-batched steps
def _export_batched():
    import sys
    from .batched_loops import batched_kernels
    globals().update(batched_kernels(sys.modules[__name__]))


_export_batched()


# --------------------------------------------------------------------- stacked-state kernels
# One njit call per Python call: each chain (first, length, out) runs its steps inside the kernel,
# chains in parallel (prange) when there are threads. Every step writes straight into its output
# slot through the same per-element code (_combine) as the single-step kernels' epilogues; the
# dense steps always take the fused np.dot path (never the NumPy route of WIDE).
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
def _phi_row(xf, e0, zr, bc, h, act, adjoint, dst):
    """dst = phi of one output row (elements e0 .. e0 + len(zr) of the flattened channel):
    x + h sigma(zr + bc) (forward; in float64, rounded once, as the single kernels'
    :func:`_fwd_row`) or x + h zr (adjoint). dst may be zr itself (element by element)."""
    for xx in range(zr.size):
        if adjoint:
            dst[xx] = xf[e0 + xx] + h * zr[xx]
        else:
            dst[xx] = xf[e0 + xx] + h * np.float64(_sig(zr[xx] + bc, act))


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


@njit(cache=True, inline="always")
def _chain_row(xf, of, uf, gf, pf, zr, e0, bc, h, h2, act, has_g, mode, share, adjoint):
    """One output row of a chain step (elements e0 .. e0 + len(zr) of the flattened channel):
    phi (:func:`_phi_row`) into zr in place, then combined into of by mode; with ``share``
    first the h2 step plain into pf. Two passes that vectorise, the same bits as one."""
    n = zr.size
    if share:
        _phi_row(xf, e0, zr, bc, h2, act, adjoint, pf[e0:e0 + n])
    _phi_row(xf, e0, zr, bc, h, act, adjoint, zr)
    _combine_row(zr, of[e0:e0 + n], uf[e0:e0 + n], gf[e0:e0 + n], has_g, mode)


@njit(cache=True)
def _conv_planes(x, Kl, bl, Dl, h, act, xp, work, out, u, g, has_g, mode, h2, p, share,
                 adjoint):
    """One conv step of every sample into out by mode (forward: x + h sigma(conv(x) + b);
    adjoint: x + h conv^T(Dl * x); bl is not read); Kl (C, C, 3, 3) the layer's kernel, grouped
    (flipped for the adjoint) by :func:`_kpack`; with ``share`` also the same with h2, plain,
    into p. The samples run through the single kernels' core (same bits)."""
    H, Wd = x.shape[2], x.shape[3]
    geo = _conv_geometry(2, (H, Wd))
    Hpl, RS, PS, q0 = geo[0], geo[1], geo[2], geo[3]
    offs = _conv_offsets(2, RS, PS)
    Kp = _kpack(Kl.reshape((Kl.shape[0], Kl.shape[1] * 9)), 9, adjoint)
    for bi in range(x.shape[0]):
        _pad_flat(x, Dl, bi, xp, adjoint, Hpl, RS, PS, q0)
        z = _conv_run(xp, Kp, offs, geo, work)
        for c in range(z.shape[0]):
            bc = z.dtype.type(0) if adjoint else bl[c]
            xf, of = x[bi, c].reshape(H * Wd), out[bi, c].reshape(H * Wd)
            uf, gf = u[bi, c].reshape(H * Wd), g[bi, c].reshape(H * Wd)
            pf = p[bi, c].reshape(H * Wd)
            for r in range(H):
                zr = z[c, r * RS:r * RS + Wd]
                if adjoint:  # constant act / adjoint per loop: the branches fold
                    _chain_row(xf, of, uf, gf, pf, zr, r * Wd, bc, h, h2, 2, has_g, mode,
                               share, True)
                elif act == 0:
                    _chain_row(xf, of, uf, gf, pf, zr, r * Wd, bc, h, h2, 0, has_g, mode,
                               share, False)
                elif act == 1:
                    _chain_row(xf, of, uf, gf, pf, zr, r * Wd, bc, h, h2, 1, has_g, mode,
                               share, False)
                else:
                    _chain_row(xf, of, uf, gf, pf, zr, r * Wd, bc, h, h2, 2, has_g, mode,
                               share, False)


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

    fns = {}
    for fn in (chains_forward, points_forward, chains_adjoint, points_adjoint):
        fn.__name__ = fn.__qualname__ = f"{kind}_{fn.__name__}"
        fn.__doc__ = (f"Numba kernel, one call for all chains / points; contract of "
                      f":data:`mgnn.backend.STACKED_KERNELS`. ``parallel`` (None: threads and "
                      f"more than one chain) picks the prange variant.")
        fns[fn.__name__] = fn
    return fns


globals().update(_stacked_kind("dense"))
globals().update(_stacked_kind("conv"))


# ------------------------------------------------------------ captured cycles (tapes)
# Layout: mgnn.backend.tape. One call runs a whole captured MGRIT cycle through the chain bodies
# above (the same per-step code as the stacked kernels: bit-identical to the engine's calls).
def _tape_body(U, G, has_g, R, W, P, d0, first, n, o, l0, ls, h, act, mode, a, b, adjoint):
    """The chain body of U's kind (dense: 3-d stores, conv: 5-d), forward (P = b) or adjoint
    (P = sigma', as many dimensions as the stores)."""


@overload(_tape_body)
def _tape_body_impl(U, G, has_g, R, W, P, d0, first, n, o, l0, ls, h, act, mode, a, b,
                    adjoint):
    # forward: P = b (N, c); adjoint: P = sigma' (layers, *state)
    body = {(3, False): _dense_fwd_chain, (3, True): _dense_adj_chain,
            (5, False): _conv_fwd_chain, (5, True): _conv_adj_chain}[U.ndim, P.ndim > 2]

    def impl(U, G, has_g, R, W, P, d0, first, n, o, l0, ls, h, act, mode, a, b, adjoint):
        return body(U, G, has_g, R, W, P, d0, first, n, o, l0, ls, h, act, mode, a, b)
    return impl


def _tape_shared(U, G, has_g, W, P, d0, i, l0, ls, h, h2, act, a, b, p):
    """The shared step into slot i of U and the coarse step out of U[i - 1] into p."""


@overload(_tape_shared)
def _tape_shared_impl(U, G, has_g, W, P, d0, i, l0, ls, h, h2, act, a, b, p):
    if U.ndim == 3 and P.ndim == 2:
        return lambda U, G, has_g, W, P, d0, i, l0, ls, h, h2, act, a, b, p: _dense_fwd_shared(
            U[i - 1], W[l0 + i * ls], P[l0 + i * ls], h, h2, act, a, U[i], G[i], has_g, p)
    if U.ndim == 3:
        return lambda U, G, has_g, W, P, d0, i, l0, ls, h, h2, act, a, b, p: _dense_adj_shared(
            U[i - 1], W[l0 + i * ls], P[l0 + i * ls - d0], h, h2, a, b, U[i], G[i], has_g, p)
    if P.ndim == 2:
        return lambda U, G, has_g, W, P, d0, i, l0, ls, h, h2, act, a, b, p: _conv_fwd_shared(
            U[i - 1], W[l0 + i * ls], P[l0 + i * ls], h, h2, act, a, b, U[i], G[i], has_g, p)
    return lambda U, G, has_g, W, P, d0, i, l0, ls, h, h2, act, a, b, p: _conv_adj_shared(
        U[i - 1], W[l0 + i * ls], P[l0 + i * ls - d0], h, h2, a, b, U[i], G[i], has_g, p)


def _tape_scratch(U):
    """Scratch of one chain body for stores like U (any mode, forward or adjoint)."""


@overload(_tape_scratch)
def _tape_scratch_impl(U):
    if U.ndim == 3:
        return lambda U: (np.empty(U.shape[1:], dtype=U.dtype),
                          np.empty(U.shape[1:], dtype=U.dtype))
    return lambda U: _conv_scratch(U, 0)


@njit(cache=True)
def _correct_into(u, uc, v):
    """u = u + (uc - v), elementwise (the states flattened)."""
    for e in range(u.size):
        u[e] = u[e] + (uc[e] - v[e])


@njit(cache=True)
def _correct_self(u, uc):
    """u = u + (uc - u), elementwise: the correction whose injected state is u itself."""
    for e in range(u.size):
        u[e] = u[e] + (uc[e] - u[e])


@njit(cache=True)
def _copy_into(dst, src):
    for e in range(dst.size):
        dst[e] = src[e]


@njit(cache=True)
def _inject_into(S, r, g, out, src):
    """Copy the state ``src`` (flat) into ``S[r][out]`` and, where ``g >= 0``, ``S[g][out]``."""
    _copy_into(S[r][out].reshape(-1), src)
    if g >= 0:
        _copy_into(S[g][out].reshape(-1), src)


@njit(cache=True)
def _tape_carried(S, row, part):
    """The correction (part 1) or injection (part 2) a CHAIN row carries (mgnn.backend.tape)."""
    U = S[row[_T.U]]
    if part == 1 and row[_T.CORR_SLOT] >= 0:
        u = U[row[_T.CORR_SLOT]].reshape(-1)
        uc = S[row[_T.CORR_G]][row[_T.CORR_OUT]].reshape(-1)
        if row[_T.CORR_R] >= 0:
            _correct_into(u, uc, S[row[_T.CORR_R]][row[_T.CORR_OUT]].reshape(-1))
        else:  # v is u's own bits (read_sources); a loop of its own, as u aliasing v would
            _correct_self(u, uc)  # fail the vectorised loop's overlap check
    elif part == 2 and row[_T.INJ_SLOT] >= 0:
        _inject_into(S, row[_T.INJ_R], row[_T.INJ_G], row[_T.INJ_OUT],
                     U[row[_T.INJ_SLOT]].reshape(-1))


@njit(cache=True)
def _tape_row(S, row, hs, W, P, d0, act, adjoint, a, b, p, steps_only=False):
    """Run one tape row (mgnn.backend.tape); returns the squared norm of a residual point.
    A CHAIN row runs what it carries first, unless ``steps_only`` (the threaded driver ran it)."""
    op, U = row[_T.OP], S[row[_T.U]]
    if op == _T.CHAIN and not steps_only:
        _tape_carried(S, row, 1)
        _tape_carried(S, row, 2)
    if op == _T.CHAIN or op == _T.POINT:
        has_g = row[_T.G] >= 0
        G = S[row[_T.G]] if has_g else U
        R = S[row[_T.R]] if row[_T.R] >= 0 else U
        l0, ls, h = row[_T.LAYER0], row[_T.LSTEP], hs[row[_T.H]]
        if op == _T.POINT:
            return _tape_body(U, G, has_g, R, W, P, d0, row[_T.FIRST], 1, row[_T.OUT], l0, ls,
                              h, act, row[_T.MODE], a, b, adjoint)
        first, n = row[_T.FIRST], row[_T.N]
        share = row[_T.SHARE_R] >= 0
        if share:  # the first step also gives the coarse step out of U[first - 1] (into p)
            _tape_shared(U, G, has_g, W, P, d0, first, l0, ls, h, hs[row[_T.SHARE_H]], act, a,
                         b, p)
            first, n = first + 1, n - 1
        _tape_body(U, G, has_g, U, W, P, d0, first, n, -1, l0, ls, h, act, 2, a, b, adjoint)
        t = 0.0
        if row[_T.R] >= 0:  # the chain's tail point: the step into the slot after it into R[OUT]
            t = _tape_body(U, G, has_g, R, W, P, d0, first + n, 1, row[_T.OUT], l0, ls, h, act,
                           row[_T.MODE], a, b, adjoint)
        if share:  # the coarse FAS right-hand side: (Rc[o] + Vc[j]) - p
            o = S[row[_T.SHARE_R]][row[_T.SHARE_OUT]].reshape(-1)
            u = S[row[_T.SHARE_U]][row[_T.SHARE_SLOT]].reshape(-1)
            pf = p.reshape(-1)
            for e in range(o.size):
                o[e] = (o[e] + u[e]) - pf[e]
        return t
    R, first, stride, out = S[row[_T.R]], row[_T.FIRST], row[_T.N], row[_T.OUT]
    if op == _T.INJECT:
        for q in range(row[_T.LEN]):
            _inject_into(S, row[_T.R], row[_T.G], out + q, U[first + q * stride].reshape(-1))
    elif op == _T.COPY:
        _copy_into(R.reshape(-1), U.reshape(-1))
    elif op == _T.CORRECT:
        Uc = S[row[_T.G]]
        for q in range(row[_T.LEN]):
            _correct_into(U[first + q * stride].reshape(-1), Uc[out + q].reshape(-1),
                          R[out + q].reshape(-1))
    return 0.0


@njit(cache=True)
def _tape(S, ops, hs, W, P, d0, act, adjoint, norms):
    a, b = _tape_scratch(S[0])
    p = np.empty(S[0].shape[1:], dtype=S[0].dtype)
    k = 0
    while k < ops.shape[0]:
        if ops[k, _T.ZIP] != 1:
            _tape_norm(S, ops[k], hs, W, P, d0, act, adjoint, a, b, p, norms)
            k += 1
            continue
        run = ops[k, _T.RUN]
        for q in range(run):  # a zipped call: its rows in pairs with the next call's
            _tape_norm(S, ops[k + q], hs, W, P, d0, act, adjoint, a, b, p, norms)
            _tape_norm(S, ops[k + run + q], hs, W, P, d0, act, adjoint, a, b, p, norms)
        k += 2 * run


@njit(cache=True)
def _tape_norm(S, row, hs, W, P, d0, act, adjoint, a, b, p, norms):
    """Run one row (serial driver), its residual norm added into ``norms``."""
    t = _tape_row(S, row, hs, W, P, d0, act, adjoint, a, b, p)
    if row[_T.NORM] >= 0:
        norms[row[_T.NORM]] += t


@njit(cache=True, parallel=True)
def _tape_par(S, ops, hs, W, P, d0, act, adjoint, norms):
    a, b = _tape_scratch(S[0])
    p = np.empty(S[0].shape[1:], dtype=S[0].dtype)
    k = 0
    while k < ops.shape[0]:
        run = ops[k, _T.RUN]
        if run > 1 and (ops[k, _T.OP] == _T.CHAIN or ops[k, _T.OP] == _T.POINT):
            t = np.zeros(run)
            carried = False
            if ops[k, _T.OP] == _T.CHAIN:
                for q in range(run):
                    if ops[k + q, _T.CORR_SLOT] >= 0 or ops[k + q, _T.INJ_SLOT] >= 0:
                        carried = True
            if carried:  # what the rows carry: corrections, then injections
                for part in range(1, 3):
                    for q in prange(run):
                        _tape_carried(S, ops[k + q], part)
            for q in prange(run):  # the rows of one engine call are independent
                aa, bb = _tape_scratch(S[0])
                pp = np.empty(S[0].shape[1:], dtype=S[0].dtype)
                t[q] = _tape_row(S, ops[k + q], hs, W, P, d0, act, adjoint, aa, bb, pp, True)
            for q in range(run):  # in row order, as the serial driver adds them
                if ops[k + q, _T.NORM] >= 0:
                    norms[ops[k + q, _T.NORM]] += t[q]
            k += run
        else:
            t0 = _tape_row(S, ops[k], hs, W, P, d0, act, adjoint, a, b, p)
            if ops[k, _T.NORM] >= 0:
                norms[ops[k, _T.NORM]] += t0
            k += 1


def stores_list(stores):
    """The stores of a tape as a Numba typed list (built once per tape; item 0 rebinds)."""
    out = numba.typed.List()
    for s in stores:
        out.append(s)
    return out


def _run_tape(kind, stores, ops, hs, W, P, d0, act, adjoint, norms, parallel=None):
    """Replay ``ops`` (mgnn.backend.tape) on ``stores`` (:func:`stores_list`) with the layers W
    and b (forward) or sigma' D from layer d0 (adjoint); squared norms added into ``norms``."""
    U0 = stores[0]
    if (W.dtype != U0.dtype or P.dtype != U0.dtype or hs.dtype != U0.dtype
            or U0.ndim != _STACKED_NDIM[kind] or bool(adjoint) != (P.ndim > 2)):
        raise TypeError(f"{kind} tape (adjoint={adjoint}): W {W.dtype}, P {P.dtype} "
                        f"{P.shape}, hs {hs.dtype} for {U0.ndim}-d stores of {U0.dtype} (the "
                        "steps are picked by P: b (N, c) forward, sigma' (layers, *state) "
                        "adjoint)")
    if parallel is None:
        parallel = numba.get_num_threads() > 1
    _call_driver(_tape_par if parallel else _tape, parallel or kind == "conv", stores, ops, hs,
                 W, P, int(d0), int(act), bool(adjoint), norms)


_STACKED_NDIM = {"dense": 3, "conv": 5}


def dense_run_tape(stores, ops, hs, W, P, d0, act, adjoint, norms, parallel=None):
    """Numba: one call for a captured cycle of dense steps (:mod:`mgnn.backend.tape`)."""
    _run_tape("dense", stores, ops, hs, W, P, d0, act, adjoint, norms, parallel)


def conv_run_tape(stores, ops, hs, W, P, d0, act, adjoint, norms, parallel=None):
    """Numba: one call for a captured cycle of conv steps (:mod:`mgnn.backend.tape`)."""
    _run_tape("conv", stores, ops, hs, W, P, d0, act, adjoint, norms, parallel)


# ------------------------------------------------------------ stacked gradient kernels
# Contract: mgnn.backend.numpy_ref (k_deriv_stacked, k_vjp_params_stacked). One njit call for
# every layer, through the same per-layer code as the single kernels (bit-identical to them);
# where a single dense kernel takes the NumPy route (WIDE / WIDE_TANH_F32) the layers loop here
# over that single kernel instead, so the results stay bit-identical and fast.
@njit(cache=True)
def _dense_deriv_stacked(U, first, count, W, b, layer0, act, D):
    for p in range(count):
        D[p] = _dense_deriv(U[first + p], W[layer0 + p], b[layer0 + p], act)


@njit(cache=True)
def _dense_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gW, gb):
    for p in range(count):
        gWl, gbl = _dense_vjp_params(L[l_first + p * l_stride], D[p], U[u_first + p], h)
        gW[layer0 + p] = gWl
        gb[layer0 + p] = gbl


@njit(cache=True)
def _conv_deriv_stacked(U, first, count, K, b, layer0, act, D, nblk):
    one = U.dtype.type(1)
    H, Wd = U.shape[3], U.shape[4]
    for p in range(count):
        Kl = K[layer0 + p]
        D[p] = _conv_forward_all(U[first + p], Kl.reshape((Kl.shape[0], Kl.shape[1] * 9)),
                                 b[layer0 + p], one, act, False, False, True, 2, (H, Wd),
                                 nblk)[1]


@njit(cache=True)
def _conv_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gK, gb,
                             nblk):
    H, Wd = U.shape[3], U.shape[4]
    for p in range(count):
        Kl = gK[layer0 + p]  # shape only: no input vjp
        _, gKl, gbl = _conv_vjp_all(L[l_first + p * l_stride], D[p], U[u_first + p],
                                    Kl.reshape((Kl.shape[0], Kl.shape[1] * 9)), h, False, False,
                                    True, 2, (H, Wd), nblk)
        gK[layer0 + p] = gKl.reshape(Kl.shape)
        gb[layer0 + p] = gbl


def _stacked_grads():
    import sys
    from .numpy_ref import check_stacked_grads, stacked_grad_loops
    loops = stacked_grad_loops(sys.modules[__name__])

    def dense_deriv_stacked(U, first, count, W, b, layer0, act, D):
        count = check_stacked_grads("dense", U, first, count, W, layer0, D, b)
        if count and _wide(U.shape[1] * W.shape[1], U.dtype, act):
            return loops["dense_deriv_stacked"](U, first, count, W, b, layer0, act, D)
        _dense_deriv_stacked(U, first, count, W, b, layer0, act, D)

    def dense_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gW, gb):
        count = check_stacked_grads("dense", U, u_first, count, gW, layer0, D, gb, L, l_first,
                                    l_stride)
        args = (L, l_first, l_stride, D, U, u_first, count, layer0, U.dtype.type(h), gW, gb)
        if count and U[0].size >= WIDE:
            return loops["dense_vjp_params_stacked"](*args)
        _dense_vjp_params_stacked(*args)

    def conv_deriv_stacked(U, first, count, K, b, layer0, act, D):
        count = check_stacked_grads("conv", U, first, count, K, layer0, D, b)
        with one_blas_thread():
            _conv_deriv_stacked(U, first, count, K, b, layer0, act, D, _blocks())

    def conv_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gK, gb):
        count = check_stacked_grads("conv", U, u_first, count, gK, layer0, D, gb, L, l_first,
                                    l_stride)
        with one_blas_thread():
            _conv_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0,
                                     U.dtype.type(h), gK, gb, _blocks())

    fns = {}
    for fn in (dense_deriv_stacked, dense_vjp_params_stacked, conv_deriv_stacked,
               conv_vjp_params_stacked):
        fn.__doc__ = ("Numba kernel, one call for every layer; contract of "
                      ":data:`mgnn.backend.STACKED_GRAD_KERNELS`.")
        fns[fn.__name__] = fn
    return fns


globals().update(_stacked_grads())


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
    from .counter_rng import dropout_mask_numba
    return dropout_mask_numba(seed, step, layer, sample0, batch, n_elements, threshold, out=out)


# ------------------------------------------------------------------ recurrent gate epilogues
# Contract: mgnn.backend.numpy_ref (RECURRENT_KERNELS). One row kernel per gate kernel, all on 2-D
# arrays of one dtype (the cache (B, 4, H) seen as (B, 4H)); one serial and one prange driver run
# any of them over the batch rows. The drivers turn 1 and dt into scalars of the arrays' dtype, so
# float32 stays float32 (an int literal would promote to float64); float32 tanh is the rational
# _tanh.
@njit(cache=True, inline="always")
def _sigmoid(x, one):
    e = np.exp(-abs(x))  # never overflows
    s = one / (one + e)
    return s if x >= 0 else e * s


@njit(cache=True, inline="always")
def _gru_fwd_row(b, gi, gh, h, out, cache, dt, mode, one):
    H = h.shape[1]
    for j in range(2 * H):  # r and z: one contiguous pass (faster than interleaved with n)
        cache[b, j] = _sigmoid(gi[b, j] + gh[b, j], one)
    for j in range(H):
        r, z, ghn = cache[b, j], cache[b, H + j], gh[b, 2 * H + j]
        n = _tanh(gi[b, 2 * H + j] + r * ghn)
        hb = h[b, j]
        if mode == 1:
            a = dt * (one - z)
            out[b, j] = (hb + a * n) / (one + a)
        elif dt == one:
            out[b, j] = (one - z) * n + z * hb
        else:
            out[b, j] = hb + dt * (one - z) * (n - hb)
        cache[b, 2 * H + j], cache[b, 3 * H + j] = n, ghn


@njit(cache=True, inline="always")
def _gru_vjp_row(b, g, h, cache, dh, dgi, dgh, dt, mode, one):
    H = h.shape[1]
    for j in range(H):
        r, z, n, ghn = cache[b, j], cache[b, H + j], cache[b, 2 * H + j], cache[b, 3 * H + j]
        gb, hb = g[b, j], h[b, j]
        if mode == 1:
            a = dt * (one - z)
            inv = one / (one + a)
            c_h, c_n, c_z = inv, a * inv, -dt * (n - hb) * inv * inv
        elif dt == one:
            c_h, c_n, c_z = z, one - z, hb - n
        else:
            c_n = dt * (one - z)
            c_h, c_z = one - c_n, -dt * (n - hb)
        dpn = gb * c_n * (one - n * n)
        dpr = dpn * ghn * r * (one - r)
        dpz = gb * c_z * z * (one - z)
        dh[b, j] = gb * c_h
        dgi[b, j], dgi[b, H + j], dgi[b, 2 * H + j] = dpr, dpz, dpn
        dgh[b, j], dgh[b, H + j], dgh[b, 2 * H + j] = dpr, dpz, dpn * r


@njit(cache=True, inline="always")
def _rnn_fwd_row(b, gi, gh, h, out, deriv, dt, one):
    for j in range(h.shape[1]):
        t = _tanh(gi[b, j] + gh[b, j])
        out[b, j] = t if dt == one else h[b, j] + dt * (t - h[b, j])
        deriv[b, j] = one - t * t


@njit(cache=True, inline="always")
def _rnn_vjp_row(b, g, deriv, dh, da, dt, one):
    for j in range(g.shape[1]):
        dh[b, j] = g[b, j] * (one - dt)
        da[b, j] = g[b, j] * dt * deriv[b, j]


@njit(cache=True, inline="always")
def _gate_row(kind, b, A, B, C, D, E, F, dt, mode, one):
    if kind == 0:
        _gru_fwd_row(b, A, B, C, D, E, dt, mode, one)
    elif kind == 1:
        _gru_vjp_row(b, A, B, C, D, E, F, dt, mode, one)
    elif kind == 2:
        _rnn_fwd_row(b, A, B, C, D, E, dt, one)
    else:
        _rnn_vjp_row(b, A, B, C, D, dt, one)


@njit(cache=True, inline="always")
def _typed(A, dt):
    """(1, dt) as scalars of A's dtype."""
    s = np.empty(2, A.dtype)
    s[0], s[1] = 1, dt
    return s[0], s[1]


@njit(cache=True)
def _gates(kind, A, B, C, D, E, F, dt, mode):
    one, dt = _typed(A, dt)
    for b in range(A.shape[0]):
        _gate_row(kind, b, A, B, C, D, E, F, dt, mode, one)


@njit(cache=True, parallel=True)
def _gates_par(kind, A, B, C, D, E, F, dt, mode):
    one, dt = _typed(A, dt)
    for b in prange(A.shape[0]):
        _gate_row(kind, b, A, B, C, D, E, F, dt, mode, one)


#: Elements of h from which the gate kernels run their rows on Numba's threads (below it the
#: parallel launch costs more than it saves).
GATES_PARALLEL = 1 << 15


def _run_gates(kind, arrays, B, H, dt, mode):
    """Kernel ``kind`` (0 GRU forward, 1 GRU vjp, 2 RNN forward, 3 RNN vjp) on six 2-D arrays."""
    par = B > 1 and B * H >= GATES_PARALLEL and numba.get_num_threads() > 1
    (_gates_par if par else _gates)(kind, *arrays, dt, mode)


def gru_gates_forward(gi, gh, h, dt, mode):
    B, H, dt, mode = gate_check(h, dt, mode, gi=(gi, 3), gh=(gh, 3))
    out, cache = np.empty_like(h), np.empty((B, 4, H), h.dtype)
    _run_gates(0, (gi, gh, h, out, cache.reshape(B, 4 * H), out), B, H, dt, mode)
    return out, cache


def gru_gates_vjp(g, h, cache, dt, mode):
    B, H, dt, mode = gate_check(h, dt, mode, g=(g, 1), cache=(cache, (4,)))
    dh, dgi, dgh = np.empty_like(h), np.empty((B, 3 * H), h.dtype), np.empty((B, 3 * H), h.dtype)
    _run_gates(1, (g, h, cache.reshape(B, 4 * H), dh, dgi, dgh), B, H, dt, mode)
    return dh, dgi, dgh


def rnn_gates_forward(gi, gh, h, dt):
    B, H, dt, _ = gate_check(h, dt, 0, gi=(gi, 1), gh=(gh, 1))
    out, deriv = np.empty_like(h), np.empty_like(h)
    _run_gates(2, (gi, gh, h, out, deriv, out), B, H, dt, 0)
    return out, deriv


def rnn_gates_vjp(g, h, deriv, dt):
    B, H, dt, _ = gate_check(h, dt, 0, g=(g, 1), deriv=(deriv, 1))
    dh, da = np.empty_like(h), np.empty_like(h)
    _run_gates(3, (g, deriv, dh, da, h, h), B, H, dt, 0)
    return dh, da


for _f in (gru_gates_forward, gru_gates_vjp, rnn_gates_forward, rnn_gates_vjp):
    _f.__doc__ = (f"Numba kernel (rows in parallel from {GATES_PARALLEL} elements); contract of "
                  f":func:`mgnn.backend.numpy_ref.{_f.__name__}`.")


@njit(cache=True, parallel=True)
def _axis_operator(x, indptr, cols, weights, m):
    """out[p, i, q] = sum_k weights[k] x[p, cols[k], q] over k in indptr[i]:indptr[i + 1]."""
    pre, _, post = x.shape
    out = np.zeros((pre, m, post), dtype=x.dtype)
    for p in prange(pre):
        for i in range(m):
            for k in range(indptr[i], indptr[i + 1]):
                j, w = cols[k], weights[k]
                for q in range(post):
                    out[p, i, q] += w * x[p, j, q]
    return out


def apply_axis_operator(x, indptr, cols, weights, m):
    """A sparse 1D operator (CSR rows ``indptr`` (m + 1,), ``cols``, ``weights`` of x's dtype)
    applied along axis 1 of ``x`` (pre, n, post), C-contiguous: a new (pre, m, post) array
    (the grid transfers of :mod:`mgnn.backend.grid_transfer` on the CPU)."""
    return _axis_operator(x, indptr, cols, weights, m)


#: Multiply-adds up to which the recurrent kernels' small GEMMs run as loops (a BLAS call
#: costs ~150 ns on its own: at B = H = 4 the loop is 2x faster; measured crossover ~10k).
#: Numba freezes it into the compiled (and cached) kernels: changing it at run time does nothing.
SMALL_GEMM = 8192


@njit(cache=True, inline="always")
def _mm(A, B, out):
    """out (n, m) = A (n, k) @ B (k, m): loops for small products, else BLAS into ``out``."""
    n, k = A.shape
    m = B.shape[1]
    if n * k * m > SMALL_GEMM:
        np.dot(A, B, out)
        return
    # four outputs at a time in registers (four independent add chains; accumulating in out
    # itself was bound by store-to-load latency): each sum still runs over i in order from 0
    for b in range(n):
        j = 0
        while j + 4 <= m:
            out[b, j] = 0
            s0 = s1 = s2 = s3 = out[b, j]  # zeros of out's dtype
            for i in range(k):
                a = A[b, i]
                s0 += a * B[i, j]
                s1 += a * B[i, j + 1]
                s2 += a * B[i, j + 2]
                s3 += a * B[i, j + 3]
            out[b, j], out[b, j + 1], out[b, j + 2], out[b, j + 3] = s0, s1, s2, s3
            j += 4
        while j < m:
            out[b, j] = 0
            s0 = out[b, j]
            for i in range(k):
                s0 += A[b, i] * B[i, j]
            out[b, j] = s0
            j += 1


@njit(cache=True)
def _rec_step(cell, src, dst, gi0, t, WihT, WhhT, bih, bhh, dt, mode, one, hk, inp, proj, out,
              cache, D, n):
    """dst (B, nl, H) = every layer's cell at time step t out of src (B, nl, H); layer 0 reads
    the input projection gi0[:, t]; the caches into D[n] when D has rows. proj (2, B, G H):
    scratch for the input and hidden projections."""
    B, nl, H = src.shape
    GH = WhhT.shape[2]
    gi, gh = proj[0], proj[1]
    for k in range(nl):
        for b in range(B):
            for j in range(H):
                hk[b, j] = src[b, k, j]
        _mm(hk, WhhT[k], gh)
        if k == 0:
            for b in range(B):
                for j in range(GH):
                    gi[b, j] = gi0[b, t, j]
        else:
            _mm(inp, WihT[k], gi)
            for b in range(B):
                for j in range(GH):
                    gi[b, j] += bih[k, j]
        for b in range(B):
            for j in range(GH):
                gh[b, j] += bhh[k, j]
            if cell == 0:
                _gru_fwd_row(b, gi, gh, hk, out, cache, dt, mode, one)
            else:
                _rnn_fwd_row(b, gi, gh, hk, out, cache, dt, one)
            for j in range(H):
                dst[b, k, j] = out[b, j]
                inp[b, j] = out[b, j]
            if D.shape[0] > 0:
                for j in range(cache.shape[1]):
                    D[n, k, b, j] = cache[b, j]


@njit(cache=True)
def _rec_scratch(U, GH, cell):
    B, H = U.shape[-3], U.shape[-1]
    return (np.empty((B, H), U.dtype), np.empty((B, H), U.dtype), np.empty((2, B, GH), U.dtype),
            np.empty((B, H), U.dtype), np.empty((B, 4 * H if cell == 0 else H), U.dtype))


@njit(cache=True)
def _sweep_fwd(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt, mode):
    one, dt = _typed(U, dt)
    hk, inp, gi, out, cache = _rec_scratch(U, WhhT.shape[2], cell)
    for n in range(U.shape[0] - 1):
        _rec_step(cell, U[n], U[n + 1], gi0, n, WihT, WhhT, bih, bhh, dt, mode, one, hk, inp,
                  gi, out, cache, D, n)


@njit(cache=True)
def _rec_chains(cell, gi0, U, G, has_g, chains, layer0, layer_step, WihT, WhhT, bih, bhh, dt,
                mode):
    one, dt = _typed(U, dt)
    hk, inp, gi, out, cache = _rec_scratch(U, WhhT.shape[2], cell)
    none = np.empty((0, 1, 1, 1), U.dtype)
    for c in range(chains.shape[0]):
        for i in range(chains[c, 0], chains[c, 0] + chains[c, 1]):
            _rec_step(cell, U[i - 1], U[i], gi0, layer0 + i * layer_step, WihT, WhhT, bih, bhh,
                      dt, mode, one, hk, inp, gi, out, cache, none, 0)
            if has_g:
                U[i] += G[i]


@njit(cache=True)
def _rec_points(cell, gi0, U, G, has_g, R, slots, outs, layer0, layer_step, WihT, WhhT, bih,
                bhh, dt, mode, point_mode):
    one, dt = _typed(U, dt)
    hk, inp, gi, out, cache = _rec_scratch(U, WhhT.shape[2], cell)
    none = np.empty((0, 1, 1, 1), U.dtype)
    phi = np.empty(U.shape[1:], U.dtype)
    r2 = 0.0
    for p in range(slots.shape[0]):
        i, o = slots[p], outs[p]
        _rec_step(cell, U[i - 1], phi, gi0, layer0 + i * layer_step, WihT, WhhT, bih, bhh, dt,
                  mode, one, hk, inp, gi, out, cache, none, 0)
        r2 += _rec_point_out(phi, U, G, has_g, R, i, o, point_mode)
    return r2


@njit(cache=True)
def _rec_point_out(phi, U, G, has_g, R, i, o, point_mode):
    """R[o] from the step phi into slot i (STACKED_KERNELS' modes); ||R[o]||^2 in mode 0."""
    if point_mode == 1:
        R[o] += U[i]
        R[o] -= phi
        return 0.0
    if point_mode == 0:
        R[o] = phi - U[i]
    else:
        R[o] = phi
    if has_g:
        R[o] += G[i]
    r2 = 0.0
    if point_mode == 0:
        for v in R[o].ravel():
            r2 += float(v) * float(v)
    return r2


@njit(cache=True, inline="always")
def _flushed(v, tiny):
    """v, or 0 when |v| is below the smallest normal number ``tiny`` (flush to zero)."""
    return v if abs(v) >= tiny else v * 0


@njit(cache=True)
def _rec_back_scratch(lam, GH):
    B, H = lam.shape[-3], lam.shape[-1]
    return (np.empty((B, H), lam.dtype), np.empty((B, H), lam.dtype), np.empty((B, H), lam.dtype),
            np.empty((B, GH), lam.dtype), np.empty((B, GH), lam.dtype),
            np.empty((2, B, H), lam.dtype))


@njit(cache=True)
def _rec_back_step(cell, lam, dst, Ut, Dt, Wih, Whh, dt, mode, one, tiny, g, hk, dh, dgi, dgh,
                   carry, DGI, DGH, row):
    """dst (B, nl, H) = the vjp of a time step at the state Ut (B, nl, H) with the gate caches
    Dt (nl, B, C H) applied to the cotangent lam (B, nl, H) of its output (dst is not lam; an
    empty (0, nl, H) dst skips it and its GEMMs);
    DGI[row, k] / DGH[row, k] (B, G H) receive layer k's input / hidden projection cotangents
    when DGI has rows. Cotangents below ``tiny`` are flushed to zero (0: none). g, hk, dh
    (B, H), dgi, dgh (B, G H) and carry (2, B, H) are scratch (:func:`_rec_back_scratch`)."""
    B, nl, H = lam.shape
    GH = Whh.shape[1]
    for k in range(nl - 1, -1, -1):
        for b in range(B):
            for j in range(H):
                g[b, j] = lam[b, k, j] + (carry[0, b, j] if k < nl - 1 else 0)
                hk[b, j] = Ut[b, k, j]
            if cell == 0:
                _gru_vjp_row(b, g, hk, Dt[k], dh, dgi, dgh, dt, mode, one)
            else:
                _rnn_vjp_row(b, g, Dt[k], dh, dgi, dt, one)
                for j in range(GH):
                    dgh[b, j] = dgi[b, j]
        for b in range(B):
            for j in range(GH):
                dgi[b, j] = _flushed(dgi[b, j], tiny)
                dgh[b, j] = _flushed(dgh[b, j], tiny)
        if dst.shape[0] > 0:  # an empty dst: the projection cotangents only
            back = carry[1]
            _mm(dgh, Whh[k], back)
            for b in range(B):
                for j in range(H):
                    dst[b, k, j] = _flushed(dh[b, j] + back[b, j], tiny)
        if DGI.shape[0] > 0:
            for b in range(B):
                for j in range(GH):
                    DGI[row, k, b, j] = dgi[b, j]
                    DGH[row, k, b, j] = dgh[b, j]
        if k > 0:
            _mm(dgi, Wih[k], carry[0])


@njit(cache=True)
def _sweep_back(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH, tiny):
    one, dt = _typed(lam, dt)
    tiny = _typed(lam, tiny)[1]
    lam = lam.copy()
    out = np.empty_like(lam)
    g, hk, dh, dgi, dgh, carry = _rec_back_scratch(lam, Whh.shape[1])
    for n in range(D.shape[0] - 1, -1, -1):
        _rec_back_step(cell, lam, out, U[n], D[n], Wih, Whh, dt, mode, one, tiny, g, hk, dh, dgi,
                       dgh, carry, DGI, DGH, n)
        lam[:, :, :] = out
    return lam


@njit(cache=True)
def _rec_chains_adj(cell, L, G, has_g, chains, layer0, layer_step, U, u_off, D, d0, Wih, Whh,
                    dt, mode, tiny):
    one, dt = _typed(L, dt)
    tiny = _typed(L, tiny)[1]
    g, hk, dh, dgi, dgh, carry = _rec_back_scratch(L, Whh.shape[1])
    none = np.empty((0, 1, 1, 1), L.dtype)
    for c in range(chains.shape[0]):
        for i in range(chains[c, 0], chains[c, 0] + chains[c, 1]):
            t = layer0 + i * layer_step
            _rec_back_step(cell, L[i - 1], L[i], U[t + u_off], D[t - d0], Wih, Whh, dt, mode,
                           one, tiny, g, hk, dh, dgi, dgh, carry, none, none, 0)
            if has_g:
                L[i] += G[i]


@njit(cache=True)
def _rec_points_adj(cell, L, G, has_g, R, slots, outs, layer0, layer_step, U, u_off, D, d0, Wih,
                    Whh, dt, mode, point_mode, tiny):
    one, dt = _typed(L, dt)
    tiny = _typed(L, tiny)[1]
    g, hk, dh, dgi, dgh, carry = _rec_back_scratch(L, Whh.shape[1])
    none = np.empty((0, 1, 1, 1), L.dtype)
    phi = np.empty(L.shape[1:], L.dtype)
    r2 = 0.0
    for p in range(slots.shape[0]):
        i, o = slots[p], outs[p]
        t = layer0 + i * layer_step
        _rec_back_step(cell, L[i - 1], phi, U[t + u_off], D[t - d0], Wih, Whh, dt, mode, one,
                       tiny, g, hk, dh, dgi, dgh, carry, none, none, 0)
        r2 += _rec_point_out(phi, L, G, has_g, R, i, o, point_mode)
    return r2


@njit(cache=True)
def _rec_cotangents(cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode, DGI, DGH,
                    row0, tiny):
    one, dt = _typed(L, dt)
    tiny = _typed(L, tiny)[1]
    g, hk, dh, dgi, dgh, carry = _rec_back_scratch(L, Whh.shape[1])
    phi = np.empty((0,) + L.shape[2:], L.dtype)  # no state cotangent: DGI / DGH only
    for p in range(count):
        _rec_back_step(cell, L[l0 + p * l_step], phi, U[u0 + p], D[d0 + p], Wih, Whh, dt, mode,
                       one, tiny, g, hk, dh, dgi, dgh, carry, DGI, DGH, row0 + p)


@njit(cache=True)
def _rec_caches(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, dt, mode):
    one, dt = _typed(U, dt)
    hk, inp, gi, out, cache = _rec_scratch(U, WhhT.shape[2], cell)
    y = np.empty(U.shape[1:], U.dtype)
    for p in range(count):
        _rec_step(cell, U[first + p], y, gi0, layer0 + p, WihT, WhhT, bih, bhh, dt, mode, one,
                  hk, inp, gi, out, cache, D, p)
        if Y.shape[0] > 0:
            Y[p] = y


def recurrent_sweep_forward(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt, mode):
    """One Numba call per sequence (GEMMs through BLAS ``np.dot``); contract of
    :func:`mgnn.backend.numpy_ref.recurrent_sweep_forward`."""
    recurrent_sweep_check(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt, mode)
    _sweep_fwd(cell, gi0, U, WihT, WhhT, bih, bhh, D, float(dt), int(mode))


def recurrent_sweep_backward(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH):
    """One Numba call per sequence; contract of
    :func:`mgnn.backend.numpy_ref.recurrent_sweep_backward`, except that cotangents below the
    dtype's smallest normal number (``np.finfo(dtype).tiny``, 1.2e-38 in float32) are flushed
    to zero: over long sequences the adjoint decays through the subnormal range, where x86
    arithmetic is several times slower (measured 7x for a float32 GRU over 512 steps)."""
    lam = np.ascontiguousarray(lam)
    recurrent_sweep_back_check(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH)
    return _sweep_back(cell, lam, U, D, Wih, Whh, float(dt), int(mode), DGI, DGH,
                       float(np.finfo(U.dtype).tiny))


def _tiny(a):
    return float(np.finfo(a.dtype).tiny)


def recurrent_chains_adjoint(cell, L, G, chains, layer0, layer_step, U, u_off, D, d0, Wih, Whh,
                             dt, mode):
    """Stacked adjoint relaxation of a recurrent model, one Numba call per sweep: contract of
    :func:`mgnn.backend.numpy_ref.recurrent_chains_adjoint`, with subnormal cotangents flushed
    to zero as in :func:`recurrent_sweep_backward`."""
    chains = recurrent_adjoint_check(cell, L, G, None, chains, layer0, layer_step, U, u_off, D,
                                     d0, Wih, Whh, dt, mode, index_check=_index_check)
    _rec_chains_adj(cell, L, L if G is None else G, G is not None, chains, int(layer0),
                    int(layer_step), U, int(u_off), D, int(d0), Wih, Whh, float(dt), int(mode),
                    _tiny(L))


def recurrent_points_adjoint(cell, L, G, R, slots, out_slots, layer0, layer_step, U, u_off, D,
                             d0, Wih, Whh, dt, mode, point_mode):
    """Adjoint residual / FAS / plain points of a recurrent model, one Numba call: contract of
    :func:`mgnn.backend.numpy_ref.recurrent_points_adjoint` (subnormals flushed)."""
    slots, outs = recurrent_adjoint_check(cell, L, G, R, slots, layer0, layer_step, U, u_off, D,
                                          d0, Wih, Whh, dt, mode, out_slots, point_mode,
                                          index_check=_index_check)
    return _rec_points_adj(cell, L, L if G is None else G, G is not None, R, slots, outs,
                           int(layer0), int(layer_step), U, int(u_off), D, int(d0), Wih, Whh,
                           float(dt), int(mode), int(point_mode), _tiny(L))


def recurrent_caches(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, dt, mode):
    """The linearisation of ``count`` time steps at given states, one Numba call: contract of
    :func:`mgnn.backend.numpy_ref.recurrent_caches`."""
    first, count, layer0 = recurrent_caches_check(cell, gi0, U, first, count, layer0, WihT, WhhT,
                                                  bih, bhh, D, Y, dt, mode)
    if Y.shape[0] == 0:
        Y = np.empty((0,) + U.shape[1:], U.dtype)
    _rec_caches(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, float(dt),
                int(mode))


def recurrent_gate_cotangents(cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode, DGI,
                              DGH, row0):
    """The projection cotangents of ``count`` steps, one Numba call: contract of
    :func:`mgnn.backend.numpy_ref.recurrent_gate_cotangents` (subnormals flushed)."""
    l0, l_step, u0, d0, count, row0 = recurrent_cotangents_check(
        cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode, DGI, DGH, row0)
    _rec_cotangents(cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, float(dt), int(mode),
                    DGI, DGH, row0, _tiny(L))


def recurrent_chains_forward(cell, gi0, U, G, chains, layer0, layer_step, WihT, WhhT, bih, bhh,
                             dt, mode):
    """Stacked relaxation of a recurrent model: contract of
    :func:`mgnn.backend.numpy_ref.recurrent_chains_forward`, one Numba call per sweep."""
    chains = recurrent_stacked_check(cell, gi0, U, G, None, chains, layer0, layer_step, WihT,
                                     WhhT, bih, bhh, dt, mode, index_check=_index_check)
    _rec_chains(cell, gi0, U, U if G is None else G, G is not None, chains, layer0, layer_step,
                WihT, WhhT, bih, bhh, float(dt), int(mode))


def recurrent_points_forward(cell, gi0, U, G, R, slots, out_slots, layer0, layer_step, WihT,
                             WhhT, bih, bhh, dt, mode, point_mode):
    """Residual / FAS / plain points of a recurrent model: contract of
    :func:`mgnn.backend.numpy_ref.recurrent_points_forward`, one Numba call."""
    slots, outs = recurrent_stacked_check(cell, gi0, U, G, R, slots, layer0, layer_step, WihT,
                                          WhhT, bih, bhh, dt, mode, out_slots, point_mode,
                                          index_check=_index_check)
    return _rec_points(cell, gi0, U, U if G is None else G, G is not None, R, slots, outs,
                       layer0, layer_step, WihT, WhhT, bih, bhh, float(dt), int(mode),
                       int(point_mode))
