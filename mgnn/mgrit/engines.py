"""How the MGRIT solver stores a level's states and applies the propagator to them.

The solver (:mod:`.solver`) orchestrates sweeps, halos and levels in terms of *slots*: a level's
store on a rank holding points [a, b) has ``b - a + 2`` slots, slot ``j - a + 1`` for point j, slot 0
for the left neighbour's point a - 1 (a received halo) and the last slot for point b (the step
into it is the boundary value sent right). Two engines implement the same operations:

* :class:`ListEngine` -- any propagator with ``step`` (and optionally ``step_batch``): a store is a
  Python list of arrays, every step's output checked (the propagator contract of
  :class:`mgnn.mgrit.MGRITSolver`), FAS arithmetic through the ``ops`` object.
* :class:`StackedEngine` -- a propagator with ``stacked = True``: a store is ONE preallocated array
  ``(slots, *state)`` (host or device), a relaxation sweep is one ``advance`` call over all its
  chains, residuals and FAS right-hand sides one ``points`` call each, restriction and correction
  strided-view arithmetic; nothing is allocated inside a cycle.

A *chain* is a run of consecutive points advanced in order (u_j = Phi(u_{j-1}) + g_j); chains of a
sweep are independent of each other. ``points`` modes: 0 residual ``R[o] = Phi(u_{i-1}) - u_i
(+ g_i)`` returning the sum of squared norms, 1 FAS ``R[o] = (R[o] + u_i) - Phi(u_{i-1})``, 2 plain
``R[o] = Phi(u_{i-1}) (+ g_i)``.
"""
import functools
import operator
import time
from collections.abc import Sequence

import numpy as np

from ..backend import tape as T
from ..backend.fas_ops import GenericOps, NumbaOps

RESIDUAL, FAS, PLAIN = 0, 1, 2


def _family(x):
    """The array library of ``x`` ('numpy', 'cupy', ...): the top package of its type."""
    return type(x).__module__.partition(".")[0]


def describe(v):
    """'numpy ndarray of shape (3,) and dtype float64' (for error messages)."""
    if v is None:
        return "None"
    return (f"{_family(v)} {type(v).__name__} of shape {getattr(v, 'shape', None)} and dtype "
            f"{getattr(v, 'dtype', None)}")


class _Done:
    """A completed request (the no-overlap baseline waits for a receive at once)."""

    def Wait(self):
        return None


class Plan:
    """The fixed index structure of one sweep kind on one level of one rank (built once).

    chains : list of [first point, length]   -- interior chains (no halo, not feeding the right)
    head, tail : [first point, length] or None -- the chain after the left halo, the chain whose
        last point feeds the right neighbour (computed first, then sent)
    points : list of int                       -- for a points sweep: the interior targets
    final : bool                               -- the solve's last sweep on level 0 (the
        stacked engine steps it through the propagator's ``advance_final`` where it has one)
    """

    def __init__(self):
        self.chains, self.head, self.tail, self.points, self.outs = [], None, None, [], None
        self.need_left = self.send_right = self.early = self.final = False
        self.arrays = {}

    def array(self, key, rows):
        """``rows()`` as an int64 array (slot indices for the stacked kernels), built once."""
        a = self.arrays.get(key)
        if a is None:
            a = self.arrays[key] = np.asarray(rows(), dtype=np.int64)
        return a


