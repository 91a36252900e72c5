"""Spatial coarsening studies (``python -m mgnn bench spatial`` and ``bench spatial-step``).

* :func:`convergence_table`: residual per MGRIT cycle, forward and adjoint, with and without
  spatial coarsening, for conv ResNets on 2D (MNIST-size) and 3D volumes, and the work per cycle
  in fine-step equivalents (a step on a level coarsened k times costs (1/2^d)^k of a fine one,
  d = 2 or 3; counted from the propagators' actual calls).
* :func:`training_step`: one setting timed as a user runs it (serial, or every rank of
  ``mpiexec -n P``): time per training step and both residual histories.
* :func:`mgrit_comparison` (``bench mgrit``'s conv rows): serial, MGRIT and MGRIT with spatial
  coarsening at the same settings, time per training step against the work in fine-step
  equivalents.
"""
import time

import numpy as np

from ..mgrit import MGRITOptions, level_sizes


class _Counter:
    """A scalar propagator that counts its steps per level (the call structure of a solve)."""

    fresh_outputs = True

    def __init__(self):
        self.counts = {}

    def step(self, u, start, stop, level):
        self.counts[level] = self.counts.get(level, 0) + 1
        return u * 0.5


def level_counts(n_layers, opts):
    """{level: steps} of one solve of ``n_layers`` under ``opts`` (one rank)."""
    c = _Counter()
    from ..mgrit import MGRITSolver
    MGRITSolver(c, n_layers, opts).solve(np.ones(1))
    return c.counts


def work_per_cycle(counts, spatial, ndim, n_layers, cycles):
    """Layer evaluations per cycle and layer in fine-step equivalents: a step on a level
    coarsened k times in space costs (1/2^ndim)^k of a fine one."""
    total = 0.0
    for level, c in counts.items():
        k = sum(1 for lev in spatial if lev < level)
        total += c * (0.5 ** ndim) ** k
    return total / max(cycles, 1) / n_layers


def _data(size, batch, seed, volumes):
    """A batch of real images (MNIST when ``MGNN_MNIST_DIR`` is set, else digits upsampled) or of
    the synthetic volumes."""
    from ..data import load_volumes
    if volumes:
        ds = load_volumes(size[0], n_train=max(batch, 64), n_test=6, seed=seed)
        x, y = ds.x_train[:batch].astype(np.float64), ds.y_train[:batch]
    else:
        import os
        from ..data import load_digits, load_mnist
        if os.environ.get("MGNN_MNIST_DIR"):
            ds = load_mnist(limit_train=batch, limit_test=1)
            x = ds.x_train
        else:
            ds = load_digits()
            x = np.kron(ds.x_train[:batch], np.ones((1, 1, 4, 4)))[:, :, :28, :28]
        x, y = x[:, :, :size[0], :size[1]], ds.y_train[:batch]
    return (x - x.mean()) / (x.std() or 1.0), y


def convergence_case(size, n_layers=32, channels=4, batch=8, cf=4, levels=3, spatial=(0,),
                     cycles=6, interp="linear", restrict="full", seed=0, backend="numba"):
    """Residual histories (forward and adjoint, ``cycles`` fixed cycles, FCF on coarse levels)
    and the work per cycle of one conv ResNet setting; returns a dict."""
    import mgnn
    from ..network import LayerParallel
    volumes = len(size) == 3
    model = mgnn.conv_resnet(1, channels, size, 6 if volumes else 10, n_layers, seed=seed)
    x, y = _data(size, batch, seed, volumes)
    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=[0, 1], tol=0.0, max_iter=cycles,
                        warn_not_converged=False)
    lp = LayerParallel(model, fwd=opts, bwd=opts, backend=backend, spatial_levels=spatial,
                       interp=interp, restrict=restrict, guard=None)
    t0 = time.perf_counter()
    lp.loss_and_grad(x, y)
    seconds = time.perf_counter() - t0
    row = {"size": "x".join(map(str, size)), "layers": n_layers, "cf": cf, "levels": levels,
           "spatial": ",".join(map(str, spatial)) or "-", "interp": interp,
           "forward": lp.stats["forward"]["residuals"],
           "adjoint": lp.stats["adjoint"]["residuals"], "seconds": seconds}
    counts = level_counts(n_layers, opts)
    row["work_per_cycle"] = work_per_cycle(counts, spatial, len(size), n_layers, cycles)
    row["fine_share"] = work_per_cycle({0: counts.get(0, 0)}, (), len(size), n_layers, cycles)
    return row


