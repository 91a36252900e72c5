"""GRU/RNN (:data:`mgnn.backend.RECURRENT_KERNELS`): gate epilogues, whole-sequence sweeps, the
stacked forward and adjoint over sequence time, caches and gate cotangents."""
import math

import numpy as np

from .stacked import (_INDEX_FAULTS, _NO_OUTS, _index_array, _int, _points_out,
                      index_check)


# ------------------------------------------------------------------ recurrent gate epilogues
# The elementwise part of a GRU / tanh-RNN cell step (:data:`mgnn.backend.RECURRENT_KERNELS`); the
# GEMMs gi = x W_ih^T + b_ih and gh = h W_hh^T + b_hh are done by the caller. GRU gates are stacked
# (r, z, n) along the last axis of gi and gh (PyTorch's layout: columns [0:H], [H:2H], [2H:3H]):
# r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r gh_n), and
#   mode 0 (explicit): h' = h + dt (1 - z)(n - h), computed as (1 - z) n + z h when dt == 1
#                      (PyTorch's GRU);
#   mode 1 (implicit): h' = (h + dt (1 - z) n) / (1 + dt (1 - z)).
# The tanh RNN: h' = h + dt (tanh(gi + gh) - h), h' = tanh(gi + gh) when dt == 1.
# dt is a real > 0 (1 on the fine level, cf^level on coarse MGRIT levels), used in h's dtype.


def gate_check(h, dt, mode, **arrays):
    """Validate a gate-kernel call (cheap: it runs on every step); returns (B, H, dt as a Python
    float, mode).

    h must be a C-contiguous float32/float64 array (B, H); each keyword value is ``(array, k)``:
    the array must be C-contiguous of h's dtype and of shape (B, k H) for an int k, (B, k[0], H)
    for a 1-tuple k. dt: a finite real > 0; mode: 0 or 1.
    """
    shape, dtype = getattr(h, "shape", None), getattr(h, "dtype", None)
    if shape is None or len(shape) != 2 or dtype.char not in "fd" or not h.flags.c_contiguous:
        raise ValueError(f"h must be a C-contiguous float32/float64 array of shape (B, H), got "
                         f"{getattr(h, 'dtype', type(h).__name__)} {shape or ''}")
    B, H = shape
    for name, (a, k) in arrays.items():
        want = (B, k * H) if k.__class__ is int else (B, k[0], H)
        if (getattr(a, "shape", None) != want or (a.dtype is not dtype and a.dtype != dtype)
                or not a.flags.c_contiguous):
            raise ValueError(f"{name} must be a C-contiguous {dtype} array of shape {want}, "
                             f"got {getattr(a, 'dtype', type(a).__name__)} "
                             f"{getattr(a, 'shape', '')}")
    if dt.__class__ is not float:
        if isinstance(dt, (bool, np.bool_)) or not isinstance(dt, (int, float, np.integer,
                                                                    np.floating)):
            raise TypeError(f"dt must be a real number, got {dt!r}")
        dt = float(dt)
    if not (math.isfinite(dt) and dt > 0):
        raise ValueError(f"dt must be finite and > 0, got {dt!r}")
    if mode.__class__ is not int:
        mode = _int("mode", mode)
    if mode != 0 and mode != 1:
        raise ValueError(f"mode must be 0 (explicit) or 1 (implicit), got {mode!r}")
    return B, H, dt, mode


def _sigmoid(x):
    """1 / (1 + exp(-x)) without overflow: exp(-|x|) only."""
    e = np.exp(-np.abs(x))
    s = 1 / (1 + e)
    return np.where(x >= 0, s, e * s)


