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
The coarsest level is solved as a chain across ranks, or redundantly on every rank when the
propagator offers ``coarse_replica`` (``coarsest``).

States are kept per level by an engine (:mod:`.engines`): lists of arrays for any propagator, or
one preallocated array per level for a ``stacked`` propagator (whole sweeps per call).
"""
import contextlib
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..backend import vector_ops
from ..comm import abort_on_error, abort_on_uncaught, make_device_halo, make_halo
from ..comm.halo import tag
from ..errors import MGNNError
from .engines import PLAIN, ListEngine, Plan, StackedEngine, describe, _family
from .hierarchy import level_sizes
from .options import MGRITOptions
from .partition import Partition, balanced_starts


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
    store : (array, int) or None -- with stacked states: the level-0 store and the point a of
                                  its slot 1 (slot j - a + 1 holds point j; ``states`` are views)
    timings : dict             -- seconds in steps (with the private copies of a propagator
                                  without fresh_outputs), halo waits, allreduce, and in total
    """

    residuals: list = field(default_factory=list)
    iterations: int = 0
    converged: bool = False
    tol: float = 0.0
    final: object = None
    states: list = None
    store: tuple = None
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


class _Level:
    """This rank's share of one level: points [a, b) of 0..n (point j is fine index j * s); its
    stores have m + 2 slots (point j in slot j - a + 1; slot 0 the left halo, slot m + 1 point b)."""

    def __init__(self, index, n, s, partition, rank):
        self.index, self.n, self.s = index, n, s
        self.a, self.b = partition.level_range(rank, s, n)
        nonempty = self.a < self.b
        self.m = self.b - self.a if nonempty else 0
        self.left = partition.owner((self.a - 1) * s) if nonempty and self.a >= 1 else None
        self.right = partition.owner(self.b * s) if nonempty and self.b <= n else None


