"""Propagators: a model's forward and adjoint propagation as the time steppers MGRIT solves.

:class:`ForwardPropagator` steps u_{n+1} = u_n + h F(u_n; theta_n) (coarse levels: the step of
layer ``start`` with step size (stop - start) h); :class:`AdjointPropagator` steps the adjoint
backward in layer index with the state vjp at the stored forward states. Both implement the
generic ``step`` and the stacked protocol (docs/design.md, "Propagator protocol");
:class:`CoarseReplica` steps a redundant coarsest level; the ``Spatial*`` propagators change the
state's grid between levels.
"""
import numpy as np

from .backend import grid_transfer
from .backend.blas_threads import solve_blas_context
from .blocks import ConvStep, DenseStep
from .blocks.composed import StepContext



class ForwardPropagator:
    """The forward residual steps of a model as an MGRIT propagator.

    ``step(u, start, stop, level)`` applies layer ``start`` (injection of the parameters of the
    layer at the coarse point) with step size ``(stop - start) h``.
    """

    fresh_outputs = True  # every step returns a new array

    def __init__(self, model, bk, ctx=None):
        self.kind, self.bk = model.step, bk
        self.ctx = StepContext(buffers=model.group_buffers()) if ctx is None else ctx
        self.P = steps = model.step_params()
        self.W, self.b = steps.get("weight"), steps.get("bias")
        self.h, self.dtype = model.t_final / model.n_layers, model.dtype
        fused = self.kind.fused
        self.batched = fused and bool(getattr(bk, "batched_relaxation", False))
        self.fused_rhs = True  # step_batch adds the FAS rhs in the kernel's epilogue
        # recurrent and composed dense kinds: layer-indexed stacked kernels of their own
        self._layered = (not fused and callable(getattr(self.kind, "chains_forward_layers", None))
                         and self.kind.can_stack(bk, self.ctx))
        _set_engine_flags(self, fused, bk)
        self.replicas = {}
        # {layer n: linearisation cache} of the level-0 steps out of n while a dict (composed
        # kinds: LayerParallel keeps the final F-relaxation's instead of evaluating them again)
        self.kept = None
        # (arrays, lo, done) while set (see can_keep_derivs): the final sweep's chains write the
        # linearisation of layer n into row n - lo of the arrays and flag done[n - lo]
        self.final_derivs = None

    def solve_context(self):
        """What a solve runs in: one BLAS thread while Numba's threads run the chains of a
        stacked dense or conv solve (:func:`mgnn.backend.blas_threads.solve_blas_context`)."""
        stacked_blas = self.stacked and isinstance(self.kind, (DenseStep, ConvStep))
        return solve_blas_context(self.bk, stacked_blas)

    def begin_graph(self):
        """Capture the backend's launches that follow into a graph (a GPU backend)."""
        self.bk.begin_capture()

    def end_graph(self):
        """The graph captured since :meth:`begin_graph` (``launch()`` replays it)."""
        return self.bk.end_capture()

    def graph_key(self):
        """The addresses a captured graph reads the layers from, and the backend's scratch
        generation (a change recaptures)."""
        return _addresses(self.W, self.b) + (getattr(self.bk, "buffer_generation", 0),)

    def tape_layers(self, origin, stride, level):
        """(layer0, layer step, h) of the stacked kernels for a store with this origin and
        stride (what :meth:`advance` passes them), for a captured cycle."""
        return origin - stride, stride, self.dtype.type(stride * self.h)

    def tape_stores(self, stores):
        """A captured cycle's stores in the backend's form."""
        return self.bk.stores_list(stores)

    def run_tape(self, stores, rows, hs, norms):
        """Replay a captured cycle (:mod:`mgnn.backend.tape`) with the current parameters."""
        if self._layered:  # composed and recurrent kinds: kernels of their own
            return self.kind.run_tape_layers(self.P, stores, rows, hs, norms, self.bk, self.ctx)
        self.kind.run_tape(self.W, self.b, 0, stores, rows, hs, norms, False, self.bk)

    def tape_key(self):
        """What a captured cycle's layer indices were checked against (a change recaptures)."""
        if self._layered:
            return _param_shapes(self.P)
        return self.W.shape, self.b.shape

    def advance(self, U, G, chains, origin, stride, level):
        """Stacked relaxation (:class:`mgnn.mgrit.engines.StackedEngine`): slot i is fine index
        origin + i stride; the step into it applies layer origin + (i - 1) stride."""
        h = self.dtype.type(stride * self.h)
        if self._stepped:
            return _stepped_advance(self, U, G, chains, origin, stride, level)
        if self._layered:
            return self.kind.chains_forward_layers(self.P, U, G, chains, origin - stride,
                                                   stride, h, self.bk, self.ctx)
        self.kind.chains_forward(self.W, self.b, U, G, chains, origin - stride, stride, h, self.bk)

    def can_keep_derivs(self):
        """Whether :meth:`advance_final` can keep the linearisation (:attr:`final_derivs`): a
        fused kind (sigma') or a recurrent one (gate caches) on stacked kernels of a backend
        that has the kernels for it."""
        return (self.stacked and not self._stepped and (self._layered or self.kind.fused)
                and self.kind.can_keep_derivs(self.bk))

    def advance_final(self, U, G, chains, origin, stride, level):
        """:meth:`advance` of the solve's final relaxation: with :attr:`final_derivs` = (the
        kind's arrays, first layer, int8 flags) set, level 0 and no right-hand side, the same
        states, and the linearisation of every layer stepped kept (fused: sigma' into D,
        recurrent: the caches and outputs of :meth:`RecurrentStep.kept_arrays`)."""
        if self.final_derivs is None or level != 0 or G is not None:
            return self.advance(U, G, chains, origin, stride, level)
        kept, lo, done = self.final_derivs
        h = self.dtype.type(stride * self.h)
        if self._layered:
            self.kind.chains_forward_layers_keep(self.P, U, chains, origin - stride, stride, h,
                                                 kept, lo, done, self.bk, self.ctx)
        else:
            self.kind.chains_forward_derivs(self.W, self.b, U, chains, origin - stride, stride,
                                            h, kept[0], lo, done, self.bk)

    def points(self, U, G, R, slots, out_slots, origin, stride, level, mode):
        """Stacked residual / FAS / plain steps (see :meth:`advance`)."""
        h = self.dtype.type(stride * self.h)
        if self._stepped:
            return _stepped_points(self, U, G, R, slots, out_slots, origin, stride, level, mode)
        if self._layered:
            return self.kind.points_forward_layers(self.P, U, G, R, slots, out_slots,
                                                   origin - stride, stride, h, mode, self.bk,
                                                   self.ctx)
        return self.kind.points_forward(self.W, self.b, U, G, R, slots, out_slots, origin - stride,
                                        stride, h, mode, self.bk)

    def coarse_replica(self, level):
        """The :class:`CoarseReplica` of ``level`` set by :meth:`LayerParallel` for this solve
        (None: the level is solved as a chain across ranks)."""
        return self.replicas.get(level)

    def step_batch(self, us, starts, stops, level, rhs=None):
        """[step(us[p], starts[p], stops[p], level) (+ rhs[p])] in one batched kernel call (one
        level: every stop - start is the same); the rhs is added in the kernel's epilogue."""
        h = self.dtype.type((stops[0] - starts[0]) * self.h)
        return self.kind.forward_batched(self.W, self.b, us, starts, h, self.bk, rhs)

    def step(self, u, start, stop, level):
        """State at fine index ``stop`` from ``u`` at ``start``: u + (stop-start) h F(u; theta_start)."""
        h = self.dtype.type((stop - start) * self.h)
        if self.kept is not None and level == 0:  # the same arithmetic, its cache kept
            out, self.kept[start] = self.kind.forward_linearize(self.P, start, u, h, self.bk,
                                                                self.ctx)
            return out
        return self.kind.forward_layer(self.P, start, u, h, self.bk, self.ctx)