class ListEngine:
    """Stores as lists; the propagator's ``step``/``step_batch`` with every output checked."""

    stacked = False

    def __init__(self, solver):
        self.solver = solver
        prop = solver.prop
        self.prop = prop
        self.fresh = bool(getattr(prop, "fresh_outputs", False))
        self.batched = bool(getattr(prop, "batched", False)) and \
            callable(getattr(prop, "step_batch", None))
        self.fused_rhs = self.batched and bool(getattr(prop, "fused_rhs", False))
        self._full = None  # level whose stores hold every point (a redundant coarsest solve)

    def _a(self, lev):
        """First point of this rank's stores of level ``lev`` (0 for a full replicated store)."""
        return 0 if lev == self._full else self.solver.levels[lev].a

    # storage
    def store(self, level, template):
        """An empty store for ``level`` (a list of slots)."""
        return [None] * (level.m + 2) if level.m else []

    def states_view(self, level, U, n):
        """List of length n+1: this rank's level-0 states at their fine indices."""
        out = [None] * (n + 1)
        out[level.a:level.b] = U[1:level.m + 1]
        return out

    def set(self, U, slot, value, copy):
        """Slot ``slot`` of store U holds ``value`` (a list binds it, or a copy; an array copies)."""
        U[slot] = value.copy() if copy else value

    def clear_ghost(self, U):
        """Drop the reference to a receive buffer held in the left ghost slot."""
        U[0] = None

    def inject(self, Uf, V, fine0, stride, coarse0, k, also=None):
        """V[coarse0 + q] = Uf[fine0 + q stride], q < k (restriction by injection), and into the
        store ``also`` alike (the coarse iterate; the other slots of a store carry nothing: a
        ghost slot is set before every read)."""
        for q in range(k):
            V[coarse0 + q] = Uf[fine0 + q * stride]
            if also is not None:
                also[coarse0 + q] = V[coarse0 + q]

    def coarse_stores(self, lev, template):
        """(V, G, U) stores of coarse level ``lev``: the injected states, the FAS right-hand
        sides and the coarse iterate (new lists every cycle)."""
        L = self.solver.levels[lev]
        return self.store(L, template), self.store(L, template), self.store(L, template)

    def residual_store(self, lev, template):
        """A store with level ``lev``'s slots holding states shaped like ``template`` (the fine
        residuals at the C-points before restriction)."""
        return self.store(self.solver.levels[lev], template)

    def copy_store(self, src, dst):
        """dst = src slot by slot (the coarse iterate starts from the injected states)."""
        dst[:] = src

    def correct(self, Uf, Uc, V, fine0, stride, coarse0, k):
        """Uf[fine0 + q stride] += Uc[coarse0 + q] - V[coarse0 + q], q < k (FAS correction)."""
        s = self.solver
        t0 = time.perf_counter()
        cs = range(coarse0, coarse0 + k)
        outs = s.ops.correct_batch([Uf[fine0 + q * stride] for q in range(k)],
                                   [Uc[c] for c in cs], [V[c] for c in cs])
        for q, u in enumerate(outs):
            Uf[fine0 + q * stride] = u
        s._vector_seconds += time.perf_counter() - t0

    # spatial coarsening (a propagator with restrict/interpolate): level lev -> lev + 1 and back
    def inject_restricted(self, Uf, V, fine0, stride, coarse0, k, lev):
        """V[coarse0 + q] = restrict(Uf[fine0 + q stride], lev), q < k."""
        restrict = self.solver.prop.restrict
        for q in range(k):
            self.set(V, coarse0 + q, self.solver._restricted(restrict(Uf[fine0 + q * stride], lev),
                                                             lev), copy=False)

    def restrict_slots(self, Rf, Gc, slots, lev):
        """Gc[o] = restrict(Rf[o], lev) for the slots ``o`` (the fine residuals at C-points)."""
        restrict = self.solver.prop.restrict
        for o in slots:
            self.set(Gc, o, self.solver._restricted(restrict(Rf[o], lev), lev), copy=False)

    def correct_interpolated(self, Uf, Uc, V, fine0, stride, coarse0, k, lev):
        """Uf[fine0 + q stride] += interpolate(Uc[coarse0 + q] - V[coarse0 + q], lev), q < k."""
        s = self.solver
        interpolate = s.prop.interpolate
        for q in range(k):
            e = interpolate(Uc[coarse0 + q] - V[coarse0 + q], lev)
            s._check_state(e, lambda: f"{type(s.prop).__name__}.interpolate(e, level={lev}) "
                                      "returned", lev)
            self._add_into(Uf, fine0 + q * stride, e)

    def _add_into(self, U, slot, e):
        U[slot] = U[slot] + e

    # propagator
    def phi(self, u, j, lev):
        """Step out of level point j (fine index j s) to point j+1 (checked; ``u`` untouched)."""
        s = self.solver
        st = s.levels[lev].s
        t0 = time.perf_counter()
        out = self.prop.step(u if self.fresh else u.copy(), j * st, (j + 1) * st, lev)
        s._step_seconds += time.perf_counter() - t0
        t = s._templates[lev]  # the common case inline: a step costs ~1 us in Python already
        if type(out) is not type(t) or out.shape != t.shape or out.dtype != t.dtype or out is u:
            self.checked(out, u, j * st, (j + 1) * st, lev, "step")
        return out

    def phi_batch(self, states, js, lev, rhs=None):
        """[Phi(states[k]) (+ rhs[k]) out of level point js[k]] in one propagator call (or a
        loop); ``rhs`` only with a ``fused_rhs`` propagator."""
        if not js:
            return []
        if not self.batched or (len(js) == 1 and rhs is None):
            return [self.phi(u, j, lev) for u, j in zip(states, js)]
        s = self.solver
        st = s.levels[lev].s
        starts, stops = [j * st for j in js], [(j + 1) * st for j in js]
        t0 = time.perf_counter()
        args = (states if self.fresh else [u.copy() for u in states], starts, stops, lev)
        out = self.prop.step_batch(*args) if rhs is None else self.prop.step_batch(*args, rhs)
        s._step_seconds += time.perf_counter() - t0
        if out is None or len(out) != len(js):
            raise TypeError(f"{type(self.prop).__name__}.step_batch(us, starts, stops, "
                            f"level={lev}) returned {describe(out)} for {len(js)} states: it "
                            "must return a list of one state per u")
        t = s._templates[lev]
        kind, shape, dtype = type(t), t.shape, t.dtype
        for v, u, a, b in zip(out, states, starts, stops):  # inline as in phi: per state
            if type(v) is not kind or v.shape != shape or v.dtype != dtype or v is u:
                self.checked(v, u, a, b, lev, "step_batch")
        return list(out)

    def checked(self, out, u, start, stop, lev, method):
        """``out``, what ``method`` returned for the solver's state ``u``; TypeError unless it is
        an array of u0's kind, shape and dtype (MPI would silently truncate or half-fill a wrong
        one, serial arithmetic would cast) that the solver may keep."""
        name = type(self.prop).__name__
        self.solver._check_state(out, lambda: f"{name}.{method}(u, {start}, {stop}, "
                                               f"level={lev}) returned", lev)
        if out is u:
            if self.fresh:
                raise TypeError(
                    f"{name}.{method}(u, {start}, {stop}, level={lev}) returned the u it was "
                    "given, but the propagator declares fresh_outputs = True (a new array every "
                    "step, u untouched): return a new array, or drop fresh_outputs (the solver "
                    "then hands step a private copy of u)")
            raise TypeError(
                f"{name}.{method}(u, {start}, {stop}, level={lev}) returned the array the "
                f"solver holds as the state at fine index {start} (an output buffer reused "
                "across calls?): return a new array, or the u it was given")
        return out

    def advance(self, lev, U, G, chains, plan=None, key=None):
        """u_j = Phi(u_{j-1}) (+ g_j) along each chain [first point, length]; with batching,
        the k-th points of all chains form one wave (one call)."""
        a = self._a(lev)
        if self.batched:
            longest = max((n for _, n in chains), default=0)
            waves = [[f + k for f, n in chains if n > k] for k in range(longest)]
        else:
            waves = [[f + k] for f, n in chains for k in range(n)]
        ops = self.solver.ops
        for wave in waves:
            slots = [j - a + 1 for j in wave]
            prev = [U[q - 1] for q in slots]
            rhs = None if G is None else [G[q] for q in slots]
            if rhs is not None and self.fused_rhs:  # Phi(u) + g in one launch
                outs = self.phi_batch(prev, [j - 1 for j in wave], lev, rhs)
            else:
                outs = self.phi_batch(prev, [j - 1 for j in wave], lev)
                if rhs is not None:
                    # a propagator that promised new arrays gets the rhs added in place
                    outs = ops.add_batch(outs, rhs, in_place=self.fresh)
            for q, v in zip(slots, outs):
                U[q] = v

    def points(self, lev, U, G, R, js, outs, mode, plan=None, key=None):
        """Mode ``mode`` (module doc) at level points ``js`` into R's slots ``outs``; returns this
        call's sum of squared residual norms (0.0 unless mode 0)."""
        if not js:
            return 0.0
        a = self._a(lev)
        slots = [j - a + 1 for j in js]
        phis = self.phi_batch([U[q - 1] for q in slots], [j - 1 for j in js], lev)
        return self.combine(U, G, R, slots, outs, phis, mode)

    def combine(self, U, G, R, slots, outs, phis, mode):
        """The arithmetic of mode ``mode`` for given step results ``phis``."""
        s, ops = self.solver, self.solver.ops
        t0 = time.perf_counter()
        r2 = 0.0
        if mode == RESIDUAL:
            # the r are new arrays: a later in-place FAS update touches nothing else
            rs, r2 = ops.residual_batch(phis, [U[q] for q in slots],
                                        None if G is None else [G[q] for q in slots])
            for o, r in zip(outs, rs):
                R[o] = r
        elif mode == FAS:
            ops.fas_rhs_batch([R[o] for o in outs], [U[q] for q in slots], phis)
        else:
            for o, q, v in zip(outs, slots, phis):
                R[o] = v if G is None else ops.add(v, G[q])
        s._vector_seconds += time.perf_counter() - t0
        return r2

    # the redundant coarsest solve: every rank steps the whole level
    def gather_level(self, lev, U, G, counts, displs, n):
        """(FU, FG): stores of every point 0..n of level ``lev`` on every rank, FU holding u_0
        (slot 1), FG the right-hand sides g_1..g_n (None if G is None)."""
        L, halo = self.solver.levels[lev], self.solver.halo
        self.solver.redundant_solves += 1
        rows = [U[1] if j == 0 else (None if G is None else G[j - L.a + 1])
                for j in range(L.a, L.b)]
        FU, FG = [None] * (n + 3), [None] * (n + 3)
        for part, d in zip(halo.allgather_objects(rows), displs):
            FG[d + 1:d + 1 + len(part)] = part
        FU[1] = FG[1]
        return FU, (None if G is None else FG)

    def replica_advance(self, replica, lev, FU, FG, n, plan):
        """Points 1..n of the full stores, stepped by ``replica`` (it can step every point)."""
        saved = self.prop, self.fresh, self.batched, self.fused_rhs
        self.prop, self._full = replica, lev
        self.fresh = bool(getattr(replica, "fresh_outputs", False))
        self.batched = bool(getattr(replica, "batched", False)) and \
            callable(getattr(replica, "step_batch", None))
        self.fused_rhs = self.batched and bool(getattr(replica, "fused_rhs", False))
        try:
            self.advance(lev, FU, FG, [[1, n]] if n else [], plan, ("full",))
        finally:
            (self.prop, self.fresh, self.batched, self.fused_rhs), self._full = saved, None

    def scatter_back(self, lev, FU, U):
        """This rank's points of the full store into its own store."""
        L = self.solver.levels[lev]
        if L.m:
            U[1:L.m + 1] = FU[L.a + 1:L.b + 1]

    def boundary(self, lev, U, pull, plan):
        """What the right neighbour receives: u_{b-1} (pull) or Phi(u_{b-1}) (push)."""
        L = self.solver.levels[lev]
        return U[L.m] if pull else self.phi(U[L.m], L.b - 1, lev)

    def combine_message(self, lev, U, G, R, msg, mode, out):
        """Mode ``mode`` at point a (slot 1) of a push propagator, whose step result Phi(u_{a-1})
        is the received ``msg`` (a receive buffer: never kept). Returns the squared norm."""
        phi = msg.copy() if mode == PLAIN and G is None else msg
        return self.combine(U, G, R, [1], [out], [phi], mode)

    # halo messages (the solver's sweeps post, send and consume them through these calls, so
    # that a captured cycle can replay them between its kernel calls)
    def post_recv(self, lev, source, tag_):
        """Start receiving level ``lev``'s boundary value from ``source``; a token."""
        return self.solver.halo.irecv(self.solver._templates[lev], source, tag_)

    def complete_recv(self, token):
        """The receive ``token`` completed now (the no-overlap baseline); a token."""
        return (_Done(), self.solver.halo.wait(token), time.perf_counter())

    def send_boundary(self, lev, U, plan, dest, tag_):
        """Start sending what the right neighbour receives (:meth:`boundary`); a token."""
        return self.solver.halo.isend(self.boundary(lev, U, self.solver.pull, plan), dest, tag_)

    def recv_ghost(self, token, U):
        """Wait for the received state u_{a-1} and hold it in U's left ghost slot (pull)."""
        self.set(U, 0, self.solver.halo.wait(token), copy=False)

    def recv_combine(self, token, lev, U, G, R, mode, out):
        """Wait for the received Phi(u_{a-1}) and combine it by ``mode`` into R's slot ``out``
        (push, :meth:`combine_message`); the squared norm (mode 0)."""
        return self.combine_message(lev, U, G, R, self.solver.halo.wait(token), mode, out)

    def wait_send(self, token):
        """Wait until a send started by :meth:`send_boundary` has left its buffer."""
        self.solver.halo.wait(token)

    def flush_sends(self, last=False):
        """Complete the sends whose waits :meth:`wait_send` deferred (none here); ``last``: at
        the end of a captured cycle."""

    def host_call(self, fn, stores):
        """``fn(stores)``: a host operation on whole stores (a collective)."""
        return fn(stores)


