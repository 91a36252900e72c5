"""Captured MGRIT cycles: one call runs a whole recorded cycle (:mod:`mgnn.backend.tape`) through
the chain bodies of :mod:`.stacked` (dense, conv), or through the kernels of :mod:`.composed`
and :mod:`.recurrent` (the kinds with kernels of their own)."""

import weakref

import numba
import numpy as np
from numba import prange

from .. import tape as _T
from .stacked import (_call_driver, _conv_adj_chain, _conv_adj_shared, _conv_fwd_chain,
                      _conv_fwd_shared, _conv_scratch, _dense_adj_chain, _dense_adj_shared,
                      _dense_fwd_chain, _dense_fwd_shared)
from .activations import njit, overload
from .composed import _chain_adj, _chain_fwd, _points_adj, _points_fwd
from .recurrent import _rec_chains, _rec_chains_adj, _rec_points, _rec_points_adj


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
    _tape_copies(S, row)
    return 0.0


@njit(cache=True)
def _tape_copies(S, row):
    """An INJECT, COPY or CORRECT row (mgnn.backend.tape)."""
    op, U = row[_T.OP], S[row[_T.U]]
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


def _tape_driver(S, ops, hs, W, P, d0, act, norms):
    """:func:`_tape_serial` with ``adjoint`` a constant, picked at typing by P's dimensions
    (adjoint: sigma' (layers, *state)): with adjoint and d0 both run-time values LLVM compiled
    the chain bodies ~1.7x slower (a conv step of a tape 0.67 ms against the engine's 0.40), and
    a run-time branch on adjoint would compile the driver twice."""


def _tape_driver_threads(S, ops, hs, W, P, d0, act, norms):
    """:func:`_tape_driver` of :func:`_tape_threads`."""


def _constant_adjoint(driver):
    def impl_for(S, ops, hs, W, P, d0, act, norms):
        if P.ndim > 2:
            return lambda S, ops, hs, W, P, d0, act, norms: driver(S, ops, hs, W, P, d0, act,
                                                                   True, norms)
        return lambda S, ops, hs, W, P, d0, act, norms: driver(S, ops, hs, W, P, d0, act,
                                                               False, norms)
    return impl_for


@njit(cache=True)
def _tape(S, ops, hs, W, P, d0, act, adjoint, norms):
    _tape_driver(S, ops, hs, W, P, d0, act, norms)


@njit(cache=True)
def _tape_serial(S, ops, hs, W, P, d0, act, adjoint, norms):
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


@njit(cache=True)
def _tape_par(S, ops, hs, W, P, d0, act, adjoint, norms):
    _tape_driver_threads(S, ops, hs, W, P, d0, act, norms)


@njit(cache=True, parallel=True)
def _tape_threads(S, ops, hs, W, P, d0, act, adjoint, norms):
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
    key = (id(stores), kind, W.dtype.char, P.dtype.char, P.ndim, hs.dtype.char, bool(adjoint))
    held = _CHECKED.get(key)
    if held is None or held() is not stores:  # a typed list's item type is fixed: one check
        U0 = stores[0]
        if (W.dtype != U0.dtype or P.dtype != U0.dtype or hs.dtype != U0.dtype
                or U0.ndim != _STACKED_NDIM[kind] or bool(adjoint) != (P.ndim > 2)):
            raise TypeError(f"{kind} tape (adjoint={adjoint}): W {W.dtype}, P {P.dtype} "
                            f"{P.shape}, hs {hs.dtype} for {U0.ndim}-d stores of {U0.dtype} "
                            "(the steps are picked by P: b (N, c) forward, sigma' (layers, "
                            "*state) adjoint)")
        if len(_CHECKED) >= 256:
            _CHECKED.clear()
        try:  # a weak reference: a dead tape's stores are not kept alive by the memo
            _CHECKED[key] = weakref.ref(stores)
        except TypeError:  # a plain list (a direct caller): checked every time
            pass
    if parallel is None:
        parallel = numba.get_num_threads() > 1
    _call_driver(_tape_par if parallel else _tape, parallel or kind == "conv", stores, ops, hs,
                 W, P, int(d0), int(act), bool(adjoint), norms)


_STACKED_NDIM = {"dense": 3, "conv": 5}
#: The checks :func:`_run_tape` passed, by store list (a weak reference: an id reused by a new
#: list does not match) and argument types (a tape cut by halo messages runs one call per
#: segment: a typed list's item read costs microseconds).
_CHECKED = {}


