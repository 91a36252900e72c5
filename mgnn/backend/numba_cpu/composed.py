"""Stacked kernels of the composed dense step F(u) = dropout(sigma(BN(u W^T + b))) (batch norm
and dropout optional): every chain of a relaxation wave, residual / FAS points, the kept
linearisation and the parameter gradients in one Numba call each, as the fused kinds' stacked
kernels (:mod:`.stacked`) and the recurrent ones (:mod:`.recurrent`) run theirs.

The reference is :class:`mgnn.blocks.composed.ComposedStep`'s block-by-block single steps (the
tests compare every kernel here with them); the arithmetic follows those blocks' Numba kernels
(:mod:`.batch_norm`, dropout masks of :mod:`mgnn.backend.counter_rng`).

Arguments shared by the kernels (B samples, width w, N layers):

- ``W`` (N, w, w), ``b`` (N, w): the affine maps; ``gam``, ``bet`` (N, w): batch norm's gamma
  and beta (any (0, w) arrays without batch norm); ``rmu``, ``rvar`` (N, w): the running
  statistics (read with ``bn`` 2).
- ``bn``: 0 no batch norm, 1 batch statistics (train mode), 2 running statistics (eval mode);
  ``eps`` batch norm's epsilon; ``act`` sigma's code (0 tanh, 1 relu, 2 identity).
- ``thr``: the dropout keep threshold (0: no dropout; :func:`~mgnn.backend.counter_rng.
  dropout_threshold`), ``dscale`` = 1 / (1 - p), ``k0``, ``k1``, ``tstep``, ``s0``: the mask's key,
  training step and first global sample (uint64 < 2**32, as :func:`dropout_mask` derives them);
  ``MS`` (S, B, w) uint8, ``m_lo``: the keep masks of layers m_lo .. m_lo + S - 1, made once per
  batch (:func:`composed_masks`; other layers' masks are drawn where they are needed).
- The linearisation of layer t in row k = t - d0: ``XH`` (S, B, w) x-hat (batch norm) or unused,
  ``DA`` (S, B, w) sigma', ``MK`` (S or 0, B, w) the dropout mask times ``dscale``, ``IS``,
  ``MU``, ``VR`` (S, w) 1/sqrt(var + eps), mean and (biased) variance.
"""
import numba
import numpy as np
from numba import prange

from ..blas_threads import one_blas_thread
from ..counter_rng import _LO32, _S8, _philox_scalar
from .activations import _tanh, njit


@njit(cache=True, inline="always")
def _act(y, act, one):
    """(sigma(y), sigma'(y)) in y's type (``one``: 1 of that type)."""
    if act == 0:
        t = _tanh(y)
        return t, one - t * t
    if act == 1:
        return (y, one) if y > 0 else (y - y, one - one)
    return y, one


@njit(cache=True)
def _statistics(z, mean, m2):
    """Per-column mean and sum of squared deviations of z (B, w), float64 accumulators over the
    rows in order (mean then deviations, as :func:`.batch_norm._bn_stats`)."""
    B, w = z.shape
    for k in range(w):
        mean[k] = 0.0
        m2[k] = 0.0
    for r in range(B):
        for k in range(w):
            mean[k] += z[r, k]
    for k in range(w):
        mean[k] /= B
    for r in range(B):
        for k in range(w):
            e = z[r, k] - mean[k]
            m2[k] += e * e


