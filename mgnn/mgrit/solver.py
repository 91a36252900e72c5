"""Multilevel FAS MGRIT over a propagator (XBraid's definitions; docs/design.md, "MGRIT"), serial or
distributed over the ranks of a communicator.

The solver only calls ``propagator.step(u, start, stop, level)`` (state at fine index ``stop`` from
``u`` at fine index ``start``) and array arithmetic (``+``, ``-``, ``*``, ``sum``, ``copy``), so it
works for any array state and any time stepper (the contract: :class:`MGRITSolver`).

Distribution (docs/design.md, "Parallel layout"): fine indices are block-distributed (:mod:`.partition`); every
level's relaxation, restriction, correction and residual run on the points each rank owns. Where a
sweep crosses a rank boundary the left rank sends one boundary value to the right: the step result
``Phi(u_last)`` for a *push* propagator (the default: the owner of fine index i computes the step
out of i, so layer i's parameters never move), or the state ``u_last`` itself for a *pull*
propagator (attribute ``pull = True``: the receiver computes the step into its first point; the
adjoint of a network uses this). Receives are posted first, the boundary chain is computed and
sent first, interior work overlaps the messages, and the halo is waited for only where it is needed.
The coarsest level is solved sequentially across ranks.
"""
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field

from ..backend import vector_ops
from ..comm import abort_on_error, abort_on_uncaught, make_device_halo, make_halo
from ..comm.halo import tag
from ..errors import MGNNError
from .hierarchy import level_sizes
from .options import MGRITOptions
from .partition import Partition, block_starts


class DivergenceError(MGNNError, FloatingPointError):
    """The MGRIT residual became NaN or infinite."""


class NotConvergedWarning(RuntimeWarning):
    """A solve with ``tol > 0`` used its ``max_iter`` cycles without reaching ``tol``
    (:attr:`MGRITOptions.warn_not_converged`)."""


@dataclass
class MGRITResult:
    """Outcome of :meth:`MGRITSolver.solve`.

    residuals : list of float  -- XBraid's r_k (level-0 C-points, t = 0 excluded), on every rank
    iterations : int           -- cycles performed
    converged : bool           -- the last r_k < tol (every rank alike); True for one level
                                  (sequential stepping is exact), never with tol = 0
    tol : float                -- the tolerance used (MGRITOptions.for_dtype of u0's dtype)
    final : array or None      -- state at fine index N (on the rank owning it; None elsewhere)
    states : list              -- length N+1: this rank's states at their fine indices (None
                                  elsewhere)
    timings : dict             -- seconds in steps (with the private copies of a propagator
                                  without fresh_outputs), halo waits, allreduce, and in total
    """

    residuals: list = field(default_factory=list)
    iterations: int = 0
    converged: bool = False
    tol: float = 0.0
    final: object = None
    states: list = None
    timings: dict = field(default_factory=dict)


def hierarchy(n_steps, options):
    """Intervals per level for ``n_steps`` (an int, NumPy's included) under ``options``;
    ValueError naming the values if ``n_steps`` is not a positive int or too small for a coarse
    level when levels were asked."""
    o = options
    if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps < 1:
        raise ValueError(f"n_steps must be an int >= 1, got {n_steps!r}")
    n_steps = int(n_steps)
    sizes = level_sizes(n_steps, o.cf, o.max_levels, o.min_coarse)
    if o.max_levels > 1 and len(sizes) == 1:
        raise ValueError(f"n_steps={n_steps} is too small for MGRIT with cf={o.cf} and "
                         f"min_coarse={o.min_coarse} (no coarse level: need n_steps >= "
                         f"{o.cf * o.min_coarse}); use max_levels=1 for sequential stepping")
    return sizes


