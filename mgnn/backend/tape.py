"""The layout of a captured MGRIT op sequence (a *tape*), shared by the recorder
(:class:`mgnn.mgrit.engines.StackedEngine`) and the backends that replay it in one call.

With a fixed cycle (every cycle of a solve does the same steps on the same stores) the stacked
engine's calls of one cycle are a fixed sequence; captured once, a cycle is then one kernel call
(Numba: ``dense_run_tape`` / ``conv_run_tape``) instead of ~20 Python calls through the solver,
the engine, the propagator and the kernel wrappers. A tape is an int64 array ``(n_ops, COLS)``;
the stores it names are a list of the level stores (index 0: the level-0 store of the solve at
hand), ``hs`` the step sizes (U's dtype) it indexes, ``norms`` a float64 array its residual
steps add their squared norms into.

Rows (``RUN``: at the first row of one engine call, how many consecutive rows it made; those
rows are independent of each other, so a threaded backend may run them at once):

=========  ==================================================================================
CHAIN      ``U[i] = Phi(U[i-1]) (+ G[i])`` for i = FIRST .. FIRST + N - 1 of store U; layer of
           slot i ``LAYER0 + i LSTEP``, step size ``hs[H]``; G = -1: no right-hand side. With
           R >= 0 the chain has a *tail*: then the POINT step into slot FIRST + N (same U, G,
           layers) into R[OUT] by MODE, its norm into NORM (a point fused onto the chain that
           computes its input, by :func:`fuse_tails`)
           With SHARE_R >= 0 the chain's first step also gives the coarse step out of
           U[FIRST - 1] (the same layer with step size ``hs[SHARE_H]``), which completes the
           coarse FAS right-hand side ``SHARE_R[SHARE_OUT] = (SHARE_R[SHARE_OUT] +
           SHARE_U[SHARE_SLOT]) - Phi_c(U[FIRST - 1])`` after the tail (by
           :func:`share_first_steps`)
POINT      the step into slot FIRST of U combined by MODE (0 residual, 1 FAS, 2 plain; the
           modes of :mod:`mgnn.mgrit.engines`) into slot OUT of store R; mode 0 adds its squared
           norm to ``norms[NORM]`` (NORM = -1 otherwise)
INJECT     ``R[OUT + q] = U[FIRST + q N]`` for q < LEN (N is the fine stride here), and
           ``G[OUT + q]`` alike unless G = -1
COPY       ``R[...] = U``
CORRECT    ``U[FIRST + q N] = U[FIRST + q N] + (G[OUT + q] - R[OUT + q])`` for q < LEN (U fine,
           G the coarse iterate, R the injected states)
=========  ==================================================================================
"""
CHAIN, POINT, INJECT, COPY, CORRECT = 0, 1, 2, 3, 4
#: columns
(OP, RUN, U, G, R, FIRST, N, OUT, LAYER0, LSTEP, H, MODE, NORM, LEN,
 SHARE_R, SHARE_OUT, SHARE_U, SHARE_SLOT, SHARE_H) = range(19)
COLS = 19


def groups(rows):
    """[(start, count)] of the engine calls in ``rows`` (by their RUN headers)."""
    out, k = [], 0
    while k < len(rows):
        out.append((k, max(int(rows[k][RUN]), 1)))
        k += out[-1][1]
    return out


def fuse_tails(rows):
    """``rows`` (a list of row lists) with every POINT call that directly follows a CHAIN call on
    the same store, right-hand sides and layers folded onto that call's chains as tails, where
    that computes the same: each point's input is the last slot of exactly one chain and its own
    slot lies in none, its output store is neither the chains' U nor G, and the points are in
    the chains' order (so squared norms are added in the same order). A point runs right after
    the chain that produced its input, while that input is still in cache."""
    out, gs, i = [], groups(rows), 0
    while i < len(gs):
        k, n = gs[i]
        a = [list(r) for r in rows[k:k + n]]
        if i + 1 < len(gs) and a[0][OP] == CHAIN and all(r[R] < 0 for r in a):
            k2, n2 = gs[i + 1]
            b = rows[k2:k2 + n2]
            fused = _fused(a, b)
            if fused is not None:
                out += fused
                i += 2
                continue
        out += a
        i += 1
    return out