def gru_gates_forward(gi, gh, h, dt, mode):
    """GRU gate epilogue: (h_next (B, H), cache (B, 4, H)).

    gi, gh (B, 3H): input and hidden projections with their biases, gates (r, z, n) stacked;
    h (B, H); dt > 0; mode 0 explicit / 1 implicit (see the section comment). cache[:, 0..3] =
    r, z, n, gh_n: what :func:`gru_gates_vjp` needs.
    """
    B, H, dt, mode = gate_check(h, dt, mode, gi=(gi, 3), gh=(gh, 3))
    r = _sigmoid(gi[:, :H] + gh[:, :H])
    z = _sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
    ghn = gh[:, 2 * H:]
    n = np.tanh(gi[:, 2 * H:] + r * ghn)
    if mode == 1:
        a = dt * (1 - z)
        h_next = (h + a * n) / (1 + a)
    elif dt == 1:
        h_next = (1 - z) * n + z * h
    else:
        h_next = h + dt * (1 - z) * (n - h)
    return h_next, np.ascontiguousarray(np.stack([r, z, n, ghn], axis=1))


def gru_gates_vjp(g, h, cache, dt, mode):
    """vjp of :func:`gru_gates_forward` with cotangent g (B, H) of h_next:
    (dh_direct (B, H), dgi (B, 3H), dgh (B, 3H)).

    dh_direct is the path h -> h_next that bypasses gh (the caller adds dgh @ W_hh); dgi, dgh are
    the cotangents of gi and gh (they differ only in the n block: dgh_n = dgi_n * r).
    """
    B, H, dt, mode = gate_check(h, dt, mode, g=(g, 1), cache=(cache, (4,)))
    r, z, n, ghn = (cache[:, k] for k in range(4))
    if mode == 1:  # h' = (h + a n) / (1 + a), a = dt (1 - z)
        a = dt * (1 - z)
        inv = 1 / (1 + a)
        c_h, c_n, c_z = inv, a * inv, -dt * (n - h) * inv * inv
    elif dt == 1:  # h' = (1 - z) n + z h
        c_h, c_n, c_z = z, 1 - z, h - n
    else:  # h' = h + dt (1 - z)(n - h)
        c_n = dt * (1 - z)
        c_h, c_z = 1 - c_n, -dt * (n - h)
    dpn = g * c_n * (1 - n * n)
    dpr = dpn * ghn * r * (1 - r)
    dpz = g * c_z * z * (1 - z)
    return (g * c_h, np.concatenate([dpr, dpz, dpn], axis=1),
            np.concatenate([dpr, dpz, dpn * r], axis=1))


def rnn_gates_forward(gi, gh, h, dt):
    """tanh-RNN epilogue: (h_next, deriv), both (B, H): t = tanh(gi + gh), h_next = h + dt (t - h)
    (= t when dt == 1), deriv = 1 - t^2; gi, gh, h (B, H), dt > 0."""
    B, H, dt, _ = gate_check(h, dt, 0, gi=(gi, 1), gh=(gh, 1))
    t = np.tanh(gi + gh)
    return (t if dt == 1 else h + dt * (t - h)), 1 - t * t


def rnn_gates_vjp(g, h, deriv, dt):
    """vjp of :func:`rnn_gates_forward` with cotangent g (B, H): (dh_direct, da), both (B, H):
    dh_direct = (1 - dt) g (the path bypassing gh), da = dt g deriv (the cotangent of gi and of
    gh). h (B, H) is only checked (kept for the GRU's signature)."""
    B, H, dt, _ = gate_check(h, dt, 0, g=(g, 1), deriv=(deriv, 1))
    return g * (1 - dt), g * dt * deriv


# --- whole-sequence recurrent sweeps (serial training: one call per sequence) ----------------
# cell 0 = GRU (gates r, z, n; caches (B, 4H): r, z, n, gh_n), 1 = tanh RNN (caches (B, H):
# 1 - tanh^2). Layer k of step n reads layer k-1's new hidden state (layer 0 the input
# projection gi0[:, n], computed outside: it does not depend on the state).

def _recurrent_arrays(cell, dtype, arrays):
    """ValueError naming the first of ``arrays`` ({name: (array, shape)}) that is not a
    C-contiguous float32/float64 array of ``dtype`` and its shape; checks ``cell``."""
    if isinstance(cell, bool) or cell not in (0, 1):
        raise ValueError(f"cell must be 0 (GRU) or 1 (RNN), got {cell!r}")
    for name, (a, shape) in arrays.items():
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(a).__name__}")
        if a.shape != tuple(shape) or a.dtype != dtype or \
                a.dtype.char not in "fd" or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous {dtype} array of shape "
                             f"{tuple(shape)}, got {getattr(a, 'dtype', type(a).__name__)} "
                             f"{getattr(a, 'shape', '')}")