class StackedStates(Sequence):
    """The level-0 states of a stacked solve by fine index 0..n (views of the store, made on
    access; None where another rank holds the point): a list's indexing without a Python object
    per state up front."""

    __slots__ = ("store", "a", "b", "n")

    def __init__(self, store, a, b, n):
        self.store, self.a, self.b, self.n = store, a, b, n

    def __len__(self):
        return self.n + 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n + 1))]
        i = operator.index(i)
        if i < 0:
            i += self.n + 1
        if not 0 <= i <= self.n:
            raise IndexError(f"state index {i} outside 0..{self.n}")
        return self.store[i - self.a + 1] if self.a <= i < self.b else None

    def __repr__(self):
        return f"StackedStates(points {self.a}..{self.b - 1} of 0..{self.n})"


class _Whole:
    """A one-block partition (every point on rank 0) for a full replicated store."""

    def __init__(self, n):
        self.n = n

    def level_range(self, rank, spacing, n_level):
        return 0, n_level + 1

    def owner(self, fine_index):
        return 0


@functools.lru_cache(maxsize=64)
def _one_class(cls, names):
    """Whether one class of ``cls``'s MRO defines all ``names`` (a subclass that overrides
    ``advance`` of a propagator that replays tapes would not be replayed as it steps)."""
    owners = {next((c for c in cls.__mro__ if n in c.__dict__), None) for n in names}
    return len(owners) == 1 and None not in owners