def _fused(a, b):
    """The chains ``a`` with the points ``b`` as tails, or None where that is not exact."""
    p = b[0]
    if p[OP] != POINT or any((r[U], r[G], r[LAYER0], r[LSTEP], r[H]) !=
                             (p[U], p[G], p[LAYER0], p[LSTEP], p[H]) for r in a + b):
        return None
    if p[R] in (p[U], p[G]) or any(r[R] != p[R] or r[MODE] != p[MODE] for r in b):
        return None
    ends = {r[FIRST] + r[N] - 1: q for q, r in enumerate(a)}
    written = set()
    for r in a:
        written.update(range(r[FIRST], r[FIRST] + r[N]))
    owner = []
    for r in b:
        q = ends.get(r[FIRST] - 1)
        if q is None or r[FIRST] in written:
            return None
        owner.append(q)
    if owner != sorted(set(owner)) or len(owner) != len(b):
        return None  # not one point per chain in the chains' order
    for r, q in zip(b, owner):
        a[q][R], a[q][OUT], a[q][MODE], a[q][NORM] = r[R], r[OUT], r[MODE], r[NORM]
    a[0][RUN] = len(a)
    return a


def _writes(r):
    """[(store, slots or None for all)] that row ``r`` writes."""
    op = r[OP]
    if op == CHAIN:
        out = [(r[U], set(range(r[FIRST], r[FIRST] + r[N])))]
        if r[R] >= 0:
            out.append((r[R], {r[OUT]}))
        if r[SHARE_R] >= 0:
            out.append((r[SHARE_R], {r[SHARE_OUT]}))
        return out
    if op == POINT:
        return [(r[R], {r[OUT]})]
    if op == INJECT:
        slots = set(range(r[OUT], r[OUT] + r[LEN]))
        return [(r[R], slots)] + ([(r[G], slots)] if r[G] >= 0 else [])
    if op == COPY:
        return [(r[R], None)]
    return [(r[U], {r[FIRST] + q * r[N] for q in range(r[LEN])})]


def _written(rows, store, slot):
    return any(s == store and (slots is None or slot in slots)
               for r in rows for s, slots in _writes(r))


def share_first_steps(rows):
    """``rows`` with the coarse FAS right-hand sides (a POINT call of mode 1 right after CHAIN
    calls whose tails computed the fine residuals it completes) folded onto those chains, where
    the coarse step out of the injected state v_{i-1} is the chain's first step with another h:
    the same layer, and v_{i-1} an exact copy of the chain's input (injected from that slot, and
    neither written since). One GEMM then gives both steps (forward ResNet steps: x + h F(x))."""
    rows = [list(r) for r in rows]
    out, gs, i = [], groups(rows), 0
    while i < len(gs):
        k, n = gs[i]
        if i + 1 < len(gs) and rows[k][OP] == CHAIN:
            k2, n2 = gs[i + 1]
            rest = _shared(rows, k, n, k2, n2)
            if rest is not None:
                out += rows[k:k + n] + rest
                i += 2
                continue
        out += rows[k:k + n]
        i += 1
    return out


def _shared(rows, k, n, k2, n2):
    """Fold the points rows[k2:k2+n2] onto the chains rows[k:k+n] (in place); the points left
    over, or None if none folds."""
    a, b = rows[k:k + n], rows[k2:k2 + n2]
    if b[0][OP] != POINT or any(r[MODE] != 1 or r[G] >= 0 for r in b):
        return None
    if any(p[R] in (c[U], c[G]) or p[U] in (c[U], c[G]) for p in b for c in a):
        return None  # the FAS moves before chains that would read or write its stores
    by_tail = {(r[R], r[OUT]): r for r in a if r[R] >= 0 and r[MODE] == 0}
    left, done = [], 0
    for p in b:
        c = by_tail.get((p[R], p[OUT]))
        j = p[FIRST] - 1  # the coarse step out of v_j = V[j]
        if (c is None or c[N] < 1 or c[SHARE_R] >= 0 or
                p[LAYER0] + p[FIRST] * p[LSTEP] != c[LAYER0] + c[FIRST] * c[LSTEP] or
                not _copy_of(rows, k, p[U], j, c[U], c[FIRST] - 1) or
                _written(a, p[U], j) or _written(a, p[U], p[FIRST]) or
                _written(a, c[U], c[FIRST] - 1)):
            left.append(p)
            continue
        c[SHARE_R], c[SHARE_OUT], c[SHARE_U], c[SHARE_SLOT], c[SHARE_H] = (
            p[R], p[OUT], p[U], p[FIRST], p[H])
        done += 1
    if not done:
        return None
    if left:
        left[0][RUN] = len(left)
    return left


def _copy_of(rows, end, store, slot, src, src_slot):
    """Whether before rows[end] slot ``slot`` of ``store`` was last written by an INJECT from
    ``src[src_slot]``, and neither was written after it."""
    for q in range(end - 1, -1, -1):
        r = rows[q]
        if r[OP] == INJECT and r[U] == src and store in (r[R], r[G]) and \
                r[OUT] <= slot < r[OUT] + r[LEN]:
            return (r[FIRST] + (slot - r[OUT]) * r[N] == src_slot and
                    not _written(rows[q + 1:end], src, src_slot))
        if _written([r], store, slot):
            return False
    return False
