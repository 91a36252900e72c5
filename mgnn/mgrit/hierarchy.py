"""Pure index maths of the MGRIT level hierarchy (no arrays, no MPI)."""
import math



def level_sizes(n_steps, cf, max_levels, min_coarse):
    """Intervals per level: [N, N // cf, N // cf^2, ...].

    A level l+1 is added while l + 1 < max_levels and it keeps at least ``min_coarse`` intervals.
    Level l point j is fine index j * cf**l.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    sizes = [int(n_steps)]
    while len(sizes) < max_levels and sizes[-1] // cf >= min_coarse:
        sizes.append(sizes[-1] // cf)
    return sizes


def intervals(n, cf):
    """C-points c = 0, cf, 2 cf, ... <= n of a level with n intervals, each with its F-points
    range(c + 1, min(c + cf, n + 1)); yields (c, f_stop)."""
    for c in range(0, n + 1, cf):
        yield c, min(c + cf, n + 1)


def step_weights(sizes, cf, nrelax, skip=False, cycle="V"):
    """Who steps how often in one cycle: :func:`cycle_work` broken down by step.

    Parameters are those of :func:`cycle_work` (the cycle starts on level 0).

    Returns
    -------
    every : list of int
        Per level l: evaluations of each level-l step out of point j, 0 <= j < n_l, for the
        distributed work (relaxation sweeps, the restriction's F-sweep and C-point residuals on
        l; the FAS right-hand side of l computed on the coarser level l).
    into_f : list of int
        Per level l: extra evaluations of each step into a level-l F-point ((j + 1) % cf != 0):
        the F-relaxation of a coarse level before its correction is injected.
    solves : int
        Coarsest solves per cycle (each steps once out of every point j < n_{L-1} of the
        coarsest level).

    ``sum_l every[l] n_l + into_f[l] (n_l - n_{l+1}) + solves n_{L-1}`` is :func:`cycle_work`.
    """
    L = len(sizes)
    every, into_f, solves = [0] * L, [0] * L, [0]

    def visit(lev, kind, skip):
        if lev == L - 1:
            solves[0] += 1
            return
        if not skip:
            every[lev] += nrelax(lev) + 1
            every[lev + 1] += 1
        visit(lev + 1, kind, skip)
        if lev + 1 < L - 1:
            if kind == "F":
                visit(lev + 1, "V", False)
            into_f[lev + 1] += 1

    visit(0, cycle, skip)
    return every, into_f, solves[0]


def level_costs(level_cost, n_levels):
    """``level_cost`` (None, or one cost per level in fine-step equivalents) as a list of
    ``n_levels`` finite floats >= 0 (None: all 1); ValueError naming the value."""
    if level_cost is None:
        return [1.0] * n_levels
    try:
        c = [float(v) for v in level_cost]
    except (TypeError, ValueError):
        raise ValueError(f"level_cost must be a sequence of numbers, got {level_cost!r}") from None
    if len(c) != n_levels or not all(math.isfinite(v) and v >= 0 for v in c):
        raise ValueError(f"level_cost must hold {n_levels} finite numbers >= 0 (one per level), "
                         f"got {level_cost!r}")
    return c


def cycle_work(sizes, cf, nrelax, skip=False, cycle="V", level=0, level_cost=None):
    """Propagator steps of one cycle (the cost model of :class:`MGRITSolver`).

    Parameters
    ----------
    sizes : list of int
        Intervals per level (:func:`level_sizes`).
    cf : int
    nrelax : callable level -> int
        (C, F) sweeps after the first F on each level.
    skip : bool
        The cascadic cycle 0 of ``skip_downcycle`` (no relaxation, no FAS restriction).
    cycle : {'V', 'F'}
    level : int
        Level the cycle starts on.
    level_cost : sequence of float or None
        Cost of a step on each level of ``sizes`` in fine-step equivalents (spatial coarsening);
        None: every step counts 1.

    Returns
    -------
    int (float with ``level_cost``)
        Steps (weighted by ``level_cost``): on a level l below the coarsest, nrelax_l (F, C) sweeps of n_l steps, the F-sweep of
        the restriction (n_l - n_{l+1}), the C-point residuals (n_{l+1}) and the coarse FAS
        right-hand side (n_{l+1} coarse steps); the coarse cycle(s); the F-relaxation of level l+1
        before its correction is injected (unless l+1 is the coarsest); n_{L-1} steps for the
        coarsest solve. The final F-relaxation of a solve (n_0 - n_1) is not included.
        Per step: :func:`step_weights`.
    """
    cost = [1] * len(sizes) if level_cost is None else level_costs(level_cost, len(sizes))
    cost, sizes = cost[level:], list(sizes[level:])
    every, into_f, solves = step_weights(sizes, cf, lambda lev: nrelax(lev + level), skip, cycle)
    nxt = sizes[1:] + [sizes[-1]]
    return (sum(c * (e * n + f * (n - m)) for c, e, f, n, m in
                zip(cost, every, into_f, sizes, nxt)) + cost[-1] * solves * sizes[-1])


def cycle_critical_path(sizes, nrelax, ranks, skip=False, level_cost=None):
    """Cost model of one V-cycle on ``ranks`` layer ranks: (steps, messages) on the critical path.

    Every sweep on level l is shared by the P_l = min(ranks, n_l + 1) ranks holding points of that
    level (work / P_l steps each) and costs one boundary message when P_l > 1; the coarsest level
    is sequential across its P_c ranks (n_{L-1} steps and P_c - 1 messages). Work per sweep as in
    :func:`cycle_work`. With ranks = 1 it equals (cycle_work, 0). ``level_cost``: a step's cost
    on each level in fine-step equivalents (spatial coarsening; None: 1), which then weighs the
    steps.
    """
    L = len(sizes)
    cost = level_costs(level_cost, L)

    def share(work, lev):
        p = min(ranks, sizes[lev] + 1)
        return cost[lev] * work / p, (1 if p > 1 else 0)

    steps = msgs = 0.0
    for lev in range(L - 1):
        n, nc = sizes[lev], sizes[lev + 1]
        sweeps = []
        if not skip:
            sweeps += [(n - nc, lev), (nc, lev)] * nrelax(lev)
            sweeps += [(n - nc, lev), (nc, lev), (nc, lev + 1)]
        if lev + 1 < L - 1:
            sweeps.append((nc - sizes[lev + 2], lev + 1))
        for work, at in sweeps:
            s, m = share(work, at)
            steps, msgs = steps + s, msgs + m
    pc = min(ranks, sizes[-1] + 1)
    return steps + cost[-1] * sizes[-1], msgs + (pc - 1)


def solve_critical_path(sizes, nrelax, ranks, cycles, skip=False, level_cost=None):
    """(steps, messages) of a whole solve: ``cycles`` cycles (the first cascadic if ``skip``) and
    the final F-relaxation (a sequential chain of N steps when there is a single level);
    ``level_cost`` as in :func:`cycle_critical_path`."""
    cost = level_costs(level_cost, len(sizes))
    if len(sizes) == 1:
        return cost[0] * sizes[0], float(min(ranks, sizes[0] + 1) - 1)
    steps = msgs = 0.0
    for k in range(cycles):
        s, m = cycle_critical_path(sizes, nrelax, ranks, skip and k == 0, cost)
        steps, msgs = steps + s, msgs + m
    p = min(ranks, sizes[0] + 1)
    return steps + cost[0] * (sizes[0] - sizes[1]) / p, msgs + (1 if p > 1 else 0)


def _cycle_sweeps(n_levels, nrelax, skip):
    """The sweeps of one V-cycle in order, as (level, kind): 'F' (the level's F-intervals),
    'C' (its C-points), 'all' (one step out of every point: the coarse FAS right-hand side);
    the structure :func:`cycle_critical_path` charges."""
    for lev in range(n_levels - 1):
        if not skip:
            for _ in range(nrelax(lev)):
                yield lev, "F"
                yield lev, "C"
            yield lev, "F"
            yield lev, "C"
            yield lev + 1, "all"
        if lev + 1 < n_levels - 1:
            yield lev + 1, "F"


def _sweep_chain(sizes, cf, lev, kind, ranks):
    """(steps, messages) on the critical path of one sweep of ``kind`` on level ``lev`` over
    ``ranks`` layer ranks whose blocks hold consecutive points: a rank's own steps, and an
    F-interval that spans several ranks as the sequential chain it is (cf - 1 steps, a hand-off
    at each rank boundary)."""
    n = sizes[lev]
    p = min(ranks, n + 1)
    msgs = 1 if p > 1 else 0
    if kind == "all":
        return math.ceil(n / p), msgs
    nc = sizes[lev + 1]
    if kind == "C":
        return math.ceil(nc / min(p, nc + 1)), msgs
    per_rank = n / p  # points a rank holds
    if per_rank >= cf:  # whole intervals on every rank: its own chains after one message
        return min(n - nc, math.ceil(math.ceil(n / cf) / p) * (cf - 1)), msgs
    # an interval spans ranks: its C-point's rank starts the chain, each boundary hands it on
    return min(n - nc, cf - 1), max(msgs, math.ceil(cf / max(per_rank, 1.0)) - 1)


def chain_critical_path(sizes, cf, nrelax, ranks, cycles, skip=False, coarsest="redundant"):
    """(steps, messages) on the critical path of a whole solve, chain by chain.

    Like :func:`solve_critical_path`, but each sweep costs what its longest chain does: a rank
    holding whole F-intervals steps ``ceil(intervals / ranks) (cf - 1)`` times after one
    message; where a coarse level's interval spans ranks it is a chain of ``cf - 1`` steps
    with a hand-off at each rank boundary (it does not shrink with more ranks). Collectives
    over the P layer ranks count ``ceil(log2 P)`` messages: the residual norm of every cycle
    but a cascadic one, and the coarsest level's allgather when it is ``'redundant'`` (every
    rank solves it); ``'sequential'``: its P_c ranks in turn. One level: the layer-by-layer
    hand-off. On one rank the steps are those of :func:`cycle_work` and the final
    F-relaxation.
    """
    if coarsest not in ("redundant", "sequential"):
        raise ValueError(f"coarsest must be 'redundant' or 'sequential', got {coarsest!r}")
    L = len(sizes)
    if L == 1:
        return float(sizes[0]), float(min(ranks, sizes[0] + 1) - 1)
    tree = math.ceil(math.log2(ranks)) if ranks > 1 else 0
    coarse_msgs = tree if coarsest == "redundant" else min(ranks, sizes[-1] + 1) - 1
    steps = msgs = 0.0
    for k in range(cycles):
        cascadic = skip and k == 0
        for lev, kind in _cycle_sweeps(L, nrelax, cascadic):
            s, m = _sweep_chain(sizes, cf, lev, kind, ranks)
            steps, msgs = steps + s, msgs + m
        steps, msgs = steps + sizes[-1], msgs + coarse_msgs + (0 if cascadic else tree)
    s, m = _sweep_chain(sizes, cf, 0, "F", ranks)  # the final F-relaxation
    return steps + s, msgs + m


def auto_levels(n_steps, cf, ranks, cycles=(2, 1), nrelax=lambda level: 1, skip=False,
                min_coarse=2, message_steps=1.0, adjoint_steps=2.0, coarsest="redundant",
                max_levels=64, slack=0.05):
    """The MGRIT level count whose forward and adjoint solves have the shortest critical path.

    Coarsening stops where the redundant coarsest solve is cheaper than another level's sweeps
    and messages (:func:`chain_critical_path`): ``steps_fwd + adjoint_steps steps_adj +
    message_steps (messages_fwd + messages_adj)``, in forward-step units.

    Parameters
    ----------
    n_steps, cf, ranks : int
        Layers (fine intervals), coarsening factor, layer ranks.
    cycles : (int, int)
        Forward and adjoint cycles per solve.
    nrelax : callable level -> int
    skip : bool
        The first cycle is cascadic (``skip_downcycle``).
    min_coarse : int
    message_steps : float
        A message (and the engine call around it) in forward steps.
    adjoint_steps : float
        An adjoint step in forward steps.
    coarsest : {'redundant', 'sequential'}
    max_levels : int
    slack : float
        The fewest levels within ``(1 + slack)`` of the shortest path win (fewer levels
        converge in fewer cycles).

    Returns
    -------
    levels : int
        1 where no hierarchy beats the layer-by-layer hand-off.
    costs : dict
        {levels: critical path in forward steps} of every level count considered.
    """
    if not (math.isfinite(message_steps) and message_steps >= 0):
        raise ValueError(f"message_steps must be a finite number >= 0, got {message_steps!r}")
    costs, prev = {}, None
    for L in range(1, max_levels + 1):
        sizes = level_sizes(n_steps, cf, L, min_coarse)
        if sizes == prev:
            break
        prev = sizes
        if L == 1:
            sf = sb = float(n_steps)
            mf = mb = float(min(ranks, n_steps + 1) - 1)
        else:
            sf, mf = chain_critical_path(sizes, cf, nrelax, ranks, cycles[0], skip, coarsest)
            sb, mb = chain_critical_path(sizes, cf, nrelax, ranks, cycles[1], skip, coarsest)
        costs[L] = sf + adjoint_steps * sb + message_steps * (mf + mb)
    best = min(costs.values())
    return min(L for L, c in costs.items() if c <= (1 + slack) * best), costs