class AdjointPropagator:
    """The adjoint recursion lam_n = lam_{n+1} + h J_n^T lam_{n+1} as a forward-in-index propagator.

    Reversed index m stands for forward index N - m. ``step(lam, start, stop, level)`` is the state
    vjp of the (coarse) forward step out of n = N - stop with step size (stop - start) h, at the
    stored forward state u_n, with sigma'(z_n) ``derivs[n]`` (the same on every level: z_n does not
    depend on the step size). For composed and recurrent kinds ``derivs[n]`` is step n's
    linearisation cache; recurrent kinds on a host backend run the stacked engine on a
    :class:`mgnn.blocks.recurrent.StackedLinearization` (built from ``states`` when ``derivs``
    is a list or dict of single-state caches).

    It is a *pull* propagator: the step into reversed index m+s needs layer N-m-s and the state
    u_{N-m-s}, which live on the rank owning forward index N-m-s = the rank owning reversed point
    m+s under the mirrored partition, so across a rank boundary the adjoint state is sent, not
    the parameters.
    """

    pull = True
    fresh_outputs = True

    def __init__(self, model, states, derivs, bk, ctx=None):
        self.kind, self.bk = model.step, bk
        self.ctx = StepContext(buffers=model.group_buffers()) if ctx is None else ctx
        self.P = steps = model.step_params()
        self.W, self.b = steps.get("weight"), steps.get("bias")
        self.N, self.h, self.dtype = model.n_layers, model.t_final / model.n_layers, model.dtype
        self.U, self.D = states, derivs  # D[n]: linearisation cache of layer n (or None)
        self._built = None  # a StackedLinearization built from list caches (_linearization)
        fused = self.kind.fused
        self.batched = fused and bool(getattr(bk, "batched_relaxation", False))
        self.fused_rhs = True
        # recurrent and composed dense kinds: stacked adjoint kernels of their own, on a
        # stacked linearisation D (StackedLinearization, ComposedLinearization)
        self._layered = (not fused and callable(getattr(self.kind, "chains_adjoint_layers", None))
                         and self.kind.can_stack_adjoint(bk, self.ctx))
        _set_engine_flags(self, fused, bk)
        self.derivs, self.d0 = None, 0  # sigma' of layers d0, d0 + 1, ... as one array
        self.replicas = {}

    coarse_replica = ForwardPropagator.coarse_replica
    tape_stores, solve_context = ForwardPropagator.tape_stores, ForwardPropagator.solve_context
    begin_graph, end_graph = ForwardPropagator.begin_graph, ForwardPropagator.end_graph

    def graph_key(self):
        D, d0 = self._stacked_derivs()
        return _addresses(self.W, D) + (d0, getattr(self.bk, "buffer_generation", 0))

    def tape_layers(self, origin, stride, level):
        """(layer0, layer step, h) as :meth:`advance` passes them, for a captured cycle."""
        return self.N - origin, -stride, self.dtype.type(stride * self.h)

    def run_tape(self, stores, rows, hs, norms):
        """Replay a captured cycle with the current sigma' (:meth:`reset`; composed kinds:
        their linearisation)."""
        if self._layered:
            return self.kind.run_tape_adjoint_layers(self.P, stores, rows, hs, norms,
                                                     self._linearization(), self.bk, self.ctx)
        D, d0 = self._stacked_derivs()
        self.kind.run_tape(self.W, D, d0, stores, rows, hs, norms, True, self.bk)

    def tape_key(self):
        if self._layered:  # (a replay reads the linearisation unchecked: its range in the key)
            lin = self._linearization()
            rows = lin.D.shape[0] if hasattr(lin, "D") else lin.arrays[1].shape[0]
            return _param_shapes(self.P) + ((lin.d0, lin.u_off, rows, len(lin.U)),)
        D, d0 = self._stacked_derivs()
        return self.W.shape, D.shape, d0

    def reset(self, states, derivs):
        """The forward states and linearisation caches of a new training step (a stacked
        sigma' array, :attr:`derivs`, is rebuilt from them unless set again after this)."""
        self.U, self.D = states, derivs
        self._built = None  # a linearisation built from the old states (_linearization)
        self.derivs, self.d0 = None, 0

    def advance(self, L, G, chains, origin, stride, level):
        """Stacked relaxation: slot i is reversed index origin + i stride; the step into it is
        the vjp of layer N - origin - i stride with sigma' from :attr:`derivs`."""
        h = self.dtype.type(stride * self.h)
        if self._stepped:
            return _stepped_advance(self, L, G, chains, origin, stride, level)
        if self._layered:
            return self.kind.chains_adjoint_layers(self.P, L, G, chains, self.N - origin,
                                                   -stride, h, self._linearization(), self.bk,
                                                   self.ctx)
        self.kind.chains_adjoint(self.W, *self._stacked_derivs(), L, G, chains, self.N - origin,
                                 -stride, h, self.bk)

    def points(self, L, G, R, slots, out_slots, origin, stride, level, mode):
        """Stacked residual / FAS / plain adjoint steps (see :meth:`advance`)."""
        h = self.dtype.type(stride * self.h)
        if self._stepped:
            return _stepped_points(self, L, G, R, slots, out_slots, origin, stride, level, mode)
        if self._layered:
            return self.kind.points_adjoint_layers(self.P, L, G, R, slots, out_slots,
                                                   self.N - origin, -stride, h, mode,
                                                   self._linearization(), self.bk, self.ctx)
        return self.kind.points_adjoint(self.W, *self._stacked_derivs(), L, G, R, slots,
                                        out_slots, self.N - origin, -stride, h, mode, self.bk)

    def _linearization(self):
        """The recurrent kinds' stacked linearisation: :meth:`reset`'s ``derivs`` if it is one,
        else built once (until :meth:`reset`) at the forward states ``states`` (a list
        or a {step: state} dict of consecutive steps: the single-state protocol's)."""
        if hasattr(self.D, "u_off"):
            return self.D
        if self._built is None:
            U = self.U
            steps = (sorted(U) if isinstance(U, dict) else
                     [n for n in range(min(len(U), self.N)) if U[n] is not None])
            if not steps or steps != list(range(steps[0], steps[0] + len(steps))):
                raise ValueError("the stacked recurrent adjoint linearises at the forward states "
                                 f"of consecutive steps; got states of steps {steps}")
            Uf = np.stack([U[n] for n in steps])
            self._built = self.kind.linearize_stacked(
                self.P, Uf, 0, len(steps), steps[0], self.bk, self.ctx,
                lambda name, shape, dt: np.empty(shape, dt))
        return self._built

    def _stacked_derivs(self):
        """(sigma' array, first layer): :attr:`derivs` if set, else built once from ``derivs``
        of the constructor (an (N, ...) array, or a list recomputed where None)."""
        if self.derivs is None:
            D = self.D
            if not hasattr(D, "shape"):
                D = self.bk.xp.stack([
                    d if d is not None else self.kind.deriv(self.W[n], self.b[n], self.U[n],
                                                            self.bk) for n, d in enumerate(D)])
            self.derivs, self.d0 = D, 0
        return self.derivs, self.d0

    def step_batch(self, lams, starts, stops, level, rhs=None):
        """[step(lams[p], starts[p], stops[p], level) (+ rhs[p])] in one batched kernel call."""
        h = self.dtype.type((stops[0] - starts[0]) * self.h)
        layers = [self.N - stop for stop in stops]
        derivs = [self.D[n] for n in layers]
        if any(d is None for d in derivs):  # sigma' not stored: recompute from the states
            derivs = [self.kind.deriv(self.W[n], self.b[n], self.U[n], self.bk) if d is None
                      else d for n, d in zip(layers, derivs)]
        return self.kind.vjp_state_batched(self.W, lams, derivs, layers, h, self.bk, rhs)

    def step(self, lam, start, stop, level):
        """Adjoint at reversed index ``stop`` from ``lam`` at reversed index ``start``."""
        n = self.N - stop
        h = self.dtype.type((stop - start) * self.h)
        cache = self.D[n]
        if cache is None:  # not stored: linearise at the stored state
            cache = self.kind.linearize(self.P, n, self.U[n], self.bk, self.ctx)
        return self.kind.vjp_state_layer(self.P, n, cache, lam, h, self.bk, self.ctx)


