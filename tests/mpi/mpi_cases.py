"""Programs run under ``mpiexec -n P python -m tests.mpi.mpi_cases CASE`` by tests/mpi/test_mpi.py.

Each case compares the distributed result with a single-process computation done on every rank
and raises (so mpiexec exits non-zero) on any mismatch; rank 0 prints one JSON summary line.
"""
import json
import os
import sys
import warnings

import numpy as np
from mpi4py import MPI

from mgnn import MGRITOptions, MGRITSolver
from mgnn.mgrit.partition import Partition, block_starts
from tests.mgrit.spatial_cases import StackedByStep

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


class Tanh:
    """u + (stop-start) h tanh(W_start u + b_start) on states (B, d)."""

    pull = False

    def __init__(self, n, d=3, seed=0, h=0.1):
        rng = np.random.default_rng(seed)
        self.W, self.b, self.h = rng.standard_normal((n, d, d)), rng.standard_normal((n, d)), h

    def step(self, u, start, stop, level):
        return u + (stop - start) * self.h * np.tanh(u @ self.W[start].T + self.b[start])


class PullTanh(Tanh):
    pull = True


class ReplicaTanh(Tanh):
    """Holds every layer: it can step any point of a coarse level on every rank."""

    def coarse_replica(self, level):
        return self


class ReplicaPullTanh(ReplicaTanh):
    pull = True


class BatchedReplicaTanh(Tanh):
    """Batched; its coarse replica is a plain (unbatched) stepper with the same layers."""

    batched = True

    def step_batch(self, us, starts, stops, level):
        return [self.step(u, a, b, level) for u, a, b in zip(us, starts, stops)]

    def coarse_replica(self, level):
        plain = Tanh.__new__(Tanh)
        plain.W, plain.b, plain.h = self.W, self.b, self.h
        return plain


class StackedPullTanh(StackedByStep, PullTanh):
    """PullTanh through the stacked protocol; like a GPU backend, ``points`` returns its squared
    norm in one 0-d array that the next call overwrites."""

    def __init__(self, n):
        super().__init__(n)
        self.norm = np.zeros(())

    def _norm(self, total):
        self.norm[()] = total
        return self.norm


def _close(a, b, rtol, what):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise AssertionError(f"rank {RANK}: {what}: shapes {a.shape} != {b.shape}")
    if b.size and not np.allclose(a, b, rtol=rtol, atol=rtol * max(1.0, float(np.abs(b).max()))):
        raise AssertionError(f"rank {RANK}: {what}: {a} != {b}")


def case_solver():
    configs = []
    for n in (13, 24, 37):
        for levels, cf in ((1, 2), (2, 2), (3, 2), (4, 2), (2, 4), (3, 3)):
            for nrelax in (0, 1, [0, 1]):
                for skip in (False, True):
                    for cycle in ("V", "F"):
                        configs.append((n, levels, cf, nrelax, skip, cycle))
    checked = 0
    for (n, levels, cf, nrelax, skip, cycle) in configs:
        if levels > 1 and n // cf < 2:
            continue
        if (n - 0) // cf + 1 < SIZE:
            continue
        opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=nrelax, tol=0.0, max_iter=3,
                            skip_downcycle=skip, cycle=cycle)
        try:
            MGRITSolver(Tanh(n), n, opts)
        except ValueError:
            continue  # hierarchy does not fit
        u0 = np.random.default_rng(n).standard_normal((2, 3))
        serial = MGRITSolver(Tanh(n), n, opts).solve(u0)
        for prop, overlap in ((Tanh(n), True), (PullTanh(n), True), (Tanh(n), False),
                              (ReplicaTanh(n), True), (ReplicaPullTanh(n), False),
                              (StackedPullTanh(n), True), (BatchedReplicaTanh(n), True)):
            solver = MGRITSolver(prop, n, opts, comm=COMM, overlap=overlap)
            redundant = isinstance(prop, (ReplicaTanh, BatchedReplicaTanh)) and SIZE > 1 and \
                len(solver.sizes) > 1
            if solver.coarsest != ("redundant" if redundant else "sequential"):
                raise AssertionError(f"rank {RANK}: coarsest {solver.coarsest} for {prop}")
            res = solver.solve(u0)
            if redundant and solver.redundant_solves == 0:
                raise AssertionError(f"rank {RANK}: no redundant coarsest solve for {opts}")
            if res.iterations != serial.iterations or len(res.residuals) != len(serial.residuals):
                raise AssertionError(f"rank {RANK}: cycle counts differ for {opts}")
            _close(res.residuals, serial.residuals, 1e-12, f"residuals {opts}")
            owned = [i for i, s in enumerate(res.states) if s is not None]
            if not owned:
                raise AssertionError(f"rank {RANK} owns no state")
            for i in owned:
                _close(res.states[i], serial.states[i], 1e-12, f"state {i} {opts}")
            if (res.final is not None) != (RANK == SIZE - 1):
                raise AssertionError(f"rank {RANK}: final on the wrong rank")
            checked += 1
    # an uneven, mirrored partition (the adjoint's) with pull semantics
    n = 29
    opts = MGRITOptions(cf=2, max_levels=3, nrelax=1, tol=0.0, max_iter=2)
    part = Partition(n, tuple(block_starts(n + 1, SIZE, 2)), tuple(range(SIZE))).mirrored()
    u0 = np.ones((2, 3))
    serial = MGRITSolver(PullTanh(n), n, opts).solve(u0)
    res = MGRITSolver(PullTanh(n), n, opts, comm=COMM, partition=part).solve(u0)
    _close(res.residuals, serial.residuals, 1e-12, "mirrored residuals")
    for i, s in enumerate(res.states):
        if s is not None:
            _close(s, serial.states[i], 1e-12, f"mirrored state {i}")
    if RANK == 0:
        print(json.dumps({"case": "solver", "ranks": SIZE, "configs": checked}))