def _step_rule(dt, mode):
    if isinstance(dt, bool) or not isinstance(dt, (int, float, np.floating, np.integer)) or \
            not np.isfinite(dt) or dt <= 0:
        raise ValueError(f"dt must be a finite real > 0, got {dt!r}")
    if isinstance(mode, bool) or mode not in (0, 1):
        raise ValueError(f"mode must be 0 (explicit) or 1 (implicit), got {mode!r}")


def _point_mode(point_mode):
    """ValueError unless ``point_mode`` is None (chains) or a STACKED_KERNELS mode 0, 1, 2."""
    if point_mode is not None and (isinstance(point_mode, bool) or point_mode not in (0, 1, 2)):
        raise ValueError(f"unknown mode {point_mode!r}; expected 0 (residual), 1 (FAS), 2 (plain)")


def _distinct(written, read):
    """ValueError naming the first array of ``written`` ({name: array}) that shares memory with
    another written one or with one of ``read`` (None entries skipped): a kernel's outputs
    must not alias each other or its inputs."""
    items = [(n, a) for n, a in written.items() if a is not None]
    others = [(n, a) for n, a in read.items() if a is not None]
    for k, (name, a) in enumerate(items):
        for other, b in items[k + 1:] + others:
            if other != name and np.may_share_memory(a, b):
                raise ValueError(f"{name} shares memory with {other}; the kernel writes {name}, "
                                 "so it must be a different array")


def _rec_stack_args(cell, S, G, R, want, dt, mode, point_mode, layer0, layer_step):
    """The checks every stacked recurrent call on the stack S (m, B, nl, H) shares: the arrays
    of ``want`` ({name: (array, shape)}), G like S or None, R (r, B, nl, H) or None, the update
    rule and the point mode; returns (layer0, layer_step) as ints."""
    want = dict(want)
    if G is not None:
        want["G"] = (G, S.shape)
    if R is not None:
        want["R"] = (R, (getattr(R, "shape", (0,))[0],) + S.shape[1:])
    _recurrent_arrays(cell, S.dtype, want)
    _step_rule(dt, mode)
    _point_mode(point_mode)
    return _int("layer0", layer0), _int("layer_step", layer_step)


def _rec_indices(idx, outs, m, R, what_m, index_check):
    """The int64 chains (n, 2) (``R`` None) or (slots (n,), out slots (n,)) of a stacked
    recurrent call on a stack of m slots; ValueError naming the first bad entry. Returns
    (idx or (slots, outs), lo, hi): slots lo..hi are stepped into (lo > hi: none)."""
    if R is None:
        idx = _index_array("chains", idx, 2)
        code, k, lo, hi = index_check(idx, _NO_OUTS, m, 0)
    else:
        idx = _index_array("slots", idx, 1)
        outs = _index_array("out_slots", outs, 1)
        if outs.shape != idx.shape:
            raise ValueError(f"out_slots has shape {outs.shape}, slots {idx.shape}")
        code, k, lo, hi = index_check(idx[:, None], outs, m, R.shape[0])
    if code == 6:
        raise ValueError(f"bad out_slots: {outs.tolist()} repeats slot {k} of R")
    if code:
        what = "chains" if R is None else ("out_slots" if code == 5 else "slots")
        why = _INDEX_FAULTS[code].format(m=m - 1, r=(0 if R is None else R.shape[0]) - 1,
                                         s=what_m)
        raise ValueError(f"bad {what}: entry {k} {why}")
    return (idx if R is None else (idx, outs)), lo, hi


def _weights(cell, nl, H, WihT, WhhT, bih, bhh):
    GH = (3 if cell == 0 else 1) * H
    return {"WihT": (WihT, (nl, H, GH)), "WhhT": (WhhT, (nl, H, GH)), "bih": (bih, (nl, GH)),
            "bhh": (bhh, (nl, GH))}