def _chains(points):
    """Runs of consecutive ints in ascending ``points`` as [first, length] pairs."""
    out = []
    for j in points:
        if out and out[-1][0] + out[-1][1] == j:
            out[-1][1] += 1
        else:
            out.append([j, 1])
    return out


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

      ``solve_context()``: a context manager the solver enters around each :meth:`solve`
      (mgnn's propagators: one BLAS thread while Numba's threads run the chains).

      ``restrict(u, level)`` and ``interpolate(e, level)`` (both, or neither): spatial
      coarsening (XBraid's coarsen/refine). Level l + 1 then holds states of the shape
      ``restrict`` returns (one shape and dtype per level, checked); ``restrict`` maps a level-l
      state to level l + 1 and ``interpolate`` a level-(l + 1) correction back. The coarse
      level starts from the restricted C-point values v_i = R(u_{cf i}), its FAS right-hand
      side is R(r_{cf i}) + v_i - Phi_c(v_{i-1}) with r the fine residual, and the correction is
      u_{cf i} += P(u^c_i - v_i). Both must return new arrays (never modify their input).

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
        order, each starting on a level-0 C-point and holding at least one step, balanced by
        the steps of an MGRIT cycle (:func:`mgnn.mgrit.partition.balanced_starts`).
    norm_comm : communicator or None
        Residual norms are summed over this communicator (default ``comm``); a data-parallel run
        passes the whole grid so that every replica sees the norm of the global batch.
    ops : vector operations or None
        FAS residual, restriction and correction arithmetic (``mgnn.backend.vector_ops(name)``);
        default: the generic reference, which works for any array type.
    overlap : bool
        Overlap halo messages with interior work (default). ``False`` waits for the left halo
        before any local work and sends only after it (the baseline the benchmarks compare with).
    reuse_states : bool
        With a stacked propagator: reuse the level-0 store in the next solve (no allocation per
        solve; ``MGRITResult.states``/``final`` are then views that the next solve overwrites).
        Default False: every solve's results stay valid.
    coarsest : {'auto', 'redundant', 'sequential'}
        The coarsest level across ranks: 'redundant' solves it on every rank (an Allgatherv of
        its right-hand sides, then the propagator's ``coarse_replica(level)``, asked once per
        solve, which must return a replica on every rank alike, or None on every rank for the
        chain); 'sequential' the chain across ranks; 'auto' (default) redundant when the
        propagator has ``coarse_replica`` and there is more than one rank.
    xp : module or None
        Array module of the states when they live on a GPU (``cupy``; None for host arrays):
        boundary states then go
        to MPI as device buffers if the MPI library is CUDA-aware, else staged through pinned
        host buffers (:mod:`mgnn.comm.device`); ``halo.path`` says which.
    capture : bool
        Capture each kind of cycle (and the final relaxation) the first time it runs and replay
        it afterwards in one backend call (:mod:`mgnn.backend.tape`; same arithmetic, results
        bit-identical): with a stacked propagator that replays tapes (``captures = True``,
        ``tape_layers``, ``tape_stores``, ``run_tape``), host states and no spatial coarsening;
        on several ranks (with ``overlap``) the halo messages are replayed between the tape's
        segments, in the captured order. With ``tol = 0`` on one rank (a fixed cycle count)
        the whole solve becomes one tape once each of its cycles has replayed (a divergence
        is then raised, with the same message, after the whole solve has run rather than after
        the cycle that diverged). A stacked
        propagator with ``graphs = True`` (``begin_graph``, ``end_graph``, ``graph_key``: a GPU
        backend) instead has its second run of each cycle captured as CUDA graphs and launched
        from then on (with ``reuse_states`` and no spatial coarsening; on several ranks, with
        ``overlap``, the halo messages run between the graphs, in the captured order). Otherwise, or
        ``False``, every cycle runs through the engine.
    abort_on_error : bool
        In a distributed solve, an exception on any rank (a user propagator's included) is
        reported and ends every rank with ``comm.Abort`` instead of leaving the others waiting.
    """

    def __init__(self, propagator, n_steps, options=None, comm=None, partition=None,
                 abort_on_error=True, norm_comm=None, overlap=True, ops=None, xp=None,
                 reuse_states=False, coarsest="auto", capture=True):
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
        context = getattr(propagator, "solve_context", None)
        self._solve_context = context if callable(context) else contextlib.nullcontext
        # spatial coarsening: coarse levels hold states of other shapes (XBraid's
        # coarsen/refine): restrict(u, l) maps level l to l + 1, interpolate(e, l) back
        self._spatial = all(callable(getattr(propagator, m, None))
                            for m in ("restrict", "interpolate"))
        self._templates_key = None
        self._stacked = bool(getattr(propagator, "stacked", False)) and all(
            callable(getattr(propagator, m, None)) for m in ("advance", "points"))
        self.xp, self.reuse_states = xp, bool(reuse_states)
        self.capture, self._tapes, self._graphs = bool(capture), {}, {}
        self._replayed = []  # the tapes the solve at hand replayed, in order
        self._engines, self._plans, self._states_key = {}, {}, None
        self.engine = None
        if coarsest not in ("auto", "redundant", "sequential"):
            raise ValueError(f"coarsest must be 'auto', 'redundant' or 'sequential', got "
                             f"{coarsest!r}")
        replicable = callable(getattr(propagator, "coarse_replica", None))
        if coarsest == "redundant" and not replicable:
            raise ValueError(f"coarsest='redundant' needs {type(propagator).__name__}."
                             "coarse_replica(level) (a propagator that steps every point of the "
                             "level on every rank)")
        self._replica = None  # the coarse replica of the solve at hand (see _coarsest)
        self.redundant_solves = 0  # coarsest levels solved redundantly so far (diagnostics)
        if comm is not None and comm.Get_size() > 1:
            abort_on_uncaught(comm)  # an uncaught Ctrl-C between solves still ends every rank
            comm = comm.Dup()  # private context: MGRIT messages never meet the user's own
        self.comm = comm
        self.halo = (make_halo(comm, norm_comm) if xp is None else
                     make_device_halo(comm, norm_comm, xp=xp))
        # the redundant coarsest level replaces a chain across ranks: pointless on one rank
        self._redundant = (coarsest != "sequential" and replicable and self.halo.size > 1
                           and len(self.sizes) > 1)
        self.coarsest = "redundant" if self._redundant else "sequential"
        if partition is None:  # balanced by the cost model of these options
            starts = balanced_starts(n_steps, self.halo.size, o.cf, self.sizes, o.nrelax_on,
                                     cycle=o.cycle, coarsest=self.coarsest)
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
    @property
    def _template(self):
        """The level-0 template (u0 of the current solve)."""
        return self._templates[0]

    @_template.setter
    def _template(self, u0):
        self._templates = [u0] * len(self.sizes)

    def _check_state(self, v, what, lev=0):
        """TypeError unless ``v`` is an array of u0's library and dtype and of level ``lev``'s
        shape; ``what()`` names where it came from (built only for the message)."""
        t = self._templates[lev]
        if ((type(v) is not type(t) and _family(v) != _family(t))
                or getattr(v, "shape", None) != t.shape or getattr(v, "dtype", None) != t.dtype):
            if t is self._templates[0]:
                raise TypeError(f"{what()} {describe(v)}, but u0 is {describe(t)}: every state "
                                "must match u0 (no silent casts)")
            raise TypeError(f"{what()} {describe(v)}, but a level-{lev} state (the restriction "
                            f"of u0) is {describe(t)}: every state of level {lev} must match it "
                            "(no silent casts)")

    def _restricted(self, v, lev):
        """``v``, what ``propagator.restrict(u, lev)`` returned, checked as a level lev+1 state."""
        self._check_state(v, lambda: f"{type(self.prop).__name__}.restrict(u, level={lev}) "
                                     "returned", lev + 1)
        return v

    def _level_templates(self, u0):
        """[u0, restrict(u0, 0), restrict(restrict(u0, 0), 1), ...] (one template per level;
        [u0] * levels without spatial coarsening); built once per u0 shape and dtype."""
        n = len(self.sizes)
        if not self._spatial:
            return [u0] * n
        key = (type(u0), u0.shape, u0.dtype.str)
        if self._templates_key != key:
            out = [u0]
            for lev in range(n - 1):
                t = self.prop.restrict(out[-1], lev)
                if ((type(t) is not type(u0) and _family(t) != _family(u0))
                        or getattr(t, "dtype", None) != u0.dtype
                        or not isinstance(getattr(t, "shape", None), tuple)):
                    raise TypeError(f"{type(self.prop).__name__}.restrict(u, level={lev}) "
                                    f"returned {describe(t)}, but u0 is {describe(u0)}: a "
                                    "coarse state must be an array of u0's kind and dtype")
                out.append(t)
            self._templates_cache, self._templates_key = out, key
        return [u0] + self._templates_cache[1:]

    def _plan(self, lev, name, target):
        """The cached :class:`Plan` of sweep ``name`` on level ``lev`` (targets ``target(j)``)."""
        key = (lev, name)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        plan = self._plans[key] = Plan()
        plan.final = lev == 0 and name in ("final", "coarsest")  # one level: its one sweep
        L = self.levels[lev]
        a, b, n = L.a, L.b, L.n
        if a >= b or target is None:
            return plan
        plan.need_left = a >= 1 and target(a)
        plan.send_right = b <= n and target(b)
        if name in ("residual", "fas_rhs"):
            plan.points = [j for j in range(max(a + 1, 1), b) if target(j)]
            return plan
        js = [j for j in range(max(a, 1), b) if target(j)]
        chains = _chains(js)
        if plan.need_left and chains and chains[0][0] == a:
            plan.head = chains.pop(0)
        if plan.send_right and chains and chains[-1][0] + chains[-1][1] == b:
            plan.tail = chains.pop()
        plan.chains = chains
        # the boundary value can go before the interior work unless the head chain makes it
        plan.early = plan.send_right and self.overlap and not (
            plan.head is not None and plan.head[0] + plan.head[1] == b)
        return plan

    def _update(self, lev, U, G, target, name):
        """u_j = Phi(u_{j-1}) + g_j for this rank's points j >= 1 with ``target(j)``, ascending.

        Runs of consecutive targets are chains; the chain that needs the left halo is computed
        last, the chain that feeds the right neighbour first (then its value is sent), interior
        chains in between (one engine call for all), overlapping both messages.
        """
        plan = self._plan(lev, name, target)
        L, eng = self.levels[lev], self.engine
        if L.a >= L.b:
            return
        t = tag(name, lev)
        recv = self._post_recv(lev, L.left, t) if plan.need_left else None
        sends = []
        if plan.early:
            if plan.tail is not None:
                eng.advance(lev, U, G, [plan.tail], plan, ("tail",))
            sends.append(eng.send_boundary(lev, U, plan, L.right, t))
        elif plan.tail is not None:
            eng.advance(lev, U, G, [plan.tail], plan, ("tail",))
        eng.advance(lev, U, G, plan.chains, plan, ("chains",))
        if recv is not None:
            first, length = plan.head
            if self.pull:  # the halo is the step's input: the left ghost slot, then the chain
                eng.recv_ghost(recv, U)
                eng.advance(lev, U, G, [plan.head], plan, ("head",))
                eng.clear_ghost(U)
            else:  # the halo is Phi(u_{a-1}): u_a = msg + g_a, then the rest of the chain
                eng.recv_combine(recv, lev, U, G, U, PLAIN, 1)
                if length > 1:
                    eng.advance(lev, U, G, [[first + 1, length - 1]], plan, ("head",))
        if plan.send_right and not sends:
            sends.append(eng.send_boundary(lev, U, plan, L.right, t))
        for req in sends:
            eng.wait_send(req)

    def _post_recv(self, lev, source, t):
        """A receive of level ``lev``'s boundary value posted (already completed without
        ``overlap``: the baseline that waits before any local work)."""
        recv = self.engine.post_recv(lev, source, t)
        return recv if self.overlap else self.engine.complete_recv(recv)

    def _apply(self, lev, U, G, R, target, name, mode, out_slot):
        """Mode ``mode`` (:mod:`.engines`) at this rank's points j >= 1 with ``target(j)``, the
        result of point j into R's slot ``out_slot(j)``; returns this rank's squared norm (mode
        0). The step into point a needs the left halo."""
        plan = self._plan(lev, name, target)
        L, eng = self.levels[lev], self.engine
        if L.a >= L.b:
            return 0.0
        t = tag(name, lev)
        recv = self._post_recv(lev, L.left, t) if plan.need_left else None
        send = (eng.send_boundary(lev, U, plan, L.right, t)
                if plan.send_right and self.overlap else None)
        if plan.outs is None:
            plan.outs = [out_slot(j) for j in plan.points]
        r2 = eng.points(lev, U, G, R, plan.points, plan.outs, mode, plan, ("points",))
        if recv is not None:
            if self.pull:
                eng.recv_ghost(recv, U)
                r2 = r2 + eng.points(lev, U, G, R, [L.a], [out_slot(L.a)], mode, plan, ("head",))
                eng.clear_ghost(U)
            else:
                r2 = r2 + eng.recv_combine(recv, lev, U, G, R, mode, out_slot(L.a))
        if plan.send_right and not self.overlap:
            send = eng.send_boundary(lev, U, plan, L.right, t)
        if send is not None:
            eng.wait_send(send)
        return r2

    def _f_relax(self, U, G, lev, name="f_relax"):
        cf = self.options.cf
        self._update(lev, U, G, lambda j: j % cf != 0, name)

    def _c_relax(self, U, G, lev):
        cf = self.options.cf
        self._update(lev, U, G, lambda j: j % cf == 0, "c_relax")

    def _coarsest(self, lev, U, G):
        """The coarsest level exactly: a chain across the ranks (sequential), or (redundant) every
        rank gathers u_0 and the right-hand sides of the level and steps all of it with the
        propagator's ``coarse_replica(level)`` (asked once per solve), keeping its own
        points."""
        if self._replica is None:
            self._update(lev, U, G, lambda j: True, "coarsest")
            return
        L, eng = self.levels[lev], self.engine
        # the partition's tuples (shared by equal partitions: virtual ranks build equal ones)
        counts = self.partition.level_counts(L.s, L.n)
        plan = self._plan(lev, "redundant", None)

        def solve_redundantly(stores):  # a replayed cycle runs it again: this solve's replica
            FU, FG = eng.gather_level(lev, stores[0], stores[1], *counts, L.n)
            eng.replica_advance(self._replica, lev, FU, FG, L.n, plan)
            eng.scatter_back(lev, FU, stores[0])

        eng.host_call(solve_redundantly, [U, G])

    def _coarse_range(self, lev, i0):
        """(fine slot, coarse slot, count) of the coarse points i0 .. C.b - 1 held here: as
        slots of level lev (every cf-th from the first) and of level lev + 1 (consecutive)."""
        F, C, cf = self.levels[lev], self.levels[lev + 1], self.options.cf
        return cf * i0 - F.a + 1, i0 - C.a + 1, max(C.b - i0, 0)

    def _restrict(self, U, G, lev, fas=True):
        """F-relax ``lev``, its C-point residuals, injection and the FAS rhs of level+1.

        Returns (V, Gc, Uc, r2): V the injected states (this rank's coarse points), Gc the FAS
        right-hand sides, Uc the coarse iterate (a copy of V), r2 this rank's share of the squared
        residual norm. ``fas=False`` (the skipped down-cycle) injects only: the coarse problem is
        the plain coarse rediscretisation (a cascadic initial guess).
        """
        cf, eng = self.options.cf, self.engine
        C = self.levels[lev + 1]
        V, Gc, Uc = eng.coarse_stores(lev + 1, self._templates[lev + 1])
        f0, c0, k = self._coarse_range(lev, C.a)
        if self._spatial:
            eng.inject_restricted(U, V, f0, cf, c0, k, lev)
        else:  # into the coarse iterate too: it starts from the injected states
            eng.inject(U, V, f0, cf, c0, k, also=Uc)
        r2 = 0.0
        if fas:
            self._f_relax(U, G, lev)
            # the fine residual at the C-points, restricted when the levels differ in space
            R = eng.residual_store(lev + 1, self._templates[lev]) if self._spatial else Gc
            r2 = self._apply(lev, U, G, R, lambda j: j % cf == 0, "residual", 0,
                             lambda j: j // cf - C.a + 1)
            if self._spatial:
                eng.restrict_slots(R, Gc, [i - C.a + 1 for i in range(max(C.a, 1), C.b)], lev)
            self._apply(lev + 1, V, None, Gc, lambda i: True, "fas_rhs", 1,
                        lambda i: i - C.a + 1)
        if self._spatial:
            eng.copy_store(V, Uc)
        return V, (Gc if fas else None), Uc, r2

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
            self._coarsest(lev, U, G)
            return None
        if not skip:
            for _ in range(o.nrelax_on(lev)):
                self._f_relax(U, G, lev)
                self._c_relax(U, G, lev)
        V, Gc, Uc, r2 = self._restrict(U, G, lev, fas=not skip)
        self._cycle(lev + 1, Uc, Gc, kind, skip)
        if lev + 1 < coarsest:
            if kind == "F":
                self._cycle(lev + 1, Uc, Gc, "V", False)
            self._f_relax(Uc, Gc, lev + 1)
        C = self.levels[lev + 1]
        f0, c0, k = self._coarse_range(lev, max(C.a, 1))
        if self._spatial:
            self.engine.correct_interpolated(U, Uc, V, f0, o.cf, c0, k, lev)
        else:
            self.engine.correct(U, Uc, V, f0, o.cf, c0, k)
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
            with self._solve_context():
                return self._solve(u0, initial_guess, o)

    def _captured(self, key, U, run):
        """``run()`` (a cycle or the final relaxation on the level-0 store U): captured the first
        time (:meth:`StackedEngine.begin_capture`), replayed after that; uncaptured where the
        engine cannot capture (see ``capture``)."""
        eng = self.engine
        cycle = run

        def run():  # the cycle, its deferred send waits completed within it (last)
            out = cycle()
            eng.flush_sends(last=True)
            return out
        if not (self.capture and eng.stacked):
            return run()
        if not eng.can_capture():
            if (getattr(self.prop, "graphs", False) and self.reuse_states
                    and self.options.tol == 0 and (self.halo.size == 1 or self.overlap)
                    and not self._spatial):
                return self._graph(key, U, run)
            return run()
        # (a cycle captured with a redundant coarsest solve replays it: the chain is another)
        key = key + (U.shape, U.dtype.str, self.prop.tape_key(), self._replica is not None)
        tape = self._tapes.get(key, False)
        if tape:
            self._replayed.append(tape)
            return eng.replay(tape, U)
        if tape is None:  # captured before and found not replayable
            return run()
        eng.begin_capture(U)
        try:
            out = run()
        except BaseException:
            eng.abandon_capture()
            raise
        self._tapes[key] = eng.end_capture(out, key)  # None: not replayable (never retried)
        return out

    def _graph(self, key, U, run):
        """:meth:`_captured` on a GPU backend: the first run allocates what the cycle uses, the
        second is captured as graphs (:meth:`StackedEngine.begin_graph`: CUDA stream capture,
        cut at every halo message on several ranks) and launched, later ones launch them. The
        graphs read the stores, the layers, the message and norm buffers at fixed addresses, so
        they key it (``reuse_states``: U stays put); a launch returns the cycle's residual norm
        from the norm buffers the graphs refill and the messages' norms: fixed cycles only
        (``tol = 0``)."""
        key = key + (U.shape, U.dtype.str, _address(U), self.prop.graph_key())
        entry = self._graphs.get(key)
        eng = self.engine
        if entry is None:
            if len(self._graphs) >= 16:  # addresses that keep changing: no graph pays off
                self._graphs.clear()
            self._graphs[key] = "warm"
            return run()
        if entry == "warm":
            try:
                eng.begin_graph()
                out = run()
            except BaseException:
                eng.abandon_graph()
                raise
            entry = self._graphs[key] = eng.end_graph(out)
        return eng.launch_graph(entry)

    def _engine_for(self, u0):
        """The stacked engine for a ``stacked`` propagator and states of its array module, else
        the list engine (built once each)."""
        xp = self.xp if self.xp is not None else np
        stacked = self._stacked and isinstance(u0, xp.ndarray)
        key = "stacked" if stacked else "list"
        if key not in self._engines:
            self._engines[key] = StackedEngine(self, xp) if stacked else ListEngine(self)
        self.engine = self._engines[key]
        return self.engine

    def _level0_store(self, eng, L0, u0):
        """The level-0 store: new for every solve (earlier results stay valid) unless
        ``reuse_states``."""
        if not eng.stacked or not self.reuse_states:
            return eng.store(L0, u0)
        key = (u0.shape, u0.dtype.str)
        if self._states_key != key:
            self._states, self._states_key = eng.store(L0, u0), key
        return self._states

    def _solve(self, u0, initial_guess, o):
        t_start = time.perf_counter()
        self._step_seconds = self._vector_seconds = 0.0
        self.halo.timers.update(halo_wait=0.0, recv_wait=0.0, halo_total=0.0, allreduce=0.0)
        if "staging" in self.halo.timers:
            self.halo.timers["staging"] = 0.0
        N = self.n_steps
        if not hasattr(u0, "shape") or not hasattr(u0, "dtype"):
            raise TypeError(f"u0 must be an array, got {type(u0).__name__}")
        self._templates = self._level_templates(u0)
        self._replica = (self.prop.coarse_replica(len(self.sizes) - 1) if self._redundant
                         else None)  # this solve's redundant coarsest stepper (None: a chain)
        eng = self._engine_for(u0)
        L0 = self.levels[0]
        U = self._level0_store(eng, L0, u0)
        c_first = -(-L0.a // o.cf) * o.cf
        if eng.stacked and initial_guess is None:  # the C-points' zero guess in one assignment
            if c_first < L0.b and len(self.sizes) > 1:  # (sequential: no point read unwritten)
                U[c_first - L0.a + 1:L0.b - L0.a + 1:o.cf] = 0
            if c_first == 0:
                eng.set(U, 1, u0, copy=False)
        else:
            for c in range(c_first, L0.b, o.cf):
                if c == 0:
                    eng.set(U, 1, u0, copy=False)
                elif initial_guess is not None:
                    guess = initial_guess(c)
                    self._check_state(guess, lambda: f"initial_guess({c}) returned")
                    eng.set(U, c - L0.a + 1, guess, copy=False)
                elif eng.stacked:
                    U[c - L0.a + 1] = 0
                else:
                    U[c - L0.a + 1] = u0 * 0
        result = MGRITResult(tol=float(o.tol))
        if len(self.sizes) == 1:
            self._update(0, U, None, lambda j: True, "coarsest")
            result.iterations, result.converged = 1, True
        else:
            # a fixed cycle count whose cycles all replayed once: from then on the whole solve
            # is one tape (one kernel call; copies fused across the cycles' seams)
            self._replayed, whole = [], None
            # a final sweep that keeps the linearisation (the propagator's ``final_derivs``)
            # runs uncaptured: a tape's rows keep none
            keep = getattr(self.prop, "final_derivs", None) is not None
            if (o.tol == 0 and self.capture and eng.stacked and eng.can_capture()
                    and self.halo.size == 1):  # several ranks: one tape per cycle (messages)
                whole = ("solve", o.max_iter, o.skip_downcycle, U.shape, U.dtype.str,
                         self.prop.tape_key(), keep)
            outs = eng.replay(self._tapes[whole], U) if self._tapes.get(whole) else None
            for k in range(o.max_iter):
                skip = o.skip_downcycle and k == 0
                r2 = outs[k] if outs is not None else self._captured(
                    ("cycle", skip), U, lambda: self._cycle(0, U, None, o.cycle, skip))
                if not skip:
                    r = math.sqrt(self.halo.allreduce_sum(r2))
                    if not math.isfinite(r):
                        raise DivergenceError(f"MGRIT diverged: residual {r} in cycle {k}")
                    result.residuals.append(r)
                result.iterations = k + 1
                if not skip and result.residuals[-1] < o.tol:
                    result.converged = True
                    break
            if keep:
                self._f_relax(U, None, 0, "final")
            elif outs is None:
                self._captured(("final",), U, lambda: self._f_relax(U, None, 0, "final"))
            if (outs is None and whole is not None
                    and len(self._replayed) == o.max_iter + (not keep)):
                self._tapes[whole] = eng.merge_tapes(self._replayed, whole)
            if not result.converged and o.tol > 0 and o.warn_not_converged and \
                    self.halo.reduce_rank == 0:  # once per solve, not once per replica
                warnings.warn(f"MGRIT did not reach tol={o.tol:.3g} in max_iter={o.max_iter} "
                              f"cycles (n_steps={N}): the states are inexact (see "
                              "MGRITResult.residuals and .converged; raise max_iter, or set "
                              "MGRITOptions.warn_not_converged=False for a fixed budget)",
                              NotConvergedWarning, stacklevel=3)
        eng.flush_sends()  # the uncaptured sweeps' sends (a captured cycle completes its own)
        result.states = eng.states_view(L0, U, N)
        result.store = (U, L0.a) if eng.stacked and L0.m else None
        result.final = result.states[N]
        total = time.perf_counter() - t_start
        result.timings = {"steps": self._step_seconds, "vector": self._vector_seconds,
                          "total": total, **self.halo.timers}
        return result


def _address(a):
    """The data address of a host or device array."""
    ptr = getattr(a.data, "ptr", None)
    return a.__array_interface__["data"][0] if ptr is None else ptr
