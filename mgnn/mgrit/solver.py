"""Multilevel FAS MGRIT over a propagator (XBraid's definitions; DESIGN.md section 2).

The solver only calls ``propagator.step(u, start, stop, level)`` (state at fine index ``stop``
from ``u`` at fine index ``start``) and array arithmetic (``+``, ``-``, ``*``, ``sum``), so it works
for any array state (numpy now) and any time stepper.
"""
import math
from dataclasses import dataclass, field

from ..errors import MGNNError
from .hierarchy import intervals, level_sizes
from .options import MGRITOptions


class DivergenceError(MGNNError, FloatingPointError):
    """The MGRIT residual became NaN or infinite."""


@dataclass
class MGRITResult:
    """Outcome of :meth:`MGRITSolver.solve`.

    residuals : list of float  -- XBraid's r_k (level-0 C-points, t = 0 excluded)
    iterations : int           -- cycles performed
    final : array              -- state at fine index N
    states : list of arrays    -- states at every fine index 0..N (level 0)
    """

    residuals: list = field(default_factory=list)
    iterations: int = 0
    final: object = None
    states: list = None


def _norm2(a):
    """Squared 2-norm of an array (real or complex), as a Python float."""
    if a.dtype.kind == "c":
        return float((a.conj() * a).real.sum())
    return float((a * a).sum())


class MGRITSolver:
    """FAS MGRIT V-cycles over ``propagator`` for ``n_steps`` fine steps.

    Parameters
    ----------
    propagator : object with ``step(u, start, stop, level)``
    n_steps : int
        N (fine indices 0..N).
    options : MGRITOptions
    comm : None
        Serial solve (distributed solves come with the MPI layer).
    """

    def __init__(self, propagator, n_steps, options=None, comm=None):
        if not callable(getattr(propagator, "step", None)):
            raise TypeError(f"propagator {type(propagator).__name__} has no step(u, start, stop, "
                            "level) method")
        self.options = options if options is not None else MGRITOptions()
        if not isinstance(self.options, MGRITOptions):
            raise TypeError(f"options must be MGRITOptions, got {type(self.options).__name__}")
        if comm is not None and getattr(comm, "Get_size", lambda: 1)() != 1:
            raise ValueError(f"comm of size {comm.Get_size()}: distributed MGRIT is not available "
                             "yet; pass None")
        self.prop = propagator
        self.n_steps = n_steps
        o = self.options
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
            raise ValueError(f"n_steps must be an int >= 1, got {n_steps!r}")
        self.sizes = level_sizes(n_steps, o.cf, o.max_levels, o.min_coarse)
        if o.max_levels > 1 and len(self.sizes) == 1:
            raise ValueError(f"n_steps={n_steps} is too small for MGRIT with cf={o.cf} and "
                             f"min_coarse={o.min_coarse} (no coarse level: need n_steps >= "
                             f"{o.cf * o.min_coarse}); use max_levels=1 for sequential stepping")

    # ------------------------------------------------------------------------------ level ops
    def _phi(self, u, j, level):
        s = self.options.cf ** level
        return self.prop.step(u, j * s, (j + 1) * s, level)

    def _step_to(self, U, G, j, level):
        """U[j] = Phi(U[j-1]) + G[j]."""
        v = self._phi(U[j - 1], j - 1, level)
        U[j] = v if G is None else v + G[j]

    def _f_relax(self, U, G, level):
        for c, stop in intervals(len(U) - 1, self.options.cf):
            for j in range(c + 1, stop):
                self._step_to(U, G, j, level)

    def _c_relax(self, U, G, level):
        for c in range(self.options.cf, len(U), self.options.cf):
            self._step_to(U, G, c, level)

    def _restrict(self, U, G, level, fas=True):
        """F-relax ``level``, then its C-point residuals, injection and the FAS rhs of level+1.

        Returns (V, G_coarse, r2) with V the injected states, r2 the squared residual norm.
        ``fas=False`` (the skipped down-cycle) injects only: the coarse problem is the plain coarse
        rediscretisation (zero rhs), solved from the injected guess (a cascadic initial guess).
        """
        cf = self.options.cf
        nc = (len(U) - 1) // cf
        V = [U[cf * i] for i in range(nc + 1)]
        if not fas:
            return V, None, 0.0
        self._f_relax(U, G, level)
        Gc = [None] * (nc + 1)
        r2 = 0.0
        for i in range(1, nc + 1):
            c = cf * i
            r = self._phi(U[c - 1], c - 1, level) - U[c]
            if G is not None:
                r = r + G[c]
            r2 += _norm2(r)
            Gc[i] = r + V[i] - self._phi(V[i - 1], i - 1, level + 1)
        return V, Gc, r2

    def _cycle(self, lev, U, G, kind, skip):
        """One FAS cycle of the problem (U, G) on level ``lev``; U is updated in place.

        'V': relax, restrict, V-cycle on lev+1, correct. 'F': the coarse problem gets an F-cycle
        and then a V-cycle. On the way up, a coarse level (not the coarsest) is F-relaxed before
        its correction is injected (XBraid's FInterp). ``skip``: the cascadic first descent.
        Returns the squared residual norm of level ``lev`` measured in the restriction (None on
        the coarsest level, which is solved exactly).
        """
        o = self.options
        coarsest = len(self.sizes) - 1
        if lev == coarsest:
            for j in range(1, len(U)):
                self._step_to(U, G, j, lev)
            return None
        if not skip:
            for _ in range(o.nrelax_on(lev)):
                self._f_relax(U, G, lev)
                self._c_relax(U, G, lev)
        V, Gc, r2 = self._restrict(U, G, lev, fas=not skip)
        Uc = list(V)
        self._cycle(lev + 1, Uc, Gc, kind, skip)
        if lev + 1 < coarsest:
            if kind == "F":
                self._cycle(lev + 1, Uc, Gc, "V", False)
            self._f_relax(Uc, Gc, lev + 1)
        for i in range(1, len(Uc)):
            U[o.cf * i] = U[o.cf * i] + (Uc[i] - V[i])
        return r2

    # ----------------------------------------------------------------------------------- solve
    def solve(self, u0, initial_guess=None):
        """Solve u_{n+1} = Phi_n(u_n), n = 0..N-1, from ``u0``.

        Parameters
        ----------
        u0 : array
            State at fine index 0.
        initial_guess : None or callable
            ``i -> state`` at the level-0 C-points i > 0 (default: zeros).

        Returns
        -------
        MGRITResult
        """
        o = self.options
        L = len(self.sizes)
        N = self.n_steps
        U = [None] * (N + 1)
        U[0] = u0
        for c in range(o.cf, N + 1, o.cf):
            U[c] = initial_guess(c) if initial_guess is not None else u0 * 0
        if L == 1:
            for j in range(1, N + 1):
                self._step_to(U, None, j, 0)
            return MGRITResult([], 1, U[N], U)
        result = MGRITResult()
        for k in range(o.max_iter):
            skip = o.skip_downcycle and k == 0
            r2 = self._cycle(0, U, None, o.cycle, skip)
            if not skip:
                r = math.sqrt(r2)
                if not math.isfinite(r):
                    raise DivergenceError(f"MGRIT diverged: residual {r} in cycle {k}")
                result.residuals.append(r)
            result.iterations = k + 1
            if not skip and result.residuals[-1] < o.tol:
                break
        self._f_relax(U, None, 0)
        result.final, result.states = U[N], U
        return result
