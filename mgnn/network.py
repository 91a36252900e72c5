"""The training front: :class:`LayerParallel` runs a model's training step (forward solve, loss,
adjoint solve, gradients, reductions) serially, by MGRIT, over layer ranks x data replicas.

The models live in :mod:`mgnn.models`, the propagators in :mod:`mgnn.propagators`; their names
are re-exported here, so ``from mgnn.network import dense_resnet, ForwardPropagator`` still works.
"""
import contextlib
import math
import numbers
import time

import numpy as np

from .backend import get_backend, grid_transfer, is_device_array, to_host, vector_ops
from .comm import (Layout, abort_on_error, agree_on_errors, apply_threads, configure_threads,
                   wait_request)
from .comm.halo import tag
from .guard import escalated_options, make_guard
from .mgrit import DivergenceError, MGRITOptions, MGRITSolver, hierarchy
from .mgrit.partition import Partition, balanced_starts, block_work, layer_work
from .blocks.composed import ComposedStep, StepContext
from .params import ParamDict
# re-exported: what mgnn.network held before the models and propagators moved out
from .backend import check_dtype  # noqa: F401
from .backend.blas_threads import solve_blas_context  # noqa: F401
from .blocks import (Conv3dOpening, ConvOpening, ConvStep, DenseClosing,  # noqa: F401
                     DenseOpening, DenseStep, PoolClosing, SoftmaxCrossEntropy)
from .blocks.composed import Activation, Affine, BatchNormAct, Dropout  # noqa: F401
from .blocks.recurrent import LastHiddenClosing, RecurrentStep, ZeroOpening  # noqa: F401
from .models import (Model, conv_resnet, dense_resnet, gru_classifier,  # noqa: F401
                     rnn_classifier)
from .propagators import (AdjointPropagator, CoarseReplica, ForwardPropagator,  # noqa: F401
                          SpatialAdjointPropagator, SpatialForwardPropagator, _has_stacked_grads)
from .propagators import _has_stacked  # noqa: F401