def case_spatial():
    """Spatial coarsening (per-level state shapes): push, pull, redundant coarsest level and the
    stacked-free list engine at SIZE ranks on uneven splits equal the serial solve to 1e-12."""
    sys.path.insert(0, os.getcwd())
    from tests.mgrit.spatial_cases import StackedStencil, Stencil

    class Pull(Stencil):
        pull = True

    class Replica(Stencil):
        def coarse_replica(self, level):
            return self

    checked = 0
    for n_steps, width, levels, cf, spatial, cycle in (
            (29, 31, 3, 2, (0,), "V"), (37, 16, 3, 2, (0, 1), "F"), (48, 31, 3, 4, (1,), "V"),
            (40, 15, 4, 2, (0, 2), "V")):
        opts = MGRITOptions(cf=cf, max_levels=levels, tol=0.0, max_iter=3, min_coarse=2,
                            cycle=cycle)
        u0 = np.random.default_rng(n_steps).standard_normal((2, width))
        serial = MGRITSolver(Stencil(n_steps, spatial).shapes(width, levels), n_steps,
                             opts).solve(u0)
        for cls in (Stencil, Pull, Replica, StackedStencil):
            prop = cls(n_steps, spatial).shapes(width, levels)
            res = MGRITSolver(prop, n_steps, opts, comm=COMM).solve(u0)
            _close(res.residuals, serial.residuals, 1e-12, f"spatial residuals {cls.__name__}")
            for i, st in enumerate(res.states):
                if st is not None:
                    _close(st, serial.states[i], 1e-12, f"spatial state {i}")
            checked += 1
    if RANK == 0:
        print(json.dumps({"case": "spatial", "ranks": SIZE, "configs": checked}))


def case_reference():
    sys.path.insert(0, os.getcwd())
    from tests.mgrit.test_solver import CASES, _case
    for path in CASES:
        d, opts, prop, n, u0 = _case(path)
        res = MGRITSolver(prop, n, opts, comm=COMM).solve(u0)
        ref = d["xbraid"]
        if res.iterations != ref["iterations"]:
            raise AssertionError(f"{path}: {res.iterations} cycles, reference {ref['iterations']}")
        if np.max(np.abs(np.array(res.residuals) - ref["rnorms"])) > 1e-13:
            raise AssertionError(f"{path}: residuals {res.residuals} vs {ref['rnorms']}")
        if res.final is not None and np.max(np.abs(res.final - ref["final_state"])) > 1e-13:
            raise AssertionError(f"{path}: final state {res.final}")
    if RANK == 0:
        print(json.dumps({"case": "reference", "ranks": SIZE, "cases": len(CASES)}))


class Failing(Tanh):
    def step(self, u, start, stop, level):
        if RANK == SIZE - 1 and start >= 10:
            raise RuntimeError(f"user propagator failed at step {start}")
        return super().step(u, start, stop, level)