class _PointByPoint:
    """Batched vector operations for an ops object that has only the single-point ones."""

    def __init__(self, ops):
        from ..backend.fas_ops import GenericOps
        self._ops, self._loops = ops, GenericOps

    def __getattr__(self, name):
        if name.endswith("_batch"):
            return getattr(self._loops, name).__get__(self)
        return getattr(self._ops, name)


def _family(x):
    """The array library of ``x`` ('numpy', 'cupy', ...): the top package of its type."""
    return type(x).__module__.partition(".")[0]


def _describe(v):
    if v is None:
        return "None"
    return (f"{_family(v)} {type(v).__name__} of shape {getattr(v, 'shape', None)} and dtype "
            f"{getattr(v, 'dtype', None)}")


class _Done:
    """A completed request (no-overlap mode waits at once)."""

    def Wait(self):
        return None


class _Level:
    """This rank's share of one level: points [a, b) of 0..n (point j is fine index j * s)."""

    def __init__(self, index, n, s, partition, rank):
        self.index, self.n, self.s = index, n, s
        self.a, self.b = partition.level_range(rank, s, n)
        nonempty = self.a < self.b
        self.left = partition.owner((self.a - 1) * s) if nonempty and self.a >= 1 else None
        self.right = partition.owner(self.b * s) if nonempty and self.b <= n else None


