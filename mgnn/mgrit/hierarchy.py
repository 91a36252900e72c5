"""Pure index maths of the MGRIT level hierarchy (no arrays, no MPI)."""


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


def cycle_work(sizes, cf, nrelax, skip=False):
    """Propagator steps of one V-cycle (the cost model of :class:`MGRITSolver`).

    Parameters
    ----------
    sizes : list of int
        Intervals per level (:func:`level_sizes`).
    cf : int
    nrelax : callable level -> int
        (C, F) sweeps after the first F on each level.
    skip : bool
        The cascadic cycle 0 of ``skip_downcycle`` (no relaxation, no FAS restriction).

    Returns
    -------
    int
        Steps per cycle: per level l below the coarsest, nrelax_l (F, C) sweeps of n_l steps, the
        F-sweep of restriction (n_l - n_{l+1}), the C-point residuals (n_{l+1}) and the coarse FAS
        right-hand side (n_{l+1} coarse steps); F-relaxation on the way up on levels 1..L-2; and
        n_{L-1} steps of the coarsest solve. The final F-relaxation of a solve (n_0 - n_1) is not
        included. One level: N steps.
    """
    L = len(sizes)
    if L == 1:
        return sizes[0]
    work = sizes[-1]
    for lev in range(L - 1):
        n, nc = sizes[lev], sizes[lev + 1]
        if not skip:
            work += nrelax(lev) * n + (n - nc) + 2 * nc
        if 0 < lev:
            work += n - nc
    return work