def case_fail():
    MGRITSolver(Failing(40), 40, MGRITOptions(cf=2, max_levels=3), comm=COMM).solve(
        np.ones((2, 3)))



def _nets(seed):
    """(kind, model, x (8, ...), y (8,)) for a dense and a conv network."""
    import mgnn
    rng = np.random.default_rng(seed)
    for kind, model, shape in (
            ("dense", mgnn.dense_resnet(5, 4, 3, 27, t_final=1.5, seed=1), (5,)),
            ("conv", mgnn.conv_resnet(1, 2, (4, 4), 3, 14, t_final=1.5, seed=1), (1, 4, 4))):
        yield kind, model, rng.standard_normal((8,) + shape), rng.integers(0, 3, 8)


def case_network():
    """LayerParallel on layer_ranks x data_ranks = SIZE equals the single-process result."""
    import mgnn
    data_ranks = int(sys.argv[2])
    checked = 0
    for kind, model, x, y in _nets(7):
        settings = [
            ("fixed cycles", MGRITOptions(cf=2, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=2,
                                          skip_downcycle=True),
             MGRITOptions(cf=2, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=1)),
            ("F-cycles", MGRITOptions(cf=3, max_levels=2, nrelax=1, tol=0.0, max_iter=2,
                                      cycle="F"),
             MGRITOptions(cf=3, max_levels=2, nrelax=1, tol=0.0, max_iter=2)),
            ("converged", MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=60),
             MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=60)),
            ("layer-wise", None, None),
        ]
        exact_loss, exact = mgnn.LayerParallel(model, backend="numpy").loss_and_grad(x, y)
        for (name, fwd, bwd), coarsest in [(st, c) for st in settings
                                           for c in ("redundant", "sequential")
                                           if st[1] is not None or c == "redundant"]:
            name = f"{name} {coarsest} coarsest"
            single = mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, backend="numba")
            loss1, g1 = single.loss_and_grad(x, y)
            lp = mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, comm=COMM, data_ranks=data_ranks,
                                    backend="numba", coarsest=coarsest)
            shard = np.array_split(np.arange(8), data_ranks)[lp.replica]
            loss, g = lp.loss_and_grad(x[shard], y[shard])
            full = lp.gather(g)
            _close(loss, loss1, 1e-12, f"{kind} {name} loss")
            for k in g1:
                _close(full[k], g1[k], 1e-11, f"{kind} {name} grad {k}")
            for part in ("forward", "adjoint"):
                _close(lp.stats[part]["residuals"], single.stats[part]["residuals"], 1e-11,
                       f"{kind} {name} {part} residuals")
            if fwd is not None and lp.layout.layer_size > 1:
                for kind_, opts_ in (("forward", fwd), ("adjoint", bwd)):
                    sv = lp._solver(kind_, opts_)
                    if sv.coarsest != coarsest or not sv.engine.stacked or \
                            (sv.redundant_solves > 0) != (coarsest == "redundant"):
                        raise AssertionError(f"rank {RANK}: {kind_} solver coarsest "
                                             f"{sv.coarsest}, stacked {sv.engine.stacked}")
            if name.split()[0] in ("converged", "layer-wise"):
                _close(loss, exact_loss, 1e-10, f"{kind} {name} vs backprop loss")
                for k in exact:
                    _close(full[k], exact[k], 1e-10, f"{kind} {name} vs backprop {k}")
            owned = lp.owned
            untouched = g.flat[~owned]
            if untouched.size and np.any(untouched != 0):
                raise AssertionError(f"rank {RANK}: gradient entries of other ranks' layers set")
            checked += 1
        # predictions on every rank equal the single process's
        lp = mgnn.LayerParallel(model, comm=COMM, data_ranks=data_ranks, backend="numba")
        if not np.array_equal(lp.predict(x), mgnn.LayerParallel(model).predict(x)):
            raise AssertionError(f"rank {RANK}: predictions differ")
    if RANK == 0:
        print(json.dumps({"case": "network", "ranks": SIZE, "data_ranks": data_ranks,
                          "checked": checked}))