class MGRITSolver:
    """FAS MGRIT cycles over ``propagator`` for ``n_steps`` fine steps.

    The propagator contract (checked where it can be, cheaply, on every level, serial or not):

    * ``step(u, start, stop, level)`` returns the state at fine index ``stop`` from ``u``, the
      state at fine index ``start``. ``level`` is the MGRIT level, 0 the finest; level l keeps
      the fine indices j cf^l, j = 0 .. N // cf^l, so a level-l step spans
      ``stop - start = cf**level`` fine steps (the propagator chooses the coarse discretisation,
      e.g. step size (stop - start) h with the parameters of layer ``start``).
    * It returns an array of u0's kind (array library), shape and dtype: never None, a list or a
      cast. Anything else is a TypeError naming the call, e.g. ``Prop.step(u, 8, 12, level=2)
      returned numpy ndarray of shape (3,) and dtype float32, but u0 is ...``, the same text in
      serial and distributed solves.
    * In place is allowed: by default ``step`` gets a private copy of the solver's state, so it
      may update ``u`` and return it (``u *= a; return u``) or return a new array; the caller's
      ``u0`` and initial guesses are never modified. It must not return an array it keeps and
      reuses (an output buffer): the solver keeps every returned array as a state (returning
      the buffer the solver holds for ``start`` is caught). Cost: one copy of the state per step.
    * Optional attributes:

      ``fresh_outputs = True``: a promise that ``step`` never modifies ``u`` (nor ``rhs``) and
      returns a new array no one else holds; the solver then passes its own states (no copy)
      and adds FAS right-hand sides into the returned arrays in place. Returning ``u`` itself
      is a TypeError. mgnn's network propagators declare it.

      ``pull = True``: across a rank boundary the left rank sends its last state u_{b-1} and
      the right rank computes the step into its first point (the default *push*: the owner of
      fine index i computes the step out of i and sends Phi(u_{b-1})); same results, only who
      computes the boundary step (whose parameters are needed where) changes.

      ``batched = True`` with ``step_batch(us, starts, stops, level)``: a list with one state
      per ``us[p]`` (``starts[p]`` to ``stops[p]``, all on one level); the rules of ``step``
      hold for each (private copies unless ``fresh_outputs``; every output checked).
      Interval-batched relaxation: one call advances every F-interval of this rank by one step,
      so a relaxation sweep costs cf calls instead of one per point (one kernel launch each on
      a GPU); the residual and FAS right-hand-side steps of a level become one call each.

      ``fused_rhs = True`` (with ``batched``): ``step_batch(us, starts, stops, level, rhs)``
      returns ``[Phi(us[p]) + rhs[p]]`` (one launch instead of two; single points with a
      right-hand side go through it too); ``rhs`` is read-only.

    Parameters
    ----------
    propagator : object with ``step(u, start, stop, level)``
        See the contract above.
    n_steps : int
        N (fine indices 0..N); a NumPy integer is accepted.
    options : MGRITOptions
    comm : mpi4py communicator or None
        The ranks that share the layers (None or size 1: serial). Every rank constructs the
        solver (collective: the communicator is duplicated once, so MGRIT's messages never mix
        with the caller's) and calls :meth:`solve`; a solver can solve many times.
    partition : Partition or None
        Which rank holds which fine indices; default: blocks over the ranks of ``comm`` in rank
        order, each starting on a level-0 C-point.
    norm_comm : communicator or None
        Residual norms are summed over this communicator (default ``comm``); a data-parallel run
        passes the whole grid so that every replica sees the norm of the global batch.
    ops : vector operations or None
        FAS residual, restriction and correction arithmetic (``mgnn.backend.vector_ops(name)``);
        default: the generic reference, which works for any array type.
    overlap : bool
        Overlap halo messages with interior work (default). ``False`` waits for the left halo
        before any local work and sends only after it (the baseline the benchmarks compare with).
    xp : module or None
        Array module of the states when they live on a GPU (``cupy``; None for host arrays):
        boundary states then go
        to MPI as device buffers if the MPI library is CUDA-aware, else staged through pinned
        host buffers (:mod:`mgnn.comm.device`); ``halo.path`` says which.
    abort_on_error : bool
        In a distributed solve, an exception on any rank (a user propagator's included) is
        reported and ends every rank with ``comm.Abort`` instead of leaving the others waiting.
    """

    def __init__(self, propagator, n_steps, options=None, comm=None, partition=None,
                 abort_on_error=True, norm_comm=None, overlap=True, ops=None, xp=None):
        if not callable(getattr(propagator, "step", None)):
            raise TypeError(f"propagator {type(propagator).__name__} has no step(u, start, stop, "
                            "level) method")
        self.options = options if options is not None else MGRITOptions()
        if not isinstance(self.options, MGRITOptions):
            raise TypeError(f"options must be MGRITOptions, got {type(self.options).__name__}")
        o = self.options
        self.sizes = hierarchy(n_steps, o)
        n_steps = self.sizes[0]
        self.prop, self.n_steps = propagator, n_steps
        self.pull = bool(getattr(propagator, "pull", False))
        self.fresh = bool(getattr(propagator, "fresh_outputs", False))
        self.batched = bool(getattr(propagator, "batched", False)) and \
            callable(getattr(propagator, "step_batch", None))
        self.fused_rhs = self.batched and bool(getattr(propagator, "fused_rhs", False))
        if comm is not None and comm.Get_size() > 1:
            abort_on_uncaught(comm)  # an uncaught Ctrl-C between solves still ends every rank
            comm = comm.Dup()  # private context: MGRIT messages never meet the user's own
        self.comm = comm
        self.halo = (make_halo(comm, norm_comm) if xp is None else
                     make_device_halo(comm, norm_comm, xp=xp))
        if partition is None:
            starts = block_starts(n_steps + 1, self.halo.size, align=o.cf)
            partition = Partition(n_steps, tuple(starts), tuple(range(self.halo.size)))
        if partition.n_steps != n_steps or sorted(partition.ranks) != list(range(self.halo.size)):
            raise ValueError(f"partition {partition} does not fit n_steps={n_steps} on "
                             f"{self.halo.size} ranks")
        self.partition = partition
        self.abort = abort_on_error
        self.overlap = bool(overlap)
        self.ops = ops if ops is not None else vector_ops("numpy")
        if not callable(getattr(self.ops, "residual_batch", None)):
            self.ops = _PointByPoint(self.ops)
        self._vector_seconds = 0.0
        self.levels = [_Level(lev, n, o.cf ** lev, partition, self.halo.rank)
                       for lev, n in enumerate(self.sizes)]
        self._step_seconds = 0.0

    # ---------------------------------------------------------------------------- primitives
    def _phi(self, u, j, lev):
        """Step out of level point j (fine index j s) to point j+1 (checked; ``u`` untouched)."""
        s = self.levels[lev].s
        t0 = time.perf_counter()
        out = self.prop.step(u if self.fresh else u.copy(), j * s, (j + 1) * s, lev)
        self._step_seconds += time.perf_counter() - t0
        t = self._template  # the common case inline: a step costs ~1 us in Python already
        if type(out) is not type(t) or out.shape != t.shape or out.dtype != t.dtype or out is u:
            self._checked(out, u, j * s, (j + 1) * s, lev, "step")
        return out

    def _phi_batch(self, states, js, lev, rhs=None):
        """[Phi(states[k]) (+ rhs[k]) out of level point js[k]] in one propagator call (or a
        loop); ``rhs`` only with a ``fused_rhs`` propagator."""
        if not js:
            return []
        if not self.batched or (len(js) == 1 and rhs is None):
            return [self._phi(u, j, lev) for u, j in zip(states, js)]
        s = self.levels[lev].s
        starts, stops = [j * s for j in js], [(j + 1) * s for j in js]
        t0 = time.perf_counter()
        args = (states if self.fresh else [u.copy() for u in states], starts, stops, lev)
        out = self.prop.step_batch(*args) if rhs is None else self.prop.step_batch(*args, rhs)
        self._step_seconds += time.perf_counter() - t0
        if out is None or len(out) != len(js):
            raise TypeError(f"{type(self.prop).__name__}.step_batch(us, starts, stops, "
                            f"level={lev}) returned {_describe(out)} for {len(js)} states: it "
                            "must return a list of one state per u")
        t = self._template
        kind, shape, dtype = type(t), t.shape, t.dtype
        for v, u, a, b in zip(out, states, starts, stops):  # inline as in _phi: per state
            if type(v) is not kind or v.shape != shape or v.dtype != dtype or v is u:
                self._checked(v, u, a, b, lev, "step_batch")
        return list(out)

    def _checked(self, out, u, start, stop, lev, method):
        """``out``, what ``method`` returned for the solver's state ``u``; TypeError unless it is
        an array of u0's kind, shape and dtype (MPI would silently truncate or half-fill a wrong
        one, serial arithmetic would cast) that the solver may keep."""
        self._check_state(out, lambda: f"{type(self.prop).__name__}.{method}(u, {start}, {stop}, "
                                        f"level={lev}) returned")
        if out is u:
            if self.fresh:
                raise TypeError(
                    f"{type(self.prop).__name__}.{method}(u, {start}, {stop}, level={lev}) "
                    "returned the u it was given, but the propagator declares fresh_outputs = "
                    "True (a new array every step, u untouched): return a new array, or drop "
                    "fresh_outputs (the solver then hands step a private copy of u)")
            raise TypeError(
                f"{type(self.prop).__name__}.{method}(u, {start}, {stop}, level={lev}) returned "
                f"the array the solver holds as the state at fine index {start} (an output "
                "buffer reused across calls?): return a new array, or the u it was given")
        return out

    def _check_state(self, v, what):
        """TypeError unless ``v`` is an array of u0's library, shape and dtype; ``what()`` names
        where it came from (built only for the message)."""
        t = self._template
        if ((type(v) is not type(t) and _family(v) != _family(t))
                or getattr(v, "shape", None) != t.shape or getattr(v, "dtype", None) != t.dtype):
            raise TypeError(f"{what()} {_describe(v)}, but u0 is {_describe(t)}: every state "
                            "must match u0 (no silent casts)")

    def _boundary_value(self, U, lev):
        """What the right neighbour receives: Phi(u_{b-1}) (push) or u_{b-1} (pull)."""
        b = self.levels[lev].b
        return U[b - 1] if self.pull else self._phi(U[b - 1], b - 1, lev)

    def _from_left(self, msg, lev):
        """Phi(u_{a-1}) from the left neighbour's message."""
        a = self.levels[lev].a
        return self._phi(msg, a - 1, lev) if self.pull else msg

    def _update(self, lev, U, G, target, name):
        """u_j = Phi(u_{j-1}) + g_j for this rank's points j >= 1 with ``target(j)``, ascending.

        Consecutive targets form chains; the chain that needs the left halo is computed last,
        the chain that feeds the right neighbour first (then its value is sent), interior chains
        in between, overlapping both messages.
        """
        L, halo = self.levels[lev], self.halo
        a, b, n = L.a, L.b, L.n
        if a >= b:
            return
        t = tag(name, lev)
        js = [j for j in range(max(a, 1), b) if target(j)]
        need_left = a >= 1 and target(a)
        send_right = b <= n and target(b)
        recv = halo.irecv(self._template, L.left, t) if need_left else None
        if recv is not None and not self.overlap:
            recv = (_Done(), halo.wait(recv), time.perf_counter())
        n_head = 0  # js[:n_head] depend on the left halo: the chain a, a+1, ...
        if need_left:
            while n_head < len(js) and js[n_head] == a + n_head:
                n_head += 1
        n_tail = 0  # js[len - n_tail:] feed the right neighbour: the chain ..., b-2, b-1
        if send_right and self.overlap:
            while (n_tail < len(js) - n_head and js[-1 - n_tail] == b - 1 - n_tail):
                n_tail += 1
        prop_fresh, ops = self.fresh, self.ops

        def run(points):
            # waves: the k-th point of every chain of consecutive points, independent of each
            # other (one batched call each); without batching, point after point
            if self.batched:
                chains, waves = [], []
                for j in points:
                    if chains and chains[-1][-1] == j - 1:
                        chains[-1].append(j)
                    else:
                        chains.append([j])
                for k in range(max((len(c) for c in chains), default=0)):
                    waves.append([c[k] for c in chains if len(c) > k])
            else:
                waves = [[j] for j in points]
            for wave in waves:
                prev, starts = [U[j - 1] for j in wave], [j - 1 for j in wave]
                rhs = None if G is None else [G[j] for j in wave]
                if rhs is not None and self.fused_rhs:  # Phi(u) + g in one launch
                    outs = self._phi_batch(prev, starts, lev, rhs)
                else:
                    outs = self._phi_batch(prev, starts, lev)
                    if rhs is not None:
                        # a propagator that promised new arrays gets the rhs added in place
                        outs = ops.add_batch(outs, rhs, in_place=prop_fresh)
                for j, v in zip(wave, outs):
                    U[j] = v

        sends = []
        if send_right and self.overlap and (n_tail or not js or js[-1] != b - 1):
            run(js[len(js) - n_tail:])
            sends.append(halo.isend(self._boundary_value(U, lev), L.right, t))
        else:
            n_tail = 0
        run(js[n_head:len(js) - n_tail])
        if need_left:
            first = self._from_left(halo.wait(recv), lev)
            # the receive buffer is reused by later messages: never keep it as a state
            U[a] = (first if self.pull else first.copy()) if G is None else ops.add(first, G[a])
            run(js[1:n_head])
        if send_right and not sends:
            sends.append(halo.isend(self._boundary_value(U, lev), L.right, t))
        for s in sends:
            halo.wait(s)

    def _phis(self, lev, U, target, name):
        """{j: Phi(u_{j-1})} for this rank's points j >= 1 with ``target(j)`` (no update)."""
        L, halo = self.levels[lev], self.halo
        a, b, n = L.a, L.b, L.n
        out = {}
        if a >= b:
            return out
        t = tag(name, lev)
        recv = halo.irecv(self._template, L.left, t) if a >= 1 and target(a) else None
        if recv is not None and not self.overlap:
            recv = (_Done(), halo.wait(recv), time.perf_counter())
        send = (halo.isend(self._boundary_value(U, lev), L.right, t)
                if b <= n and target(b) and self.overlap else None)
        js = [j for j in range(max(a + 1, 1), b) if target(j)]
        out.update(zip(js, self._phi_batch([U[j - 1] for j in js], [j - 1 for j in js], lev)))
        if recv is not None:
            out[a] = self._from_left(halo.wait(recv), lev)
        if b <= n and target(b) and not self.overlap:
            send = halo.isend(self._boundary_value(U, lev), L.right, t)
        if send is not None:
            halo.wait(send)
        return out

    def _f_relax(self, U, G, lev, name="f_relax"):
        cf = self.options.cf
        self._update(lev, U, G, lambda j: j % cf != 0, name)

    def _c_relax(self, U, G, lev):
        cf = self.options.cf
        self._update(lev, U, G, lambda j: j % cf == 0, "c_relax")

    def _restrict(self, U, G, lev, fas=True):
        """F-relax ``lev``, its C-point residuals, injection and the FAS rhs of level+1.

        Returns (V, G_coarse, r2): V the injected states (this rank's coarse points), r2 this
        rank's share of the squared residual norm. ``fas=False`` (the skipped down-cycle) injects
        only: the coarse problem is the plain coarse rediscretisation (a cascadic initial guess).
        """
        cf = self.options.cf
        C = self.levels[lev + 1]
        V = [None] * (C.n + 1)
        for i in range(C.a, C.b):
            V[i] = U[cf * i]
        if not fas:
            return V, None, 0.0
        self._f_relax(U, G, lev)
        phis = self._phis(lev, U, lambda j: j % cf == 0, "residual")
        Gc = [None] * (C.n + 1)
        ops = self.ops
        t0 = time.perf_counter()
        cs = list(phis)
        # the r are new arrays: the in-place update below touches nothing else
        rs, r2 = ops.residual_batch([phis[c] for c in cs], [U[c] for c in cs],
                                    None if G is None else [G[c] for c in cs])
        for c, r in zip(cs, rs):
            Gc[c // cf] = r
        self._vector_seconds += time.perf_counter() - t0
        coarse_phis = self._phis(lev + 1, V, lambda i: True, "fas_rhs")
        t0 = time.perf_counter()
        ii = list(coarse_phis)
        ops.fas_rhs_batch([Gc[i] for i in ii], [V[i] for i in ii], [coarse_phis[i] for i in ii])
        self._vector_seconds += time.perf_counter() - t0
        return V, Gc, r2

    def _cycle(self, lev, U, G, kind, skip):
        """One FAS cycle of the problem (U, G) on level ``lev``; U is updated in place.

        'V': relax, restrict, V-cycle on lev+1, correct. 'F': the coarse problem gets an F-cycle
        and then a V-cycle. On the way up, a coarse level (not the coarsest) is F-relaxed before
        its correction is injected (XBraid's FInterp). ``skip``: the cascadic first descent.
        Returns this rank's share of the squared residual norm of level ``lev`` (None on the
        coarsest level, which is solved exactly).
        """
        o = self.options
        coarsest = len(self.sizes) - 1
        if lev == coarsest:
            self._update(lev, U, G, lambda j: True, "coarsest")
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
        C = self.levels[lev + 1]
        t0 = time.perf_counter()
        ii = range(max(C.a, 1), C.b)
        outs = self.ops.correct_batch([U[o.cf * i] for i in ii], [Uc[i] for i in ii],
                                      [V[i] for i in ii])
        for i, u in zip(ii, outs):
            U[o.cf * i] = u
        self._vector_seconds += time.perf_counter() - t0
        return r2

    # ----------------------------------------------------------------------------------- solve
    def solve(self, u0, initial_guess=None):
        """Solve u_{n+1} = Phi_n(u_n), n = 0..N-1, from ``u0``.

        Parameters
        ----------
        u0 : array
            State at fine index 0. Every rank passes an array of the state's shape and dtype
            (only the owner's values are used; others may pass zeros).
        initial_guess : None or callable
            ``i -> state`` at the level-0 C-points i > 0 this rank owns (default: zeros).

        Returns
        -------
        MGRITResult
            ``converged`` says whether ``tol`` was reached (the tolerance used is
            ``options.for_dtype(u0.dtype).tol``: the default is adapted to float32, an explicit
            one below what the dtype resolves is a ValueError). With ``tol > 0`` a budget that
            ran out also warns (:class:`NotConvergedWarning`, on the first rank only) unless
            ``options.warn_not_converged`` is False.

        Raises
        ------
        TypeError
            ``u0``, an initial guess or a step output that is not a state like u0.
        DivergenceError
            The residual became NaN or infinite.
        """
        # the tolerance for u0's dtype: the same on every rank, so raised alike before any message
        o = self.options.for_dtype(u0.dtype) if hasattr(u0, "dtype") else self.options
        # a divergence is seen in the residual summed over every rank: raised on all alike
        with abort_on_error(self.comm if self.abort else None, "mgnn MGRIT",
                            collective=(DivergenceError,)):
            return self._solve(u0, initial_guess, o)

    def _solve(self, u0, initial_guess, o):
        t_start = time.perf_counter()
        self._step_seconds = self._vector_seconds = 0.0
        self.halo.timers.update(halo_wait=0.0, recv_wait=0.0, halo_total=0.0, allreduce=0.0)
        if "staging" in self.halo.timers:
            self.halo.timers["staging"] = 0.0
        N = self.n_steps
        if not hasattr(u0, "shape") or not hasattr(u0, "dtype"):
            raise TypeError(f"u0 must be an array, got {type(u0).__name__}")
        self._template = u0
        L0 = self.levels[0]
        U = [None] * (N + 1)
        for c in range(-(-L0.a // o.cf) * o.cf, L0.b, o.cf):
            if c == 0:
                U[0] = u0
            elif initial_guess is not None:
                U[c] = initial_guess(c)
                self._check_state(U[c], lambda: f"initial_guess({c}) returned")
            else:
                U[c] = u0 * 0
        result = MGRITResult(tol=float(o.tol))
        if len(self.sizes) == 1:
            self._update(0, U, None, lambda j: True, "coarsest")
            result.iterations, result.converged = 1, True
        else:
            for k in range(o.max_iter):
                skip = o.skip_downcycle and k == 0
                r2 = self._cycle(0, U, None, o.cycle, skip)
                if not skip:
                    r = math.sqrt(self.halo.allreduce_sum(r2))
                    if not math.isfinite(r):
                        raise DivergenceError(f"MGRIT diverged: residual {r} in cycle {k}")
                    result.residuals.append(r)
                result.iterations = k + 1
                if not skip and result.residuals[-1] < o.tol:
                    result.converged = True
                    break
            self._f_relax(U, None, 0, "final")
            if not result.converged and o.tol > 0 and o.warn_not_converged and \
                    self.halo.reduce_rank == 0:  # once per solve, not once per replica
                warnings.warn(f"MGRIT did not reach tol={o.tol:.3g} in max_iter={o.max_iter} "
                              f"cycles (n_steps={N}): the states are inexact (see "
                              "MGRITResult.residuals and .converged; raise max_iter, or set "
                              "MGRITOptions.warn_not_converged=False for a fixed budget)",
                              NotConvergedWarning, stacklevel=3)
        result.final = U[N] if L0.a <= N < L0.b else None
        result.states = U
        total = time.perf_counter() - t_start
        result.timings = {"steps": self._step_seconds, "vector": self._vector_seconds,
                          "total": total, **self.halo.timers}
        return result