@njit(cache=True)
def _forward_f(x, t, W, b, gam, bet, rmu, rvar, eps, act, bn, thr, dscale, k0, k1, tstep, s0,
               MS, m_lo, z, mean, m2, st, keep, XH, DA, MK, IS, MU, VR, k):
    """z = F(x) of layer t (overwrites the scratch z (B, w); mean, m2 (w,) float64 and st
    (4, w) of z's dtype: scratch); with ``keep`` the linearisation into row k of XH, DA, MK, IS,
    MU, VR."""
    B, w = z.shape
    np.dot(x, W[t].T, z)
    for r in range(B):
        for j in range(w):
            z[r, j] += b[t, j]
    if bn == 1:
        _statistics(z, mean, m2)
    for j in range(w if bn else 0):
        if bn == 1:
            st[0, j] = mean[j]  # rounded to the dtype, as the single-step kernels store it
            st[1, j] = m2[j]
            st[1, j] = st[1, j] / B
        else:
            st[0, j], st[1, j] = rmu[t, j], rvar[t, j]
        st[2, j] = 1 / np.sqrt(st[1, j] + eps)
        if keep:
            IS[k, j], MU[k, j], VR[k, j] = st[2, j], st[0, j], st[1, j]
    st[3, 0] = 1
    one = st[3, 0]
    n = np.uint64(t) & _LO32
    mrow = t - m_lo if thr and 0 <= t - m_lo < MS.shape[0] else -1  # the batch's masks' row
    for r in range(B):
        s = (s0 + np.uint64(r)) & _LO32
        for j in range(w):
            y = z[r, j]
            if bn:
                xh = (y - st[0, j]) * st[2, j]
                y = gam[t, j] * xh + bet[t, j]
                if keep:
                    XH[k, r, j] = xh
            a, d = _act(y, act, one)
            m = one
            if thr:
                if mrow >= 0:
                    kept = MS[mrow, r, j] != 0
                else:  # a layer outside the batch's masks: drawn here, the same bits
                    kept = (_philox_scalar(np.uint64(j), s, n, tstep, k0, k1)[0] >> _S8) >= thr
                m = dscale if kept else dscale - dscale
                a *= m
            if keep and MK.shape[0]:
                MK[k, r, j] = m
            if keep:
                DA[k, r, j] = d
            z[r, j] = a


@njit(cache=True)
def _point_out(x, z, h, out, u, g, has_g, mode):
    """out from phi = x + h z by mode (0 (phi - u) [+ g], returns ||.||^2; 1 (out + u) - phi;
    2 phi [+ g]) (B, w)."""
    r2 = 0.0
    for r in range(z.shape[0]):
        for j in range(z.shape[1]):
            phi = x[r, j] + h * z[r, j]
            if mode == 1:
                out[r, j] = (out[r, j] + u[r, j]) - phi
                continue
            v = phi - u[r, j] if mode == 0 else phi
            if has_g:
                v += g[r, j]
            out[r, j] = v
            if mode == 0:
                r2 += np.float64(v) * np.float64(v)
    return r2


@njit(cache=True)
def _chain_fwd(c, U, G, has_g, chains, layer0, layer_step, h, W, b, gam, bet, rmu, rvar, eps,
               act, bn, thr, dscale, k0, k1, tstep, s0, MS, m_lo, XH, DA, MK, IS, MU, VR, d_lo,
               done):
    """Chain c (first, n): U[i] = U[i - 1] + h F_t(U[i - 1]) (+ G[i]), t = layer0 + i
    layer_step; steps with 0 <= t - d_lo < len(done) keep their linearisation."""
    z = np.empty(U.shape[1:], U.dtype)
    mean, m2 = np.empty(U.shape[2]), np.empty(U.shape[2])
    st = np.empty((4, U.shape[2]), U.dtype)
    for i in range(chains[c, 0], chains[c, 0] + chains[c, 1]):
        t = layer0 + i * layer_step
        k = t - d_lo
        keep = 0 <= k < done.shape[0]
        _forward_f(U[i - 1], t, W, b, gam, bet, rmu, rvar, eps, act, bn, thr, dscale, k0,
                   k1, tstep, s0, MS, m_lo, z, mean, m2, st, keep, XH, DA, MK, IS, MU, VR, k)
        _point_out(U[i - 1], z, h, U[i], U[i], G[i], has_g, 2)
        if keep:
            done[k] = 1


@njit(cache=True)
def _chains_fwd(U, G, has_g, chains, layer0, layer_step, h, W, b, gam, bet, rmu, rvar, eps, act,
                bn, thr, dscale, k0, k1, tstep, s0, MS, m_lo, XH, DA, MK, IS, MU, VR, d_lo, done):
    """Every chain of ``chains`` in turn (:func:`_chain_fwd`)."""
    for c in range(chains.shape[0]):
        _chain_fwd(c, U, G, has_g, chains, layer0, layer_step, h, W, b, gam, bet, rmu, rvar, eps,
                   act, bn, thr, dscale, k0, k1, tstep, s0, MS, m_lo, XH, DA, MK, IS, MU, VR,
                   d_lo, done)