#: The FAS corrections a tape replays as ``u + (uc - v)`` (a user's ops object may differ).
_REPLAYED_CORRECTIONS = (GenericOps.correct_strided, NumbaOps.correct_strided)


class _Norm(float):
    """A squared residual norm computed while a cycle is captured: the tape's ``norms`` slots
    whose sum it is replayed as (a sum of such norms is one again; a plain float other than
    0.0 in a sum is a value the tape cannot replay)."""

    def __new__(cls, value, indices):
        out = super().__new__(cls, value)
        out.indices = tuple(indices)
        return out

    def __add__(self, other):
        if isinstance(other, _Norm):
            return _Norm(float(self) + float(other), self.indices + other.indices)
        if type(other) is float and other == 0.0:  # a rank's empty share
            return _Norm(float(self) + other, self.indices)
        return float(self) + other

    def __radd__(self, other):
        if type(other) is float and other == 0.0:
            return _Norm(other + float(self), self.indices)
        return other + float(self)


def _replayed(result, norms):
    """A replayed cycle's return value: as captured (("const", v) or None) or its norm, the
    sum of the ``norms`` slots it was captured as (in the captured order)."""
    if result is None:
        return None
    if result[0] == "const":
        return result[1]
    total = 0.0
    for i in result:
        total = total + float(norms[i])
    return _Norm(total, result)


def _nothing(S, pending):
    """The action of :meth:`StackedEngine.flush_sends` after its waits."""


class _Action:
    """A host operation of a captured cycle (a halo message, a collective), replayed between
    the tape's row segments as it ran: ``fn(stores, pending, *args)`` with the tape's stores
    named by index, its value into ``norms[norm]`` (norm >= 0)."""

    __slots__ = ("fn", "stores", "args", "norm")

    def __init__(self, fn, stores, args, norm):
        self.fn, self.stores, self.args, self.norm = fn, stores, args, norm


class Tape:
    """A captured cycle (:mod:`mgnn.backend.tape`): the rows, the stores they name (item 0: the
    level-0 store, rebound at every replay), the step sizes, how many norms, and where the
    cycle's return value comes from (``result``: a tuple of norms indices, or None / ("const",
    0.0) as captured). A cycle with halo messages has ``parts``: row segments (int64 arrays)
    and :class:`_Action` items in the order they ran (``rows`` is then None)."""

    def __init__(self, rows, stores, hs, n_norms, result, key, parts=None):
        self.rows, self.stores, self.hs, self.n_norms = rows, stores, hs, n_norms
        self.result, self.key, self.parts = result, key, parts
        self.replays = 0
        self.bound = None  # the stores in the propagator's form (built at the first replay)


class _GraphNorm:
    """A squared residual norm while a cycle is captured as CUDA graphs (nothing has run yet):
    the terms it is the sum of, left to right, each a device norm buffer the graphs refill or
    (an int) the slot of a message's norm computed between them. A sum with 0.0 (a rank's
    empty share) is itself; anything else has no value a launch could refill."""

    __slots__ = ("terms",)

    def __init__(self, terms):
        self.terms = tuple(terms)

    def __add__(self, other):
        if isinstance(other, _GraphNorm):
            return _GraphNorm(self.terms + other.terms)
        if type(other) is float and other == 0.0:
            return self
        raise TypeError(f"a captured graph's residual norm plus {type(other).__name__} "
                        f"{other!r}: not a value a graph launch refills")

    def __radd__(self, other):
        if type(other) is float and other == 0.0:
            return self
        raise TypeError(f"{type(other).__name__} {other!r} plus a captured graph's residual "
                        "norm: not a value a graph launch refills")

    def value(self, norms):
        """The sum after a launch (``norms``: the messages' norms by slot), a float."""
        total = 0.0
        for t in self.terms:
            total = total + (norms[t] if isinstance(t, int) else float(t))
        return total


class GraphCycle:
    """A cycle captured as CUDA graphs (:meth:`StackedEngine.begin_graph`): ``parts``, the
    graphs (``launch()``) and the halo messages between them (:class:`_Action` with the arrays
    themselves as stores: a graph's addresses are fixed) in the order they ran; ``result`` the
    captured run's return value (a :class:`_GraphNorm`, 0.0 or None)."""

    def __init__(self, parts, n_norms, result):
        self.parts, self.n_norms, self.result = parts, n_norms, result
        self.launches = 0

    @property
    def graphs(self):
        """How many graphs one launch of the cycle launches."""
        return sum(not isinstance(p, _Action) for p in self.parts)


class _GraphRecorder:
    """The parts of a cycle being captured as graphs (see :meth:`StackedEngine.begin_graph`)."""

    def __init__(self):
        self.parts, self.n_norms, self.tokens = [], 0, 0
        self.open_empty = False  # the graph being captured is empty by construction