def dense_run_tape(stores, ops, hs, W, P, d0, act, adjoint, norms, parallel=None):
    """Numba: one call for a captured cycle of dense steps (:mod:`mgnn.backend.tape`)."""
    _run_tape("dense", stores, ops, hs, W, P, d0, act, adjoint, norms, parallel)


def conv_run_tape(stores, ops, hs, W, P, d0, act, adjoint, norms, parallel=None):
    """Numba: one call for a captured cycle of conv steps (:mod:`mgnn.backend.tape`)."""
    _run_tape("conv", stores, ops, hs, W, P, d0, act, adjoint, norms, parallel)


overload(_tape_driver)(_constant_adjoint(_tape_serial))
overload(_tape_driver_threads)(_constant_adjoint(_tape_threads))


# ------------------------------------- captured cycles of the kinds with kernels of their own
# Dense batch norm / dropout (composed) and GRU/RNN (recurrent): the rows of mgnn.backend.tape
# without shared first steps (the recorder leaves them apart for these kinds: ``tape_shares``),
# each through the kind's own chain and point kernels (:mod:`.composed`, :mod:`.recurrent`), as
# the engine's call on that chain or point: the same bits. A replay's ``layer`` tuple says which:
#   composed forward  (W, b, gam, bet, rmu, rvar, eps, act, bn, thr, dscale, k0, k1, tstep, s0,
#                      MS, m_lo): the kernels' layer arguments (ComposedStep.kernel_args)
#   composed adjoint  (W, gam, bn, XH, DA, MK, IS, d0): the linearisation of layer t in row t - d0
#   recurrent forward (dts, modes, cell, gi0, WihT, WhhT, bih, bhh)
#   recurrent adjoint (dts, modes, cell, U, u_off, D, d0, Wih, Whh, tiny)
# (a recurrent row's step size picks its update rule: (dts, modes)[H], RecurrentStep._rule).
def _layer_kind(layer):
    """'composed forward' / 'composed adjoint' / 'recurrent forward' / 'recurrent adjoint' of
    a ``layer`` tuple's Numba type (see above)."""
    types = list(layer)
    composed = getattr(types[0], "ndim", 0) == 3  # W (N, w, w); recurrent: dts (1-d)
    if composed:
        return "composed forward" if len(types) == 17 else "composed adjoint"
    return "recurrent forward" if len(types) == 8 else "recurrent adjoint"


def _own_chain(U, G, has_g, chain, l0, ls, h, hi, layer):
    """The engine's chain call of the kind of ``layer`` on the one chain ``chain`` (1, 2)
    (step size h = hs[hi]; recurrent kinds: the rule of index hi)."""


@overload(_own_chain)
def _own_chain_impl(U, G, has_g, chain, l0, ls, h, hi, layer):
    kind = _layer_kind(layer)
    if kind == "composed forward":
        def impl(U, G, has_g, chain, l0, ls, h, hi, layer):
            none3, none2 = np.empty((0, 1, 1), U.dtype), np.empty((0, 1), U.dtype)
            _chain_fwd(0, U, G, has_g, chain, l0, ls, h, *layer, none3, none3, none3, none2,
                       none2, none2, 0, np.zeros(0, np.int8))
    elif kind == "composed adjoint":
        def impl(U, G, has_g, chain, l0, ls, h, hi, layer):
            _chain_adj(0, U, G, has_g, chain, l0, ls, h, *layer)
    elif kind == "recurrent forward":
        def impl(U, G, has_g, chain, l0, ls, h, hi, layer):
            dts, modes, cell, gi0, WihT, WhhT, bih, bhh = layer
            none = np.empty((0, 1, 1, 1), U.dtype)
            _rec_chains(cell, gi0, U, G, has_g, chain, l0, ls, WihT, WhhT, bih, bhh, dts[hi],
                        modes[hi], none, none, 0, np.zeros(0, np.int8))
    else:
        def impl(U, G, has_g, chain, l0, ls, h, hi, layer):
            dts, modes, cell, Uf, u_off, D, d0, Wih, Whh, tiny = layer
            _rec_chains_adj(cell, U, G, has_g, chain, l0, ls, Uf, u_off, D, d0, Wih, Whh,
                            dts[hi], modes[hi], tiny)
    return impl


def _own_points(U, G, has_g, R, slot, out, l0, ls, h, hi, mode, layer):
    """The engine's points call of the kind of ``layer`` on the slots ``slot`` into R[out]
    (see :func:`_own_chain`); returns the squared norm (mode 0)."""