class LayerParallel:
    """Forward and adjoint propagation of a model, with the loss and its gradient; serial or
    distributed over layer ranks x data replicas.

    Parameters
    ----------
    model : Model
        Every rank holds the whole parameter buffer; a rank computes with (and gets gradients
        for) only the layers it owns, the first layer rank also the opening layer, the last layer
        rank the closing layer and the loss.
    fwd, bwd : MGRITOptions or None
        MGRIT options of the forward and the adjoint solve; ``None`` propagates layer after layer
        (exact; across ranks a sequential hand-off). Training usually uses a fixed small cycle
        count (e.g. ``max_iter`` 2 and 1), so gradients are inexact: :attr:`stats` reports both
        residual histories of every call.
    comm : mpi4py communicator or None
        The user's communicator (None: serial). Its size must be layer ranks x ``data_ranks``.
    data_ranks : int
        Data-parallel replicas D; each passes its own shard to :meth:`loss_and_grad` and the
        result is the loss and gradient of the global batch.
    backend : {'numba', 'numpy', 'cuda', 'cuda-emulated'} or a backend object
        (an object with every kernel of ``mgnn.backend.KERNELS``, an array module ``xp`` and
        ``batched_relaxation``, e.g. a :class:`mgnn.backend.cupy_raw.RawBackend` over another
        launcher).
        'cuda' keeps everything on the GPU as CuPy arrays: constructing the LayerParallel moves
        ``model.params`` to the device (build the optimizer on ``model.params.flat`` after it);
        inputs may be CuPy arrays, any array with ``__cuda_array_interface__`` or DLPack (used
        without copies) or NumPy arrays (moved once). The MGRIT relaxation is interval-batched.
    warm_start : bool
        Start the forward solve from the previous call's states (same batch size), as TorchBraid
        and DLMG do.
    overlap : bool
        Overlap halo messages with computation (default; ``False`` is the benchmark baseline).
    coarsest : {'redundant', 'sequential'}
        How a distributed MGRIT solve treats its coarsest level: 'redundant' (default) gathers
        the level's right-hand sides and every rank steps the whole level with compact copies of
        its layers (refreshed from their owners at each solve: two allgathers of their rows),
        'sequential' passes the solution along the ranks as a chain.
    threads : 'auto', int or None
        BLAS and Numba threads of this process (:func:`mgnn.comm.configure_threads`). 'auto'
        (default): ``max(1, cores // ranks sharing them)`` Numba threads (a single process: its
        cores) and one BLAS thread (mgnn's per-layer GEMMs are small: BLAS threads slow them
        down), for every library whose thread variable (``OPENBLAS_NUM_THREADS``,
        ``MKL_NUM_THREADS``, ``OMP_NUM_THREADS``, ``NUMBA_NUM_THREADS``) the environment does not
        set. int: that many threads for BLAS and Numba. None: leave every thread setting alone.
        The limits are process-wide and persist.
    sync_bn : bool
        Batch norm over the global batch: every BN evaluation merges the replicas' statistics
        (one small allgather over the data replicas) so that any layer ranks x replicas run
        equals one process on the whole batch to round-off. False (default): each replica
        normalises with its own shard's statistics (PyTorch DDP's default), and after every
        training step the running statistics of replica 0 are broadcast to the others (as DDP
        broadcasts rank 0's buffers), so evaluation agrees on every rank. A no-op without data
        replicas or without batch norm.
    spatial_levels : tuple of int
        Spatial coarsening (conv models, 2D or 3D): level l in ``spatial_levels`` means MGRIT
        level l + 1 holds images of half the resolution per axis (odd sizes 2m + 1 vertex-
        centred, even sizes 2m cell-centred, both to m: :mod:`mgnn.backend.grid_transfer`), in
        the forward and the adjoint solve; coarse steps apply the same kernels on the coarse
        grid. Default () (none). Every level must be below the options' last level. Both solves
        then run the stacked engine on per-level stores (the adjoint's coarsened levels with
        sigma' at restricted forward states), the coarsest level is sequential, and the layer
        partition weighs each level's steps by its pixel ratio (:attr:`level_cost`).
    interp : {'linear', 'nearest'}
        Interpolation of the spatial coarsening ((bi/tri)linear or nearest).
    restrict : {'full', 'injection'}
        Restriction: 'full' (the transpose of ``interp`` scaled to preserve constants) or
        'injection'. The adjoint solve uses the transposes (P^T to restrict, R^T to correct).
    capture : bool
        Replay fixed MGRIT cycles from a capture (``MGRITSolver(capture=)``: one Numba call per
        cycle on the CPU, or per segment between the overlapping halo messages of several
        layer ranks; a CUDA graph launch on a GPU with one layer rank; no spatial coarsening;
        results identical). Default True.
    guard : {'auto', 'off'}, None or GradientGuard
        The gradient guard (:mod:`mgnn.guard`), active when ``fwd`` or ``bwd`` is given: every
        step it reads the solves' residual histories, and at the first MGRIT step, every
        ``check_every`` steps and when the residuals stop contracting or grow, compares the
        gradient with the exact one of the same batch; above ``tol`` relative error (1.0) or
        below ``min_cosine`` (0.5) it iterates further or propagates exactly for a while (``stats['guard']`` says what and why; one
        :class:`mgnn.guard.GuardWarning` at the first fallback). 'auto' (default): a
        GradientGuard with its defaults. None or 'off': the fixed cycle budget, unwatched.

    Composed steps (batch norm, dropout: :class:`mgnn.blocks.composed.ComposedStep`) run the
    stacked engine through the stacked protocol over single steps (one step call per state, no
    stacked kernels), and their coarsest level is always 'sequential' (the redundant one copies
    the compact fused layers). The model's mode (:meth:`Model.train` /
    :meth:`Model.eval`) decides batch or running statistics and dropout in
    :meth:`loss_and_grad`; :meth:`logits` and :meth:`predict` always use eval mode. A
    train-mode call updates the running statistics once, from the final forward states, and
    counts ``model.train_steps`` (the dropout masks' step counter).

    Attributes
    ----------
    stats : dict
        ``{'forward': {'residuals', 'iterations'}, 'adjoint': {...}, 'timings': {...}}`` of the
        last call, and ``'threads'``: the BLAS and Numba thread counts chosen at construction and
        why (see :func:`mgnn.comm.configure_threads`).
    replica : int
        This rank's data replica 0..D-1 (which shard it reads).
    layout : Layout
    """

    def __init__(self, model, fwd=None, bwd=None, comm=None, backend="numba", warm_start=False,
                 data_ranks=1, overlap=True, threads="auto", coarsest="redundant",
                 sync_bn=False, spatial_levels=(), interp="linear", restrict="full",
                 capture=True, guard="auto"):
        if not isinstance(model, Model):
            raise TypeError(f"model must be an mgnn Model, got {type(model).__name__}")
        for name, opt in (("fwd", fwd), ("bwd", bwd)):
            if opt is not None and not isinstance(opt, MGRITOptions):
                raise TypeError(f"{name} must be MGRITOptions or None, got {type(opt).__name__}")
        if not isinstance(warm_start, bool):
            raise TypeError(f"warm_start must be a bool, got {warm_start!r}")
        if comm is not None and not callable(getattr(comm, "Get_size", None)):
            raise TypeError(f"comm must be an mpi4py communicator or None, got "
                            f"{type(comm).__name__}")
        self.guard = make_guard(guard)
        self.layout = Layout(comm, data_ranks)
        self.model = model
        self.fwd, self.bwd, self.warm_start = fwd, bwd, warm_start
        self.overlap = bool(overlap)
        self.capture = bool(capture)
        self.backend = backend
        bk, error = None, None
        try:  # may fail on some ranks only (a node without a GPU): every rank raises alike
            bk = get_backend(backend) if isinstance(backend, str) else _check_backend(backend)
        except (ValueError, TypeError) as exc:
            error = exc
        agree_on_errors(comm, error)
        self.bk = bk
        self.threads = configure_threads(comm, threads)  # collective; before any kernel runs
        self.xp = getattr(self.bk, "xp", np)
        if self.xp is not np:
            model.params = model.params.to(self.xp)
            model.buffers = model.buffers.to(self.xp)
        N, P = model.n_layers, self.layout.layer_size
        self._serial_opts = MGRITOptions(max_levels=1)
        for opt in (fwd, bwd):  # validates the hierarchy against N before any kernel runs
            if opt is not None:
                hierarchy(N, opt)
                opt.for_dtype(model.dtype)  # a tolerance the dtype cannot resolve: rejected
        if coarsest not in ("redundant", "sequential"):
            raise ValueError(f"coarsest must be 'redundant' or 'sequential', got {coarsest!r}")
        if not isinstance(sync_bn, bool):
            raise TypeError(f"sync_bn must be a bool, got {sync_bn!r}")
        self.spatial = _spatial_options(model, spatial_levels, interp, restrict, fwd, bwd)
        self.coarsest = coarsest if model.step.fused and not self.spatial else "sequential"
        self.sync_bn = sync_bn
        replicas = None
        if sync_bn and self.layout.data_ranks > 1 and len(model.buffers):
            replicas = _ReplicaGather(self.layout.data_comm)
        self.ctx = StepContext(seed=model.dropout_seed, buffers=model.group_buffers(),
                               replicas=replicas)
        #: cost of a step on each MGRIT level in fine-step equivalents (spatial coarsening: the
        #: pixel ratio of the level's images; 1 on every level without it)
        self.level_cost = _level_costs(model, self.spatial, fwd, bwd)
        starts, work_per_block = _balanced_layers(N, P, fwd, bwd, self.coarsest,
                                                  self.level_cost)
        self.partition = Partition(N, starts, tuple(range(P)))
        self.adjoint_partition = self.partition.mirrored()
        #: modelled layer evaluations per training step of each layer rank (balanced)
        self.block_work = list(work_per_block)
        lo, hi = self.partition.fine_range(self.layout.layer_rank)
        self.layers = range(lo, min(hi, N))
        if self.layout.layer_size > 1:  # sequence models project the inputs of these steps only
            self.ctx.steps = (self.layers.start, self.layers.stop)
        self._owned = None  # built on first use (a bool per parameter entry)
        self.stats = {}
        self._previous_states = None
        self._solvers = {}
        # the last forward solve's linearisation caches: {layer: cache} (composed kinds) or
        # ((sigma' rows D,) or (gate caches, outputs), first layer, int8 flags of the rows
        # written) (fused, recurrent kinds)
        self._kept = None
        self._replica_buffers, self._replica_seconds = {}, 0.0
        self._replica_weights = None  # ((stride, rows), device copy) of this step's forward
        self._arrays = {}  # per-shape arrays reused by every step (:meth:`_reused`)
        #: the guard's "iterate further" options (kept alive: solvers are cached by their id)
        self._escalated = (escalated_options(fwd), escalated_options(bwd))
        self._guard_grads = None  # the exact gradient of a guard check
        self._guard_base = None  # the configured options' gradient at a check while escalated

    @property
    def stats(self):
        """Residual histories, iterations and timings of the last call; ``'threads'`` always."""
        return self._stats

    @stats.setter
    def stats(self, value):
        value["threads"] = self.threads
        self._stats = value

    @property
    def replica(self):
        """Index 0..D-1 of this rank's data replica."""
        return self.layout.replica

    @property
    def distributed(self):
        """More than one rank takes part."""
        return self.layout.size > 1

    @property
    def owned(self):
        """Entries this rank owns, as a boolean mask of the flat parameter buffer (see
        :meth:`_rows`); built when first needed, so that a rank that never gathers holds no
        parameter-sized mask."""
        if self._owned is None:
            self._owned = self._owned_mask()
        return self._owned

    def message_path(self):
        """How boundary states and gradient sums reach MPI, in words (for ``--timings``)."""
        if self.layout.size == 1:
            return "single process: no messages"
        if self.xp is np:
            return f"host buffers ({getattr(self.bk, 'name', self.backend)} backend)"
        from .comm import cuda_aware_mpi
        aware, why = cuda_aware_mpi()
        return ("device buffers straight to CUDA-aware MPI" if aware else
                "device buffers staged through pinned host buffers") + f" ({why})"

    def to_device(self, a):
        """``a`` as an array of this backend (NumPy arrays unchanged on the CPU backends; moved
        to the GPU once for 'cuda'): what a training loop does with its data before batching."""
        return a if self.xp is np else self._as_array(a, "array")

    # ----------------------------------------- public: a training step, inference, gathering
    def loss_and_grad(self, x, y, out=None):
        """Mean softmax cross-entropy of the (global) batch and its gradient.

        Parameters
        ----------
        x : ndarray (B, ...) of the model's dtype -- this replica's shard
        y : ndarray (B,) of integers in [0, K)
        out : ParamDict or None
            A gradient buffer to fill and return instead of a new one (e.g. the previous call's
            ``grads``, or ``model.params.zeros_like()`` made after the LayerParallel): a
            training loop that passes the same ``out`` every step allocates no gradient
            buffer. Same names, shapes, dtype and array module as ``model.params``, and not
            ``model.params`` itself.

        Returns
        -------
        loss : float
            Of the global batch (all replicas' samples), on every rank.
        grads : ParamDict
            ``out``, or a new buffer each call; same names and shapes as ``model.params``. In
            a distributed run only the entries of this rank's layers are set (others are
            zero), summed over the replicas. :meth:`gather` assembles every entry on every rank.
        """
        x, y = self._validated(x, y, out)
        lay, m = self.layout, self.model
        self.ctx.training, self.ctx.step = m.training, m.train_steps
        self.ctx.begin(x)
        if lay.size == 1 and self.fwd is None and self.bwd is None:
            result = self._serial_loss_and_grad(x, y, out)
        else:
            # a divergence is seen in the residual summed over every rank: raised on all alike
            with abort_on_error(lay.comm, "mgnn", collective=(DivergenceError,)):
                if self.guard is not None and (self.fwd is not None or self.bwd is not None):
                    result = self._guarded_loss_and_grad(x, y, out)
                else:
                    result = self._general_loss_and_grad(x, y, out)
        if m.training:
            m.train_steps += 1
            if len(m.buffers) and self.ctx.replicas is None and lay.data_ranks > 1:
                # per-replica statistics: every replica continues from replica 0's (as PyTorch
                # DDP broadcasts rank 0's buffers), so evaluation agrees across replicas
                _bcast_staged(lay.data_comm, m.buffers.flat)
        return result

    def logits(self, x):
        """Logits (B, K) of the model's dtype for inputs x (B, ...), by exact forward propagation
        (the network's function, whatever the training solver options); on every layer rank."""
        x, _ = self._validated(x)
        lay = self.layout
        self.ctx.training = False  # evaluation: running statistics, no dropout
        self.ctx.begin(x)
        if lay.layer_size == 1:
            return self._forward(x, store=False)[0]
        with abort_on_error(lay.comm, "mgnn"):
            res, _ = self._distributed_forward(x, self._serial_opts)
            logits = None
            if lay.last:
                logits = self.model.closing.forward(self.model.group("closing"), res.final,
                                                    self.bk)[0]
            return lay.layer_comm.bcast(logits, root=lay.layer_size - 1)

    def predict(self, x):
        """Predicted class indices (B,) int64 for inputs x (B, ...)."""
        return self.xp.argmax(self.logits(x), axis=1)

    def gather(self, grads):
        """Every entry of ``grads`` (a ParamDict from :meth:`loss_and_grad`) on every rank: a new
        ParamDict (the entries of other ranks' layers are summed in from their owners)."""
        out = grads.copy()
        lay = self.layout
        if lay.layer_comm is not None and lay.layer_size > 1:
            out.flat[~self.owned] = 0  # shared weights: every rank holds the sum, count it once
            _allreduce_staged(lay.layer_comm, out.flat)
        return out

    def grad_norm(self, grads):
        """Collective over the layer ranks: the 2-norm of the whole gradient ``grads`` (from
        :meth:`loss_and_grad`; every entry counted once, from its owner), the same float on
        every rank (what gradient clipping needs)."""
        xp, lay = self.xp, self.layout
        sq = float(xp.sum(xp.where(self.owned, grads.flat, 0) ** 2))
        if lay.layer_comm is not None and lay.layer_size > 1:
            sq = lay.layer_comm.allreduce(sq)
        return sq ** 0.5

    def gather_buffers(self):
        """The model's buffers (running statistics) as held by their layers' owners in replica
        0, on every rank: a new 1-D array laid out like ``model.buffers.flat``."""
        buf = self.model.buffers
        xp, lay = self.xp, self.layout
        lo, hi = self.layers.start, self.layers.stop
        out = xp.zeros_like(buf.flat)
        if lay.replica == 0:
            for k in buf:
                out[buf.offsets[k]:buf.offsets[k] + buf[k].size].reshape(buf[k].shape)[lo:hi] \
                    = buf[k][lo:hi]
        if lay.comm is not None and lay.size > 1:
            _allreduce_staged(lay.comm, out)
        return out

    def gather_params(self, flat=None):
        """The model's parameters (or another flat buffer laid out like them, e.g. optimizer
        state) as held by their owners, on every rank: a new 1-D array."""
        src = self.model.params.flat if flat is None else flat
        xp = self.xp
        out = xp.where(self.owned, xp.asarray(src), 0).astype(src.dtype)
        lay = self.layout
        if lay.layer_comm is not None and lay.layer_size > 1:
            _allreduce_staged(lay.layer_comm, out)
        return out


    # ----------------------------------------------------------- the training step, in order
    def _general_loss_and_grad(self, x, y, out=None, opts=None):
        """MGRIT (or distributed) loss and gradient under ``opts`` = (fwd, bwd) (default: this
        object's); on a backend with a workspace
        (:meth:`mgnn.backend.cupy_raw.RawBackend.workspace`) the step's temporaries are reused
        buffers: nothing is allocated after the first step of a shape."""
        ws = getattr(self.bk, "workspace", None)
        fwd, bwd = (self.fwd, self.bwd) if opts is None else opts
        with ws() if callable(ws) else contextlib.nullcontext():
            return self._general_step(x, y, out, fwd, bwd)

    def _general_step(self, x, y, out, fwd, bwd):
        """One training step under MGRIT options ``fwd``/``bwd`` (None: exact propagation), on
        one process or on this rank of a distributed run, read top to bottom: the forward solve
        over the layers, the linearisation of the owned layers at its final states, the loss and
        its seed lambda_N on the last layer rank, the adjoint solve backward in layer index, the
        parameter gradients, then the opening layer's vjp and the reductions."""
        st = _Step(self, x, y, out)
        self._forward_solve(st, fwd)
        self._linearize(st, bwd)
        self._loss_and_seed(st)
        self._adjoint_solve(st, bwd)
        self._parameter_gradients(st)
        self._opening_and_reductions(st)
        return float(st.loss), st.grads

    def _forward_solve(self, st, fwd):
        """MGRIT (or the exact hand-off) from the opening layer's output: st.U[n] for n owned
        (and N on the last rank), st.store the solver's level-0 store (stacked engine)."""
        guess = None
        prev = self._previous_states
        if self.warm_start and prev is not None and prev[1] == st.batch:
            guess = prev[0].__getitem__
        self._replica_seconds, self._replica_weights = 0.0, None
        res, st.d_open = self._distributed_forward(st.x, fwd or self._serial_opts, guess)
        st.add(res)
        if fwd is not None:
            st.stats["forward"] = {"residuals": list(res.residuals),
                                   "iterations": res.iterations, "converged": res.converged}
            if self.warm_start:
                self._previous_states = (res.states, st.batch)
        st.U, st.store = res.states, res.store
        st.kept, self._kept = self._kept, None

    def _linearize(self, st, bwd):
        """The linearisation caches D[n] of the owned layers at the final forward states:
        composed kinds one per layer (committing the BN running statistics), recurrent kinds all
        owned steps in one call, fused kinds sigma' of layer n in row n - lo of st.derivs (read
        straight from the solver's store when stacked: one call, no per-layer Python). What the
        forward solve's final sweep kept (st.kept: every layer it stepped) is not evaluated
        again: only the layers stepping into C-points and a rank's boundary step are."""
        m, bk, N, U, owned = self.model, self.bk, self.model.n_layers, st.U, st.owned
        lo = owned.start
        steps = st.steps
        W, b = steps.get("weight"), steps.get("bias")
        st.stacked = st.store is not None and m.step.fused and _has_stacked_grads(bk)
        t0 = time.perf_counter()
        st.template = U[lo] if len(owned) else U[N]
        st.solver = self._solver("adjoint", bwd or self._serial_opts)
        st.layered = not m.step.fused and st.solver.prop._layered
        kept = st.kept if isinstance(st.kept, tuple) else None  # the final sweep's, if kept
        if st.layered:  # recurrent kinds: every owned step's caches in one call, from the store
            done = None
            if st.store is not None:
                Uf, first = st.store[0], lo - st.store[1] + 1
                if kept is not None and kept[0][0] is m.step.kept_arrays(
                        Uf.shape[1:], len(owned), Uf.dtype, self._reused)[0]:
                    done = kept[2]  # the final sweep's rows kept: only the others computed
            else:  # the forward ran on the list engine: its states stacked once
                Uf, first = self.xp.stack([U[n] for n in owned] or [st.template]), 0
            st.D = m.step.linearize_stacked(steps, Uf, first, len(owned), lo, bk, self.ctx,
                                            self._reused, done)
            if m.step.buffer_shapes():  # batch norm's running statistics (composed kinds)
                self._commit_buffers(owned, st.D)
        elif not m.step.fused:
            st.D = [None] * N
            # the final sweep's (composed kinds: all but the steps into C-points)
            caches = st.kept if isinstance(st.kept, dict) else {}
            for n in owned:
                cache = caches.get(n)
                st.D[n] = m.step.linearize(steps, n, U[n], bk, self.ctx) if cache is None \
                    else cache
            self._commit_buffers(owned, st.D)
        elif st.stacked:
            st.derivs = self._reused("derivs", (len(owned),) + st.template.shape,
                                     st.template.dtype)
            Uf, a_f = st.store  # state n in slot n - a_f + 1
            if kept is not None and kept[0][0] is st.derivs:  # the final sweep's, the rest here
                m.step.deriv_missing(W, b, Uf, lo - a_f + 1, len(owned), lo, st.derivs, kept[2],
                                     bk)
            else:
                m.step.deriv_stacked(W, b, Uf, lo - a_f + 1, len(owned), lo, st.derivs, bk)
            st.D = _Rows(st.derivs, lo)
        else:
            st.derivs = self._reused("derivs", (len(owned),) + st.template.shape,
                                     st.template.dtype)
            st.D = [None] * N
            for k, d in enumerate(m.step.deriv_batched(W, b, [U[n] for n in owned],
                                                       list(owned), bk)):
                st.derivs[k] = d
                st.D[owned[k]] = st.derivs[k]
        st.timings["steps"] += time.perf_counter() - t0

    def _loss_and_seed(self, st):
        """The gradient buffer, and on the last layer rank the closing layer, the loss of this
        shard (weighted by its share of the global batch) and lambda_N = dL/du_N; other ranks
        seed their adjoint solve with zeros. The closing gradients' reduction starts here."""
        m, bk, N = self.model, self.bk, self.model.n_layers
        if st.out is None:
            st.grads = ParamDict.allocate(m.params.shapes(), m.dtype, self.xp)
        else:
            st.grads = self._zero_unowned(st.out)
        st.buckets = _Buckets(self.layout.data_comm, st.grads, self.layout.comm)
        if self.layout.last:
            logits, c_close = m.closing.forward(m.group("closing"), st.U[N], bk)
            loss, g = m.loss.forward_grad(logits, st.y, bk)
            st.loss_part = loss * st.batch / st.total_batch
            g *= m.dtype.type(st.batch / st.total_batch)
            st.lam_N, gc = m.closing.vjp(m.group("closing"), st.U[N], c_close, g, bk)
            for k, v in gc.items():
                st.grads[f"closing.{k}"][...] = v
            st.buckets.start("closing.weight", "closing.bias")
        elif st.stacked:  # the stacked engine copies u0 into its store: a cached zero serves
            st.lam_N = self._reused("zeros", st.template.shape, st.template.dtype)
        else:
            st.lam_N = self.xp.zeros_like(st.template)

    def _adjoint_solve(self, st, bwd):
        """MGRIT (or the exact hand-off) backward in layer index from lambda_N: st.lam[n] is the
        adjoint at forward index n; st.finish completes the message that brings lambda at the
        next rank's first index (needed by the last owned layer only)."""
        solver = st.solver
        solver.prop.reset(st.U, st.D)
        solver.prop.derivs, solver.prop.d0 = st.derivs, st.owned.start
        self._refresh_replica(solver, st.derivs)
        adj = solver.solve(st.lam_N)
        st.add(adj)
        if bwd is not None:
            st.stats["adjoint"] = {"residuals": list(adj.residuals),
                                   "iterations": adj.iterations, "converged": adj.converged}
        st.adj_store = adj.store
        st.lam = _Reversed(adj.states)  # lam[n] = adjoint at forward index n (owned entries)
        # its message overlaps the parameter gradients of all the other layers
        st.finish = self._exchange_adjoint_halo(st.lam, st.timings)

    def _parameter_gradients(self, st):
        """dL/dtheta_n of the owned layers from U and lambda: every layer whose adjoint is here
        (all but the last one unless lambda at index hi is here too), then, after the halo, the
        last one; the steps' reduction starts as soon as they are done."""
        m, bk, N = self.model, self.bk, self.model.n_layers
        owned, lam, D, grads, finish = st.owned, st.lam, st.D, st.grads, st.finish
        lo, hi = owned.start, owned.stop
        steps = st.steps
        gW, gb = grads.get("steps.weight"), grads.get("steps.bias")
        t0 = time.perf_counter()
        n_ready = len(owned) if lam[hi] is not None else max(len(owned) - 1, 0)
        ready, rest = owned[:n_ready], owned[n_ready:]
        if st.layered and st.adj_store is not None:  # cotangents from the store, then the halo's
            L, a_l = st.adj_store
            waited = [0.0]

            def halo_part():  # called after the ready steps' cotangents: the wait overlaps them
                t1 = time.perf_counter()
                finish()
                waited[0] += time.perf_counter() - t1
                return lam[hi][None], 0, 0, len(rest)
            parts = [(L, N - lo - a_l, -1, n_ready)] + ([halo_part] if rest else [])
            m.step.vjp_params_stacked_layers(steps, parts, D, bk, self.ctx,
                                             grads.group(m.step_prefix), self._reused,
                                             h=m.dtype.type(m.h))
            t0 += waited[0]  # the wait is halo time, not step time
            groups = ()
        elif st.stacked and st.adj_store is not None:
            L, a_l = st.adj_store  # lam at forward n + 1 = adjoint point N - n - 1: slot N - n - a_l
            Uf, a_f = st.store
            m.step.vjp_params_stacked(L, N - lo - a_l, -1, st.derivs, Uf, lo - a_f + 1,
                                      n_ready, lo, m.dtype.type(m.h), gW, gb, bk)
            groups = (rest,)
        else:
            groups = (ready, rest)
        G = grads.group(m.step_prefix)
        U = st.U
        for group in groups:
            if group is rest:
                t1 = time.perf_counter()
                finish()
                t0 += time.perf_counter() - t1  # the wait is halo time, not step time
            if len(group) and m.step.fused:
                m.step.vjp_params_batched([U[n] for n in group], m.h,
                                          [lam[n + 1] for n in group], [D[n] for n in group],
                                          list(group), gW, gb, bk)
        if not m.step.fused and groups:  # one call over the owned steps (a GEMM each)
            m.step.vjp_params_steps(steps, owned, U, D, lam, m.dtype.type(m.h), bk, self.ctx, G)
        st.timings["steps"] += time.perf_counter() - t0
        finish()
        names = [f"{m.step_prefix}.{k}" for k in G]
        if m.step.shared:  # every layer rank holds a part of the sum over the steps
            st.buckets.start_all(names)
        else:
            st.buckets.start_rows(names, lo, hi)

    def _opening_and_reductions(self, st):
        """The opening layer's vjp on the first layer rank, then the gradient reductions over
        the replicas and the loss over the layer ranks; st.stats (with the step's timings)
        becomes :attr:`stats`."""
        m, grads, timings = self.model, st.grads, st.timings
        if self.layout.first:
            _, go = m.opening.vjp(m.group("opening"), st.x, st.d_open, st.lam[0], self.bk)
            for k, v in go.items():
                grads[f"opening.{k}"][...] = v
            if go:
                st.buckets.start("opening.weight", "opening.bias")
        t0 = time.perf_counter()
        st.buckets.wait()
        comm = self.layout.comm
        st.loss = st.loss_part if comm is None else comm.allreduce(st.loss_part)
        timings["allreduce"] += time.perf_counter() - t0 + self._replica_seconds
        timings["total"] = time.perf_counter() - st.t_start
        sync = self.ctx.replicas
        if sync is not None:  # inside "steps": the BN statistics' allgathers
            timings["bn_sync"] = sync.seconds
        timings["other"] = timings["total"] - timings["steps"] - timings["vector"] \
            - timings["halo_wait"] - timings["allreduce"] - timings["staging"]
        st.stats["timings"] = timings
        st.stats["mpi_path"] = getattr(st.solver.halo, "path", "host")
        self.stats = st.stats

    # ------------------------------------- exact propagation (one process: the serial sweep)
    def _serial_loss_and_grad(self, x, y, out=None):
        m, bk = self.model, self.bk
        logits, (d_open, U, D, c_close) = self._forward(x, store=True)
        loss, g = m.loss.forward_grad(logits, y, bk)
        grads = m.params.zeros_like() if out is None else out  # every entry is written below
        lam, gc = m.closing.vjp(m.group("closing"), U[-1], c_close, g, bk)
        steps = m.step_params()
        if m.step.fused:
            lam = m.step.sweep_backward(steps["weight"], steps["bias"], U, D, m.h, lam,
                                        grads["steps.weight"], grads["steps.bias"], bk)
        else:  # state vjps layer after layer, then every parameter gradient in one call
            G = grads.group(m.step_prefix)
            sweep = getattr(m.step, "sweep_backward_layers", None)  # or one call for it all
            lam0 = None if sweep is None else sweep(steps, U, D, lam, m.h, bk, self.ctx, G,
                                                    scratch=self._reused)
            if lam0 is None and isinstance(m.step, ComposedStep) and not m.step.shared:
                for n in range(m.n_layers - 1, -1, -1):  # state and parameter vjps in one pass
                    lam = m.step.vjp_layer(steps, n, U[n], D[n], lam, m.h, bk, self.ctx, G)
                lam0 = lam
            if lam0 is None:
                lams = [None] * m.n_layers + [lam]
                for n in range(m.n_layers - 1, -1, -1):
                    lams[n] = m.step.vjp_state_layer(steps, n, D[n], lams[n + 1], m.h, bk,
                                                     self.ctx)
                m.step.vjp_params_steps(steps, range(m.n_layers), U, D, lams, m.h, bk,
                                        self.ctx, G)
                lam0 = lams[0]
            lam = lam0
            self._commit_buffers(range(m.n_layers), D)
        _, go = m.opening.vjp(m.group("opening"), x, d_open, lam, bk)
        for prefix, gd in (("opening", go), ("closing", gc)):
            for k, v in gd.items():
                grads[f"{prefix}.{k}"][...] = v
        self.stats = _exact_stats()
        return loss, grads

    def _serial_states(self, u0, store):
        """Layer after layer: U (N+1, B, ...) and, if ``store``, D: the linearisation caches
        (fused kinds: sigma'(z_n) as one (N, B, ...) array; composed: a list)."""
        m, kind, ctx = self.model, self.model.step, self.ctx
        steps = m.step_params()
        # the stores are kept across calls (per shape): a fresh (N+1) B C H W array each step
        # costs its page faults (~7 ms of a 100 ms conv step at C 16, N 16, B 32)
        U = self._reused("serial_U", (m.n_layers + 1,) + u0.shape, m.dtype)
        U[0] = u0
        if kind.fused:
            D = self._reused("serial_D", (m.n_layers if store else 0,) + u0.shape, m.dtype)
            kind.sweep_forward(steps["weight"], steps["bias"], U, m.h, D, self.bk)
            return U, D
        sweep = getattr(kind, "sweep_forward_layers", None)  # one call for the whole sequence
        D = None if sweep is None else sweep(steps, U, m.h, store, self.bk, ctx,
                                             scratch=self._reused)
        if D is not None:
            return U, D
        D = [None] * m.n_layers
        for n in range(m.n_layers):
            if store:
                U[n + 1], D[n] = kind.forward_linearize(steps, n, U[n], m.h, self.bk, ctx)
            else:
                U[n + 1] = kind.forward_layer(steps, n, U[n], m.h, self.bk, ctx)
        return U, D

    def _forward(self, x, store):
        m, bk = self.model, self.bk
        u0, d_open = m.opening.forward(m.group("opening"), x, bk)
        U, D = self._serial_states(u0, store)
        logits, c_close = m.closing.forward(m.group("closing"), U[-1], bk)
        return logits, (d_open, U, D, c_close)

    def _distributed_forward(self, x, opts, guess=None):
        """(MGRITResult of the forward solve, opening's sigma' or None): states on their owners."""
        m, bk, lay = self.model, self.bk, self.layout
        if lay.first:
            u0, d_open = m.opening.forward(m.group("opening"), x, bk)
        else:
            # a template only (the owner's values are used): zeros, kept per shape
            u0, d_open = self._reused("zeros", m.step.state_shape(x.shape[0]), m.dtype), None
        solver = self._solver("forward", opts)
        self._refresh_replica(solver)
        prop = solver.prop
        # composed kinds: the level-0 steps keep their linearisation caches; those of the last
        # sweep (the final F-relaxation, or the one sequential sweep) are at the final states
        keep = (isinstance(m.step, ComposedStep) and isinstance(prop, ForwardPropagator)
                and self.ctx.training and not prop._layered)
        prop.kept = {} if keep else None
        # fused kinds: the final sweep writes sigma' of the layers it steps (flagged in done)
        derivs = None
        if (self.ctx.training and isinstance(prop, ForwardPropagator) and len(self.layers)
                and prop.can_keep_derivs()):
            owned = len(self.layers)
            done = self._reused("derivs_done", (owned,), np.int8)
            done[...] = 0
            if prop._layered:  # the arrays _linearize's linearize_stacked fills
                kept = m.step.kept_arrays(tuple(u0.shape), owned, m.dtype, self._reused)
            else:
                kept = (self._reused("derivs", (owned,) + tuple(u0.shape), m.dtype),)
            derivs = (kept, self.layers.start, done)
        prop.final_derivs = derivs
        try:
            res = solver.solve(u0, guess)
        finally:
            kept, prop.kept, prop.final_derivs = prop.kept, None, None
        cf, single = solver.options.cf, len(solver.sizes) == 1
        self._kept = derivs if not keep else {
            n: c for n, c in kept.items() if single or (n + 1) % cf != 0}
        return res, d_open

    # -------------------------------------------------------------------- the gradient guard
    def _guarded_loss_and_grad(self, x, y, out):
        """One training step under the gradient guard (:mod:`mgnn.guard`): MGRIT as configured,
        checked against the exact gradient when the guard asks; iterate further or fall back.
        The accepted MGRIT step is bit for bit the unguarded one (a check runs after it, into
        its own buffers, and the model's running statistics are restored)."""
        g, lay = self.guard, self.layout
        if g.exact_now():
            loss, grads = self._exact_loss_and_grad(x, y, out)
            g.exact_step()
            self._guard_report("exact", f"fallback: MGRIT again in {g.exact_left} steps",
                               [], [], None, 0.0)
            return loss, grads
        opts = self._escalated if g.escalated else (self.fwd, self.bwd)
        buffers = self.model.buffers.flat
        before = buffers.copy() if len(self.model.buffers) and self.ctx.training else None
        guess = self._previous_states  # the warm start this step began from
        try:
            loss, grads = self._general_loss_and_grad(x, y, out, opts)
        except DivergenceError as exc:  # on every rank alike (the residual is a global sum)
            return self._diverged(x, y, out, before, str(exc))
        stats = self.stats
        rf, ra = _residuals(stats, "forward"), _residuals(stats, "adjoint")
        reason = g.trigger(rf, ra)
        if reason is None:
            estimate = g.estimate(rf, ra)
            g.accepted(rf, ra)
            self._guard_report("accept", "contracting", rf, ra, None, 0.0, estimate, stats)
            return loss, grads
        t_check = time.perf_counter()
        after = None
        if before is not None:  # the running statistics: the exact step's replace MGRIT's
            after = buffers.copy()
            buffers[...] = before
        if self._guard_grads is None:
            self._guard_grads = self.model.params.zeros_like()
        ex_loss, exact = self._exact_loss_and_grad(x, y, self._guard_grads)
        error, cosine = self._compare(grads, exact)
        ok, verdict = g.judge(error, cosine)
        if ok:
            base = None
            if g.escalated:  # the fixed budget may do again: back to it if it passes
                text, base = self._try_base_options(x, y, exact, before, guess)
                verdict += text
            if after is not None:
                buffers[...] = after
            if base is not None:
                g.relaxed(*base)
            else:
                g.accepted(rf, ra, error)
            self._guard_report("accept", f"{reason}; checked: {verdict}", rf, ra,
                               (error, cosine), time.perf_counter() - t_check, error, stats)
            return loss, grads
        if g.escalate and not g.escalated and self._escalated != (self.fwd, self.bwd):
            keep = buffers.copy() if after is not None else None
            if keep is not None:
                buffers[...] = before
            try:
                loss2, grads = self._general_loss_and_grad(x, y, grads, self._escalated)
            except DivergenceError as exc:
                return self._diverged(x, y, grads, before, str(exc), exact=(ex_loss, exact),
                                      forward=rf, adjoint=ra)
            stats2 = self.stats
            rf2, ra2 = _residuals(stats2, "forward"), _residuals(stats2, "adjoint")
            error2, cosine2 = self._compare(grads, exact)
            ok2, verdict2 = g.judge(error2, cosine2)
            if ok2:
                g.iterated(rf2, ra2, error2)
                self._guard_report(
                    "iterate", f"{reason}; {verdict} with the fixed budget; {verdict2} with "
                    f"twice the cycles, FCF", rf2, ra2, (error2, cosine2),
                    time.perf_counter() - t_check, error2, stats2)
                return loss2, grads
            if keep is not None:
                buffers[...] = keep
            verdict += f" (with twice the cycles, FCF: {verdict2})"
        grads.flat[...] = exact.flat
        n = g.fell_back(error)
        g.warn_once(f"gradient guard: the layer-parallel gradient is off ({verdict}; forward "
                    f"residuals {_fmt(rf)}, adjoint residuals {_fmt(ra)}); propagating exactly "
                    f"for {n + 1} steps, then MGRIT again", emit=lay.rank == 0)
        self._guard_report("fallback", f"{reason}; {verdict}: exact propagation for this and the "
                           f"next {n} steps", rf, ra, (error, cosine),
                           time.perf_counter() - t_check, error, stats)
        return ex_loss, grads

    def _exact_loss_and_grad(self, x, y, out):
        """The exact loss and gradient (layer after layer; across ranks the sequential
        hand-off)."""
        if self.layout.size == 1:
            return self._serial_loss_and_grad(x, y, out)
        return self._general_loss_and_grad(x, y, out, (None, None))

    def _compare(self, grads, exact):
        """(relative error |grads - exact| / |exact|, cosine) over every parameter of the model
        (one collective over the layer ranks: the same numbers on every rank)."""
        lay = self.layout
        g, e = grads.flat, exact.flat
        if lay.size > 1:
            g, e = g[self.owned], e[self.owned]
        g, e = g.astype(np.float64), e.astype(np.float64)
        d = g - e
        sums = [float((d * d).sum()), float((g * e).sum()), float((g * g).sum()),
                float((e * e).sum())]
        if lay.layer_comm is not None:  # (an array: a list's "sum" would concatenate)
            sums = lay.layer_comm.allreduce(np.array(sums)).tolist()
        tiny = np.finfo(np.float64).tiny
        ne = math.sqrt(sums[3])
        return (math.sqrt(sums[0]) / max(ne, tiny),
                sums[1] / max(math.sqrt(sums[2]) * ne, tiny))

    def _try_base_options(self, x, y, exact, before, guess):
        """At a passing check under the escalated options: the configured options on the same
        batch (from the warm start the step began with), into scratch buffers. Returns (text for
        the report, (forward residuals, adjoint residuals, error) if they pass too, else
        None)."""
        g = self.guard
        stats = self.stats
        if self._guard_base is None:
            self._guard_base = self.model.params.zeros_like()
        if before is not None:
            self.model.buffers.flat[...] = before
        previous, self._previous_states = self._previous_states, guess
        try:
            self._general_loss_and_grad(x, y, self._guard_base, (self.fwd, self.bwd))
            base_stats = self.stats
        except DivergenceError as exc:
            return f"; the configured cycles still diverge ({exc})", None
        finally:  # the escalated step's states stay the next warm start
            self.stats, self._previous_states = stats, previous
        error, cosine = self._compare(self._guard_base, exact)
        ok, verdict = g.judge(error, cosine)
        if ok:
            return (f"; the configured cycles pass again ({verdict}): back to them",
                    (_residuals(base_stats, "forward"), _residuals(base_stats, "adjoint"),
                     error))
        return f"; the configured cycles still fail ({verdict})", None

    def _diverged(self, x, y, out, before, why, exact=None, forward=(), adjoint=()):
        """A guarded MGRIT solve diverged (non-finite residual): the exact gradient for this
        step (``exact``: (loss, gradient) if already computed) and a fallback."""
        g = self.guard
        if before is not None:
            self.model.buffers.flat[...] = before
        t0 = time.perf_counter()
        if exact is None:
            loss, grads = self._exact_loss_and_grad(x, y, out)
        else:
            loss, grads = exact[0], out
            grads.flat[...] = exact[1].flat
        n = g.fell_back(float("inf"))
        g.warn_once(f"gradient guard: {why}; propagating exactly for {n + 1} steps, then MGRIT "
                    "again", emit=self.layout.rank == 0)
        self._guard_report("fallback", f"{why}: exact propagation for this and the next {n} "
                           "steps", forward, adjoint, None, time.perf_counter() - t0)
        return loss, grads

    def _guard_report(self, action, reason, forward, adjoint, check, seconds, estimate=None,
                      stats=None):
        """``stats['guard']`` of this step (``check``: (error, cosine) of a check, or None), and
        ``stats`` itself where given (the MGRIT step's residuals and timings stay the report of
        the step)."""
        g = self.guard
        if stats is not None:
            self.stats = stats
        st = self.stats
        error, cosine = check if check is not None else (None, None)
        g.seconds += seconds
        st["guard"] = {"action": action, "reason": reason, "error": error, "cosine": cosine,
                       "error_estimate": estimate, "tol": g.tol, "escalated": g.escalated,
                       "forward_residuals": list(forward), "adjoint_residuals": list(adjoint),
                       "exact_steps_left": g.exact_left, "seconds": seconds,
                       "counts": dict(g.counts)}
        if "timings" in st:
            st["timings"]["guard"] = seconds

    # ----------------------------------- the step's parts: solvers, replicas, halos, buffers
    def _solver(self, kind, opts):
        """The cached solver for 'forward' or 'adjoint' propagation under ``opts`` (built once:
        construction duplicates the layer communicator)."""
        key = (kind, id(opts))  # opts are this object's own, alive as long as it is
        if key not in self._solvers:
            lay, m = self.layout, self.model
            spatial = {} if not self.spatial else dict(
                spatial_levels=self.spatial[0], interp=self.spatial[1], restrict=self.spatial[2])
            if kind == "forward":
                cls = SpatialForwardPropagator if spatial else ForwardPropagator
                prop, part = cls(m, self.bk, self.ctx, **spatial), self.partition
            else:
                cls = SpatialAdjointPropagator if spatial else AdjointPropagator
                prop, part = (cls(m, None, None, self.bk, self.ctx, **spatial),
                              self.adjoint_partition)
            self._solvers[key] = MGRITSolver(prop, m.n_layers, opts, comm=lay.layer_comm,
                                             partition=part, norm_comm=lay.comm,
                                             abort_on_error=False, overlap=self.overlap,
                                             ops=vector_ops(self.backend),
                                             xp=None if self.xp is np else self.xp,
                                             reuse_states=True, coarsest=self.coarsest,
                                             capture=self.capture)
        return self._solvers[key]

    def _refresh_replica(self, solver, derivs=None):
        """Before a solve with a redundant coarsest level: every rank gets the coarsest level's
        layers (forward: weights and biases; adjoint: weights and sigma' ``derivs`` of this
        rank's layers) from their owners: two allgathers of the owners' rows (exact copies;
        device buffers kept per shape, so that captured graphs read fixed addresses; on a
        device the adjoint's weights are the step's forward copy reversed where they can be)."""
        if solver.coarsest != "redundant":
            return
        m, lay = self.model, self.layout
        lev = len(solver.sizes) - 1
        S, n_c, N = solver.levels[lev].s, solver.sizes[lev], m.n_layers
        adjoint = derivs is not None
        steps = m.step_params()
        W = steps["weight"]
        second = derivs if adjoint else steps["bias"]
        shape_w, shape_2 = (n_c,) + W.shape[1:], (n_c,) + second.shape[1:]
        counts, displs = self.partition.replica_counts(S, n_c, adjoint)
        r0 = displs[lay.layer_rank]
        r1 = r0 + counts[lay.layer_rank]
        # this rank's rows, layer r S (forward) or N - (r + 1) S (adjoint) for r in [r0, r1):
        # one strided slice of the owned layers (adjoint rows run down)
        first = r0 * S if not adjoint else N - r1 * S
        off = self.layers.start if adjoint else 0  # derivs hold the owned layers only
        order = slice(None, None, -1 if adjoint else 1)
        if r1 > r0:
            last = first + (r1 - r0 - 1) * S
            mine_w = W[first:last + 1:S][order]
            mine_2 = second[first - off:last - off + 1:S][order]
        else:
            mine_w, mine_2 = W[:0], second[:0]
        reuse = False
        if self.xp is np:  # fresh pages each solve (virtual runs hold thousands of ranks)
            Wc, Sc = np.empty(shape_w, m.dtype), np.empty(shape_2, m.dtype)
            send_w, send_2 = np.ascontiguousarray(mine_w), np.ascontiguousarray(mine_2)
        else:  # device buffers kept per shape (one strided copy each)
            key = (adjoint, shape_w, shape_2, S, r0, r1)
            bufs = self._replica_buffers.get(key)
            if bufs is None:
                xp = self.xp
                bufs = self._replica_buffers[key] = (
                    xp.empty(shape_w, m.dtype), xp.empty(shape_2, m.dtype),
                    xp.empty((r1 - r0,) + shape_w[1:], m.dtype),
                    xp.empty((r1 - r0,) + shape_2[1:], m.dtype))
            Wc, Sc, send_w, send_2 = bufs
            # the adjoint's weight rows are the forward's of this step, reversed, when the
            # level tiles the layers (N = n_c S): one device copy instead of a collective
            fwd = self._replica_weights
            reuse = adjoint and fwd is not None and fwd[0] == (S, n_c) and N == n_c * S
            if reuse:
                Wc[...] = fwd[1][::-1]
            else:
                send_w[...] = mine_w
            send_2[...] = mine_2
            if not adjoint:
                self._replica_weights = ((S, n_c), Wc)
        t0 = time.perf_counter()
        if not reuse:
            solver.halo.allgather_rows(send_w, Wc, counts, displs)
        solver.halo.allgather_rows(send_2, Sc, counts, displs)
        self._replica_seconds += time.perf_counter() - t0
        solver.prop.replicas = {lev: CoarseReplica(solver.prop, Wc, Sc, S, adjoint)}

    def _exchange_adjoint_halo(self, lam, timings):
        """Start the exchange of lam at forward index hi (the next layer rank's first point, needed
        by this rank's last layer); returns a callable that completes it (idempotent)."""
        lay = self.layout
        if lay.layer_size == 1:
            return lambda: None
        if getattr(self, "_halo", None) is None:
            from .comm import make_device_halo, make_halo
            self._halo = (make_halo(lay.layer_comm) if self.xp is np else
                          make_device_halo(lay.layer_comm, xp=self.xp))
        halo = self._halo
        halo.timers.update(halo_wait=0.0, recv_wait=0.0, halo_total=0.0, staging=0.0)
        lo, hi = self.partition.fine_range(lay.layer_rank)
        t = tag("adjoint_halo")
        template = lam[lo]
        recv = halo.irecv(template, lay.layer_rank + 1, t) if not lay.last else None
        send = halo.isend(lam[lo], lay.layer_rank - 1, t) if not lay.first else None
        pending = [recv, send]

        def finish():
            if pending[0] is not None:
                lam[hi] = halo.wait(pending[0]).copy()
            if pending[1] is not None:
                halo.wait(pending[1])
            if pending != [None, None]:
                for k in ("halo_wait", "halo_total", "recv_wait", "staging"):
                    timings[k] += halo.timers[k]
                pending[:] = [None, None]

        return finish

    def _commit_buffers(self, layers, caches):
        """Train mode: the running statistics of ``layers`` from their caches at the final
        forward states (once per training step)."""
        if self.ctx.training:
            for n in layers:
                self.model.step.commit_buffers(self.ctx.buffers, n, caches[n])

    def _zero_unowned(self, grads):
        """Zero the entries of ``grads`` this rank does not compute (none on a single rank;
        see :meth:`_rows`); returns ``grads``."""
        for k, v in grads.items():
            computed = self._rows(k)[0]
            if computed is None:
                v[...] = 0
            elif computed != slice(None):
                v[:computed.start] = 0
                v[computed.stop:] = 0
        return grads

    def _reused(self, name, shape, dtype):
        """An array of this backend kept per (name, shape, dtype) across calls: 'zeros' arrays
        are all-zero and only read (templates, a zero lam_N); others are scratch."""
        key = (name, tuple(shape), np.dtype(dtype).str)
        a = self._arrays.get(key)
        if a is None:
            make = self.xp.zeros if name == "zeros" else self.xp.empty
            a = self._arrays[key] = make(tuple(shape), dtype=dtype)
        return a

    def _rows(self, name):
        """(rows of parameter ``name`` this rank computes, rows it owns) as slices of the leading
        axis, None for none: its own layers of per-layer step parameters; the opening on the
        first and the closing on the last layer rank; weights shared by every step are computed
        in part on every rank (their gradient is a sum over the steps) and owned by the first.
        The one ownership table of :meth:`_owned_mask` and :meth:`_zero_unowned`."""
        group, lay, m = name.split(".")[0], self.layout, self.model
        whole = slice(None)
        if group == m.step_prefix:
            if m.step.shared:
                return whole, (whole if lay.first else None)
            own = slice(self.layers.start, self.layers.stop)
            return own, own
        mine = lay.first if group == "opening" else lay.last
        return (whole, whole) if mine else (None, None)

    def _owned_mask(self):
        """Entries this rank owns (reports in :meth:`gather` / :meth:`gather_params`; see
        :meth:`_rows`) as a boolean mask of the flat buffer."""
        mask = self.model.params.zeros_like()
        for k, v in mask.items():
            owned = self._rows(k)[1]
            if owned is not None:
                v[owned] = 1
        return mask.flat.astype(bool)

    # ---------------------------------------------------------------------------- validation
    def _validated(self, x, y=None, out=None):
        """Checked (x, y) (and the gradient buffer ``out`` if given); in a distributed run every
        rank raises if any rank's input is bad (one collective, whatever each rank passed). Also
        puts this model's thread counts back (another model of the process may have changed
        them: they are process-wide)."""
        apply_threads(self.threads)
        err = None
        try:
            if out is not None:
                self._check_out(out)
            x = self._check_x(x)
            if y is not None:
                y = self._check_y(y, x.shape[0])
        except (ValueError, TypeError) as exc:
            err = exc
        lay = self.layout
        batches = agree_on_errors(lay.comm, err, x.shape[0] if err is None else None)
        L = lay.layer_size
        for replica in range(lay.data_ranks):
            mine = batches[replica * L:(replica + 1) * L]
            if len(set(mine)) > 1:
                raise ValueError(f"the layer ranks of replica {replica} passed batches of sizes "
                                 f"{mine}; every layer rank of a replica must pass the same shard")
        shards = [batches[r * L] for r in range(lay.data_ranks)]
        if y is not None and self.model.training:  # the same check on every rank
            stat_batches = [sum(shards)] if self.ctx.replicas is not None else shards
            self.model.step.check_batch(min(stat_batches))
        self.ctx.sample0 = sum(shards[:lay.replica])
        return x, y

    def _as_array(self, a, what):
        """``a`` as an array of this backend: NumPy for the CPU backends; for 'cuda' a CuPy array
        (CuPy, ``__cuda_array_interface__`` and DLPack inputs without a copy, NumPy moved once)."""
        xp = self.xp
        if xp is np:
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{what} must be a numpy array, got {type(a).__name__}")
            return a
        if isinstance(a, (xp.ndarray, np.ndarray)) or hasattr(a, "__cuda_array_interface__"):
            return xp.asarray(a)
        if hasattr(a, "__dlpack__"):
            if _dlpack_on_host(a):  # cupy.from_dlpack refuses host memory: one copy over
                return xp.asarray(np.from_dlpack(a))
            return xp.from_dlpack(a)
        raise TypeError(f"{what} must be an array (CuPy, NumPy, __cuda_array_interface__ or "
                        f"DLPack), got {type(a).__name__}")

    def _check_x(self, x):
        m, xp = self.model, self.xp
        x = self._as_array(x, "x")
        if x.dtype != m.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the model is {m.dtype}; "
                            "convert explicitly (mgnn never casts silently)")
        want = m.input_shape()
        if x.ndim != len(want) + 1 or x.shape[1:] != want or x.shape[0] < 1:
            raise ValueError(f"x has shape {x.shape}, expected (B,) + {want} with B >= 1")
        if not bool(xp.isfinite(x).all()):
            raise ValueError(f"x contains {int(xp.count_nonzero(~xp.isfinite(x)))} non-finite "
                             "values")
        return xp.ascontiguousarray(x)

    def _check_y(self, y, batch):
        if self.xp is not np and hasattr(y, "shape"):
            y = self._as_array(y, "y")
        if not isinstance(y, (np.ndarray, self.xp.ndarray)) or \
                not np.issubdtype(y.dtype, np.integer):
            raise TypeError(f"y must be an integer array, got "
                            f"{getattr(y, 'dtype', type(y).__name__)}")
        if y.shape != (batch,):
            raise ValueError(f"y has shape {y.shape}, expected ({batch},) to match x")
        k = self.model.n_classes
        bad = (y < 0) | (y >= k)
        if bool(bad.any()):
            raise ValueError(f"labels out of range [0, {k}): "
                             f"{np.unique(to_host(y[bad]))[:10].tolist()}")
        return self.xp.ascontiguousarray(y, dtype=np.int64)

    def _check_out(self, out):
        """``out`` of :meth:`loss_and_grad` must be a ParamDict laid out like model.params."""
        p = self.model.params
        if not isinstance(out, ParamDict):
            raise TypeError(f"out must be a ParamDict (e.g. model.params.zeros_like()), got "
                            f"{type(out).__name__}")
        if getattr(out, "offsets", None) != p.offsets or out.shapes() != p.shapes():
            raise ValueError(f"out has parameters {out.shapes()}, expected model.params' "
                             f"{p.shapes()}")
        if (is_device_array(out.flat) != is_device_array(p.flat)
                or isinstance(out.flat, np.ndarray) != isinstance(p.flat, np.ndarray)
                or out.flat.dtype != p.flat.dtype):  # (host or device; a subclass is fine)
            raise TypeError(f"out holds {type(out.flat).__name__} {out.flat.dtype}; expected "
                            f"{type(p.flat).__name__} {p.flat.dtype} like model.params")
        if out.flat is p.flat or (out.flat.base is not None and out.flat.base is p.flat.base):
            raise ValueError("out is model.params itself; pass a separate gradient buffer")