def convergence_table(quick=False, backend="numba"):
    """Every setting of the study (2D 28x28 and 3D 32^3 (16^3 with ``quick``); cf 2 and 4;
    2-4 levels; without and with spatial coarsening)."""
    rows = []
    size3 = (16, 16, 16) if quick else (32, 32, 32)
    for size, n_layers in (((28, 28), 32), (size3, 16 if quick else 32)):
        for cf, levels in ((2, 3), (4, 2), (4, 3), (2, 4)):
            if levels == 4 and quick:
                continue
            for spatial in ((), (0,), tuple(range(levels - 1))):
                if spatial == (0,) and levels == 2 and rows and rows[-1]["spatial"] == "0":
                    continue
                rows.append(convergence_case(size, n_layers=n_layers, cf=cf, levels=levels,
                                             spatial=spatial, cycles=4 if quick else 6,
                                             backend=backend))
    return rows


def format_convergence(rows):
    """The table: residual after each cycle relative to the first, and the work per cycle."""
    lines = [f"{'size':>9} {'N':>4} {'cf':>3} {'lev':>4} {'spatial':>8} "
             f"{'work/cycle':>10} {'fine':>6}  forward r_k/r_0 per cycle | adjoint r_k/r_0"]
    for r in rows:
        f = " ".join(f"{v / r['forward'][0]:.1e}" for v in r["forward"][1:])
        a = " ".join(f"{v / r['adjoint'][0]:.1e}" for v in r["adjoint"][1:])
        work, fine = f"{r['work_per_cycle']:.2f}", f"{r['fine_share']:.2f}"
        lines.append(f"{r['size']:>9} {r['layers']:>4} {r['cf']:>3} {r['levels']:>4} "
                     f"{r['spatial']:>8} {work:>10} {fine:>6}  {f} | {a}")
    return "\n".join(lines)


def training_step(size=(31, 31, 31), n_layers=128, channels=4, batch=4, cf=4, levels=3,
                  spatial=(0,), fwd_iters=2, bwd_iters=1, repeats=2, comm=None,
                  backend="numba", seed=0):
    """Time per training step (median of ``repeats`` after one untimed step) of the peer's
    setting: F-relaxation on the fine level, FCF on coarse ones; returns a dict (every rank)."""
    import mgnn
    from ..network import LayerParallel
    volumes = len(size) == 3
    model = mgnn.conv_resnet(1, channels, size, 6 if volumes else 10, n_layers,
                             dtype="float32", seed=seed)
    x, y = _data(size, batch, seed, volumes)
    x = x.astype(np.float32)
    fwd = MGRITOptions(cf=cf, max_levels=levels, nrelax=[0, 1], tol=0.0, max_iter=fwd_iters,
                       warn_not_converged=False)
    bwd = MGRITOptions(cf=cf, max_levels=levels, nrelax=[0, 1], tol=0.0, max_iter=bwd_iters,
                       warn_not_converged=False)
    lp = LayerParallel(model, fwd=fwd, bwd=bwd, comm=comm, backend=backend,
                       spatial_levels=spatial, guard=None)
    lp.loss_and_grad(x, y)
    times = []
    for _ in range(repeats):
        if comm is not None:
            comm.Barrier()
        t0 = time.perf_counter()
        lp.loss_and_grad(x, y)
        times.append(time.perf_counter() - t0)
    if comm is not None:
        times = [comm.allreduce(t, op=_max_op()) for t in times]
    return {"size": "x".join(map(str, size)), "layers": n_layers, "channels": channels,
            "batch": batch, "spatial": ",".join(map(str, spatial)) or "-",
            "ranks": 1 if comm is None else comm.Get_size(),
            "seconds_per_step": float(np.median(times)),
            "forward": lp.stats["forward"]["residuals"],
            "adjoint": lp.stats["adjoint"]["residuals"]}


def _max_op():
    from mpi4py import MPI
    return MPI.MAX