class CoarseReplica:
    """Steps every point of one coarse MGRIT level on every rank (the redundant coarsest solve),
    from compact copies of that level's layers: row r holds layer r S (forward) or N - (r + 1) S
    (adjoint; with sigma' of that layer), S the level's fine stride. Same step methods and index
    conventions as :class:`ForwardPropagator` / :class:`AdjointPropagator`.
    """

    fresh_outputs = True

    def __init__(self, prop, W, second, stride, adjoint):
        self.kind, self.bk, self.h, self.dtype = prop.kind, prop.bk, prop.h, prop.dtype
        self.W, self.second, self.S, self.adjoint = W, second, stride, adjoint
        self.stacked = prop.stacked

    def advance(self, U, G, chains, origin, stride, level):
        h = self.dtype.type(stride * self.h)
        row0 = origin // stride - 1  # the step into slot i uses row row0 + i
        if self.adjoint:
            self.kind.chains_adjoint(self.W, self.second, 0, U, G, chains, row0, 1, h, self.bk)
        else:
            self.kind.chains_forward(self.W, self.second, U, G, chains, row0, 1, h, self.bk)

    def step(self, u, start, stop, level):
        h = self.dtype.type((stop - start) * self.h)
        if self.adjoint:
            r = stop // self.S - 1
            return self.kind.vjp_state(self.W[r], None, None, h, u, self.bk, deriv=self.second[r])
        r = start // self.S
        return self.kind.forward(self.W[r], self.second[r], u, h, self.bk)


