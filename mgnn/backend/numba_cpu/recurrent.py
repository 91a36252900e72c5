"""GRU/RNN kernels (:data:`mgnn.backend.RECURRENT_KERNELS`): gate epilogues, sweeps, chains and
points over sequence time, caches and gate cotangents."""

import numpy as np
import numba
from numba import prange

from ..numpy_ref import (gate_check, recurrent_adjoint_check, recurrent_caches_check,
                         recurrent_cotangents_check, recurrent_stacked_check,
                         recurrent_sweep_back_check, recurrent_sweep_check)
from .stacked import _index_check, check_kept
from .activations import _tanh, njit


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
                mode, D, Y, d_lo, done):
    """Along each chain U[i] = the cell step t = layer0 + i layer_step out of U[i - 1] (+ G[i]);
    with D rows (a forward solve's final sweep, no G) each step t also writes its gate caches
    into D[t - d_lo] and its output into Y[t - d_lo] (Y with rows) where 0 <= t - d_lo <
    len(D), flagging done[t - d_lo]."""
    one, dt = _typed(U, dt)
    hk, inp, gi, out, cache = _rec_scratch(U, WhhT.shape[2], cell)
    none = np.empty((0, 1, 1, 1), U.dtype)
    for c in range(chains.shape[0]):
        for i in range(chains[c, 0], chains[c, 0] + chains[c, 1]):
            t = layer0 + i * layer_step
            p = t - d_lo
            keep = 0 <= p < D.shape[0]
            _rec_step(cell, U[i - 1], U[i], gi0, t, WihT, WhhT, bih, bhh, dt, mode, one, hk,
                      inp, gi, out, cache, D if keep else none, p if keep else 0)
            if has_g:
                U[i] += G[i]
            if keep:
                if Y.shape[0] > 0:
                    Y[p] = U[i]
                done[p] = 1


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
def _rec_caches(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, dt, mode, done):
    one, dt = _typed(U, dt)
    hk, inp, gi, out, cache = _rec_scratch(U, WhhT.shape[2], cell)
    y = np.empty(U.shape[1:], U.dtype)
    for p in range(count):  # done empty: every step; else the steps not flagged
        if done.size > 0 and done[p] != 0:
            continue
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
                int(mode), _EVERY_STEP)


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
                WihT, WhhT, bih, bhh, float(dt), int(mode), np.empty((0, 1, 1, 1), U.dtype),
                np.empty((0,) + U.shape[1:], U.dtype), 0, _EVERY_STEP)


def recurrent_chains_forward_keep(cell, gi0, U, chains, layer0, layer_step, WihT, WhhT, bih,
                                  bhh, dt, mode, D, Y, d_lo, done):
    """:func:`recurrent_chains_forward` without right-hand sides, the same states bit for bit,
    each time step t of the chains also writing the linearisation :func:`recurrent_caches`
    gives (D[t - d_lo] (nl, B, C H), Y[t - d_lo] (B, nl, H) when Y has rows) where
    0 <= t - d_lo < len(D), and setting the int8 flag done[t - d_lo]. One Numba call."""
    chains = recurrent_stacked_check(cell, gi0, U, None, None, chains, layer0, layer_step, WihT,
                                     WhhT, bih, bhh, dt, mode, index_check=_index_check)
    rows = _keep_check(cell, U, D, Y, done, d_lo)
    _rec_chains(cell, gi0, U, U, False, chains, layer0, layer_step, WihT, WhhT, bih, bhh,
                float(dt), int(mode), D, Y if rows else np.empty((0,) + U.shape[1:], U.dtype),
                int(d_lo), done)


def recurrent_caches_missing(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, dt,
                             mode, done):
    """:func:`recurrent_caches` for the rows p with ``done[p] == 0`` only (those a final sweep
    did not write: :func:`recurrent_chains_forward_keep`)."""
    first, count, layer0 = recurrent_caches_check(cell, gi0, U, first, count, layer0, WihT, WhhT,
                                                  bih, bhh, D, Y, dt, mode)
    _keep_check(cell, U, D, Y, done)
    if Y.shape[0] == 0:
        Y = np.empty((0,) + U.shape[1:], U.dtype)
    _rec_caches(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, float(dt),
                int(mode), done)


def _keep_check(cell, U, D, Y, done, d_lo=0):
    """The kept linearisation's arrays: D (rows, nl, B, C H), Y (rows or 0, B, nl, H) of U's
    dtype, C-contiguous, done and d_lo as :func:`check_kept`; returns whether Y has rows."""
    _, B, nl, H = U.shape
    C = 4 if cell == 0 else 1
    rows = getattr(D, "shape", (0,))[0]
    for name, a, shape in (("D", D, (rows, nl, B, C * H)),
                           ("Y", Y, (rows if getattr(Y, "shape", (0,))[0] else 0, B, nl, H))):
        if (getattr(a, "dtype", None) != U.dtype or tuple(a.shape) != shape
                or not a.flags.c_contiguous):
            raise ValueError(f"{name} must be a C-contiguous {U.dtype} array of shape {shape}, "
                             f"got {getattr(a, 'dtype', None)} {getattr(a, 'shape', None)}")
    check_kept(done, rows, d_lo)
    return Y.shape[0] > 0


_EVERY_STEP = np.zeros(0, dtype=np.int8)  # the flags of a call that keeps / skips nothing


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