def recurrent_sweep_check(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt=1.0, mode=0):
    """Validate a sweep call; returns (L, B, nl, H, G). Shapes: gi0 (B, L, G H), U (L + 1, B,
    nl, H), WihT / WhhT (nl, H, G H) (WihT[0] unused), bih / bhh (nl, G H), D (L, nl, B, C H)
    with C = 4 (GRU) or 1 (RNN), or a 0-length first axis (no caches). One float dtype, all
    C-contiguous; dt > 0, mode 0 or 1."""
    _recurrent_arrays(cell, getattr(U, "dtype", None), {"U": (U, getattr(U, "shape", ()))})
    if U.ndim != 4:
        raise ValueError(f"U must be (L + 1, B, nl, H), got shape {U.shape}")
    L1, B, nl, H = U.shape
    G, C = (3, 4) if cell == 0 else (1, 1)
    want = {"gi0": (gi0, (B, L1 - 1, G * H)), **_weights(cell, nl, H, WihT, WhhT, bih, bhh)}
    if D.shape[0]:
        want["D"] = (D, (L1 - 1, nl, B, C * H))
    _recurrent_arrays(cell, U.dtype, want)
    _step_rule(dt, mode)
    _distinct({"U": U, "D": D}, {"gi0": gi0, "WhhT": WhhT})
    return L1 - 1, B, nl, H, G


def recurrent_sweep_back_check(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH):
    """Validate a backward sweep call (shapes as :func:`recurrent_sweep_backward` documents)."""
    _recurrent_arrays(cell, getattr(U, "dtype", None), {"U": (U, getattr(U, "shape", ()))})
    if U.ndim != 4:
        raise ValueError(f"U must be (L + 1, B, nl, H), got shape {U.shape}")
    L1, B, nl, H = U.shape
    GH, C = (3 * H, 4) if cell == 0 else (H, 1)
    _recurrent_arrays(cell, U.dtype, {
        "lam": (lam, (B, nl, H)), "D": (D, (L1 - 1, nl, B, C * H)), "Wih": (Wih, (nl, GH, H)),
        "Whh": (Whh, (nl, GH, H)), "DGI": (DGI, (L1 - 1, nl, B, GH)),
        "DGH": (DGH, (L1 - 1, nl, B, GH))})
    _step_rule(dt, mode)
    _distinct({"DGI": DGI, "DGH": DGH}, {"lam": lam, "U": U, "D": D})


def recurrent_sweep_forward(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt, mode):
    """U[n + 1] = the step of every layer out of U[n] for n = 0..L-1 (in place), and D[n, k]
    the gate caches (if D has L rows). Reference: the gate kernels step after step."""
    L = recurrent_sweep_check(cell, gi0, U, WihT, WhhT, bih, bhh, D, dt, mode)[0]
    for n in range(L):
        U[n + 1], caches = _rec_step(cell, U[n], gi0[:, n], WihT, WhhT, bih, bhh, dt, mode)
        if D.shape[0]:
            D[n] = np.stack(caches)


def recurrent_sweep_backward(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH):
    """The adjoint sweep of :func:`recurrent_sweep_forward` from the cotangent ``lam`` (B, nl, H)
    of U[L]: returns that of U[0]; DGI[n, k], DGH[n, k] (L, nl, B, G H) receive the cotangents of
    the input and hidden projections of layer k at step n (the parameter gradients are GEMMs of
    them). Wih / Whh (nl, G H, H) (Wih[0] unused); D the forward's caches."""
    lam = np.ascontiguousarray(lam)
    recurrent_sweep_back_check(cell, lam, U, D, Wih, Whh, dt, mode, DGI, DGH)
    for n in range(D.shape[0] - 1, -1, -1):
        lam, dgis, dghs = _rec_back(cell, lam, U[n], D[n], Wih, Whh, dt, mode)
        DGI[n], DGH[n] = np.stack(dgis), np.stack(dghs)
    return lam