class _SpatialLevels:
    """Spatial coarsening of a conv model's propagators (mgnn issue 14): level l + 1 of the
    hierarchy holds images coarsened once more than level l when l is in ``levels``.

    States (B, C, *spatial) with 2 or 3 spatial axes; transfers of
    :mod:`mgnn.backend.grid_transfer` (odd sizes vertex-centred, even sizes cell-centred).
    Coarse steps apply the same kernels to the coarse grid. Both propagators keep the stacked
    protocol (one store per level, of that level's shape; the adjoint linearises a coarsened
    level's steps at restricted states), or on a backend without stacked kernels the list
    protocol with batched waves. No captured cycles, and a sequential coarsest level.
    """

    stacked = batched = False
    #: restrict / interpolate act on the trailing axes of any batch: the stacked engine passes
    #: every C-point of a call as one (k B, C, ...) batch
    batched_transfers = True

    def _spatial_setup(self, model, levels, interp, restrict):
        self.spatial_levels, self.interp, self.restrict_kind = tuple(levels), interp, restrict
        # the image size a coarsened level is interpolated back to: from the model, per level
        size, self._fine_size = model.step.state_shape(1)[2:], {}
        for lev in sorted(self.spatial_levels):
            self._fine_size[lev] = size
            size = grid_transfer.coarse_shape(size)

    def coarsenings(self, level):
        """How often a level-``level`` state has been coarsened in space."""
        return sum(1 for lev in self.spatial_levels if lev < level)

    def coarse_replica(self, level):
        return None