class _Recorder:
    """Collects the rows of the stacked engine's calls during one captured cycle."""

    def __init__(self, engine, U0):
        self.engine, self.rows, self.hs, self.n_norms = engine, [], {}, 0
        self.stores, self.ids = [U0], {id(U0): 0}
        self.broken = None  # why this cycle cannot be replayed
        self.parts = []  # finished row segments and the host actions between them
        self.tokens = 0  # halo requests started so far (their tokens at replay)

    def cut(self, action):
        """End the current row segment; ``action`` runs after it."""
        if self.rows:
            self.parts.append(self.rows)
            self.rows = []
        self.parts.append(action)

    def before_segment(self, action):
        """``action`` before the current row segment (it touches no store: posting a receive
        earlier changes nothing but keeps the segment whole for the row rewrites)."""
        self.parts.append(action)

    def norm(self):
        """A new index into the tape's norms."""
        self.n_norms += 1
        return self.n_norms - 1

    def _persistent(self, a):
        """Whether ``a`` is one of the engine's level stores (kept for the engine's lifetime;
        the scratch buffers that grow are not)."""
        for key, v in self.engine._scratch.items():
            if key[0] in ("coarse", "residual", "send") and any(
                    x is a for x in (v if isinstance(v, tuple) else (v,))):
                return True
        return False

    def store(self, a):
        """The tape index of store ``a`` (-1 for None); a temporary array breaks the tape."""
        if a is None:
            return -1
        k = self.ids.get(id(a))
        if k is None:
            if not self._persistent(a):
                self.broken = "an array that is not one of the engine's stores"
                return -1
            k = self.ids[id(a)] = len(self.stores)
            self.stores.append(a)
        return k

    def h(self, value):
        return self.hs.setdefault(value, len(self.hs))

    def row(self, op, run=1, **cols):
        r = T.blank(op, run)
        for name, v in cols.items():
            r[getattr(T, name)] = int(v)
        self.rows.append(r)

    def steps(self, op, U, G, R, firsts, lens, outs, origin, stride, lev, mode):
        """Rows of one advance (CHAIN) or points (POINT) call."""
        layer0, lstep, h = self.engine.prop.tape_layers(origin, stride, lev)
        u, g, r, hk = self.store(U), self.store(G), self.store(R), self.h(h)
        norm = self.norm() if op == T.POINT and mode == RESIDUAL else -1
        for q, (f, n, o) in enumerate(zip(firsts, lens, outs)):
            self.row(op, len(firsts) if q == 0 else 1, U=u, G=g, R=r, FIRST=f, N=n, OUT=o,
                     LAYER0=layer0, LSTEP=lstep, H=hk, MODE=mode, NORM=norm)
        return norm

    def finish(self, result, key, xp):
        """The :class:`Tape`, or None if this cycle cannot be replayed."""
        if isinstance(result, _Norm):
            result = result.indices
        elif result is None or result == 0.0:  # a plain 0.0: a rank's share with no norm
            result = None if result is None else ("const", result)
        else:
            self.broken = "the cycle returned a sum of residual norms"
        if self.broken:
            return None
        dtype = self.stores[0].dtype  # the capture's level-0 store
        hs = np.array([h for h, _ in sorted(self.hs.items(), key=lambda kv: kv[1])],
                      dtype=dtype)
        stores = [None] + self.stores[1:]  # item 0: the level-0 store of each replay
        if self.rows or not self.parts:
            self.parts.append(self.rows)
        shares = getattr(self.engine.prop, "tape_shares", True)
        parts = [p if isinstance(p, _Action) else
                 (T.share_first_steps(T.fuse_tails(p)) if shares else T.fuse_tails(p))
                 for p in self.parts]
        # a segment's copy rewrites may drop a copy only if no other part reads its store
        reads = [set(p.stores) if isinstance(p, _Action) else T.stores_read(p) for p in parts]
        parts = [p if isinstance(p, _Action) else _segment(
            p, set().union(*(r for j, r in enumerate(reads) if j != k)))
            for k, p in enumerate(parts)]
        if len(parts) == 1 and not isinstance(parts[0], _Action):
            return Tape(parts[0], stores, hs, self.n_norms, result, key)
        return Tape(None, stores, hs, self.n_norms, result, key, parts)


def _segment(rows, read_elsewhere):
    """A segment's rows as a tape's int64 array, its copies rewritten
    (:func:`mgnn.backend.tape.rewrite_copies`)."""
    rows = T.rewrite_copies(rows, read_elsewhere)
    return np.array(rows, dtype=np.int64).reshape(-1, T.COLS)