def _rec_step(cell, src, gi_t, WihT, WhhT, bih, bhh, dt, mode):
    """(dst, caches): every layer's cell out of src (B, nl, H) with layer 0's input projection
    gi_t (B, G H); caches[k] (B, C H) the gate cache of layer k."""
    dst, caches = np.empty_like(src), []
    inp = None
    for k in range(src.shape[1]):
        gi = np.ascontiguousarray(gi_t if k == 0 else inp @ WihT[k] + bih[k])
        hk = np.ascontiguousarray(src[:, k])
        gh = hk @ WhhT[k] + bhh[k]
        out, cache = (gru_gates_forward(gi, gh, hk, dt, mode) if cell == 0 else
                      rnn_gates_forward(gi, gh, hk, dt))
        dst[:, k] = out
        caches.append(cache.reshape(src.shape[0], -1))
        inp = out
    return dst, caches


def recurrent_stacked_check(cell, gi0, U, G, R, idx, layer0, layer_step, WihT, WhhT, bih, bhh,
                            dt, mode, out_slots=None, point_mode=None, index_check=index_check):
    """Validate a stacked recurrent kernel call (chains when R is None, else points); returns
    the int64 chains (n, 2), or (slots (n,), out slots (n,)). U (m, B, nl, H), G like U or
    None, R (r, B, nl, H) not sharing U's memory, gi0 (B, L, G H) and the weights as in
    :func:`recurrent_sweep_check`. The time step into slot i is layer0 + i layer_step, inside
    0..L-1."""
    _recurrent_arrays(cell, getattr(U, "dtype", None), {"U": (U, getattr(U, "shape", ()))})
    if U.ndim != 4:
        raise ValueError(f"U must be a stack (m, B, nl, H), got shape {U.shape}")
    m, B, nl, H = U.shape
    GH = (3 if cell == 0 else 1) * H
    gi_shape = tuple(getattr(gi0, "shape", ()))
    L = gi_shape[1] if len(gi_shape) == 3 else -1  # any sequence length; -1 fails the check
    want = {"gi0": (gi0, (B, L, GH)), **_weights(cell, nl, H, WihT, WhhT, bih, bhh)}
    layer0, layer_step = _rec_stack_args(cell, U, G, R, want, dt, mode, point_mode, layer0,
                                         layer_step)
    _distinct({"U": U if R is None else None, "R": R}, {"U": U, "G": G, "gi0": gi0})
    idx, lo, hi = _rec_indices(idx, out_slots, m, R, "U", index_check)
    if lo <= hi:
        for i in (lo, hi):
            if not 0 <= layer0 + i * layer_step < L:
                raise ValueError(f"the step into slot {i} uses time step {layer0 + i * layer_step}"
                                 f" (layer0={layer0}, layer_step={layer_step}), not in 0..{L - 1}")
    return idx


def recurrent_chains_forward(cell, gi0, U, G, chains, layer0, layer_step, WihT, WhhT, bih, bhh,
                             dt, mode):
    """Stacked relaxation of a recurrent model: along each chain (first slot, length) U[i] =
    the cells of time step layer0 + i layer_step out of U[i - 1] (+ G[i]); arrays as in
    :func:`recurrent_sweep_forward`, dt / mode the update rule of the level's step."""
    chains = recurrent_stacked_check(cell, gi0, U, G, None, chains, layer0, layer_step, WihT,
                                     WhhT, bih, bhh, dt, mode)
    for first, n in chains.tolist():
        for i in range(first, first + n):
            t = layer0 + i * layer_step
            y = _rec_step(cell, U[i - 1], gi0[:, t], WihT, WhhT, bih, bhh, dt, mode)[0]
            U[i] = y if G is None else y + G[i]