@overload(_own_points)
def _own_points_impl(U, G, has_g, R, slot, out, l0, ls, h, hi, mode, layer):
    kind = _layer_kind(layer)
    if kind == "composed forward":
        def impl(U, G, has_g, R, slot, out, l0, ls, h, hi, mode, layer):
            return _points_fwd(U, G, has_g, R, slot, out, l0, ls, h, *layer, mode)
    elif kind == "composed adjoint":
        def impl(U, G, has_g, R, slot, out, l0, ls, h, hi, mode, layer):
            return _points_adj(U, G, has_g, R, slot, out, l0, ls, h, *layer, mode)
    elif kind == "recurrent forward":
        def impl(U, G, has_g, R, slot, out, l0, ls, h, hi, mode, layer):
            dts, modes, cell, gi0, WihT, WhhT, bih, bhh = layer
            return _rec_points(cell, gi0, U, G, has_g, R, slot, out, l0, ls, WihT, WhhT, bih,
                               bhh, dts[hi], modes[hi], mode)
    else:
        def impl(U, G, has_g, R, slot, out, l0, ls, h, hi, mode, layer):
            dts, modes, cell, Uf, u_off, D, d0, Wih, Whh, tiny = layer
            return _rec_points_adj(cell, U, G, has_g, R, slot, out, l0, ls, Uf, u_off, D, d0,
                                   Wih, Whh, dts[hi], modes[hi], mode, tiny)
    return impl


@njit(cache=True)
def _own_row(S, row, hs, chain, slot, out, layer, steps_only=False):
    """One row (what it carries first, unless ``steps_only``); returns the squared norm of a
    residual point (a chain's tail's). ``chain`` (1, 2), ``slot``, ``out`` (1,) int64:
    scratch."""
    op = row[_T.OP]
    if op != _T.CHAIN and op != _T.POINT:
        _tape_copies(S, row)
        return 0.0
    U = S[row[_T.U]]
    has_g = row[_T.G] >= 0
    G = S[row[_T.G]] if has_g else U
    l0, ls, hi = row[_T.LAYER0], row[_T.LSTEP], row[_T.H]
    if op == _T.POINT:
        slot[0], out[0] = row[_T.FIRST], row[_T.OUT]
        R = S[row[_T.R]] if row[_T.R] >= 0 else U
        return _own_points(U, G, has_g, R, slot, out, l0, ls, hs[hi], hi, row[_T.MODE], layer)
    if not steps_only:
        _tape_carried(S, row, 1)
        _tape_carried(S, row, 2)
    chain[0, 0], chain[0, 1] = row[_T.FIRST], row[_T.N]
    _own_chain(U, G, has_g, chain, l0, ls, hs[hi], hi, layer)
    if row[_T.R] < 0:
        return 0.0
    slot[0], out[0] = row[_T.FIRST] + row[_T.N], row[_T.OUT]
    return _own_points(U, G, has_g, S[row[_T.R]], slot, out, l0, ls, hs[hi], hi, row[_T.MODE],
                       layer)


@njit(cache=True)
def _own_tape(S, ops, hs, norms, layer):
    """The rows in order (a zipped pair's rows are independent of what runs between them in
    the array's order: the order before the zip), norms added as they come."""
    chain, slot, out = np.empty((1, 2), np.int64), np.empty(1, np.int64), np.empty(1, np.int64)
    for k in range(ops.shape[0]):
        t = _own_row(S, ops[k], hs, chain, slot, out, layer)
        if ops[k, _T.NORM] >= 0:
            norms[ops[k, _T.NORM]] += t


@njit(cache=True, parallel=True)
def _own_tape_par(S, ops, hs, norms, layer):
    """:func:`_own_tape` with the rows of one engine call (``RUN``) on Numba's threads, as
    :func:`_tape_threads` runs them (carried copies first; norms added in row order)."""
    chain, slot, out = np.empty((1, 2), np.int64), np.empty(1, np.int64), np.empty(1, np.int64)
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
            for q in prange(run):
                c2, s2, o2 = np.empty((1, 2), np.int64), np.empty(1, np.int64), \
                    np.empty(1, np.int64)
                t[q] = _own_row(S, ops[k + q], hs, c2, s2, o2, layer, True)
            for q in range(run):
                if ops[k + q, _T.NORM] >= 0:
                    norms[ops[k + q, _T.NORM]] += t[q]
            k += run
        else:
            t0 = _own_row(S, ops[k], hs, chain, slot, out, layer)
            if ops[k, _T.NORM] >= 0:
                norms[ops[k, _T.NORM]] += t0
            k += 1