@njit(cache=True, parallel=True)
def _chains_fwd_par(U, G, has_g, chains, layer0, layer_step, h, W, b, gam, bet, rmu, rvar, eps,
                    act, bn, thr, dscale, k0, k1, tstep, s0, MS, m_lo, XH, DA, MK, IS, MU, VR,
                    d_lo, done):
    """The chains on Numba's threads (the same bits: each chain's arithmetic is its own)."""
    for c in prange(chains.shape[0]):
        _chain_fwd(c, U, G, has_g, chains, layer0, layer_step, h, W, b, gam, bet, rmu, rvar, eps,
                   act, bn, thr, dscale, k0, k1, tstep, s0, MS, m_lo, XH, DA, MK, IS, MU, VR,
                   d_lo, done)


@njit(cache=True)
def _points_fwd(U, G, has_g, R, slots, outs, layer0, layer_step, h, W, b, gam, bet, rmu, rvar,
                eps, act, bn, thr, dscale, k0, k1, tstep, s0, MS, m_lo, mode):
    z = np.empty(U.shape[1:], U.dtype)
    mean, m2 = np.empty(U.shape[2]), np.empty(U.shape[2])
    st = np.empty((4, U.shape[2]), U.dtype)
    none = np.empty((0, 1, 1), U.dtype)
    none2 = np.empty((0, 1), U.dtype)
    r2 = 0.0
    for p in range(slots.shape[0]):
        i = slots[p]
        _forward_f(U[i - 1], layer0 + i * layer_step, W, b, gam, bet, rmu, rvar, eps, act, bn,
                   thr, dscale, k0, k1, tstep, s0, MS, m_lo, z, mean, m2, st, False, none, none,
                   none, none2, none2, none2, 0)
        r2 += _point_out(U[i - 1], z, h, R[outs[p]], U[i], G[i], has_g, mode)
    return r2


@njit(cache=True)
def _caches(U, first, count, t0, W, b, gam, bet, rmu, rvar, eps, act, bn, thr, dscale, k0, k1,
            tstep, s0, MS, m_lo, XH, DA, MK, IS, MU, VR, done):
    """The linearisation of layers t0 .. t0 + count - 1 at U[first ..] into rows 0 .., only the
    rows p with done[p] == 0."""
    z = np.empty(U.shape[1:], U.dtype)
    mean, m2 = np.empty(U.shape[2]), np.empty(U.shape[2])
    st = np.empty((4, U.shape[2]), U.dtype)
    for p in range(count):
        if done[p] == 0:
            _forward_f(U[first + p], t0 + p, W, b, gam, bet, rmu, rvar, eps, act, bn, thr,
                       dscale, k0, k1, tstep, s0, MS, m_lo, z, mean, m2, st, True, XH, DA, MK,
                       IS, MU, VR, p)


@njit(cache=True)
def _adjoint_gz(lam, k, t, gam, bn, XH, DA, MK, IS, gz, s1, s2, tq):
    """gz (B, w): the cotangent of z = u W^T + b from the cotangent ``lam`` of F's output, at
    the linearisation row k of layer t (s1, s2 (w,) float64: the batch sums, left in them; tq
    (3, w) of the dtype: scratch)."""
    B, w = gz.shape
    for j in range(w):
        s1[j] = 0.0
        s2[j] = 0.0
    for r in range(B):
        for j in range(w):
            gy = lam[r, j]
            if MK.shape[0]:
                gy = gy * MK[k, r, j]
            gy = gy * DA[k, r, j]
            gz[r, j] = gy
            if bn:
                s1[j] += gy
                s2[j] += gy * XH[k, r, j]
    if bn == 0:
        return
    for j in range(w):
        tq[0, j], tq[1, j] = s1[j], s2[j]  # the sums rounded to the dtype, then / B
        tq[0, j], tq[1, j] = tq[0, j] / B, tq[1, j] / B
        tq[2, j] = gam[t, j] * IS[k, j]
    for r in range(B):
        for j in range(w):
            if bn == 1:
                gz[r, j] = tq[2, j] * ((gz[r, j] - tq[0, j]) - XH[k, r, j] * tq[1, j])
            else:
                gz[r, j] = tq[2, j] * gz[r, j]