def recurrent_points_forward(cell, gi0, U, G, R, slots, out_slots, layer0, layer_step, WihT,
                             WhhT, bih, bhh, dt, mode, point_mode):
    """The step into each of U's ``slots`` combined into R's ``out_slots`` (point_mode 0
    residual, returns the squared norm; 1 FAS; 2 plain: STACKED_KERNELS' modes)."""
    slots, outs = recurrent_stacked_check(cell, gi0, U, G, R, slots, layer0, layer_step, WihT,
                                          WhhT, bih, bhh, dt, mode, out_slots, point_mode)
    r2 = 0.0
    for i, o in zip(slots.tolist(), outs.tolist()):
        t = layer0 + i * layer_step
        phi = _rec_step(cell, U[i - 1], gi0[:, t], WihT, WhhT, bih, bhh, dt, mode)[0]
        r2 += _points_out(phi, U, G, R, i, o, point_mode)
    return r2


# --- the stacked adjoint of a recurrent model (the MGRIT adjoint solve, one call per sweep) ---
# The linearisation of time step t is its gate caches D[t - d0] (nl, B, C H) at the forward state
# U[t + u_off] (B, nl, H) (slots of the forward solve's store); the vjp of step t with the update
# rule (dt, mode) of the level's step size maps the cotangent of u_{t+1} to that of u_t.

def _rec_back(cell, lam, Ut, Dt, Wih, Whh, dt, mode):
    """(cotangent of u_t (B, nl, H), [dgi_k], [dgh_k] (B, G H) for k = 0..nl-1) from the
    cotangent ``lam`` (B, nl, H) of u_{t+1}, the state Ut (B, nl, H) and the caches Dt
    (nl, B, C H) of step t: the gate kernels layer after layer, last layer first."""
    B, nl, H = lam.shape
    out, dgis, dghs = np.empty_like(lam), [None] * nl, [None] * nl
    carry = None  # cotangent of layer k's new hidden state from layer k+1's input
    for k in range(nl - 1, -1, -1):
        g = np.ascontiguousarray(lam[:, k]) if carry is None else lam[:, k] + carry
        hk = np.ascontiguousarray(Ut[:, k])
        if cell == 0:
            dh, dgi, dgh = gru_gates_vjp(g, hk, Dt[k].reshape(B, 4, H), dt, mode)
        else:
            dh, dgi = rnn_gates_vjp(g, hk, np.ascontiguousarray(Dt[k]), dt)
            dgh = dgi
        out[:, k] = dh + dgh @ Whh[k]
        dgis[k], dghs[k] = dgi, dgh
        carry = dgi @ Wih[k] if k > 0 else None
    return out, dgis, dghs


def _rec_lin_arrays(cell, L, U, D, Wih, Whh):
    """Validate the stack L (m, B, nl, H), the states U (k, B, nl, H), the caches D
    (nd, nl, B, C H) and Wih / Whh (nl, G H, H); returns (B, nl, H)."""
    _recurrent_arrays(cell, getattr(L, "dtype", None), {"L": (L, getattr(L, "shape", ()))})
    if L.ndim != 4:
        raise ValueError(f"L must be a stack (m, B, nl, H), got shape {L.shape}")
    _, B, nl, H = L.shape
    GH, C = (3 * H, 4) if cell == 0 else (H, 1)
    _recurrent_arrays(cell, L.dtype, {
        "U": (U, (getattr(U, "shape", (0,))[0], B, nl, H)),
        "D": (D, (getattr(D, "shape", (0,))[0], nl, B, C * H)),
        "Wih": (Wih, (nl, GH, H)), "Whh": (Whh, (nl, GH, H))})
    return B, nl, H


def _rec_rows(first, last, u_off, d0, U, D):
    """ValueError unless time steps first..last (first <= last) have states U[t + u_off] and
    caches D[t - d0]."""
    for t in (first, last):
        if not 0 <= t + u_off < U.shape[0]:
            raise ValueError(f"time step {t} reads state row {t + u_off} (u_off={u_off}), not in "
                             f"0..{U.shape[0] - 1}")
        if not 0 <= t - d0 < D.shape[0]:
            raise ValueError(f"time step {t} reads cache row {t - d0} (d0={d0}), not in "
                             f"0..{D.shape[0] - 1}")