def case_spatial_network():
    """Spatial coarsening in LayerParallel on layer ranks x data replicas = SIZE equals one
    process with the same options (fixed cycles) and serial backprop (converged); 2D and 3D."""
    import mgnn
    data_ranks = int(sys.argv[2])
    rng = np.random.default_rng(11)
    nets = [("2d", mgnn.conv_resnet(1, 2, (9, 8), 3, 14, seed=1), (1, 9, 8), (0,)),
            ("2d-two", mgnn.conv_resnet(1, 2, (8, 8), 3, 16, seed=2), (1, 8, 8), (0, 1)),
            ("3d", mgnn.conv_resnet(1, 2, (7, 6, 5), 3, 14, seed=3), (1, 7, 6, 5), (0,))]
    checked = 0
    for kind, model, shape, spatial in nets:
        x, y = rng.standard_normal((8,) + shape), rng.integers(0, 3, 8)
        exact_loss, exact = mgnn.LayerParallel(model, backend="numpy").loss_and_grad(x, y)
        for name, fwd, bwd in (
                ("fixed", MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=2),
                 MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=1)),
                ("converged", MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=60,
                                           warn_not_converged=False),
                 MGRITOptions(cf=2, max_levels=3, tol=1e-13, max_iter=60,
                              warn_not_converged=False))):
            single = mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, backend="numba",
                                        spatial_levels=spatial)
            loss1, g1 = single.loss_and_grad(x, y)
            lp = mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, comm=COMM, data_ranks=data_ranks,
                                    backend="numba", spatial_levels=spatial)
            shard = np.array_split(np.arange(8), data_ranks)[lp.replica]
            loss, g = lp.loss_and_grad(x[shard], y[shard])
            full = lp.gather(g)
            what = f"{kind} {name}"
            _close(loss, loss1, 1e-12, f"{what} loss")
            for k in g1:
                _close(full[k], g1[k], 1e-12, f"{what} grad {k}")
            for part in ("forward", "adjoint"):
                _close(lp.stats[part]["residuals"], single.stats[part]["residuals"], 1e-12,
                       f"{what} {part} residuals")
            if name == "converged":
                _close(loss, exact_loss, 1e-10, f"{what} vs backprop loss")
                for k in exact:
                    _close(full[k], exact[k], 1e-10, f"{what} vs backprop {k}")
            checked += 1
    if RANK == 0:
        print(json.dumps({"case": "spatial_network", "ranks": SIZE, "data_ranks": data_ranks,
                          "checked": checked}))


def case_bad_input():
    """Bad input on one rank: every rank raises the ValueError (no hang)."""
    import mgnn
    model = mgnn.dense_resnet(5, 4, 3, 8, seed=1)
    lp = mgnn.LayerParallel(model, comm=COMM, backend="numpy")
    x = np.ones((4, 5))
    if RANK == SIZE - 1:
        x[2, 3] = np.nan
    try:
        lp.loss_and_grad(x, np.zeros(4, dtype=np.int64))
    except ValueError as exc:
        msg = str(exc)
    else:
        raise AssertionError(f"rank {RANK}: no error")
    if "non-finite" not in msg or (RANK != SIZE - 1 and f"rank {SIZE - 1}" not in msg):
        raise AssertionError(f"rank {RANK}: unclear message {msg!r}")
    if RANK == 0:
        print(json.dumps({"case": "bad_input", "ranks": SIZE, "message": msg}))


def case_robustness():
    """Review findings: repeated solves keep earlier results; mismatched shards between layer
    ranks and a checkpoint that cannot be written raise on every rank instead of hanging."""
    import tempfile

    import mgnn
    from mgnn.train import distributed_checkpoint
    n = 4 * SIZE
    opts = MGRITOptions(max_levels=1)
    solver = MGRITSolver(Tanh(n), n, opts, comm=COMM)
    first = solver.solve(np.ones((2, 3)))
    kept = {i: s.copy() for i, s in enumerate(first.states) if s is not None}
    solver.solve(np.full((2, 3), 5.0))
    for i, s in kept.items():
        if not np.array_equal(first.states[i], s):
            raise AssertionError(f"rank {RANK}: state {i} of the first solve was overwritten")
    model = mgnn.dense_resnet(5, 4, 3, 8, seed=1)
    lp = mgnn.LayerParallel(model, comm=COMM, backend="numpy")
    batch = 3 if RANK == SIZE - 1 else 2
    try:
        lp.loss_and_grad(np.ones((batch, 5)), np.zeros(batch, dtype=np.int64))
    except ValueError as exc:
        if "batches of sizes" not in str(exc):
            raise
    else:
        raise AssertionError(f"rank {RANK}: mismatched shards accepted")
    blocker = os.path.join(tempfile.gettempdir(), f"mgnn-not-a-dir-{os.getppid()}")
    if RANK == 0:
        open(blocker, "w").close()
    COMM.Barrier()
    opt = mgnn.Adam(model.params.flat)
    try:
        distributed_checkpoint(os.path.join(blocker, "c.npz"), lp, opt, 1, 1,
                               np.random.default_rng(0))
    except ValueError as exc:
        if "cannot write checkpoint" not in str(exc):
            raise
    else:
        raise AssertionError(f"rank {RANK}: unwritable checkpoint accepted")
    COMM.Barrier()
    if RANK == 0:
        os.unlink(blocker)
        print(json.dumps({"case": "robustness", "ranks": SIZE}))


