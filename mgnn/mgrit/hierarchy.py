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