def recurrent_adjoint_check(cell, L, G, R, idx, layer0, layer_step, U, u_off, D, d0, Wih, Whh,
                            dt, mode, out_slots=None, point_mode=None, index_check=index_check):
    """Validate a stacked recurrent adjoint call (chains when R is None, else points); returns
    the int64 chains (n, 2), or (slots (n,), out slots (n,)). L (m, B, nl, H) the adjoint
    stack, G like L or None, R (r, B, nl, H) not sharing L's memory; the step into slot i is
    the vjp of time step t = layer0 + i layer_step at the state U[t + u_off] with the caches
    D[t - d0] (see :func:`recurrent_chains_adjoint`)."""
    B, nl, H = _rec_lin_arrays(cell, L, U, D, Wih, Whh)
    layer0, layer_step = _rec_stack_args(cell, L, G, R, {}, dt, mode, point_mode, layer0,
                                         layer_step)
    u_off, d0 = _int("u_off", u_off), _int("d0", d0)
    _distinct({"L": L if R is None else None, "R": R}, {"L": L, "G": G, "U": U, "D": D})
    idx, lo, hi = _rec_indices(idx, out_slots, L.shape[0], R, "L", index_check)
    if lo <= hi:
        t_lo, t_hi = sorted((layer0 + lo * layer_step, layer0 + hi * layer_step))
        _rec_rows(t_lo, t_hi, u_off, d0, U, D)
    return idx


def recurrent_chains_adjoint(cell, L, G, chains, layer0, layer_step, U, u_off, D, d0, Wih, Whh,
                             dt, mode):
    """Stacked adjoint relaxation of a recurrent model: along each chain (first slot, length)
    L[i] = the vjp of time step t = layer0 + i layer_step applied to L[i - 1] (+ G[i]), at the
    state U[t + u_off] (B, nl, H) with the gate caches D[t - d0] (nl, B, C H) of
    :func:`recurrent_sweep_forward`; Wih / Whh (nl, G H, H) (Wih[0] unused), dt / mode the
    update rule of the level's step. Reference: the gate kernels step after step."""
    chains = recurrent_adjoint_check(cell, L, G, None, chains, layer0, layer_step, U, u_off, D,
                                     d0, Wih, Whh, dt, mode)
    for first, n in chains.tolist():
        for i in range(first, first + n):
            t = layer0 + i * layer_step
            y = _rec_back(cell, L[i - 1], U[t + u_off], D[t - d0], Wih, Whh, dt, mode)[0]
            L[i] = y if G is None else y + G[i]


def recurrent_points_adjoint(cell, L, G, R, slots, out_slots, layer0, layer_step, U, u_off, D,
                             d0, Wih, Whh, dt, mode, point_mode):
    """The adjoint step into each of L's ``slots`` (see :func:`recurrent_chains_adjoint`)
    combined into R's ``out_slots`` (point_mode 0 residual, returns the squared norm; 1 FAS;
    2 plain: STACKED_KERNELS' modes)."""
    slots, outs = recurrent_adjoint_check(cell, L, G, R, slots, layer0, layer_step, U, u_off, D,
                                          d0, Wih, Whh, dt, mode, out_slots, point_mode)
    r2 = 0.0
    for i, o in zip(slots.tolist(), outs.tolist()):
        t = layer0 + i * layer_step
        phi = _rec_back(cell, L[i - 1], U[t + u_off], D[t - d0], Wih, Whh, dt, mode)[0]
        r2 += _points_out(phi, L, G, R, i, o, point_mode)
    return r2