#: Work of the opening layer (first layer rank) and of the closing layer + loss (last layer rank)
#: in layer evaluations, for balancing the layer blocks (rough: an affine map each way).
OPENING_WORK, CLOSING_WORK = 2.0, 3.0


def _spatial_options(model, spatial_levels, interp, restrict, fwd, bwd):
    """(levels, interp, restrict) validated for ``model`` and the MGRIT options, or None for
    no spatial coarsening; ValueError/TypeError naming the bad value."""
    if isinstance(spatial_levels, numbers.Integral) and not isinstance(spatial_levels, bool):
        spatial_levels = (spatial_levels,)
    if not isinstance(spatial_levels, (tuple, list)) or any(
            isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in spatial_levels):
        raise TypeError(f"spatial_levels must be a tuple of ints, got {spatial_levels!r}")
    if interp not in grid_transfer.INTERPS:
        raise ValueError(f"interp must be one of {grid_transfer.INTERPS}, got {interp!r}")
    if restrict not in grid_transfer.RESTRICTS:
        raise ValueError(f"restrict must be one of {grid_transfer.RESTRICTS}, got {restrict!r}")
    levels = tuple(sorted(set(int(v) for v in spatial_levels)))
    if not levels:
        return None
    shape = model.step.state_shape(1)[2:]
    if len(shape) not in (2, 3) or model.step.shared:
        raise ValueError(f"spatial_levels={levels!r} needs a conv model (2D or 3D images), "
                         f"but the model's states are {model.step.state_shape(1)[1:]} per sample")
    for name, opt in (("fwd", fwd), ("bwd", bwd)):
        n_levels = 1 if opt is None else len(hierarchy(model.n_layers, opt))
        bad = [v for v in levels if not 0 <= v < n_levels - 1]
        if bad:
            raise ValueError(f"spatial_levels {bad} do not exist in the {name} hierarchy of "
                             f"{n_levels} levels (a level l coarsens level l + 1: 0 <= l < "
                             f"{n_levels - 1})")
    size = shape
    for k in range(len(levels)):
        try:
            size = grid_transfer.coarse_shape(size)
        except ValueError as exc:
            raise ValueError(f"image size {shape} cannot be coarsened {len(levels)} times for "
                             f"spatial_levels={levels!r}: {exc}") from None
    return levels, interp, restrict