def case_pipeline():
    """GPipe baseline on SIZE stages (optionally x data replicas) equals serial backprop."""
    import mgnn
    from mgnn.studies.pipeline import PipelineParallel
    data_ranks = int(sys.argv[2])
    checked = 0
    for kind, model, x, y in _nets(3):
        loss0, g0 = mgnn.LayerParallel(model, backend="numpy").loss_and_grad(x, y)
        for micro in (1, 2, 4):
            pp = PipelineParallel(model, comm=COMM, micro_batches=micro, data_ranks=data_ranks)
            shard = np.array_split(np.arange(8), data_ranks)[pp.replica]
            if len(shard) < micro:
                continue
            loss, g = pp.loss_and_grad(x[shard], y[shard])
            full = pp.gather(g)
            _close(loss, loss0, 1e-12, f"pipeline {kind} M={micro} loss")
            for k in g0:
                _close(full[k], g0[k], 1e-11, f"pipeline {kind} M={micro} {k}")
            checked += 1
    if RANK == 0:
        print(json.dumps({"case": "pipeline", "ranks": SIZE, "checked": checked}))


def _composed_nets():
    """(name, factory) of networks with batch norm and/or dropout (composed steps)."""
    import mgnn
    return [
        ("dense bn", lambda: mgnn.dense_resnet(5, 4, 3, 12, seed=2, batch_norm=True), (5,)),
        ("conv bn", lambda: mgnn.conv_resnet(1, 2, (4, 4), 3, 9, seed=2, batch_norm=True),
         (1, 4, 4)),
        ("conv bn dropout", lambda: mgnn.conv_resnet(1, 2, (4, 4), 3, 9, seed=2,
                                                     batch_norm=True, dropout=0.3), (1, 4, 4)),
        ("dense dropout", lambda: mgnn.dense_resnet(5, 4, 3, 12, seed=2, dropout=0.5), (5,)),
    ]


def _per_replica_bn(data_ranks, rng):
    """Per-replica batch norm (sync_bn=False): the loss and gradient are those of one process
    per shard combined by shard size; every replica's running statistics are replica 0's."""
    import mgnn
    checked = 0
    for name, make, shape in _composed_nets()[:2]:
        x, y = rng.standard_normal((9,) + shape), rng.integers(0, 3, 9)
        shards = np.array_split(np.arange(9), data_ranks)
        lp = mgnn.LayerParallel(make(), comm=COMM, data_ranks=data_ranks, backend="numba")
        loss, g = lp.loss_and_grad(x[shards[lp.replica]], y[shards[lp.replica]])
        full = lp.gather(g)
        want_loss, want = 0.0, 0.0
        for r, idx in enumerate(shards):
            one = make()
            l_r, g_r = mgnn.LayerParallel(one, backend="numba").loss_and_grad(x[idx], y[idx])
            want_loss += l_r * len(idx) / 9
            want = want + g_r.flat * (len(idx) / 9)
            if r == 0:
                buffers0 = one.buffers.copy()
        _close(loss, want_loss, 1e-12, f"per-replica {name} loss")
        _close(full.flat, want, 1e-11, f"per-replica {name} gradient")
        _close(lp.gather_buffers(), buffers0.flat, 1e-12, f"per-replica {name} buffers")
        lo, hi = lp.layers.start, lp.layers.stop  # every replica holds replica 0's statistics
        for k, v in lp.model.buffers.items():
            _close(v[lo:hi], buffers0[k][lo:hi], 1e-12, f"per-replica {name} {k} on this rank")
        checked += 1
    return checked


