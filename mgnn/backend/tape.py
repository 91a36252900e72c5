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

A CHAIN row may also carry one item of a CORRECT and one of an INJECT that came right before its
call (by :func:`fuse_copies`), run before its steps, correction first: with CORR_SLOT >= 0
``U[CORR_SLOT] = U[CORR_SLOT] + (CORR_G[CORR_OUT] - CORR_R[CORR_OUT])`` (CORR_R = -1: the
injected state is read where it was injected from, ``U[CORR_SLOT]`` itself, by
:func:`read_sources`), with INJ_SLOT >= 0
``INJ_R[INJ_OUT] = U[INJ_SLOT]`` (and ``INJ_G[INJ_OUT]`` unless INJ_G = -1). A copy then runs
while the chain's states are in cache, not as a pass of its own over the level. A driver that
runs a call's rows at once runs every row's correction, then every injection, then the steps:
the order of the rows before the fusion.

ZIP = 1 at the first row of a call (by :func:`zip_calls`): the next call has as many rows, and
a driver that runs rows one by one runs them in pairs, row q of this call then row q of the
next (a FAS point right after the chain whose tail wrote its output, its inputs in cache); the
order of the rows before, where only independent steps trade places.
"""
CHAIN, POINT, INJECT, COPY, CORRECT = 0, 1, 2, 3, 4
#: columns
(OP, RUN, U, G, R, FIRST, N, OUT, LAYER0, LSTEP, H, MODE, NORM, LEN,
 SHARE_R, SHARE_OUT, SHARE_U, SHARE_SLOT, SHARE_H,
 CORR_SLOT, CORR_G, CORR_R, CORR_OUT, INJ_SLOT, INJ_R, INJ_G, INJ_OUT, ZIP) = range(28)
COLS = 28
#: the columns that name a store (-1: none)
STORE_COLS = (U, G, R, SHARE_R, SHARE_U, CORR_G, CORR_R, INJ_R, INJ_G)


def blank(op, run=1):
    """A row of ``op`` heading a call of ``run`` rows, every optional column off (-1)."""
    r = [0] * COLS
    r[OP], r[RUN] = op, run
    for c in (G, R, OUT, NORM, SHARE_R, CORR_SLOT, INJ_SLOT, INJ_G):
        r[c] = -1
    return r


def zip_calls(rows):
    """``rows`` with ZIP set on each CHAIN call followed by a POINT call of as many rows where
    running them in pairs (chain q, point q) computes the same: no point reads or writes what a
    later chain (or what it carries) writes or reads, and the two calls add into different
    norms (each norm's sum keeps its order)."""
    rows = [list(r) for r in rows]
    gs = groups(rows)
    for (k, n), (k2, n2) in zip(gs, gs[1:]):
        a, b = rows[k:k + n], rows[k2:k2 + n2]
        if a[0][OP] != CHAIN or b[0][OP] != POINT or n != n2 or n < 2:
            continue
        if {r[NORM] for r in a if r[NORM] >= 0} & {r[NORM] for r in b if r[NORM] >= 0}:
            continue
        last_any, last_wr = _indexed([_chain_access(c) for c in a], max)
        if not any(_conflicts_at(_row_access(p, "steps"), last_any, last_wr, q, max)
                   for q, p in enumerate(b)):  # no point q against a chain j > q
            a[0][ZIP] = 1
    return rows


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


def fuse_copies(rows):
    """``rows`` with the items of each CORRECT and INJECT call that comes right before a CHAIN
    call on the same store carried by those chains (the CORR_* / INJ_* columns of the module
    doc), where that computes the same: each item rides on the chain that ends at its slot (the
    state the chain's tail or the next chain reads), at most one of each kind per chain, a call's
    corrections before its injections, and no item moves past a chain step or another item it
    depends on. The items left over stay a call of their own, before the chains."""
    rows = [list(r) for r in rows]
    again = True
    while again:
        again = False
        gs = groups(rows)
        for i, (k, n) in enumerate(gs):
            if n != 1 or rows[k][OP] not in (INJECT, CORRECT):
                continue
            j = i + 1  # past the copies it commutes with (the items another copy left over)
            while (j < len(gs) and gs[j][1] == 1 and rows[gs[j][0]][OP] in (INJECT, CORRECT)
                   and not _copies_conflict(rows[k], rows[gs[j][0]])):
                j += 1
            if j == len(gs) or rows[gs[j][0]][OP] != CHAIN:
                continue
            k2, n2 = gs[j]
            fused = _attach(rows[k], [list(r) for r in rows[k2:k2 + n2]])
            if fused is not None:
                rows[k:k2 + n2] = rows[k + 1:k2] + fused
                again = True
                break
    return rows


def _copies_conflict(x, y):
    """Whether two copy rows (INJECT / CORRECT) do not commute."""
    return _conflict(*_union(_item_access(x, q) for q in range(x[LEN])),
                     *_union(_item_access(y, q) for q in range(y[LEN])))


def _union(accesses):
    rd, wr = set(), set()
    for a, b in accesses:
        rd |= a
        wr |= b
    return rd, wr


def _chain_access(c):
    """(reads, writes) of a chain row, what it carries included."""
    return _union(_row_access(c, part) for part in ("correct", "inject", "steps"))


def _indexed(accesses, pick):
    """({(store, slot): the ``pick`` (min or max) index of the accesses that read or write it},
    {...: that write it}): which of them an access conflicts with, looked up per slot."""
    any_, wr_ = {}, {}
    for i, (rd, wr) in enumerate(accesses):
        for key in rd | wr:
            any_[key] = pick(any_.get(key, i), i)
        for key in wr:
            wr_[key] = pick(wr_.get(key, i), i)
    return any_, wr_


def _conflicts_at(access, any_, wr_, i, pick):
    """Whether ``access`` conflicts with an indexed access (:func:`_indexed`) before index i
    (pick = min) or after it (pick = max)."""
    rd, wr = access
    hits = [any_[key] for key in wr if key in any_] + [wr_[key] for key in rd if key in wr_]
    return bool(hits) and (pick(hits) < i if pick is min else pick(hits) > i)


def _independent(accesses):
    """Whether no access writes what another reads or writes."""
    writer = {}
    for q, (_, wr) in enumerate(accesses):
        for key in wr:
            if writer.setdefault(key, q) != q:
                return False
    return all(writer.get(key, q) == q for q, (rd, _) in enumerate(accesses) for key in rd)


def _attach(x, chains):
    """The rows that replace the copy call ``x`` and the chains after it, with x's items on the
    chains (:func:`fuse_copies`); None where no item can move."""
    correct = x[OP] == CORRECT
    slot_col = CORR_SLOT if correct else INJ_SLOT
    if x[LEN] < 1 or x[N] < 1 or any(c[slot_col] >= 0 for c in chains) or (
            not correct and any(c[CORR_SLOT] >= 0 for c in chains)):
        return None  # one item of each kind per chain; a call's corrections before injections
    ends = {}
    for j, c in enumerate(chains):
        if c[U] == x[U]:
            ends.setdefault(c[FIRST] + c[N], j)
    owner = [ends.get(x[FIRST] + q * x[N]) for q in range(x[LEN])]
    if all(j is None for j in owner):
        return None
    items = [_item_access(x, q) for q in range(x[LEN])]
    if not _independent(items):  # the items of one call are independent
        return None
    first_any, first_wr = _indexed([_chain_access(c) for c in chains], min)
    for q, j in enumerate(owner):
        if j is not None and _conflicts_at(items[q], first_any, first_wr, j, min):
            owner[q] = None  # it would move past a chain step or a copy it depends on
    if all(j is None for j in owner):
        return None
    out = []
    q = 0
    while q < x[LEN]:  # the items left over: runs of consecutive items, each one call
        if owner[q] is not None:
            q += 1
            continue
        e = q
        while e < x[LEN] and owner[e] is None:
            e += 1
        r = list(x)
        r[RUN], r[FIRST], r[OUT], r[LEN] = 1, x[FIRST] + q * x[N], x[OUT] + q, e - q
        out.append(r)
        q = e
    for q, j in enumerate(owner):
        if j is None:
            continue
        c, slot = chains[j], x[FIRST] + q * x[N]
        if correct:
            c[CORR_SLOT], c[CORR_G], c[CORR_R], c[CORR_OUT] = slot, x[G], x[R], x[OUT] + q
        else:
            c[INJ_SLOT], c[INJ_R], c[INJ_G], c[INJ_OUT] = slot, x[R], x[G], x[OUT] + q
    return out + chains


def _item_access(x, q):
    """(reads, writes): sets of (store, slot) of item q of the copy row ``x``."""
    src = (x[U], x[FIRST] + q * x[N])
    if x[OP] == CORRECT:
        return {src, (x[G], x[OUT] + q), (x[R], x[OUT] + q)}, {src}
    return {src}, {(x[R], x[OUT] + q)} | ({(x[G], x[OUT] + q)} if x[G] >= 0 else set())


def _row_access(c, part):
    """(reads, writes) of one part of the chain row ``c``: its carried correction or injection,
    or its steps (shared first step, chain, tail and coarse right-hand side)."""
    if part == "correct":
        if c[CORR_SLOT] < 0:
            return set(), set()
        s = (c[U], c[CORR_SLOT])
        rd = {s, (c[CORR_G], c[CORR_OUT])}
        return rd | ({(c[CORR_R], c[CORR_OUT])} if c[CORR_R] >= 0 else set()), {s}
    if part == "inject":
        if c[INJ_SLOT] < 0:
            return set(), set()
        wr = {(c[INJ_R], c[INJ_OUT])} | ({(c[INJ_G], c[INJ_OUT])} if c[INJ_G] >= 0 else set())
        return {(c[U], c[INJ_SLOT])}, wr
    first, n = c[FIRST], c[N]
    if c[OP] == POINT:
        rd = {(c[U], first - 1), (c[U], first), (c[R], c[OUT])}
        if c[G] >= 0:
            rd.add((c[G], first))
        return rd, {(c[R], c[OUT])}
    rd = {(c[U], i) for i in range(first - 1, first + n + 1)}  # inputs, and the tail's u
    if c[G] >= 0:
        rd |= {(c[G], i) for i in range(first, first + n + 1)}
    wr = {(c[U], i) for i in range(first, first + n)}
    if c[R] >= 0:
        rd.add((c[R], c[OUT]))
        wr.add((c[R], c[OUT]))
    if c[SHARE_R] >= 0:
        rd |= {(c[SHARE_R], c[SHARE_OUT]), (c[SHARE_U], c[SHARE_SLOT])}
        wr.add((c[SHARE_R], c[SHARE_OUT]))
    return rd, wr


def _conflict(rd1, wr1, rd2, wr2):
    """Whether two accesses (reads, writes) do not commute."""
    return bool(wr1 & (rd2 | wr2)) or bool(wr2 & rd1)


def stores_read(rows):
    """The stores ``rows`` read (tape store indices)."""
    return {s for _, _, rd, _, _ in _events(rows) for s, _ in rd}


def read_sources(rows, read_elsewhere=frozenset()):
    """``rows`` reading each injected state where it was injected from, where that is the same
    bits (the copy's source not written since): a carried correction ``u + (uc - v)`` with v the
    copy of u reads u itself (CORR_R = -1), a shared step's coarse right-hand side reads the fine
    C-point instead of its copy. A coarse store (not the level-0 store 0) that no row reads then
    is not written either (its injections write only the coarse iterate): a copy that is never
    read costs a pass over the level's states; ``read_elsewhere``: the stores that the rest of a
    tape cut in segments reads (their copies stay). Rows of COPY calls: unchanged."""
    rows = [list(r) for r in rows]
    if any(r[OP] == COPY for r in rows):
        return rows
    last_write, copies = {}, {}  # the latest writer of each (store, slot); the copies' sources

    def source(key):
        """The (store, slot) that ``key`` holds an exact copy of now, or None."""
        src, j = copies.get(key, (None, -1))
        return None if src is None or last_write.get(src, -1) > j else src

    for i, (k, part, _, wr, cp) in enumerate(_events(rows)):
        r = rows[k]
        if part == "correct" and r[CORR_SLOT] >= 0 and r[CORR_R] >= 0:
            if source((r[CORR_R], r[CORR_OUT])) == (r[U], r[CORR_SLOT]):
                r[CORR_R] = -1
        elif part == "steps" and r[OP] == CHAIN and r[SHARE_R] >= 0:
            src = source((r[SHARE_U], r[SHARE_SLOT]))
            if src is not None and src not in wr:  # nor written by this row's steps
                r[SHARE_U], r[SHARE_SLOT] = src
        for key in wr:
            last_write[key] = i
            if key in cp:
                copies[key] = (cp[key], i)
            else:
                copies.pop(key, None)
    read = stores_read(rows) | set(read_elsewhere)
    for r in rows:
        if r[OP] == INJECT and r[R] > 0 and r[R] not in read and r[G] >= 0:
            r[R], r[G] = r[G], -1
        if r[OP] == CHAIN and r[INJ_SLOT] >= 0 and r[INJ_R] > 0 and r[INJ_R] not in read:
            if r[INJ_G] >= 0:
                r[INJ_R], r[INJ_G] = r[INJ_G], -1
    return rows


def _events(rows):
    """The accesses of ``rows`` in the serial driver's order: (row, part, reads, writes,
    copies), copies a dict {written (store, slot): the (store, slot) it is a copy of}."""
    out = []
    for k, r in enumerate(rows):
        if r[OP] == CHAIN:
            for part in ("correct", "inject", "steps"):
                rd, wr = _row_access(r, part)
                src = (r[U], r[INJ_SLOT])
                out.append((k, part, rd, wr, {d: src for d in wr} if part == "inject" else {}))
        elif r[OP] == POINT:
            out.append((k, "steps", *_row_access(r, "steps"), {}))
        else:
            rd, wr, cp = set(), set(), {}
            for q in range(r[LEN]):
                a, b = _item_access(r, q)
                rd, wr = rd | a, wr | b
                if r[OP] == INJECT:
                    cp.update({d: (r[U], r[FIRST] + q * r[N]) for d in b})
            out.append((k, "copy", rd, wr, cp))
    return out


def rewrite_copies(rows, read_elsewhere=frozenset()):
    """``rows`` after the copy rewrites, in the order they rely on: :func:`fuse_copies` (items
    onto the chains ending at their slots), :func:`read_sources` (reads at the source, dead
    copies dropped; ``read_elsewhere`` as there), then :func:`zip_calls` (FAS points paired
    with their chains)."""
    return zip_calls(read_sources(fuse_copies(rows), read_elsewhere))