def _own_run_tape(stores, ops, hs, norms, layer, parallel):
    """Replay ``ops`` on ``stores`` (:func:`stores_list`) with ``layer`` (see above);
    ``parallel`` (None: Numba has threads): each call's rows on the threads."""
    if ops.ndim != 2 or ops.shape[1] != _T.COLS or (ops[:, _T.SHARE_R] >= 0).any():
        raise ValueError("a tape of these kinds has rows of mgnn.backend.tape's layout without "
                         "shared first steps (SHARE_R -1: their recorder's tape_shares False)")
    if parallel is None:
        parallel = numba.get_num_threads() > 1
    _call_driver(_own_tape_par if parallel else _own_tape, parallel, stores, ops, hs, norms,
                 tuple(layer))


def _composed_tape_check(stores, hs, W):
    U0 = stores[0]
    if U0.ndim != 3 or W.dtype != U0.dtype or hs.dtype != U0.dtype:
        raise TypeError(f"composed tape: W {W.dtype}, hs {hs.dtype} for {U0.ndim}-d stores of "
                        f"{U0.dtype} ((m, B, w) stores of the layers' dtype expected)")


def composed_run_tape(stores, ops, hs, layer, norms, parallel=None):
    """Numba: one call for a captured forward cycle of composed dense steps
    (:mod:`mgnn.backend.tape`; ``layer`` the tuple of
    :meth:`mgnn.blocks.composed.ComposedStep.kernel_args`); squared norms added into
    ``norms``. ``parallel`` (default: Numba has threads): each call's rows on the threads."""
    _composed_tape_check(stores, hs, layer[0])
    _own_run_tape(stores, ops, hs, norms, layer, parallel)


def composed_run_tape_adjoint(stores, ops, hs, W, gam, bn, lin_arrays, d0, norms,
                              parallel=None):
    """Numba: one call for a captured adjoint cycle of composed dense steps, the linearisation
    ``lin_arrays`` (XH, DA, MK, IS) of layer t in row t - d0 (see
    :func:`composed_run_tape`)."""
    _composed_tape_check(stores, hs, W)
    _own_run_tape(stores, ops, hs, norms, (W, gam, int(bn), *lin_arrays, int(d0)), parallel)


def _recurrent_tape_check(stores, *arrays):
    U0 = stores[0]
    if U0.ndim != 4 or any(a.dtype != U0.dtype for a in arrays):
        raise TypeError(f"recurrent tape: {[str(a.dtype) for a in arrays]} for {U0.ndim}-d "
                        f"stores of {U0.dtype} ((m, B, layers, H) stores of the weights' dtype "
                        "expected)")


def _rules(rules):
    """(dts float64, modes int64) of a tape's step sizes from their (dt, mode) pairs."""
    return (np.array([float(d) for d, _ in rules], dtype=np.float64),
            np.array([int(m) for _, m in rules], dtype=np.int64))


def recurrent_run_tape(stores, ops, rules, norms, cell, gi0, WihT, WhhT, bih, bhh,
                       parallel=None):
    """Numba: one call for a captured forward cycle of recurrent steps (:mod:`mgnn.backend.tape`;
    ``rules`` the (dt, mode) of each step size of the tape, the rest as
    :func:`mgnn.backend.numba_cpu.recurrent_chains_forward` takes them); squared norms added
    into ``norms`` (``parallel``: see :func:`composed_run_tape`)."""
    _recurrent_tape_check(stores, gi0, WihT, WhhT, bih, bhh)
    dts, modes = _rules(rules)
    _own_run_tape(stores, ops, dts, norms, (dts, modes, int(cell), gi0, WihT, WhhT, bih, bhh),
                  parallel)


def recurrent_run_tape_adjoint(stores, ops, rules, norms, cell, U, u_off, D, d0, Wih, Whh,
                               parallel=None):
    """Numba: one call for a captured adjoint cycle of recurrent steps (see
    :func:`recurrent_run_tape`; U, u_off, D, d0 the linearisation as
    :func:`mgnn.backend.numba_cpu.recurrent_chains_adjoint` takes it)."""
    _recurrent_tape_check(stores, U, Wih, Whh)
    dts, modes = _rules(rules)
    tiny = float(np.finfo(stores[0].dtype).tiny)
    _own_run_tape(stores, ops, dts, norms, (dts, modes, int(cell), U, int(u_off), D, int(d0),
                                            Wih, Whh, tiny), parallel)