def case_composed():
    """Batch norm (sync_bn) and dropout: layer ranks x data replicas = SIZE equal one process
    on the whole batch (two training steps, a full and a ragged batch: uneven shards, a shard of
    one sample), running statistics included."""
    import mgnn
    data_ranks = int(sys.argv[2])
    rng = np.random.default_rng(5)
    ragged = max(3, data_ranks + 1)  # uneven shards, one of a single sample
    checked = 0
    fixed = (MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=2, skip_downcycle=True),
             MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=1))
    for name, make, shape in _composed_nets():
        batches = [(rng.standard_normal((8,) + shape), rng.integers(0, 3, 8)),
                   (rng.standard_normal((ragged,) + shape), rng.integers(0, 3, ragged))]
        for fwd, bwd in (fixed, (None, None)):
            one, many = make(), make()
            single = mgnn.LayerParallel(one, fwd=fwd, bwd=bwd, backend="numba")
            lp = mgnn.LayerParallel(many, fwd=fwd, bwd=bwd, comm=COMM, data_ranks=data_ranks,
                                    backend="numba", sync_bn=True)
            for step, (x, y) in enumerate(batches):
                loss1, g1 = single.loss_and_grad(x, y)
                shard = np.array_split(np.arange(len(y)), data_ranks)[lp.replica]
                loss, g = lp.loss_and_grad(x[shard], y[shard])
                full = lp.gather(g)
                what = f"{name} {'mgrit' if fwd else 'layer-wise'} step {step}"
                _close(loss, loss1, 1e-12, f"{what} loss")
                for k in g1:
                    _close(full[k], g1[k], 1e-11, f"{what} grad {k}")
                if len(one.buffers):
                    _close(lp.gather_buffers(), one.buffers.flat, 1e-12, f"{what} buffers")
                one.params.flat[:] -= 0.1 * g1.flat  # the same update: step 2 sees new weights
                many.params.flat[:] -= 0.1 * full.flat
                checked += 1
            _close(lp.logits(batches[0][0]), single.logits(batches[0][0]), 1e-12,
                   f"{name} eval-mode logits")
    if data_ranks > 1:
        checked += _per_replica_bn(data_ranks, rng)
    if RANK == 0:
        print(json.dumps({"case": "composed", "ranks": SIZE, "data_ranks": data_ranks,
                          "checked": checked}))


def case_recurrent():
    """GRU / RNN over sequence time: sequence ranks x data replicas = SIZE equal one process
    (sequence length 13: no rank count here divides it), MGRIT and step after step."""
    import mgnn
    data_ranks = int(sys.argv[2])
    rng = np.random.default_rng(8)
    checked = 0
    fixed = (MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=2, skip_downcycle=True),
             MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=1))
    makers = [("gru", lambda: mgnn.gru_classifier(3, 4, 3, 13, n_layers=2, seed=1)),
              ("gru rediscretised", lambda: mgnn.gru_classifier(3, 4, 3, 13, seed=1,
                                                                coarse="rediscretise")),
              ("implicit gru", lambda: mgnn.gru_classifier(3, 4, 3, 13, cell="implicit_gru",
                                                           coarse="implicit", seed=1)),
              ("rnn", lambda: mgnn.rnn_classifier(3, 4, 3, 13, n_layers=2, seed=1))]
    x, y = rng.standard_normal((7, 13, 3)), rng.integers(0, 3, 7)
    for name, make in makers:
        for fwd, bwd in (fixed, (None, None)):
            model = make()
            single = mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, backend="numba")
            loss1, g1 = single.loss_and_grad(x, y)
            lp = mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, comm=COMM, data_ranks=data_ranks,
                                    backend="numba")
            shard = np.array_split(np.arange(len(y)), data_ranks)[lp.replica]
            loss, g = lp.loss_and_grad(x[shard], y[shard])
            what = f"{name} {'mgrit' if fwd else 'step after step'}"
            _close(loss, loss1, 1e-12, f"{what} loss")
            for k in g1:  # shared weights: the whole sum on every rank, before any gather
                if k.startswith(model.step_prefix):
                    _close(g[k], g1[k], 1e-11, f"{what} grad {k} on this rank")
            full = lp.gather(g)
            for k in g1:
                _close(full[k], g1[k], 1e-11, f"{what} gathered grad {k}")
            _close(lp.grad_norm(g), np.linalg.norm(g1.flat), 1e-11, f"{what} gradient norm")
            if not np.array_equal(lp.predict(x), single.predict(x)):
                raise AssertionError(f"rank {RANK}: {what} predictions differ")
            checked += 1
    if RANK == 0:
        print(json.dumps({"case": "recurrent", "ranks": SIZE, "data_ranks": data_ranks,
                          "checked": checked}))