def mgrit_comparison(size=(28, 28), n_layers=32, channels=4, batch=8, cf=4, levels=3,
                     fwd_iters=2, bwd_iters=1, spatial=(0,), repeats=5, backend="numba", seed=0):
    """MGRIT with and without spatial coarsening at the same settings, against the serial step
    (``bench mgrit``'s spatial rows; one process).

    Work is counted in fine-step equivalents: each level's steps of a solve (the solver's call
    structure, :func:`level_counts`) times the level's cost, ``LayerParallel.level_cost`` (the
    pixel ratio of its images: a coarse 3D step of 16^3 -> 8^3 is 1/8). A training step's work
    is the forward and adjoint solves plus one parameter-gradient evaluation per layer; the
    serial step's is 3 N. ``cost_model_ratio`` = time / (work x the serial step's time per
    evaluation): 1 means MGRIT costs exactly its work.

    Returns
    -------
    list of dict
        One per run ('serial', 'mgrit', 'mgrit-spatial'): seconds per training step, work per
        cycle and layer of each solve, work per step / N, the cost-model ratio and the residual
        histories.
    """
    import mgnn
    from .bench import median_time
    from ..network import LayerParallel
    volumes = len(size) == 3
    model = mgnn.conv_resnet(1, channels, size, 6 if volumes else 10, n_layers,
                             dtype="float32", seed=seed)
    x, y = _data(size, batch, seed, volumes)
    x = x.astype(np.float32)
    common = dict(cf=cf, max_levels=levels, nrelax=[0, 1], tol=0.0, warn_not_converged=False)
    fwd = MGRITOptions(max_iter=fwd_iters, **common)
    bwd = MGRITOptions(max_iter=bwd_iters, **common)
    name = (f"{'x'.join(map(str, size))} conv C={channels} N={n_layers} B={batch} cf={cf} "
            f"levels={levels} {fwd_iters}/{bwd_iters} cycles {backend}")
    runs = [("serial", LayerParallel(model, backend=backend), ())]
    runs += [("mgrit", LayerParallel(model, fwd=fwd, bwd=bwd, backend=backend,
                                     guard=None), ())]
    runs += [("mgrit-spatial", LayerParallel(model, fwd=fwd, bwd=bwd, backend=backend,
                                             spatial_levels=spatial, guard=None), spatial)]
    rows = []
    for key, lp, levs in runs:
        lp.loss_and_grad(x, y)  # compile
        t = median_time(lambda: lp.loss_and_grad(x, y), repeats=repeats, warmup=1)
        row = {"name": name, "run": key, "size": "x".join(map(str, size)),
               "spatial": ",".join(map(str, levs)) or "-", "seconds_per_step": t}
        if key == "serial":
            row.update(work_per_step=3.0, fwd_work_per_cycle=None, adj_work_per_cycle=None)
        else:
            work = n_layers  # the parameter gradients
            for part, opts, cycles in (("fwd", fwd, fwd_iters), ("adj", bwd, bwd_iters)):
                counts = level_counts(n_layers, opts)
                weighted = sum(c * lp.level_cost[lev] for lev, c in counts.items())
                sizes = level_sizes(n_layers, cf, levels, opts.min_coarse)
                final_f = sizes[0] - sizes[1]  # the solve's last F-relaxation, on level 0
                row[f"{part}_work_per_cycle"] = (weighted - final_f) / cycles / n_layers
                work += weighted
            row["work_per_step"] = work / n_layers
            row["forward"] = lp.stats["forward"]["residuals"]
            row["adjoint"] = lp.stats["adjoint"]["residuals"]
        rows.append(row)
    per_eval = rows[0]["seconds_per_step"] / (3.0 * n_layers)
    for r in rows:
        r["cost_model_ratio"] = r["seconds_per_step"] / (r["work_per_step"] * n_layers * per_eval)
        r["speedup_vs_serial"] = rows[0]["seconds_per_step"] / r["seconds_per_step"]
    return rows


def format_mgrit_comparison(rows):
    """Plain-text lines of :func:`mgrit_comparison`."""
    lines = [rows[0]["name"] if rows else ""]
    for r in rows:
        cyc = ("" if r["fwd_work_per_cycle"] is None else
               f"; work per cycle / N: forward {r['fwd_work_per_cycle']:.3f}, adjoint "
               f"{r['adj_work_per_cycle']:.3f}")
        res = ("" if "forward" not in r else
               f"; residuals fwd {r['forward'][-1]:.2e} adj {r['adjoint'][-1]:.2e}")
        lines.append(f"    {r['run']:<14} spatial {r['spatial']:<4} {1e3 * r['seconds_per_step']:9.2f}"
                     f" ms/step  work/step {r['work_per_step']:.3f} N (fine-step equivalents)"
                     f"{cyc}; time / (work x serial per evaluation) {r['cost_model_ratio']:.3f}"
                     f"; speedup vs serial {r['speedup_vs_serial']:.2f}{res}")
    return "\n".join(lines)