@njit(cache=True)
def _chain_adj(c, L, G, has_g, chains, layer0, layer_step, h, W, gam, bn, XH, DA, MK, IS, d0):
    """Chain c: L[i] = L[i - 1] + h J_t^T L[i - 1] (+ G[i]), t = layer0 + i layer_step, J_t at
    the linearisation row t - d0."""
    gz, gx = np.empty(L.shape[1:], L.dtype), np.empty(L.shape[1:], L.dtype)
    s1, s2 = np.empty(L.shape[2]), np.empty(L.shape[2])
    tq = np.empty((3, L.shape[2]), L.dtype)
    for i in range(chains[c, 0], chains[c, 0] + chains[c, 1]):
        t = layer0 + i * layer_step
        _adjoint_gz(L[i - 1], t - d0, t, gam, bn, XH, DA, MK, IS, gz, s1, s2, tq)
        np.dot(gz, W[t], gx)
        _point_out(L[i - 1], gx, h, L[i], L[i], G[i], has_g, 2)


@njit(cache=True)
def _chains_adj(L, G, has_g, chains, layer0, layer_step, h, W, gam, bn, XH, DA, MK, IS, d0):
    """Every chain of ``chains`` in turn (:func:`_chain_adj`)."""
    for c in range(chains.shape[0]):
        _chain_adj(c, L, G, has_g, chains, layer0, layer_step, h, W, gam, bn, XH, DA, MK, IS, d0)


@njit(cache=True, parallel=True)
def _chains_adj_par(L, G, has_g, chains, layer0, layer_step, h, W, gam, bn, XH, DA, MK, IS, d0):
    """The chains on Numba's threads."""
    for c in prange(chains.shape[0]):
        _chain_adj(c, L, G, has_g, chains, layer0, layer_step, h, W, gam, bn, XH, DA, MK, IS, d0)


@njit(cache=True)
def _points_adj(L, G, has_g, R, slots, outs, layer0, layer_step, h, W, gam, bn, XH, DA, MK, IS,
                d0, mode):
    gz, gx = np.empty(L.shape[1:], L.dtype), np.empty(L.shape[1:], L.dtype)
    s1, s2 = np.empty(L.shape[2]), np.empty(L.shape[2])
    tq = np.empty((3, L.shape[2]), L.dtype)
    r2 = 0.0
    for p in range(slots.shape[0]):
        i = slots[p]
        t = layer0 + i * layer_step
        _adjoint_gz(L[i - 1], t - d0, t, gam, bn, XH, DA, MK, IS, gz, s1, s2, tq)
        np.dot(gz, W[t], gx)
        r2 += _point_out(L[i - 1], gx, h, R[outs[p]], L[i], G[i], has_g, mode)
    return r2


@njit(cache=True)
def _params(L, l0, l_step, count, U, u0, row0, t0, h, gam, bn, XH, DA, MK, IS, GW, Gb, Gg, Gbe):
    """Rows t = t0 + row0 + p (p < count) of the gradients: h (dF_t/dtheta)^T lam_{t+1}, lam_{t+1}
    = L[l0 + p l_step], the state U[u0 + p]."""
    gz = np.empty(L.shape[1:], L.dtype)
    s1, s2 = np.empty(L.shape[2]), np.empty(L.shape[2])
    tq = np.empty((3, L.shape[2]), L.dtype)
    for p in range(count):
        k = row0 + p
        t = t0 + k
        _adjoint_gz(L[l0 + p * l_step], k, t, gam, bn, XH, DA, MK, IS, gz, s1, s2, tq)
        np.dot(gz.T, U[u0 + p], GW[t])
        for a in range(GW.shape[1]):
            for j in range(GW.shape[2]):
                GW[t, a, j] *= h
        for j in range(gz.shape[1]):
            acc = 0.0
            for r in range(gz.shape[0]):
                acc += gz[r, j]
            Gb[t, j] = acc
            Gb[t, j] = h * Gb[t, j]
            if bn:
                Gg[t, j], Gbe[t, j] = s2[j], s1[j]
                Gg[t, j], Gbe[t, j] = h * Gg[t, j], h * Gbe[t, j]


@njit(cache=True)
def _masks(MS, m_lo, k0, k1, tstep, s0, thr):
    """MS[k] = the keep mask (0/1) of layer m_lo + k, for every sample and element."""
    for k in range(MS.shape[0]):
        n = np.uint64(m_lo + k) & _LO32
        for r in range(MS.shape[1]):
            s = (s0 + np.uint64(r)) & _LO32
            for j in range(MS.shape[2]):
                word = _philox_scalar(np.uint64(j), s, n, tstep, k0, k1)[0]
                MS[k, r, j] = 1 if (word >> _S8) >= thr else 0