def case_guard():
    """The gradient guard on layer ranks x data replicas = SIZE: every rank takes the same
    decisions as one process, and the gradients equal the one process's (accepted MGRIT steps,
    iterating further, and exact fallbacks on an oscillating GRU)."""
    import mgnn
    from tests.guard_models import oscillator_gru, sequences
    data_ranks = int(sys.argv[2])
    opts = dict(tol=0.0, warn_not_converged=False)
    cases = [
        ("dense accept", lambda: mgnn.dense_resnet(5, 4, 3, 24, activation="relu", seed=1),
         (5,), MGRITOptions(cf=2, max_levels=3, max_iter=2, skip_downcycle=True, **opts),
         MGRITOptions(cf=2, max_levels=3, max_iter=1, **opts), dict(check_every=2)),
        ("dense iterate", lambda: mgnn.dense_resnet(5, 4, 3, 24, activation="relu", seed=1),
         (5,), MGRITOptions(cf=2, max_levels=2, max_iter=1, **opts),
         MGRITOptions(cf=2, max_levels=2, max_iter=1, **opts), dict(tol=0.02)),
        ("oscillator fallback", lambda: oscillator_gru(64), None,
         MGRITOptions(cf=4, max_levels=2, max_iter=2, **opts),
         MGRITOptions(cf=4, max_levels=2, max_iter=1, **opts), dict(backoff=1)),
    ]
    checked = 0
    for name, make, shape, fwd, bwd, kw in cases:
        rng = np.random.default_rng(3)
        if shape is None:
            batches = [sequences(8, 64, seed=s) for s in range(4)]
        else:
            batches = [(rng.standard_normal((8,) + shape), rng.integers(0, 3, 8))
                       for _ in range(4)]
        runs = []
        for comm in (None, COMM):
            model = make()
            lp = mgnn.LayerParallel(model, fwd=fwd, bwd=bwd, comm=comm, backend="numba",
                                    data_ranks=1 if comm is None else data_ranks,
                                    guard=mgnn.GradientGuard(**kw))
            opt = mgnn.SGD(model.params.flat, lr=0.1)
            losses, grads, actions, errors = [], [], [], []
            for x, y in batches:
                shard = np.array_split(np.arange(len(y)), lp.layout.data_ranks)[lp.replica]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loss, g = lp.loss_and_grad(x[shard], y[shard])
                full = lp.gather(g) if comm is not None else g
                losses.append(loss)
                grads.append(full.flat.copy())
                actions.append(lp.stats["guard"]["action"])
                errors.append(lp.stats["guard"]["error"])
                opt.step(g.flat)
                if comm is not None:  # every rank holds the whole model again
                    model.params.flat[:] = lp.gather_params()
            runs.append((losses, grads, actions, errors))
        (l1, g1, a1, e1), (l, g, a, e) = runs
        if [v is None for v in e] != [v is None for v in e1]:
            raise AssertionError(f"rank {RANK}: {name}: checks at {e} vs one process {e1}")
        # the check's error is over every rank's parameters, as in one process
        _close([v for v in e if v is not None], [v for v in e1 if v is not None], 1e-8,
               f"{name} check errors")
        everyone = COMM.allgather(a)
        if any(other != a1 for other in everyone):
            raise AssertionError(f"rank {RANK}: {name}: decisions {everyone} vs one process {a1}")
        want = {"dense accept": {"accept"}, "dense iterate": {"iterate", "accept"},
                "oscillator fallback": {"fallback", "exact"}}[name]
        if set(a1) != want:
            raise AssertionError(f"{name}: decisions {a1}, expected {sorted(want)}")
        _close(l, l1, 1e-10, f"{name} losses")
        for k, (u, v) in enumerate(zip(g, g1)):
            _close(u, v, 1e-9, f"{name} gradient of step {k}")
        checked += 1
    if RANK == 0:
        print(json.dumps({"case": "guard", "ranks": SIZE, "data_ranks": data_ranks,
                          "checked": checked}))