class SpatialForwardPropagator(_SpatialLevels, ForwardPropagator):
    """:class:`ForwardPropagator` with ``restrict`` (the grid transfer R) and ``interpolate``
    (P) between the levels in ``spatial_levels`` and the next."""

    def __init__(self, model, bk, ctx=None, spatial_levels=(0,), interp="linear",
                 restrict="full"):
        ForwardPropagator.__init__(self, model, bk, ctx)
        self.captures = self.graphs = False
        self._spatial_setup(model, spatial_levels, interp, restrict)

    def restrict(self, u, level):
        """Level ``level`` -> level + 1: R u where the level is coarsened, else a copy."""
        if level not in self.spatial_levels:
            return u.copy()
        return grid_transfer.restrict(u, self.interp, self.restrict_kind)

    def interpolate(self, e, level):
        """Level ``level`` + 1 -> level: P e where the level is coarsened, else a copy."""
        if level not in self.spatial_levels:
            return e.copy()
        return grid_transfer.interpolate(e, self._fine_size[level], self.interp)


class SpatialAdjointPropagator(_SpatialLevels, AdjointPropagator):
    """:class:`AdjointPropagator` on spatially coarsened levels: the transposes of the forward
    transfers (restriction P^T, interpolation R^T), and on a level coarsened k times the vjp of
    the coarse forward step linearised at R^k u_n (the state the coarse forward level holds at
    convergence), so the adjoint solve is the true adjoint of the coarse-grid operators the
    forward solve uses."""

    def __init__(self, model, states, derivs, bk, ctx=None, spatial_levels=(0,),
                 interp="linear", restrict="full"):
        AdjointPropagator.__init__(self, model, states, derivs, bk, ctx)
        # fused kinds on a stacked backend: the stacked engine on per-level stores (sigma' of a
        # coarsened level at R^k u_n, :meth:`_level_derivs`); else batched waves. Never captured.
        self.stacked = self.kind.fused and _has_stacked(bk)
        self.captures = self.graphs = False
        self._spatial_setup(model, spatial_levels, interp, restrict)
        self._coarse = {}  # (n, k) -> (R^k u_n, its linearisation cache), for this solve
        # k -> [sigma' at R^k u_n of the layers d0 .. d0 + rows - 1, d0, the layers filled]:
        # the arrays stay across training steps (refilled), only the filled sets are reset
        self._coarse_derivs = {}

    def reset(self, states, derivs):
        """New forward states and caches (a new training step)."""
        AdjointPropagator.reset(self, states, derivs)
        self._coarse = {}
        for entry in self._coarse_derivs.values():
            entry[2] = set()

    def _level_derivs(self, k, layers):
        """(sigma' array, d0) for a level coarsened k times: row n - d0 is sigma' of layer n at
        R^k u_n (the cache :meth:`_coarse_cache` keeps), filled once per solve for each of
        ``layers``; rows for the layers of the fine sigma' array (this rank's: d0 .. d0 +
        len - 1), allocated once."""
        entry = self._coarse_derivs.get(k)
        for n in layers:
            if entry is not None and n in entry[2]:
                continue
            _, d = self._coarse_cache(n, k)  # fused kinds: the cache is sigma'
            if entry is None or entry[0].shape[1:] != d.shape or entry[0].dtype != d.dtype:
                fine, d0 = self._stacked_derivs()
                entry = self._coarse_derivs[k] = [
                    self.bk.xp.zeros((fine.shape[0],) + d.shape, d.dtype), d0, set()]
            if not 0 <= n - entry[1] < entry[0].shape[0]:  # a layer beyond those rows: all N
                full = self.bk.xp.zeros((self.N,) + d.shape, d.dtype)
                full[entry[1]:entry[1] + entry[0].shape[0]] = entry[0]
                entry[0], entry[1] = full, 0
            entry[0][n - entry[1]] = d
            entry[2].add(n)
        return entry[0], entry[1]

    def _layers(self, slots, origin, stride):
        """The layers of the steps into ``slots`` (slot i: reversed index origin + i stride)."""
        return {self.N - origin - int(i) * stride for i in slots}

    def advance(self, L, G, chains, origin, stride, level):
        """:meth:`AdjointPropagator.advance`; on a coarsened level with sigma' at R^k u_n."""
        k = self.coarsenings(level)
        if k == 0:
            return AdjointPropagator.advance(self, L, G, chains, origin, stride, level)
        slots = [i for first, n in np.asarray(chains).reshape(-1, 2).tolist()
                 for i in range(first, first + n)]
        if not slots:
            return
        D, d0 = self._level_derivs(k, self._layers(slots, origin, stride))
        self.kind.chains_adjoint(self.W, D, d0, L, G, chains, self.N - origin, -stride,
                                 self.dtype.type(stride * self.h), self.bk)

    def points(self, L, G, R, slots, out_slots, origin, stride, level, mode):
        """:meth:`AdjointPropagator.points`; on a coarsened level with sigma' at R^k u_n."""
        k = self.coarsenings(level)
        if k == 0:
            return AdjointPropagator.points(self, L, G, R, slots, out_slots, origin, stride,
                                            level, mode)
        if not len(slots):
            return 0.0
        D, d0 = self._level_derivs(k, self._layers(np.asarray(slots).tolist(), origin, stride))
        return self.kind.points_adjoint(self.W, D, d0, L, G, R, slots, out_slots,
                                        self.N - origin, -stride,
                                        self.dtype.type(stride * self.h), mode, self.bk)

    def restrict(self, lam, level):
        if level not in self.spatial_levels:
            return lam.copy()
        return grid_transfer.interpolate_transpose(lam, self.interp)

    def interpolate(self, e, level):
        if level not in self.spatial_levels:
            return e.copy()
        return grid_transfer.restrict_transpose(e, self._fine_size[level], self.interp,
                                                self.restrict_kind)

    def _coarse_cache(self, n, k):
        """(R^k u_n, the linearisation of layer n there)."""
        key = (n, k)
        hit = self._coarse.get(key)
        if hit is None:
            u = self.U[n]
            for _ in range(k):
                u = grid_transfer.restrict(u, self.interp, self.restrict_kind)
            hit = self._coarse[key] = (u, self.kind.linearize(self.P, n, u, self.bk, self.ctx))
        return hit

    def step_batch(self, lams, starts, stops, level, rhs=None):
        """:meth:`AdjointPropagator.step_batch`; on a level coarsened k times with sigma' at
        R^k u_n (:meth:`_coarse_cache`)."""
        k = self.coarsenings(level)
        if k == 0:
            return AdjointPropagator.step_batch(self, lams, starts, stops, level, rhs)
        h = self.dtype.type((stops[0] - starts[0]) * self.h)
        layers = [self.N - stop for stop in stops]
        derivs = [self._coarse_cache(n, k)[1] for n in layers]
        return self.kind.vjp_state_batched(self.W, lams, derivs, layers, h, self.bk, rhs)

    def step(self, lam, start, stop, level):
        k = self.coarsenings(level)
        if k == 0:
            return AdjointPropagator.step(self, lam, start, stop, level)
        n = self.N - stop
        h = self.dtype.type((stop - start) * self.h)
        _, cache = self._coarse_cache(n, k)
        return self.kind.vjp_state_layer(self.P, n, cache, lam, h, self.bk, self.ctx)