# ---------------------------------------------------------------------------- Python wrappers
def composed_masks(MS, m_lo, k0, k1, tstep, s0, thr):
    """Fill ``MS`` (S, B, w) uint8 with the dropout keep masks of layers m_lo .. m_lo + S - 1
    (bit for bit :func:`mgnn.backend.counter_rng.dropout_mask`'s); one Numba call."""
    if not isinstance(MS, np.ndarray) or MS.dtype != np.uint8 or MS.ndim != 3:
        raise ValueError(f"composed_masks: MS must be a (S, B, w) uint8 array, got "
                         f"{getattr(MS, 'dtype', None)} {getattr(MS, 'shape', None)}")
    _masks(MS, int(m_lo), *(np.uint64(v) for v in (k0, k1, tstep, s0, thr)))
def _index_array(a, name, columns=None):
    """``a`` as a C-contiguous int64 array ((k, 2) chains with ``columns`` 2, else (k,))."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    if (columns is not None and (a.ndim != 2 or a.shape[1] != columns)) or \
            (columns is None and a.ndim != 1):
        raise ValueError(f"composed stacked kernel: {name} must be "
                         f"{'(k, 2)' if columns else '(k,)'} integers, got shape {a.shape}")
    return a


def _check_store(U, name="U"):
    if not isinstance(U, np.ndarray) or U.ndim != 3 or not U.flags.c_contiguous:
        raise ValueError(f"composed stacked kernel: {name} must be a C-contiguous (m, B, w) "
                         f"NumPy array, got {type(U).__name__} {getattr(U, 'shape', None)}")


def _check_steps(U, idx, layer0, layer_step, n_layers, chains):
    """The slots stepped into lie in U (1 .. m - 1) and their layers in 0 .. N - 1."""
    if chains:
        firsts, lens = idx[:, 0], idx[:, 1]
        if (lens < 0).any():
            raise ValueError(f"composed stacked kernel: negative chain length in {idx.tolist()}")
        live = lens > 0
        lo, hi = firsts[live], firsts[live] + lens[live] - 1
    else:
        lo = hi = idx
    if lo.size == 0:
        return
    if lo.min() < 1 or hi.max() >= U.shape[0]:
        raise ValueError(f"composed stacked kernel: slots {int(lo.min())}..{int(hi.max())} "
                         f"outside 1..{U.shape[0] - 1} of the store")
    ends = np.concatenate([layer0 + lo * layer_step, layer0 + hi * layer_step])
    if ends.min() < 0 or ends.max() >= n_layers:
        raise ValueError(f"composed stacked kernel: layers {int(ends.min())}..{int(ends.max())} "
                         f"outside 0..{n_layers - 1}")


def _parallel(serial, par, chains, *args):
    """``par(*args)`` (chains on Numba's threads, one BLAS thread each: their np.dot calls
    must not start threads of their own) when there are threads and several chains, else
    ``serial(*args)``; the results are the same bits."""
    if chains.shape[0] > 1 and numba.get_num_threads() > 1:
        with one_blas_thread():
            return par(*args)
    return serial(*args)


def _g(U, G):
    return (U, False) if G is None else (G, True)


def composed_chains_forward(U, G, chains, layer0, layer_step, h, layer, keep=None, d_lo=0,
                            done=None):
    """Stacked relaxation of the composed dense step, one Numba call: along each chain
    (first, n) of ``chains``, U[i] = U[i - 1] + h F_t(U[i - 1]) (+ G[i]), t = layer0 + i
    layer_step. ``layer``: the tuple of :meth:`mgnn.blocks.composed.ComposedStep.kernel_args`.
    ``keep`` (XH, DA, MK, IS, MU, VR) with ``done`` (int8): steps with 0 <= t - d_lo <
    len(done) also write their linearisation into row t - d_lo and flag done[t - d_lo]."""
    _check_store(U)
    chains = _index_array(chains, "chains", 2)
    _check_steps(U, chains, layer0, layer_step, layer[0].shape[0], True)
    Gs, has_g = _g(U, G)
    if keep is None:
        keep, done = _no_keep(U), np.zeros(0, np.int8)
    _parallel(_chains_fwd, _chains_fwd_par, chains, U, Gs, has_g, chains, int(layer0),
              int(layer_step), U.dtype.type(h), *layer, *keep, int(d_lo), done)


def composed_points_forward(U, G, R, slots, out_slots, layer0, layer_step, h, layer, mode):
    """Residual (``mode`` 0, returns the squared norm) / FAS (1) / plain (2) points of the
    composed dense step into U's ``slots``, written to R[out_slots]; one Numba call."""
    _check_store(U)
    _check_store(R, "R")
    slots, outs = _index_array(slots, "slots"), _index_array(out_slots, "out_slots")
    if slots.shape != outs.shape or (outs.size and (outs.min() < 0 or outs.max() >= len(R))):
        raise ValueError(f"composed stacked kernel: out_slots {outs.tolist()} do not match "
                         f"slots {slots.tolist()} or lie outside R ({len(R)} slots)")
    _check_steps(U, slots, layer0, layer_step, layer[0].shape[0], False)
    Gs, has_g = _g(U, G)
    return _points_fwd(U, Gs, has_g, R, slots, outs, int(layer0), int(layer_step),
                       U.dtype.type(h), *layer, int(mode))


