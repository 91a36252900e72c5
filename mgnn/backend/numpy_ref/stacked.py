"""The stacked-state kernels' contract (:data:`mgnn.backend.STACKED_KERNELS`), its argument
checks, and the reference loops over the single steps."""
import operator

import numpy as np


# --------------------------------------------------------------------- stacked-state kernels
# The solver keeps a level's states in one C-contiguous array U (m, *state) ("slots"); the step
# into slot i maps U[i-1] to U[i] with the layer l_i = layer0 + i * layer_step (layer_step may be
# negative) and step size h. For kind k in ('dense', 'conv'), all in place:
#   k_chains_forward(U, G, W, b, chains, layer0, layer_step, h, act)
#       chains (n, 2) int of independent (first slot, length); for i in first..first+length-1:
#       U[i] = Phi_{l_i}(U[i-1]) [+ G[i]]  (order (x + h sigma) + g; G None or like U);
#   k_points_forward(U, G, R, W, b, slots, out_slots, layer0, layer_step, h, act, mode) -> float
#       phi = Phi_{l_i}(U[i-1]) for i = slots[p] (U only read) into R[o], o = out_slots[p]
#       (distinct; R is not U): mode 0 R[o] = (phi - U[i]) [+ G[i]], returns sum ||R[o]||^2
#       accumulated in float64; mode 1 R[o] = (R[o] + U[i]) - phi; mode 2 R[o] = phi [+ G[i]];
#   k_chains_adjoint(L, G, W, D, d0, chains, layer0, layer_step, h),
#   k_points_adjoint(L, G, R, W, D, d0, slots, out_slots, layer0, layer_step, h, mode) -> float
#       the same with the adjoint step lam + h (D_l * lam) W_l (conv: conv_vjp_input), D[l - d0]
#       holding sigma' of layer l.
# Modes 1 and 2 return 0.0. A backend that has these sets ``stacked_states = True``.
_STATE_NDIM = {"dense": 3, "conv": 5}


def _int(what, v):
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {v!r}") from None