def _param_shapes(P):
    """The names and shapes of a parameter dict (a captured cycle's key for the kinds whose
    kernels take the parameters by name)."""
    return tuple(sorted((k, tuple(np.shape(v))) for k, v in P.items()))


def _set_engine_flags(prop, fused, bk):
    """The engine attributes of a network propagator, from its kind and backend: ``stacked``
    (fused kinds with the backend's stacked kernels, recurrent kinds with their own
    (``_layered``), other kinds through the stacked protocol over single steps
    (``_stepped``)), ``captures`` and ``graphs`` (not for the stepped protocol)."""
    prop._stepped = not fused and not prop._layered and _has_stacked(bk)
    prop.stacked = (fused and _has_stacked(bk)) or prop._layered or prop._stepped
    kernels = prop.stacked and not prop._stepped
    prop.captures = kernels and prop.kind.can_replay(bk)
    # whether a captured cycle may fold a coarse FAS step into a chain's first step (the
    # fused kinds' tape bodies compute both; the composed kinds' replay runs rows as the
    # engine's calls: mgnn.backend.tape.share_first_steps)
    prop.tape_shares = not prop._layered
    prop.graphs = kernels and bool(getattr(bk, "graphs", False))


def _stepped_advance(prop, U, G, chains, origin, stride, level):
    """The stacked protocol's ``advance`` over ``prop.step`` (composed kinds: one step call per
    state, written into the store): U[i] = step(U[i-1]) (+ G[i]) along every chain."""
    for first, n in np.asarray(chains).reshape(-1, 2).tolist():
        for i in range(first, first + n):
            v = prop.step(U[i - 1], origin + (i - 1) * stride, origin + i * stride, level)
            U[i] = v if G is None else v + G[i]


