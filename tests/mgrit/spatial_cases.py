"""A propagator with spatial coarsening for the solver tests (serial here, distributed in
tests/mpi/mpi_cases.py): a nonlinear 1D stencil stepper on states (B, n) whose coarse levels live
on grids of half the size, with vertex-centred (odd n) or cell-centred (even n) transfers written
here from their definitions (independent of mgnn.backend.grid_transfer)."""
import numpy as np


def coarse_n(n):
    """2m + 1 -> m (vertex-centred), 2m -> m (cell-centred)."""
    return n // 2


def restrict_1d(u):
    """Full weighting (1/4, 1/2, 1/4) around fine 2i+1 (odd n) or the average of cells 2i, 2i+1
    (even n), along the last axis."""
    n = u.shape[-1]
    if n % 2:
        return 0.25 * u[..., 0:-2:2] + 0.5 * u[..., 1::2] + 0.25 * u[..., 2::2]
    return 0.5 * (u[..., 0::2] + u[..., 1::2])


def interpolate_1d(e, n):
    """Linear interpolation to n points (odd: fine 2i+1 <- e_i, fine 2i <- (e_{i-1} + e_i)/2 with
    zeros outside; even: piecewise constant, fine 2i and 2i+1 <- e_i)."""
    out = np.zeros(e.shape[:-1] + (n,), dtype=e.dtype)
    if n % 2:
        out[..., 1::2] = e
        out[..., 0:-1:2] += 0.5 * e
        out[..., 2::2] += 0.5 * e
    else:
        out[..., 0::2] = e
        out[..., 1::2] = e
    return out


class Stencil:
    """u + (stop - start) h tanh(a_l (u_{x-1} - 2u + u_{x+1}) + b_l u + c_l) with l = start, on
    any grid size (zero Dirichlet ends); ``spatial`` levels l mean level l + 1 is halved.
    With a_l > 0 (diffusion) coarse grids approximate the fine one; with anti-diffusive stencils
    spatial coarsening stagnates (a property of the method, not of the solver)."""

    def __init__(self, n_steps, spatial=(0,), h=0.1, seed=0):
        rng = np.random.default_rng(seed)  # diffusive (a > 0): what spatial coarsening needs
        self.a = 2 + rng.random(n_steps)
        self.b = -0.5 * rng.random(n_steps)
        self.c = 0.5 * rng.standard_normal(n_steps)
        self.h, self.spatial = h, tuple(spatial)
        self.calls = {"restrict": 0, "interpolate": 0}

    def step(self, u, start, stop, level):
        p = np.pad(u, [(0, 0)] * (u.ndim - 1) + [(1, 1)])
        lap = p[..., :-2] - 2 * u + p[..., 2:]
        return u + (stop - start) * self.h * np.tanh(self.a[start] * lap + self.b[start] * u
                                                     + self.c[start])

    def restrict(self, u, level):
        self.calls["restrict"] += 1
        return restrict_1d(u) if level in self.spatial else u.copy()

    def interpolate(self, e, level):
        self.calls["interpolate"] += 1
        if level not in self.spatial:
            return e.copy()
        return interpolate_1d(e, self._fine_n[level])

    def shapes(self, n0, levels):
        """Record the grid size of every level (interpolate needs the fine size)."""
        self._fine_n = {}
        n = n0
        for lev in range(levels - 1):
            self._fine_n[lev] = n
            if lev in self.spatial:
                n = coarse_n(n)
        return self


def serial(prop, u0, n_steps):
    """Sequential stepping: [u_0 .. u_N]."""
    out = [u0]
    for i in range(n_steps):
        out.append(prop.step(out[-1], i, i + 1, 0))
    return out


def two_level_reference(prop, u0, n_steps, cf, iters):
    """Two-level FAS MGRIT (F-relaxation, XBraid's residual norm at the fine C-points excluding
    t = 0) with spatial restriction R and interpolation P, written from the definitions: returns
    (residual history, fine states). The coarse problem is solved exactly by stepping."""
    nc = n_steps // cf
    u = [u0] + [np.zeros_like(u0) for _ in range(n_steps)]
    hist = []

    def f_relax():
        for i in range(nc):
            for j in range(i * cf + 1, (i + 1) * cf):
                u[j] = prop.step(u[j - 1], j - 1, j, 0)
        for j in range(nc * cf + 1, n_steps + 1):  # a trailing partial interval
            u[j] = prop.step(u[j - 1], j - 1, j, 0)

    for _ in range(iters):
        f_relax()  # F
        for i in range(1, nc + 1):  # C
            u[i * cf] = prop.step(u[i * cf - 1], i * cf - 1, i * cf, 0)
        f_relax()  # F again before restriction (FCF)
        r = [None] + [prop.step(u[i * cf - 1], i * cf - 1, i * cf, 0) - u[i * cf]
                      for i in range(1, nc + 1)]
        hist.append(float(np.sqrt(sum(np.sum(x * x) for x in r[1:]))))
        v = [prop.restrict(u[i * cf], 0) for i in range(nc + 1)]
        g = [None] + [prop.restrict(r[i], 0) + v[i] - prop.step(v[i - 1], (i - 1) * cf, i * cf, 1)
                      for i in range(1, nc + 1)]
        w = [v[0]]
        for i in range(1, nc + 1):
            w.append(prop.step(w[-1], (i - 1) * cf, i * cf, 1) + g[i])
        for i in range(1, nc + 1):
            u[i * cf] = u[i * cf] + prop.interpolate(w[i] - v[i], 0)
    f_relax()
    return hist, u


class StackedByStep:
    """The stacked protocol (:class:`mgnn.mgrit.engines.StackedEngine`) over a propagator's
    ``step``: one array per level store; ``points`` returns ``self._norm(total)``."""

    stacked = True

    def _phi(self, U, i, origin, stride, level):
        return self.step(U[i - 1], origin + (i - 1) * stride, origin + i * stride, level)

    def advance(self, U, G, chains, origin, stride, level):
        for first, length in chains:
            for i in range(first, first + length):
                v = self._phi(U, i, origin, stride, level)
                U[i] = v if G is None else v + G[i]

    def points(self, U, G, R, slots, out_slots, origin, stride, level, mode):
        total = 0.0
        for i, o in zip(slots, out_slots):
            phi = self._phi(U, i, origin, stride, level)
            if mode == 0:
                R[o] = phi - U[i] + (0 if G is None else G[i])
                total += float(np.vdot(R[o], R[o]))
            elif mode == 1:
                R[o] = (R[o] + U[i]) - phi
            else:
                R[o] = phi if G is None else phi + G[i]
        return self._norm(total)

    def _norm(self, total):
        return total


class StackedStencil(StackedByStep, Stencil):
    """Stencil through the stacked protocol: the solver's StackedEngine with per-level shapes."""