def _options_key(opts):
    """What of MGRITOptions ``opts`` (or None) the layer work model depends on, hashable."""
    if opts is None:
        return None
    return (opts.cf, opts.max_levels, opts.min_coarse, opts.skip_downcycle, opts.max_iter,
            opts.cycle, opts._nrelax)  # _nrelax: the sweeps per level, the last one repeating


_LAYER_SPLITS = {}  # (N, P, option keys, coarsest) -> (starts, work per block)


def _level_costs(model, spatial, fwd, bwd):
    """Per MGRIT level (as many as the deeper of the two hierarchies), the cost of one step in
    fine-step equivalents: the ratio of the level's pixels to the fine images' under the
    spatial coarsening ``spatial`` (:func:`_spatial_options`; None: 1 on every level)."""
    n = max([len(hierarchy(model.n_layers, o)) for o in (fwd, bwd) if o is not None] or [1])
    if spatial is None:
        return (1.0,) * n
    levels = spatial[0]
    size = fine = model.step.state_shape(1)[2:]
    out = []
    for lev in range(n):
        out.append(float(np.prod(size)) / float(np.prod(fine)))
        if lev in levels:
            size = grid_transfer.coarse_shape(size)
    return tuple(out)


def _balanced_layers(N, P, fwd, bwd, coarsest, level_cost=None):
    """(starts, work per block) of N layers on P layer ranks (:func:`balanced_starts` over
    :func:`layer_work_model`), computed once per configuration in a process: virtual ranks
    build the same split P times."""
    key = (N, P, _options_key(fwd), _options_key(bwd), coarsest, level_cost)
    got = _LAYER_SPLITS.get(key)
    if got is None:
        work = layer_work_model(N, fwd, bwd, coarsest, level_cost)
        align = fwd.cf if fwd is not None else 1
        starts = balanced_starts(N, P, align, work=work, extra_first=OPENING_WORK,
                                 extra_last=CLOSING_WORK)
        got = (tuple(starts), tuple(block_work(N, starts, work=work, extra_first=OPENING_WORK,
                                               extra_last=CLOSING_WORK)))
        if len(_LAYER_SPLITS) > 64:
            _LAYER_SPLITS.clear()
        _LAYER_SPLITS[key] = got
    return got