def _stepped_points(prop, U, G, R, slots, out_slots, origin, stride, level, mode):
    """The stacked protocol's ``points`` over ``prop.step``: mode 0 R[o] = phi - U[i] (+ G[i])
    returning the sum of squared norms (accumulated in float64), 1 R[o] = (R[o] + U[i]) - phi,
    2 R[o] = phi (+ G[i])."""
    total = 0.0
    for i, o in zip(np.asarray(slots).tolist(), np.asarray(out_slots).tolist()):
        phi = prop.step(U[i - 1], origin + (i - 1) * stride, origin + i * stride, level)
        if mode == 0:
            r = phi - U[i]
            if G is not None:
                r += G[i]
            R[o] = r
            total += float((r.astype(np.float64) ** 2).sum())
        elif mode == 1:
            R[o] = (R[o] + U[i]) - phi
        else:
            R[o] = phi if G is None else phi + G[i]
    return total


def _addresses(*arrays):
    """The data addresses (and shapes) of host or device arrays."""
    out = ()
    for a in arrays:
        ptr = getattr(a.data, "ptr", None)  # CuPy; NumPy's .data is a memoryview
        out += (a.__array_interface__["data"][0] if ptr is None else ptr, a.shape)
    return out


def _has_stacked(bk):
    """Whether backend ``bk`` provides the stacked-state kernels (mgnn.backend.STACKED_KERNELS)."""
    from .backend import STACKED_KERNELS
    return bool(getattr(bk, "stacked_states", False)) and all(
        callable(getattr(bk, k, None)) for k in STACKED_KERNELS)


def _has_stacked_grads(bk):
    """Whether ``bk`` has the stacked gradient kernels (mgnn.backend.STACKED_GRAD_KERNELS)."""
    from .backend import STACKED_GRAD_KERNELS
    return _has_stacked(bk) and all(callable(getattr(bk, k, None)) for k in STACKED_GRAD_KERNELS)