def case_captured():
    """Captured cycles on layer ranks x data replicas = SIZE (halo messages replayed between
    the tape's segments): three training steps (parameters updated between them) equal the
    uncaptured engine's bit for bit, for dense, conv and GRU networks, both coarsest modes,
    fixed, converged and F-cycles (4 levels: some ranks own no coarsest point); the replayed
    tapes hold message actions (GRU too: its own tape drivers); and equal a
    run that evaluates the linearisation of every layer again instead of keeping the final
    sweep's."""
    import mgnn
    from mgnn.optim import SGD
    from mgnn.propagators import ForwardPropagator
    keeps = ForwardPropagator.can_keep_derivs
    data_ranks = int(sys.argv[2])
    rng = np.random.default_rng(3)
    nets = [(k, m, x, y) for k, m, x, y in _nets(5)]
    nets.append(("gru", mgnn.gru_classifier(3, 4, 3, 13, n_layers=1, seed=1),
                 rng.standard_normal((8, 13, 3)), rng.integers(0, 3, 8)))
    settings = [("fixed", MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=2,
                                       skip_downcycle=True),
                 MGRITOptions(cf=2, max_levels=3, tol=0.0, max_iter=1)),
                ("converged", MGRITOptions(cf=2, max_levels=3, tol=1e-10, max_iter=40),
                 MGRITOptions(cf=2, max_levels=3, tol=1e-10, max_iter=40)),
                ("F-cycles, 4 levels", MGRITOptions(cf=2, max_levels=4, min_coarse=1, tol=0.0,
                                                    max_iter=2, cycle="F", nrelax=[0, 1]),
                 MGRITOptions(cf=2, max_levels=4, min_coarse=1, tol=0.0, max_iter=1,
                              cycle="F"))]
    checked = segmented = 0
    for kind, model, x, y in nets:
        for name, fwd, bwd in settings:
            for coarsest in ("redundant", "sequential"):
                runs = []
                # a third run that evaluates the linearisation of every layer again (the final
                # sweep's kept sigma' / gate caches must give the same bits on layer ranks too)
                variants = [(True, True), (False, True), (True, False)]
                for capture, keep in variants:
                    m = model
                    params = m.params.flat.copy()
                    if not keep:
                        ForwardPropagator.can_keep_derivs = lambda self: False
                    lp = mgnn.LayerParallel(m, fwd=fwd, bwd=bwd, comm=COMM,
                                            data_ranks=data_ranks, backend="numba",
                                            coarsest=coarsest, capture=capture, guard=None)
                    shard = np.array_split(np.arange(len(y)), data_ranks)[lp.replica]
                    opt = SGD(m.params, lr=0.05)
                    out = []
                    for _ in range(3):
                        loss, g = lp.loss_and_grad(x[shard], y[shard])
                        out.append((loss, lp.gather(g).flat.copy(),
                                    [list(lp.stats[p]["residuals"])
                                     for p in ("forward", "adjoint")]))
                        opt.step(g)
                    m.params.flat[...] = params  # the next run starts from the same model
                    ForwardPropagator.can_keep_derivs = keeps
                    runs.append((out, lp))
                what = f"{kind} {name} {coarsest}"
                for other, differs in zip(runs[1:], ("uncaptured",
                                                     "the linearisation evaluated again")):
                    for (l1, g1, r1), (l2, g2, r2) in zip(runs[0][0], other[0]):
                        if l1 != l2 or not np.array_equal(g1, g2) or r1 != r2:
                            raise AssertionError(
                                f"rank {RANK}: {what}: captured differs from {differs} (loss "
                                f"{l1} vs {l2}, max grad diff {np.abs(g1 - g2).max()}, "
                                f"residuals {r1} vs {r2})")
                solvers = runs[0][1]._solvers.values()
                tapes = [t for sv in solvers for t in sv._tapes.values() if t and t.replays]
                if not any(sv.prop.captures for sv in solvers):  # a kind without tapes
                    if tapes:
                        raise AssertionError(f"rank {RANK}: {what}: tapes replayed")
                    checked += 1
                    continue
                if not tapes:
                    raise AssertionError(f"rank {RANK}: {what}: no tape was replayed")
                if runs[0][1].layout.layer_size > 1:
                    if not any(t.parts is not None for t in tapes):
                        raise AssertionError(f"rank {RANK}: {what}: no replayed tape has "
                                             "message actions")
                    segmented += 1
                checked += 1
    if RANK == 0:
        print(json.dumps({"case": "captured", "ranks": SIZE, "data_ranks": data_ranks,
                          "checked": checked, "segmented": segmented}))


if __name__ == "__main__":
    globals()[f"case_{sys.argv[1]}"]()