def layer_work_model(n_layers, fwd, bwd, coarsest="redundant", level_cost=None):
    """Modelled layer evaluations of each layer in one training step (N,) float64: the forward
    and adjoint solves (MGRIT cycles by :func:`mgnn.mgrit.partition.layer_work`, the final
    F-relaxation, or one evaluation each layer by layer) and the parameter gradient.
    ``level_cost``: a step's cost per level in fine-step equivalents (None: 1; a hierarchy
    shallower than it uses its first entries)."""
    from .mgrit.hierarchy import level_sizes
    work = np.ones(n_layers)  # the parameter gradient of every layer
    for opts, mirrored in ((fwd, False), (bwd, True)):
        if opts is None:
            work += 1.0
            continue
        sizes = level_sizes(n_layers, opts.cf, opts.max_levels, opts.min_coarse)
        if len(sizes) == 1:
            work += 1.0
            continue
        cascadic = 1 if opts.skip_downcycle else 0
        for skip, count in ((True, cascadic), (False, opts.max_iter - cascadic)):
            if count:
                work += count * layer_work(n_layers, opts.cf, sizes, opts.nrelax_on, skip=skip,
                                           cycle=opts.cycle, coarsest=coarsest,
                                           mirrored=mirrored,
                                           level_cost=None if level_cost is None
                                           else level_cost[:len(sizes)])
        work += 1.0  # the final F-relaxation (F-points only: an upper bound)
    return work