def _array(what, a, dtype, shape):
    """``a`` must be a C-contiguous ndarray of ``dtype`` and ``shape`` (None entries: any)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} must be a NumPy array, got {type(a).__name__}")
    if a.dtype is not dtype and a.dtype != dtype:
        raise TypeError(f"{what} has dtype {a.dtype}, expected {dtype} (the dtype of U)")
    if a.ndim != len(shape) or a.shape[1:] != shape[1:] or shape[0] not in (None, a.shape[0]):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{what} has shape {a.shape}, expected {want}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")


def _index_array(what, a, ndim):
    a = np.asarray(a)
    if a.dtype.kind not in "iu" and a.size:
        raise TypeError(f"{what} must be an integer array, got dtype {a.dtype}")
    if a.ndim != ndim or (ndim == 2 and a.shape[1] != 2):
        want = "(n, 2)" if ndim == 2 else "(n,)"
        raise ValueError(f"{what} has shape {a.shape}, expected {want}")
    return a if a.dtype == np.int64 and a.flags.c_contiguous else a.astype(np.int64, order="C")


def index_check(idx, outs, m, n_out):
    """Bounds of the chains (``idx`` (n, 2), ``outs`` empty) or points (``idx`` (n, 1) slots,
    ``outs`` (n,)) of a stacked kernel on U with m slots and R with n_out: ``(code, k, lo, hi)``,
    code 0 (valid; lo..hi the slots stepped into, lo > hi if none) or the first fault: 1 chain k
    has a negative length, 2 chain k leaves slots 1..m-1, 3 chain k overlaps or reads what an
    earlier one (by first slot) writes, 4 slot k outside 1..m-1, 5 out slot k outside R, 6 out
    slot value k repeated. Vectorised NumPy; the numba backend has a compiled twin."""
    first = idx[:, 0]
    n = idx[:, 1] if idx.shape[1] == 2 else np.ones_like(first)
    live = n > 0
    for code, bad in ((1, n < 0), (2 if idx.shape[1] == 2 else 4,
                                   live & ((first < 1) | (first + n > m))),
                      (5, (outs < 0) | (outs >= n_out))):
        if bad.any():
            return code, int(np.flatnonzero(bad)[0]), 0, -1
    rows = np.flatnonzero(live)
    if not rows.size:
        return 0, 0, 1, 0
    rows = rows[np.argsort(first[rows], kind="stable")]
    clash = first[rows[1:]] <= (first + n)[rows[:-1]]
    if idx.shape[1] == 2 and clash.any():
        return 3, int(rows[1:][np.flatnonzero(clash)[0]]), 0, -1
    srt = np.sort(outs)
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if dup.size:
        return 6, int(srt[dup[0]]), 0, -1
    return 0, 0, int(first[rows[0]]), int((first + n)[rows].max()) - 1


_INDEX_FAULTS = {1: "has a negative length", 2: "(first, length) leaves the slots 1..{m} of {s}",
                 3: "overlaps or reads a slot another chain writes (chains must be independent)",
                 4: "is not a slot 1..{m} of {s}", 5: "is not a slot 0..{r} of R"}
_NO_OUTS = np.zeros(0, dtype=np.int64)


def check_stacked(kind, U, G, W, P, idx, layer0, layer_step, h, act=None, R=None, out=None,
                  mode=None, d0=None, index_check=index_check):
    """Validate the arguments of a stacked kernel of ``kind`` ('dense' / 'conv') in O(1) checks plus
    one bounds check of the chains / slots (``index_check``); raises TypeError / ValueError
    naming the value.

    ``P`` is b (forward, ``d0`` None) or D (adjoint); ``idx`` the chains (``R`` None) or the slots
    (points, with ``out`` the out_slots). Returns ``(idx, outs, h)``: ``idx`` int64 (n, 2)
    chains or (n, 1) slots, ``outs`` int64 (empty for chains: a step writes its own slot) and
    ``h`` as a scalar of U's dtype.
    """
    if not isinstance(U, np.ndarray):
        raise TypeError(f"U must be a NumPy array, got {type(U).__name__}")
    if U.dtype.char not in "fd":
        raise TypeError(f"U has dtype {U.dtype}, expected float32 or float64")
    if U.ndim != _STATE_NDIM[kind]:
        raise ValueError(f"U has shape {U.shape}; {kind} states stacked are "
                         f"{'(m, B, w)' if kind == 'dense' else '(m, B, C, H, W)'}")
    dt, m, state = U.dtype, U.shape[0], U.shape[1:]
    if not U.flags.c_contiguous:
        raise ValueError("U must be C-contiguous")
    c = state[1]
    _array("W", W, dt, (None, c, c) if kind == "dense" else (None, c, c, 3, 3))
    N = W.shape[0]
    if d0 is None:
        _array("b", P, dt, (N, c))
        lo, hi = 0, N
    else:
        d0 = _int("d0", d0)
        _array("D", P, dt, (None,) + state)
        lo, hi = max(0, d0), min(N, d0 + P.shape[0])
    if G is not None:
        _array("G", G, dt, U.shape)
    if act is not None and act not in (0, 1, 2):
        raise ValueError(f"unknown activation code act={act!r}; expected 0, 1 or 2")
    layer0, layer_step = _int("layer0", layer0), _int("layer_step", layer_step)
    if not isinstance(h, (float, int, np.floating, np.integer)):
        raise TypeError(f"h must be a real scalar, got {h!r}")
    if R is None:
        what, idx, outs, n_out = "chains", _index_array("chains", idx, 2), _NO_OUTS, 0
    else:
        _array("R", R, dt, (None,) + state)
        if np.may_share_memory(R, U):
            raise ValueError("R shares memory with U; the output must be a different array")
        if mode not in (0, 1, 2):
            raise ValueError(f"unknown mode {mode!r}; expected 0 (residual), 1 (FAS), 2 (plain)")
        what, idx = "slots", _index_array("slots", idx, 1)[:, None]
        outs, n_out = _index_array("out_slots", out, 1), R.shape[0]
        if outs.shape[0] != idx.shape[0]:
            raise ValueError(f"out_slots has shape {outs.shape}, slots {idx.shape[:1]}")
    code, k, lo_i, hi_i = index_check(idx, outs, m, n_out)
    if code == 6:
        raise ValueError(f"out_slots {outs.tolist()} repeats slot {k} of R")
    if code:
        name, arr = ("out_slots", outs) if code == 5 else (what, idx if R is None else idx[:, 0])
        why = _INDEX_FAULTS[code].format(m=m - 1, r=n_out - 1, s="U")
        raise ValueError(f"{name}[{k}] = {arr[k].tolist()} {why}")
    if lo_i <= hi_i:
        for i in (lo_i, hi_i):  # l is linear in i: the extreme slots bound the layers
            if not lo <= layer0 + i * layer_step < hi:
                src = "W / b" if d0 is None else f"W / D (layers d0={d0}..{d0 + P.shape[0] - 1})"
                raise ValueError(f"the step into slot {i} uses layer {layer0 + i * layer_step} "
                                 f"(layer0={layer0}, layer_step={layer_step}), not in {src}")
    return idx, outs, dt.type(h)


def _points_out(phi, U, G, R, i, o, mode):
    """R[o] from phi for point i in ``mode`` (see STACKED_KERNELS); ||R[o]||^2 in mode 0."""
    if mode == 1:
        R[o] += U[i]
        R[o] -= phi
        return 0.0
    if mode == 0:
        np.subtract(phi, U[i], out=R[o])
    else:
        R[o] = phi
    if G is not None:
        R[o] += G[i]
    if mode:
        return 0.0
    r = R[o].astype(np.float64).ravel()
    return float(r @ r)


def stacked_loops(bk):
    """{name: function}: the 8 stacked kernels as loops over the single-step kernels of backend
    module ``bk`` (``k_forward`` / ``k_vjp_input``), plus NumPy arithmetic in the stated order."""
    fns = {}
    for kind in ("dense", "conv"):
        fns.update(_stacked_kind(bk, kind))
    return fns


def _stacked_kind(bk, kind):
    fwd, vjp = getattr(bk, f"{kind}_forward"), getattr(bk, f"{kind}_vjp_input")

    def fwd_step(U, W, b, layer0, layer_step, h, act):
        return lambda i: fwd(U[i - 1], W[layer0 + i * layer_step], b[layer0 + i * layer_step],
                             h, act, True)

    def adj_step(L, W, D, d0, layer0, layer_step, h):
        return lambda i: vjp(L[i - 1], D[layer0 + i * layer_step - d0],
                             W[layer0 + i * layer_step], h, True)

    def run_chains(step, U, G, chains):
        for first, n in chains.tolist():
            for i in range(first, first + n):
                y = step(i)
                U[i] = y if G is None else y + G[i]

    def run_points(step, U, G, R, slots, outs, mode):
        return float(sum(_points_out(step(i), U, G, R, i, o, mode)
                         for i, o in zip(slots[:, 0].tolist(), outs.tolist())))

    def chains_forward(U, G, W, b, chains, layer0, layer_step, h, act):
        chains, _, h = check_stacked(kind, U, G, W, b, chains, layer0, layer_step, h, act)
        run_chains(fwd_step(U, W, b, layer0, layer_step, h, act), U, G, chains)

    def points_forward(U, G, R, W, b, slots, out_slots, layer0, layer_step, h, act, mode):
        s, o, h = check_stacked(kind, U, G, W, b, slots, layer0, layer_step, h, act, R,
                                out_slots, mode)
        return run_points(fwd_step(U, W, b, layer0, layer_step, h, act), U, G, R, s, o, mode)

    def chains_adjoint(L, G, W, D, d0, chains, layer0, layer_step, h):
        chains, _, h = check_stacked(kind, L, G, W, D, chains, layer0, layer_step, h, d0=d0)
        run_chains(adj_step(L, W, D, d0, layer0, layer_step, h), L, G, chains)

    def points_adjoint(L, G, R, W, D, d0, slots, out_slots, layer0, layer_step, h, mode):
        s, o, h = check_stacked(kind, L, G, W, D, slots, layer0, layer_step, h, None, R,
                                out_slots, mode, d0)
        return run_points(adj_step(L, W, D, d0, layer0, layer_step, h), L, G, R, s, o, mode)

    fns = {}
    for fn in (chains_forward, points_forward, chains_adjoint, points_adjoint):
        fn.__name__ = fn.__qualname__ = f"{kind}_{fn.__name__}"
        fn.__doc__ = (f"Stacked ``{fn.__name__}`` as a loop of ``{bk.__name__}`` single steps "
                      f"(contract: :data:`mgnn.backend.STACKED_KERNELS`).")
        fns[fn.__name__] = fn
    return fns