def recurrent_caches_check(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, dt,
                           mode):
    """Validate a :func:`recurrent_caches` call; returns (first, count, layer0) as ints."""
    _recurrent_arrays(cell, getattr(U, "dtype", None), {"U": (U, getattr(U, "shape", ()))})
    if U.ndim != 4:
        raise ValueError(f"U must be a stack (m, B, nl, H), got shape {U.shape}")
    m, B, nl, H = U.shape
    GH, C = (3 * H, 4) if cell == 0 else (H, 1)
    first, count, layer0 = _int("first", first), _int("count", count), _int("layer0", layer0)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    gi_shape = tuple(getattr(gi0, "shape", ()))
    Ls = gi_shape[1] if len(gi_shape) == 3 else -1
    want = {"gi0": (gi0, (B, Ls, GH)), **_weights(cell, nl, H, WihT, WhhT, bih, bhh),
            "D": (D, (count, nl, B, C * H))}
    if getattr(Y, "shape", (None,))[0] != 0:
        want["Y"] = (Y, (count, B, nl, H))
    _recurrent_arrays(cell, U.dtype, want)
    _step_rule(dt, mode)
    _distinct({"D": D, "Y": Y}, {"U": U, "gi0": gi0})
    if count and not (0 <= first and first + count <= m):
        raise ValueError(f"slots {first}..{first + count - 1} are not slots 0..{m - 1} of U")
    if count and not (0 <= layer0 and layer0 + count <= Ls):
        raise ValueError(f"time steps {layer0}..{layer0 + count - 1} are not in 0..{Ls - 1}")
    return first, count, layer0


def recurrent_caches(cell, gi0, U, first, count, layer0, WihT, WhhT, bih, bhh, D, Y, dt, mode):
    """The linearisation of ``count`` time steps at given states: for p < count, time step
    t = layer0 + p out of the state U[first + p] (B, nl, H): D[p] (nl, B, C H) its gate caches
    and, if Y has rows, Y[p] (B, nl, H) its output (layer k's new hidden state is layer k+1's
    input, which the weight gradients read). Arrays as in :func:`recurrent_sweep_forward`."""
    first, count, layer0 = recurrent_caches_check(cell, gi0, U, first, count, layer0, WihT, WhhT,
                                                  bih, bhh, D, Y, dt, mode)
    for p in range(count):
        t = layer0 + p
        y, caches = _rec_step(cell, U[first + p], gi0[:, t], WihT, WhhT, bih, bhh, dt, mode)
        D[p] = np.stack(caches)
        if Y.shape[0]:
            Y[p] = y


def recurrent_cotangents_check(cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode,
                               DGI, DGH, row0):
    """Validate a :func:`recurrent_gate_cotangents` call; returns its int arguments."""
    B, nl, H = _rec_lin_arrays(cell, L, U, D, Wih, Whh)
    GH = (3 if cell == 0 else 1) * H
    ints = [_int(w, v) for w, v in (("l0", l0), ("l_step", l_step), ("u0", u0), ("d0", d0),
                                    ("count", count), ("row0", row0))]
    l0, l_step, u0, d0, count, row0 = ints
    rows = getattr(DGI, "shape", (0,))[0]
    _recurrent_arrays(cell, L.dtype, {"DGI": (DGI, (rows, nl, B, GH)),
                                      "DGH": (DGH, (rows, nl, B, GH))})
    _step_rule(dt, mode)
    _distinct({"DGI": DGI, "DGH": DGH}, {"L": L, "U": U, "D": D})
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if count:
        for what, a, step, n in (("L", l0, l_step, L.shape[0]), ("U", u0, 1, U.shape[0]),
                                 ("D", d0, 1, D.shape[0]), ("DGI", row0, 1, rows)):
            for i in (a, a + (count - 1) * step):
                if not 0 <= i < n:
                    raise ValueError(f"{what} row {i} is not in 0..{n - 1}")
    return ints


def recurrent_gate_cotangents(cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode, DGI,
                              DGH, row0):
    """For p < count: DGI[row0 + p, k], DGH[row0 + p, k] (B, G H) = the cotangents of layer
    k's input and hidden projections in the vjp of a step at the state U[u0 + p] with the
    caches D[d0 + p], applied to the cotangent L[l0 + p l_step] of its output (what the weight
    gradients are GEMMs of, after the adjoint solve)."""
    l0, l_step, u0, d0, count, row0 = recurrent_cotangents_check(
        cell, L, l0, l_step, U, u0, D, d0, count, Wih, Whh, dt, mode, DGI, DGH, row0)
    for p in range(count):
        _, dgis, dghs = _rec_back(cell, L[l0 + p * l_step], U[u0 + p], D[d0 + p], Wih, Whh, dt,
                                  mode)
        DGI[row0 + p], DGH[row0 + p] = np.stack(dgis), np.stack(dghs)