class _Step:
    """What one training step of :class:`LayerParallel` carries from phase to phase (forward
    states, linearisation, adjoint, gradients, timings)."""

    def __init__(self, lp, x, y, out):
        self.t_start = time.perf_counter()
        self.x, self.y, self.out = x, y, out
        self.timings = {"steps": 0.0, "vector": 0.0, "halo_wait": 0.0, "recv_wait": 0.0,
                        "halo_total": 0.0, "allreduce": 0.0, "staging": 0.0}
        if lp.ctx.replicas is not None:
            lp.ctx.replicas.seconds = 0.0
        data_comm = lp.layout.data_comm
        self.batch = x.shape[0]
        self.total_batch = self.batch if data_comm is None else data_comm.allreduce(self.batch)
        self.stats = _exact_stats()
        self.steps = lp.model.step_params()
        self.owned = lp.layers
        self.derivs = None
        self.kept = None  # linearisation caches of the forward solve's last sweep, by layer
        self.loss_part = 0.0

    def add(self, result):
        """Add an MGRIT result's timings to the step's."""
        for k in self.timings:
            self.timings[k] += result.timings.get(k, 0.0)


class _Reversed:
    """``lam[n]`` = ``states[len(states) - 1 - n]`` (a solve's states in reversed order, read
    on access: no Python object per state); assigned entries (the halo's) override."""

    __slots__ = ("states", "last", "set")

    def __init__(self, states):
        self.states, self.last, self.set = states, len(states) - 1, {}

    def __getitem__(self, n):
        got = self.set.get(n)
        return self.states[self.last - n] if got is None else got

    def __setitem__(self, n, value):
        self.set[n] = value