class StackedEngine(ListEngine):
    """Stores as one array per level; the propagator's ``advance`` and ``points`` on them.

    The propagator's stacked methods (fine index of slot i: ``origin + i * stride``):

    * ``advance(U, G, chains, origin, stride, level)``: for each row (first slot, length) of the
      int64 array ``chains``, U[i] = Phi(U[i-1]) (+ G[i]) for i = first .. first + length - 1;
    * ``points(U, G, R, slots, out_slots, origin, stride, level, mode)``: the modes of the
      module doc at U's ``slots`` into R's ``out_slots``; returns the squared norm (mode 0; a
      float or a 0-d device array).
    """

    stacked = True

    def __init__(self, solver, xp):
        super().__init__(solver)
        self.xp = xp
        self._scratch = {}
        self._rec = None  # the recorder of a cycle being captured
        self._grec = None  # the parts of a cycle being captured as CUDA graphs
        self._pending, self._requests = {}, 0  # halo requests by token (see post_recv)
        # sends from the send buffers whose waits are deferred to the next host action (a
        # send buffer of each level alternates between two: the one written next is free)
        self._deferred, self._send_turn = [], {}

    # capture (mgnn.backend.tape): a fixed cycle recorded once, then replayed in one call
    def can_capture(self):
        """Whether this engine's cycles can be captured: host stores, a propagator that replays
        tapes (``run_tape`` and ``tape_layers``), one state shape on every level; on several
        ranks, messages that overlap the work (the tape replays them between its segments)."""
        s, prop = self.solver, self.prop
        return (self.xp is np and (s.halo.size == 1 or s.overlap) and not s._spatial
                and bool(getattr(prop, "captures", False))
                and _one_class(type(prop), ("advance", "points", "run_tape", "tape_layers"))
                and type(s.ops).correct_strided in _REPLAYED_CORRECTIONS)

    def begin_capture(self, U0):
        self._rec = _Recorder(self, U0)
        self._deferred = []  # (none are left by a cycle; an earlier error's are stale)

    def end_capture(self, result, key):
        """The captured :class:`Tape` (None if the cycle cannot be replayed)."""
        rec, self._rec = self._rec, None
        return None if rec is None else rec.finish(result, key, self.xp)

    def abandon_capture(self):
        self._rec, self._deferred = None, []

    def merge_tapes(self, tapes, key):
        """One :class:`Tape` that runs ``tapes`` (captured on this engine, level-0 store item 0 in
        each) one after the other: their stores, step sizes and norms renumbered, then
        :func:`mgnn.backend.tape.rewrite_copies` across the seams (a cycle's last correction
        rides on the next cycle's first chains). Its replay returns the parts' values as a
        list."""
        stores, index, hs, rows, results, n_norms = [None], {}, [], [], [], 0
        for t in tapes:
            remap = [0]
            for a in t.stores[1:]:
                if id(a) not in index:
                    index[id(a)] = len(stores)
                    stores.append(a)
                remap.append(index[id(a)])
            for r in t.rows.tolist():
                for c in T.STORE_COLS:
                    if r[c] >= 0:
                        r[c] = remap[r[c]]
                r[T.H] += len(hs)
                r[T.SHARE_H] += len(hs)
                if r[T.NORM] >= 0:
                    r[T.NORM] += n_norms
                r[T.ZIP] = 0  # zipped again below, with what the seams' copies add
                rows.append(r)
            results.append(t.result if t.result is None or t.result[0] == "const" else
                           tuple(i + n_norms for i in t.result))
            hs += t.hs.tolist()
            n_norms += t.n_norms
        rows = T.rewrite_copies(rows)
        rows = np.array(rows, dtype=np.int64).reshape(-1, T.COLS)
        return Tape(rows, stores, np.array(hs, dtype=tapes[0].hs.dtype), n_norms, results, key)

    def replay(self, tape, U0):
        """Run ``tape`` on the level-0 store ``U0``; the cycle's return value (a list of them:
        a tape of :meth:`merge_tapes`)."""
        if tape.bound is None:
            tape.bound = self.prop.tape_stores([U0] + tape.stores[1:])
        stores = tape.bound
        stores[0] = U0
        norms = np.zeros(max(tape.n_norms, 1))
        if tape.parts is None:
            t0 = time.perf_counter()
            self.prop.run_tape(stores, tape.rows, tape.hs, norms)
            self.solver._step_seconds += time.perf_counter() - t0
        else:  # row segments and the halo messages between them, in the captured order
            arrays = [U0] + tape.stores[1:]
            self._run_parts(tape.parts, norms,
                            lambda action: [None if i < 0 else arrays[i] for i in action.stores],
                            lambda part: self.prop.run_tape(stores, part, tape.hs, norms))
        tape.replays += 1
        if isinstance(tape.result, list):
            return [_replayed(r, norms) for r in tape.result]
        return _replayed(tape.result, norms)

    # CUDA graphs (a GPU propagator's ``begin_graph`` / ``end_graph``): stream capture records
    # the cycle's launches without running them; on several ranks each halo message ends the
    # graph being captured and is recorded as an action (not run: its data does not exist yet);
    # a launch runs graph, message, graph, ... in the captured order
    def begin_graph(self):
        """Start capturing a cycle as graphs (:meth:`end_graph`); an error starting the capture
        leaves the engine as it was."""
        self.prop.begin_graph()
        self._grec = _GraphRecorder()
        self._deferred = []  # (none are left by a cycle; an earlier error's are stale)

    def end_graph(self, result):
        """The :class:`GraphCycle` captured since :meth:`begin_graph`; ``result`` is the captured
        run's return value."""
        rec, self._grec = self._grec, None
        graph = self.prop.end_graph()
        if not rec.open_empty:  # (after a last flush the open graph captured nothing)
            rec.parts.append(graph)
        return GraphCycle(rec.parts, rec.n_norms, result)

    def abandon_graph(self):
        """Leave a capture that failed (the failure is the news: errors ending it are not)."""
        self._deferred = []
        if self._grec is not None:
            self._grec = None
            try:
                self.prop.end_graph()
            except Exception:  # noqa: BLE001
                pass

    def launch_graph(self, cycle):
        """Run a :class:`GraphCycle`: its graphs and, between them, its halo messages; returns
        the cycle's value (a residual norm as a float)."""
        norms = [0.0] * cycle.n_norms
        self._run_parts(cycle.parts, norms, lambda action: action.stores,
                        lambda graph: graph.launch())
        cycle.launches += 1
        result = cycle.result
        return result.value(norms) if isinstance(result, _GraphNorm) else result

    def _run_parts(self, parts, norms, stores_of, run):
        """A captured cycle's ``parts`` in order: each :class:`_Action` (a halo message) on
        ``stores_of(action)``, its value into ``norms`` where it has a slot; ``run(part)`` for
        the others (a tape's row segment, a graph), timed as steps."""
        pending = {}  # (the cycle's own requests: posted and completed within it)
        for part in parts:
            if isinstance(part, _Action):
                value = part.fn(stores_of(part), pending, *part.args)
                if part.norm >= 0:
                    norms[part.norm] = value
            else:
                t0 = time.perf_counter()
                run(part)
                self.solver._step_seconds += time.perf_counter() - t0

    def _uncaptured(self, what):
        if self._rec is not None:
            self._rec.broken = what

    def store(self, level, template):
        if not level.m:
            return None
        return self.xp.zeros((level.m + 2,) + tuple(template.shape), dtype=template.dtype)

    def states_view(self, level, U, n):
        return StackedStates(U, level.a, level.b, n)

    def set(self, U, slot, value, copy):
        self._uncaptured("a state set from outside the cycle's steps")
        U[slot] = value

    def clear_ghost(self, U):
        """Nothing: the ghost slot holds a copy."""

    def inject(self, Uf, V, fine0, stride, coarse0, k, also=None):
        if k:
            V[coarse0:coarse0 + k] = Uf[fine0:fine0 + (k - 1) * stride + 1:stride]
            if also is not None:
                also[coarse0:coarse0 + k] = V[coarse0:coarse0 + k]
            if self._rec is not None:
                r = self._rec
                r.row(T.INJECT, U=r.store(Uf), R=r.store(V), G=r.store(also), FIRST=fine0,
                      N=stride, OUT=coarse0, LEN=k)

    def coarse_stores(self, lev, template):
        """(V, G, U) of coarse level ``lev``: allocated once, reused by every cycle."""
        key = ("coarse", lev, template.shape, template.dtype.str)
        stores = self._scratch.get(key)
        if stores is None:
            stores = self._scratch[key] = super().coarse_stores(lev, template)
        return stores

    def residual_store(self, lev, template):
        key = ("residual", lev, template.shape, template.dtype.str)
        store = self._scratch.get(key)
        if store is None:
            store = self._scratch[key] = super().residual_store(lev, template)
        return store

    def copy_store(self, src, dst):
        if src is not None:
            dst[...] = src
            if self._rec is not None:
                self._rec.row(T.COPY, U=self._rec.store(src), R=self._rec.store(dst))

    def _add_into(self, U, slot, e):
        U[slot] += e

    # spatial transfers of every C-point of a call at once, for a propagator whose
    # restrict / interpolate act on the trailing axes of any batch (``batched_transfers``):
    # (k, B, C, ...) states go through as one (k B, C, ...) batch, the same numbers per state
    def _batched_transfers(self, k):
        return k > 1 and bool(getattr(self.prop, "batched_transfers", False))

    def _transfer_many(self, fn, X, lev):
        k, B = X.shape[:2]
        Y = fn(self.xp.ascontiguousarray(X).reshape((k * B,) + X.shape[2:]), lev)
        return Y.reshape((k, B) + Y.shape[1:])

    def inject_restricted(self, Uf, V, fine0, stride, coarse0, k, lev):
        if not self._batched_transfers(k):
            return super().inject_restricted(Uf, V, fine0, stride, coarse0, k, lev)
        self._uncaptured("a spatial transfer")
        Y = self._transfer_many(self.prop.restrict,
                                Uf[fine0:fine0 + (k - 1) * stride + 1:stride], lev)
        self.solver._restricted(Y[0], lev)
        V[coarse0:coarse0 + k] = Y

    def restrict_slots(self, Rf, Gc, slots, lev):
        slots = list(slots)
        if not (self._batched_transfers(len(slots))
                and slots == list(range(slots[0], slots[0] + len(slots)))):
            return super().restrict_slots(Rf, Gc, slots, lev)
        self._uncaptured("a spatial transfer")
        a, b = slots[0], slots[0] + len(slots)
        Y = self._transfer_many(self.prop.restrict, Rf[a:b], lev)
        self.solver._restricted(Y[0], lev)
        Gc[a:b] = Y

    def correct_interpolated(self, Uf, Uc, V, fine0, stride, coarse0, k, lev):
        if not self._batched_transfers(k):
            return super().correct_interpolated(Uf, Uc, V, fine0, stride, coarse0, k, lev)
        s = self.solver
        E = self._transfer_many(s.prop.interpolate,
                                Uc[coarse0:coarse0 + k] - V[coarse0:coarse0 + k], lev)
        s._check_state(E[0], lambda: f"{type(s.prop).__name__}.interpolate(e, level={lev}) "
                                     "returned", lev)
        Uf[fine0:fine0 + (k - 1) * stride + 1:stride] += E

    def correct(self, Uf, Uc, V, fine0, stride, coarse0, k):
        if not k:
            return
        t0 = time.perf_counter()
        ops = self.solver.ops
        fn = getattr(ops, "correct_strided", None)
        if fn is None:  # an ops object of the user's: the generic strided form
            fn = GenericOps().correct_strided
        fn(Uf, fine0, stride, Uc, V, coarse0, k, self._tmp(Uc, k))
        self.solver._vector_seconds += time.perf_counter() - t0
        if self._rec is not None:
            r = self._rec
            r.row(T.CORRECT, U=r.store(Uf), G=r.store(Uc), R=r.store(V), FIRST=fine0, N=stride,
                  OUT=coarse0, LEN=k)

    def _tmp(self, like, k):
        """k states of scratch for a correction on the coarse store ``like``: one buffer per
        store shape (k <= its slots), so never reallocated: a captured graph reads it at a
        fixed address."""
        key = ("tmp", like.shape, like.dtype.str)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = self.xp.empty(like.shape, dtype=like.dtype)
        if k > buf.shape[0]:
            raise ValueError(f"a correction of {k} states on a store of {buf.shape[0]} slots")
        return buf[:k]

    def _origin(self, lev):
        L = self.solver.levels[lev]
        return (self._a(lev) - 1) * L.s, L.s

    def gather_level(self, lev, U, G, counts, displs, n):
        self._uncaptured("a collective")
        L = self.solver.levels[lev]
        t = self.solver._templates[lev]
        key = ("full", lev, t.shape, t.dtype.str)
        bufs = self._scratch.get(key)
        if bufs is None:
            full = type(L)(lev, n, L.s, _Whole(n), 0)
            bufs = self._scratch[key] = (self.store(full, t), self.store(full, t),
                                         self.xp.zeros((L.m,) + tuple(t.shape), t.dtype))
        FU, FG, rows = bufs
        if L.m:
            if G is not None:
                rows[...] = G[1:L.m + 1]
            if L.a == 0:
                rows[0] = U[1]
        self._host(self._allgathered, [rows, FG], (counts, displs, n))
        FU[1] = FG[1]
        return FU, (None if G is None else FG)

    def _allgathered(self, S, pending, counts, displs, n):
        self.solver.redundant_solves += 1  # (here: once per solve, captured or not)
        self.solver.halo.allgather_rows(S[0], S[1][1:n + 2], counts, displs)

    def advance(self, lev, U, G, chains, plan=None, key=None):
        if not chains:
            return
        a = self._a(lev)
        rows = plan.array(key, lambda: [[f - a + 1, n] for f, n in chains])
        origin, stride = self._origin(lev)
        advance = self.prop.advance
        if plan is not None and plan.final and self._rec is None:  # (a tape keeps no sigma')
            advance = getattr(self.prop, "advance_final", advance)
        t0 = time.perf_counter()
        advance(U, G, rows, origin, stride, lev)
        self.solver._step_seconds += time.perf_counter() - t0
        if self._rec is not None:
            self._rec.steps(T.CHAIN, U, G, None, rows[:, 0], rows[:, 1], [-1] * len(rows),
                            origin, stride, lev, PLAIN)

    def points(self, lev, U, G, R, js, outs, mode, plan=None, key=None):
        if not js:
            return 0.0
        a = self._a(lev)
        slots = plan.array(key + ("in",), lambda: [j - a + 1 for j in js])
        out_slots = plan.array(key + ("out",), lambda: outs)
        origin, stride = self._origin(lev)
        t0 = time.perf_counter()
        r2 = self.prop.points(U, G, R, slots, out_slots, origin, stride, lev, mode)
        if mode == RESIDUAL and not isinstance(r2, float):
            # a device scalar the next residual call overwrites: into this level's own buffer
            key = ("norm", lev) + key  # per call site: _apply adds the head's to the rest's
            buf = self._scratch.get(key)
            if buf is None:
                buf = self._scratch[key] = r2.copy()
            else:
                buf[...] = r2
            r2 = buf if self._grec is None else _GraphNorm((buf,))
        self.solver._step_seconds += time.perf_counter() - t0
        if self._rec is not None:
            norm = self._rec.steps(T.POINT, U, G, R, slots, [1] * len(slots), out_slots, origin,
                                   stride, lev, mode)
            if norm >= 0:
                r2 = _Norm(r2, (norm,))
        return r2

    # halo messages: while a cycle is captured, each is a host action of the tape (run now,
    # replayed between the row segments around it); the rows that make a boundary value are
    # steps into the level's send buffer, a store of the tape
    def _host(self, fn, stores, args, norm=False, early=False):
        """``fn(stores, pending, *args)`` now (recording suspended), and while capturing an
        :class:`_Action` of the tape (its value a new norm if ``norm``; ``early``: an action
        that touches no store, recorded before the current row segment). While capturing
        graphs it only records the action, ending the graph being captured (not ``early``)."""
        if self._deferred and not early:  # the deferred send waits first, in one action
            fn, args = self._after_sends, (tuple(self._deferred), fn) + tuple(args)
            self._deferred = []
        grec = self._grec
        if grec is not None:  # recorded only: it runs at every launch, between the graphs
            grec.open_empty = False
            index = -1
            if norm:
                index, grec.n_norms = grec.n_norms, grec.n_norms + 1
            action = _Action(fn, list(stores), args, index)
            if early:  # touches no store: it may go before the open graph
                grec.parts.append(action)
            else:  # ends the open graph; the next one starts after it
                grec.parts += [self.prop.end_graph(), action]
                self.prop.begin_graph()
            return _GraphNorm((index,)) if norm else None
        rec, self._rec = self._rec, None
        try:
            value = fn(stores, self._pending, *args)
        finally:
            self._rec = rec
        if rec is not None:
            index = rec.norm() if norm else -1
            action = _Action(fn, [rec.store(a) for a in stores], args, index)
            if early:
                rec.before_segment(action)
            else:
                rec.cut(action)
            if norm:
                value = _Norm(value, (index,))
        return value

    def _token(self):
        """The key of a new halo request in the pending table (the tape's own while capturing:
        the same keys at every replay)."""
        if self._rec is not None:
            self._rec.tokens += 1
            return ("tape", self._rec.tokens)
        if self._grec is not None:
            self._grec.tokens += 1
            return ("graph", self._grec.tokens)
        self._requests += 1
        return self._requests

    def _irecv(self, S, pending, token, lev, source, tag_):
        s = self.solver
        pending[token] = s.halo.irecv(s._templates[lev], source, tag_)

    def _isend(self, S, pending, token, slot, dest, tag_):
        pending[token] = self.solver.halo.isend(S[0][slot], dest, tag_)

    def _ghost(self, S, pending, token):
        S[0][0] = self.solver.halo.wait(pending.pop(token))

    def _combined(self, S, pending, token, lev, mode, out):
        msg = self.solver.halo.wait(pending.pop(token))
        return self.combine_message(lev, S[0], S[1], S[2], msg, mode, out)

    def _waited(self, S, pending, token):
        self.solver.halo.wait(pending.pop(token))

    def _after_sends(self, S, pending, tokens, fn, *args):
        """The deferred sends ``tokens`` waited for, then ``fn(S, pending, *args)``."""
        for token in tokens:
            self.solver.halo.wait(pending.pop(token))
        return fn(S, pending, *args)

    def post_recv(self, lev, source, tag_):
        token = self._token()
        self._host(self._irecv, [], (token, lev, source, tag_), early=True)
        return token

    def complete_recv(self, token):
        self._uncaptured("a message without overlap")
        self._pending[token] = (_Done(), self.solver.halo.wait(self._pending[token]),
                                time.perf_counter())
        return token

    def send_boundary(self, lev, U, plan, dest, tag_):
        L = self.solver.levels[lev]
        store = self._send_buffer(lev, U)
        if self.solver.pull:  # the last owned state, copied (its slot is written next)
            self.inject(U, store, L.m, 1, 0, 1)
        else:  # the step out of b-1 into the spare last slot's place
            self.points(lev, U, None, store, [L.b], [0], PLAIN, plan, ("boundary",))
        token = self._token()
        self._host(self._isend, [store], (token, 0, dest, tag_))
        return token

    def recv_ghost(self, token, U):
        self._host(self._ghost, [U], (token,))

    def recv_combine(self, token, lev, U, G, R, mode, out):
        r2 = self._host(self._combined, [U, G, R], (token, lev, mode, out),
                        norm=mode == RESIDUAL)
        return r2 if mode == RESIDUAL else 0.0

    def wait_send(self, token):
        """Waited for at the next host action: the send's buffer is not written before (the
        level's next send uses its other buffer), and a captured cycle is cut once per message,
        not twice. Without ``overlap`` (the baseline that waits first) now."""
        if self.solver.overlap:
            self._deferred.append(token)
        else:
            self._host(self._waited, [], (token,))

    def flush_sends(self, last=False):
        """Complete the deferred sends (one host action): at the end of every cycle and solve,
        so that no request outlives the cycle that started it. ``last``: the cycle being
        captured as graphs ends here (no device work follows: no graph after the action)."""
        if self._deferred:
            tokens, self._deferred = tuple(self._deferred), []
            self._host(self._after_sends, [], (tokens, _nothing))
            if last and self._grec is not None:
                self._grec.open_empty = True

    def host_call(self, fn, stores):
        if self._grec is not None:  # captured as it runs: its device work goes in the graphs,
            return fn(stores)  # the messages it sends through this engine between them
        return self._host(lambda S, pending: fn(S), stores, ())

    def _send_buffer(self, lev, U):
        """Level ``lev``'s next send buffer (1, *state): its two in turn, made together (no
        allocation while a cycle is captured as graphs)."""
        turn = self._send_turn[lev] = 1 - self._send_turn.get(lev, 1)  # 0, 1, 0, ...
        key = ("send", lev, U.shape[1:], U.dtype.str)
        pair = self._scratch.get(key)
        if pair is None:
            pair = self._scratch[key] = tuple(
                self.xp.empty((1,) + U.shape[1:], dtype=U.dtype) for _ in range(2))
        return pair[turn]

    def combine_message(self, lev, U, G, R, msg, mode, out):
        t0 = time.perf_counter()
        r2 = 0.0
        r = R[out]
        if mode == RESIDUAL:
            r[...] = msg
            r -= U[1]
            if G is not None:
                r += G[1]
            r2 = self.solver.ops.norm2(r)
        elif mode == FAS:
            r += U[1]
            r -= msg
        else:
            r[...] = msg
            if G is not None:
                r += G[1]
        self.solver._vector_seconds += time.perf_counter() - t0
        return r2