def composed_caches(U, first, count, t0, layer, keep, done):
    """The linearisation of layers t0 .. t0 + count - 1 at the states U[first ..] into rows
    0 .. count - 1 of ``keep`` (only the rows p with done[p] == 0); one Numba call."""
    _check_store(U)
    if first < 0 or first + count > len(U) or t0 < 0 or t0 + count > layer[0].shape[0]:
        raise ValueError(f"composed_caches: states {first}..{first + count - 1} of {len(U)} or "
                         f"layers {t0}..{t0 + count - 1} out of range")
    _caches(U, int(first), int(count), int(t0), *layer, *keep, done)


def composed_chains_adjoint(L, G, chains, layer0, layer_step, h, W, gam, bn, lin_arrays, d0):
    """Stacked adjoint relaxation: along each chain L[i] = L[i - 1] + h J_t^T L[i - 1] (+ G[i]),
    t = layer0 + i layer_step, J_t at row t - d0 of ``lin_arrays`` (XH, DA, MK, IS)."""
    _check_store(L, "L")
    chains = _index_array(chains, "chains", 2)
    _check_steps(L, chains, layer0, layer_step, W.shape[0], True)
    Gs, has_g = _g(L, G)
    _parallel(_chains_adj, _chains_adj_par, chains, L, Gs, has_g, chains, int(layer0),
              int(layer_step), L.dtype.type(h), W, gam, int(bn), *lin_arrays, int(d0))


def composed_points_adjoint(L, G, R, slots, out_slots, layer0, layer_step, h, W, gam, bn,
                            lin_arrays, d0, mode):
    """Adjoint residual / FAS / plain points (see :func:`composed_points_forward`)."""
    _check_store(L, "L")
    slots, outs = _index_array(slots, "slots"), _index_array(out_slots, "out_slots")
    _check_steps(L, slots, layer0, layer_step, W.shape[0], False)
    Gs, has_g = _g(L, G)
    return _points_adj(L, Gs, has_g, R, slots, outs, int(layer0), int(layer_step),
                       L.dtype.type(h), W, gam, int(bn), *lin_arrays, int(d0), int(mode))


def composed_params(L, l0, l_step, count, U, u0, row0, t0, h, gam, bn, lin_arrays, GW, Gb, Gg,
                    Gbe):
    """Rows t0 + row0 .. t0 + row0 + count - 1 of the parameter gradients (written):
    h (dF_t/dtheta)^T lam_{t+1} with lam_{t+1} = L[l0 + p l_step], the state U[u0 + p] and
    linearisation row row0 + p; one Numba call."""
    _check_store(L, "L")
    _params(L, int(l0), int(l_step), int(count), U, int(u0), int(row0), int(t0), L.dtype.type(h),
            gam, int(bn), *lin_arrays, GW, Gb, Gg, Gbe)


def _no_keep(U):
    e3, e2 = np.empty((0, 1, 1), U.dtype), np.empty((0, 1), U.dtype)
    return e3, e3, e3, e2, e2, e2


#: Whether this backend has the composed kernels (:meth:`ComposedStep.can_stack`).
composed_stacked = True