class _Rows:
    """``rows[n]`` = ``A[n - first]`` for the rows of A, else None: per-layer access to one
    stacked array without a Python object per layer."""

    __slots__ = ("A", "first")

    def __init__(self, A, first):
        self.A, self.first = A, first

    def __getitem__(self, n):
        k = n - self.first
        return self.A[k] if 0 <= k < self.A.shape[0] else None


def _residuals(stats, kind):
    """The residual history of the ``kind`` ('forward' / 'adjoint') solve in ``stats`` ([] if
    none was measured or the solve was exact)."""
    return list(stats.get(kind, {}).get("residuals", ()))


def _fmt(residuals):
    return "[" + ", ".join(f"{r:.3g}" for r in residuals) + "]" if residuals else "none measured"


def _exact_stats():
    """``stats`` of exact (layer-by-layer) propagation: no MGRIT cycles, nothing to converge."""
    return {kind: {"residuals": [], "iterations": 0, "converged": True}
            for kind in ("forward", "adjoint")}


#: DLPack device types of host memory (kDLCPU, kDLCUDAHost: pinned), which ``cupy.from_dlpack``
#: refuses ("CPU arrays cannot be directly imported to CuPy").
_DLPACK_HOST = (1, 3)


def _dlpack_on_host(a):
    """Whether the DLPack object ``a`` lives in host memory (no ``__dlpack_device__``: assume so,
    as the DLPack protocol's default device is the CPU)."""
    dev = getattr(a, "__dlpack_device__", None)
    return dev is None or int(dev()[0]) in _DLPACK_HOST


def _check_backend(bk):
    """A user's backend object: it must provide every kernel of the contract."""
    from .backend import KERNELS
    missing = [k for k in KERNELS if not callable(getattr(bk, k, None))]
    if missing:
        raise TypeError(f"backend object {type(bk).__name__} lacks kernels {missing}")
    return bk


def _in_place():
    from mpi4py import MPI
    return MPI.IN_PLACE


def _bcast_staged(comm, buf, root=0):
    """Broadcast ``buf`` from ``root`` over ``comm`` in place (device arrays through a host copy)."""
    if not is_device_array(buf):
        comm.Bcast(buf, root=root)
        return
    import cupy
    host = cupy.asnumpy(buf)
    comm.Bcast(host, root=root)
    buf[...] = cupy.asarray(host)


def _allreduce_staged(comm, buf, polled=False):
    """Sum ``buf`` over ``comm`` in place; device arrays go through a host copy (checkpoints,
    epoch-end synchronisation, the redundant coarsest level's few layers). ``polled``: a
    nonblocking Iallreduce completed by polling (:func:`mgnn.comm.wait_request`: ranks sharing
    cores are not starved by a spinning blocking collective)."""
    def reduce(a):
        if polled:
            wait_request(comm.Iallreduce(_in_place(), a))
        else:
            comm.Allreduce(_in_place(), a)
    if not is_device_array(buf):
        reduce(buf)
        return
    import cupy
    host = cupy.asnumpy(buf)
    reduce(host)
    buf[...] = cupy.asarray(host)


class _ReplicaGather:
    """The data-parallel hook of synchronised batch norm (``StepContext.replicas``): allgather
    of small host vectors over the replicas, in replica order, identical on every replica.
    ``seconds`` accumulates the time spent in it (reported as the ``bn_sync`` timing)."""

    def __init__(self, comm):
        self.comm, self.seconds = comm, 0.0

    def allgather(self, a):
        """(D, a.size) float64: row r is replica r's ``a``."""
        a = np.ascontiguousarray(a, dtype=np.float64).reshape(-1)
        out = np.empty((self.comm.Get_size(), a.size))
        t0 = time.perf_counter()
        self.comm.Allgather(a, out)
        self.seconds += time.perf_counter() - t0
        return out


class _Buckets:
    """Gradient buckets summed over the data replicas with nonblocking Allreduce, each started as
    soon as its gradients are final (closing before the adjoint solve, steps, then opening).

    Device (CuPy) gradients always go through host copies that are written back on
    :meth:`wait`: CUDA-aware MPI libraries support device buffers in point-to-point and blocking
    collectives, but not in nonblocking collectives such as Iallreduce (Open MPI's FAQ).
    """

    def __init__(self, data_comm, grads, all_comm=None):
        self.comm = data_comm if data_comm is not None and data_comm.Get_size() > 1 else None
        self.all_comm = all_comm if all_comm is not None and all_comm.Get_size() > 1 else None
        self.grads, self.requests, self.staged = grads, [], []
        self.device = is_device_array(grads.flat)

    def start(self, first, last):
        """Start summing parameters ``first``..``last`` (adjacent in the flat buffer)."""
        if self.comm is not None:
            g = self.grads
            a = g.offsets[first]
            self._start([g.flat[a:g.offsets[last] + g[last].size]])

    def start_rows(self, names, lo, hi):
        """Start summing rows lo..hi of each parameter in ``names``."""
        if self.comm is not None:
            self._start([self.grads.flat_slice(k, lo, hi) for k in names])

    def start_all(self, names):
        """Start summing the parameters ``names`` (adjacent in the flat buffer) over every rank
        (layer ranks x replicas): weights shared by the steps of all layer ranks."""
        if self.all_comm is not None and names:
            g = self.grads
            a = g.offsets[names[0]]
            self._start([g.flat[a:g.offsets[names[-1]] + g[names[-1]].size]], self.all_comm)

    def _start(self, slices, comm=None):
        from mpi4py import MPI
        comm = self.comm if comm is None else comm
        for sl in slices:
            if not sl.size:
                continue
            buf = sl
            if self.device:
                import cupy
                buf = cupy.asnumpy(sl)  # synchronises the stream
                self.staged.append((sl, buf))
            self.requests.append(comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM))

    def wait(self):
        """Wait for every started bucket (and copy staged sums back to the device)."""
        for r in self.requests:
            wait_request(r)
        if self.staged:
            import cupy
            for dev, host in self.staged:
                dev[...] = cupy.asarray(host)
        self.requests, self.staged = [], []
