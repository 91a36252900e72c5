"""Scaling studies behind ``python -m mgnn bench scaling``: layer-parallel MGRIT against serial
training, naive layer-wise model parallelism and a GPipe-style pipeline on the same network, ranks
and batch, with a calibrated cost model next to every measured speedup.

Run it under ``mpiexec -n P`` (every study point uses the first p <= P ranks; the others sleep),
or without MPI, in which case it launches ``mpiexec -n max(ranks)`` itself.
"""
import csv
import io
import json
import os
import sys
import tempfile
import time

import numpy as np

from ..backend import get_backend
from .bench import median_time
from ..mgrit import MGRITOptions, cycle_work, level_sizes, solve_critical_path
from ..blocks.composed import StepContext
from ..comm import polled_barrier
from ..comm.halo import ping_pong
from ..network import (AdjointPropagator, ForwardPropagator, LayerParallel, conv_resnet,
                      dense_resnet, gru_classifier)
from .pipeline import PipelineParallel

#: Every output field, as ``--help`` and the JSON header document it.
FIELDS = {
    "study": "strong (fixed network, more ranks) | weak (layers per rank fixed) | sweep-<key>",
    "method": "serial | layerwise (each rank its block, sequential hand-off) | pipeline "
              "(GPipe, M micro-batches) | mgrit (layer-parallel MGRIT, overlap on) | "
              "mgrit-nooverlap | mgrit-spatial (conv: MGRIT with spatial coarsening)",
    "model": "dense (ResNet over layers) | gru (GRU over N time steps, hidden = width; no "
             "pipeline baseline) | conv (conv ResNet on 28 x 28 images, width = channels)",
    "spatial": "levels coarsened in space below them (mgrit-spatial; '-' for none)",
    "ranks": "MPI processes P used for the point",
    "micro_batches": "M for the pipeline (0 otherwise)",
    "n_layers": "residual layers N", "width": "state width", "batch": "batch size",
    "dtype": "the network's dtype (dense: --dtype, default float64; conv float32; gru "
             "float64)",
    "activation": "sigma of the opening and the residual layers (dense: --activation, default "
                  "tanh)",
    "levels": "MGRIT max levels", "cf": "coarsening factor",
    "fwd_iters": "forward MGRIT cycles", "bwd_iters": "adjoint MGRIT cycles",
    "time_s": "median wall time of one training step (loss and gradient), ranks synchronised",
    "speedup": "serial time of the same network and batch (one process, measured in the same "
               "study point while the other ranks sleep) / time_s",
    "predicted_s": "cost-model time: critical-path layer steps x t_step + messages x t_msg",
    "predicted_speedup": "cost-model serial time / predicted_s",
    "model_efficiency": "speedup / predicted_speedup (1 = the model explains the run)",
    "parallel_efficiency": "speedup / ranks",
    "exposed_halo_pct": "MGRIT: time blocked on halo receives / receive posted-to-completed",
    "steps_s": "per-phase time of the last step, slowest rank: step kernels",
    "halo_wait_s": "... blocked on halo messages", "allreduce_s": "... in reductions",
    "other_s": "... everything else (vector kernels, Python, loss)",
    "work_per_cycle": "MGRIT: layer steps per forward cycle (mean over the cycles) / N in "
                      "fine-step equivalents (a step on coarsened images costs their pixel "
                      "ratio)",
    "work_per_step": "layer steps of the whole training step / N, fine-step equivalents "
                     "(serial: 3)",
    "t_step_us": "one layer step (mean of forward and adjoint), measured in the same run",
    "t_msg_us": "one boundary message one way (ping-pong / 2), measured in the same run",
    "oversubscribed": "more ranks than cores (timings then measure sharing, not scaling)",
}


def _max_op():
    from mpi4py import MPI
    return MPI.MAX


def _time_step(obj, x, y, comm, repeats):
    for _ in range(2):
        obj.loss_and_grad(x, y)
    times = []
    for _ in range(repeats):
        if comm is not None:
            comm.Barrier()
        t0 = time.perf_counter()
        obj.loss_and_grad(x, y)
        if comm is not None:
            comm.Barrier()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


#: image edge of the conv studies (MNIST-sized)
CONV_IMAGE = 28


def _problem(cfg):
    """(model, x, y) of a configuration: the dense ResNet (width w, N layers, inputs of size
    w; ``cfg['dtype']`` and ``cfg['activation']``, default float64 tanh), with
    ``cfg['model'] == 'gru'`` a GRU over N time steps (hidden w, 4 features), with 'conv' a
    float32 conv ResNet with w channels on 28 x 28 images."""
    rng = np.random.default_rng(0)
    if cfg.get("model") == "conv":
        S = CONV_IMAGE
        model = conv_resnet(1, cfg["width"], (S, S), 10, cfg["n_layers"], dtype="float32",
                            seed=0)
        x = rng.standard_normal((cfg["batch"], 1, S, S)).astype(np.float32)
    elif cfg.get("model", "dense") == "gru":
        model = gru_classifier(4, cfg["width"], 10, cfg["n_layers"], seed=0)
        x = rng.standard_normal((cfg["batch"], cfg["n_layers"], 4))
    else:
        dtype = cfg.get("dtype") or "float64"
        model = dense_resnet(cfg["width"], cfg["width"], 10, cfg["n_layers"],
                             activation=cfg.get("activation") or "tanh", dtype=dtype, seed=0)
        x = rng.standard_normal((cfg["batch"], cfg["width"])).astype(dtype)
    return model, x, rng.integers(0, 10, cfg["batch"])


def _calibrate(model, x, comm):
    """(t_step, t_msg) in seconds, measured on the ranks of ``comm`` at once."""
    bk = get_backend("numba")
    N = model.n_layers
    u = np.tanh(np.random.default_rng(1).standard_normal(
        model.step.state_shape(x.shape[0]))).astype(model.dtype)
    ctx = StepContext(buffers=model.group_buffers())
    ctx.begin(x)
    d = model.step.linearize(model.step_params(), N - 1, u, bk, ctx)
    fp = ForwardPropagator(model, bk, ctx)
    ap = AdjointPropagator(model, {N - 1: u}, {N - 1: d}, bk, ctx)
    t = 0.5 * (median_time(lambda: fp.step(u, 0, 1, 0), repeats=5)
               + median_time(lambda: ap.step(u, 0, 1, 0), repeats=5))
    if comm is None or comm.Get_size() == 1:
        return t, 0.0
    P = comm.Get_size()
    t = comm.allreduce(t) / P
    buf = np.empty_like(u)
    comm.Barrier()
    t_msg = ping_pong(comm, u, buf, 50, tag=99)
    return t, comm.bcast(t_msg, root=0)


def _models(cfg, P, t_step, t_msg, spatial_cost=None):
    """Cost-model seconds per method for ``cfg`` on P ranks (and the serial reference);
    ``spatial_cost``: the level costs of the spatially coarsened run (mgrit-spatial)."""
    N = cfg["n_layers"]
    opts = MGRITOptions(cf=cfg["cf"], max_levels=cfg["levels"], nrelax=[0, 1])
    sizes = level_sizes(N, cfg["cf"], cfg["levels"], 2)

    def mgrit(p, cost=None):
        steps = msgs = 0.0
        for cycles in (cfg["fwd_iters"], cfg["bwd_iters"]):
            s, m = solve_critical_path(sizes, opts.nrelax_on, p, cycles, skip=True,
                                       level_cost=cost)
            steps, msgs = steps + s, msgs + m
        return (steps + 2 * N / p) * t_step + msgs * t_msg

    serial = 3 * N * t_step  # forward (+ stored sigma') and backward with parameter vjp
    out = {"serial": serial, "layerwise": serial + 2 * (P - 1) * t_msg,
           "mgrit": mgrit(P), "mgrit-nooverlap": mgrit(P), "mgrit@1": mgrit(1)}
    if spatial_cost is not None:
        out["mgrit-spatial"] = mgrit(P, spatial_cost[:len(sizes)])
    for M in cfg["micro"]:
        out[f"pipeline-{M}"] = serial / (M * P) * (M + P - 1) + 2 * (M + P - 2) * t_msg
    return out


def _work(cfg, fwd, bwd, lp):
    """{'work_per_cycle', 'work_per_step'} of a run (fine-step equivalents / N, the run's
    ``level_cost``); empty for runs without MGRIT."""
    if lp.fwd is None:
        return {}
    N = cfg["n_layers"]
    sizes = level_sizes(N, cfg["cf"], cfg["levels"], 2)
    cost = lp.level_cost[:len(sizes)]
    total, per_cycle = float(N), 0.0  # the parameter gradients
    for opts in (fwd, bwd):
        cycles = [cycle_work(sizes, opts.cf, opts.nrelax_on, opts.skip_downcycle and k == 0,
                             opts.cycle, level_cost=cost) for k in range(opts.max_iter)]
        total += sum(cycles) + sizes[0] - sizes[1]  # and the final F-relaxation
        if opts is fwd:
            per_cycle = sum(cycles) / len(cycles) / N
    return {"work_per_cycle": per_cycle, "work_per_step": total / N}


def _config_fields(cfg, model):
    """The configuration columns of a row (:data:`FIELDS`): sizes, MGRIT settings, and the
    dtype and activation of ``model`` (the network :func:`_problem` built for ``cfg``)."""
    out = {k: cfg[k] for k in ("n_layers", "width", "batch", "levels", "cf", "fwd_iters",
                               "bwd_iters")}
    out.update(dtype=model.dtype.name, activation=model.config.get("activation", "-"))
    return out


def study_point(comm, cfg, repeats):
    """Every method at one configuration on the ranks of ``comm`` (None = 1 process).

    Returns rows (dicts with :data:`FIELDS`) on rank 0 of ``comm``, None elsewhere.
    """
    P = 1 if comm is None else comm.Get_size()
    rank = 0 if comm is None else comm.Get_rank()
    model, x, y = _problem(cfg)
    common = dict(cf=cfg["cf"], max_levels=cfg["levels"], nrelax=[0, 1], tol=0.0,
                  skip_downcycle=True)
    fwd = MGRITOptions(max_iter=cfg["fwd_iters"], **common)
    bwd = MGRITOptions(max_iter=cfg["bwd_iters"], **common)
    runs = {}
    if P > 1:
        runs["layerwise"] = LayerParallel(model, comm=comm)
    for M in (cfg["micro"] if model.step.fused else ()):  # GPipe: residual networks only
        if M <= cfg["batch"]:
            runs[f"pipeline-{M}"] = PipelineParallel(model, comm=comm, micro_batches=M)
    runs["mgrit"] = LayerParallel(model, fwd=fwd, bwd=bwd, comm=comm, guard=None)
    runs["mgrit-nooverlap"] = LayerParallel(model, fwd=fwd, bwd=bwd, comm=comm, overlap=False,
                                            guard=None)
    if cfg.get("spatial"):
        runs["mgrit-spatial"] = LayerParallel(model, fwd=fwd, bwd=bwd, comm=comm,
                                              spatial_levels=cfg["spatial"], guard=None)
    # the serial baseline of this very configuration: one process, the other ranks asleep
    serial_t = _time_step(LayerParallel(model), x, y, None, repeats) if rank == 0 else 0.0
    if comm is not None:
        polled_barrier(comm)
    spatial = ",".join(map(str, cfg.get("spatial") or ())) or "-"
    rows = [{"method": "serial", "micro_batches": 0, "key": "serial", "ranks": P,
             "time_s": serial_t, "exposed_halo_pct": 0.0, "model": cfg.get("model", "dense"),
             "spatial": spatial, "work_per_step": 3.0,
             **_config_fields(cfg, model)}]
    for name, obj in runs.items():
        t = _time_step(obj, x, y, comm, repeats)
        tim = obj.stats.get("timings", {})
        phases = {f"{k}_s": (tim.get(k, 0.0) if comm is None else
                             comm.allreduce(tim.get(k, 0.0), op=_max_op()))
                  for k in ("steps", "halo_wait", "allreduce", "other")}
        exposed = 0.0
        if name.startswith("mgrit"):
            tim = obj.stats.get("timings", {})
            w, tot = tim.get("recv_wait", 0.0), tim.get("halo_total", 0.0)
            if comm is not None:
                w, tot = comm.allreduce(w), comm.allreduce(tot)
            exposed = 100.0 * w / tot if tot > 0 else 0.0
        work = _work(cfg, fwd, bwd, obj)
        rows.append({**work, "spatial": spatial,
                     "method": name.split("-")[0] if name.startswith("pipeline") else name,
                     "micro_batches": int(name.split("-")[1]) if name.startswith("pipeline")
                     else 0, "key": name, "ranks": P, "time_s": t, "exposed_halo_pct": exposed,
                     **phases,
                     "model": cfg.get("model", "dense"),
                     **_config_fields(cfg, model)})
    t_step, t_msg = _calibrate(model, x, comm)
    models = _models(cfg, P, t_step, t_msg, runs["mgrit-spatial"].level_cost
                     if "mgrit-spatial" in runs else None)
    for r in rows:
        r.update(predicted_s=models[r["key"]], t_step_us=1e6 * t_step, t_msg_us=1e6 * t_msg,
                 oversubscribed=P > (os.cpu_count() or 1), serial_model_s=models["serial"])
    return rows if rank == 0 else None


def run_study(comm, ranks, studies, base, repeats, log=print):
    """All study points on the world communicator ``comm`` (size >= max(ranks)); rows on rank 0.

    ``studies``: list of (study name, cfg, ranks) tuples.
    """
    from mpi4py import MPI
    world_rank = comm.Get_rank()
    rows = []
    for study, cfg, plist in studies:
        for P in plist:
            sub = comm.Split(0 if world_rank < P else MPI.UNDEFINED, world_rank)
            if sub != MPI.COMM_NULL:
                t0 = time.perf_counter()
                out = study_point(sub, cfg, repeats)
                if out is not None:
                    for r in out:
                        r["study"] = study
                    rows += out
                    log(f"  {study:<14} P={P} N={cfg['n_layers']:<4} w={cfg['width']:<4} "
                        f"B={cfg['batch']:<4} L={cfg['levels']} cf={cfg['cf']}: "
                        f"{time.perf_counter() - t0:5.1f} s")
                sub.Free()
            polled_barrier(comm)
    return rows if world_rank == 0 else None


def finish_rows(rows):
    """Add speedups (against the serial row of the same configuration) and efficiencies."""
    def key(r):
        return (r["study"], r["ranks"], r["n_layers"], r["width"], r["batch"], r["levels"],
                r["cf"], r["fwd_iters"], r["bwd_iters"])
    serial = {key(r): r for r in rows if r["key"] == "serial"}
    for r in rows:
        s = serial.get(key(r))
        if s is None:
            continue
        r["speedup"] = s["time_s"] / r["time_s"]
        r["predicted_speedup"] = s["predicted_s"] / r["predicted_s"]
        r["model_efficiency"] = r["speedup"] / r["predicted_speedup"]
        r["parallel_efficiency"] = r["speedup"] / r["ranks"]
    return rows


def verdicts(rows):
    """Per configuration and P: the fastest method, and the least M at which the pipeline is
    faster than layer-parallel MGRIT (None if it never is, and on one rank, where neither runs
    anything in parallel)."""
    groups = {}
    for r in rows:
        k = (r["study"], r["n_layers"], r["width"], r["batch"], r["levels"], r["cf"], r["ranks"])
        groups.setdefault(k, []).append(r)
    out = []
    for k, rs in groups.items():
        best = min(rs, key=lambda r: r["time_s"])
        mg = next((r for r in rs if r["key"] == "mgrit"), None)
        pipes = sorted((r for r in rs if r["method"] == "pipeline"),
                       key=lambda r: r["micro_batches"])
        over = next((r["micro_batches"] for r in pipes if mg and r["time_s"] < mg["time_s"]),
                    None) if k[6] > 1 else None
        out.append({"study": k[0], "n_layers": k[1], "width": k[2], "batch": k[3],
                    "levels": k[4], "cf": k[5], "ranks": k[6], "fastest": best["key"],
                    "fastest_s": best["time_s"], "pipeline_overtakes_mgrit_at_M": over})
    return out


def format_table(rows, verdict_rows):
    """Plain-text table of the study."""
    lines = [f"{'study':<14} {'P':>2} {'N':>4} {'w':>4} {'B':>4} {'L':>2} {'cf':>2} "
             f"{'method':<16} {'time s':>8} {'speedup':>8} {'model':>7} {'model eff':>9} "
             f"{'exposed':>8} {'work/step':>9}"]
    for r in rows:
        lines.append(f"{r['study']:<14} {r['ranks']:>2} {r['n_layers']:>4} {r['width']:>4} "
                     f"{r['batch']:>4} {r['levels']:>2} {r['cf']:>2} {r['key']:<16} "
                     f"{r['time_s']:8.4f} {r.get('speedup', float('nan')):8.2f} "
                     f"{r.get('predicted_speedup', float('nan')):7.2f} "
                     f"{r.get('model_efficiency', float('nan')):9.2f} "
                     f"{r['exposed_halo_pct']:7.1f}% "
                     + (f"{r['work_per_step']:8.3f}N" if "work_per_step" in r else f"{'':>9}")
                     + ("  oversubscribed" if r["oversubscribed"] else ""))
    lines.append("")
    for v in verdict_rows:
        over = v["pipeline_overtakes_mgrit_at_M"]
        line = (f"{v['study']:<14} P={v['ranks']} N={v['n_layers']} w={v['width']} "
                f"B={v['batch']} L={v['levels']} cf={v['cf']}: fastest {v['fastest']}"
                f" ({v['fastest_s']:.4f} s)")
        if v["ranks"] > 1:  # on one rank neither pipelines nor MGRIT run anything in parallel
            line += f"; pipeline overtakes MGRIT at {'M=' + str(over) if over else 'no M tried'}"
        lines.append(line)
    return "\n".join(lines)


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic_write(path, data):
    """Write bytes ``data`` to ``path`` through a temporary file renamed over it; the file mode
    follows the umask (0644 under the usual 022), as for any file ``open`` creates."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _save_figure(fig, path):
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    _atomic_write(path, buf.getvalue())
    return path


def _legend_outside(ax):
    """Legend to the right of the axes, so that it never hides a line."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def plot_metric(rows, metric, ylabel):
    """Figure of ``metric`` per method against P (strong/weak) or the swept key (sweeps), one
    panel per study; ticks at the integer values measured, legends outside the panels."""
    import matplotlib.pyplot as plt
    studies = sorted({r["study"] for r in rows})
    fig, axes = plt.subplots(1, len(studies), figsize=(7 * len(studies), 4), squeeze=False)
    for ax, study in zip(axes[0], studies):
        rs = [r for r in rows if r["study"] == study and metric in r]
        xkey = study[len("sweep-"):] if study.startswith("sweep-") else "ranks"
        for key in sorted({r["key"] for r in rs}):
            pts = sorted((r[xkey], r[metric]) for r in rs if r["key"] == key)
            ax.plot(*zip(*pts), marker="o", label=key)
        if metric == "speedup":
            if xkey == "ranks":
                ps = sorted({r["ranks"] for r in rs})
                ax.plot(ps, ps, "k:", label="ideal")
            mg = sorted((r[xkey], r["predicted_speedup"]) for r in rs
                        if r["key"] == "mgrit" and "predicted_speedup" in r)
            if mg:
                ax.plot(*zip(*mg), "k--", label="mgrit cost model")
        ax.set_xticks(sorted({int(r[xkey]) for r in rs}))
        if xkey == "ranks":
            ax.set_xlabel(f"ranks P (oversubscribed beyond {os.cpu_count()} cores)")
        else:
            ax.set_xlabel(f"{xkey} (P = {rs[0]['ranks'] if rs else '?'})")
        ax.set_ylabel(ylabel)
        ax.set_title(study)
        ax.grid(alpha=0.3)
        _legend_outside(ax)
    fig.tight_layout()
    return fig


def plot_residuals(residuals):
    """Figure of the residual histories {name: [r_k]} against the cycle (integer ticks)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, hist in residuals.items():
        ax.semilogy(range(len(hist)), hist, marker="o", label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("cycle")
    ax.set_ylabel("residual (XBraid norm)")
    ax.set_title("MGRIT convergence, base configuration")
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    fig.tight_layout()
    return fig


def write_outputs(out_dir, rows, verdict_rows, residuals, meta):
    """scaling.csv, scaling.json and PNG plots (time, speedup, efficiency, residuals), each written
    atomically with the umask's file mode; returns the PNG paths."""
    os.makedirs(out_dir, exist_ok=True)
    names = ["study", "method", "key", "ranks", "micro_batches"] + \
        [k for k in FIELDS if k not in ("study", "method", "ranks", "micro_batches")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=names, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    _atomic_write(os.path.join(out_dir, "scaling.csv"), buf.getvalue().encode())
    doc = {"fields": FIELDS, "meta": meta, "rows": rows, "verdicts": verdict_rows,
           "residuals": residuals}
    _atomic_write(os.path.join(out_dir, "scaling.json"), json.dumps(doc, indent=1).encode())
    import matplotlib
    matplotlib.use("Agg")
    written = []
    for metric, ylabel in (("time_s", "time per training step [s]"), ("speedup", "speedup"),
                           ("parallel_efficiency", "parallel efficiency (speedup / P)")):
        path = os.path.join(out_dir, f"{metric.split('_')[0]}.png")
        written.append(_save_figure(plot_metric(rows, metric, ylabel), path))
    written.append(_save_figure(plot_residuals(residuals),
                                os.path.join(out_dir, "residuals.png")))
    return written


def residual_histories(cfg, cycles=10):
    """Forward and adjoint residual histories of the base configuration (one process), with
    and without its spatial coarsening."""
    model, x, y = _problem(cfg)
    out = {}
    for levels in sorted({2, cfg["levels"]}):
        opts = MGRITOptions(cf=cfg["cf"], max_levels=levels, nrelax=[0, 1], tol=0.0,
                            max_iter=cycles)
        depth = len(level_sizes(cfg["n_layers"], cfg["cf"], levels, opts.min_coarse))
        for spatial in ((), cfg.get("spatial") or ()):
            if spatial and any(lev >= depth - 1 for lev in spatial):
                continue  # that level does not exist in this hierarchy
            lp = LayerParallel(model, fwd=opts, bwd=opts, spatial_levels=spatial, guard=None)
            lp.loss_and_grad(x, y)
            tag = f", spatial {','.join(map(str, spatial))}" if spatial else ""
            out[f"forward, {levels} levels{tag}"] = lp.stats["forward"]["residuals"]
            out[f"adjoint, {levels} levels{tag}"] = lp.stats["adjoint"]["residuals"]
            if not cfg.get("spatial"):
                break
    return out


def plan(base, ranks, quick, sweeps):
    """The list of (study, cfg, ranks) points: strong and weak scaling plus one-key sweeps."""
    studies = [("strong", dict(base), ranks)]
    per_rank = max(base["n_layers"] // max(ranks), base["cf"] ** (base["levels"] - 1) * 2)
    for P in ranks:
        studies.append(("weak", dict(base, n_layers=per_rank * P), [P]))
    for key, values in sweeps.items():
        for v in values:
            studies.append((f"sweep-{key}", dict(base, **{key: v}), [max(ranks)]))
    return studies


def main(args, log=print):
    """Entry point of ``bench scaling`` (see ``python -m mgnn bench --help``)."""
    ranks = [int(p) for p in args.ranks.split(",")]
    model = getattr(args, "model", "dense")
    spatial = _spatial(getattr(args, "spatial_levels", None), model)
    dtype, activation = _dense_settings(args, model)
    base = dict(model=model, n_layers=args.n_layers, dtype=dtype, activation=activation,
                width=(args.channels or 4) if model == "conv" else args.width, spatial=spatial,
                batch=args.batch, levels=args.levels,
                cf=args.cf, fwd_iters=args.fwd_iters, bwd_iters=args.bwd_iters,
                micro=[int(m) for m in args.micro.split(",")])
    sweeps = {}
    for item in args.sweep or []:
        key, _, values = item.partition("=")
        if key not in ("n_layers", "width", "batch", "levels", "cf", "fwd_iters", "bwd_iters"):
            raise ValueError(f"--sweep key {key!r} unknown")
        sweeps[key] = [int(v) for v in values.split(",")]
    if args.quick:
        base.update(n_layers=min(base["n_layers"], 64))
        sweeps = sweeps or {"levels": [2, 3]}
    size = 1
    comm = None
    try:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        size = comm.Get_size()
    except ImportError:
        pass
    if size < max(ranks):
        if size > 1:
            raise ValueError(f"--ranks {args.ranks} needs {max(ranks)} MPI processes, have {size}")
        return _relaunch(args, max(ranks), log)
    rank = comm.Get_rank()
    studies = plan(base, ranks, args.quick, sweeps)
    if rank == 0:
        net = f"dense {dtype} {activation}" if model == "dense" else model
        log(f"scaling study ({net}): {len(studies)} configurations, ranks {ranks}, "
            f"{size} processes on {os.cpu_count()} cores, repeats {args.repeats}")
    rows = run_study(comm, ranks, studies, base, args.repeats, log=log if rank == 0 else print)
    if rank != 0:
        return None
    rows = finish_rows(rows)
    ver = verdicts(rows)
    res = residual_histories(base, cycles=6 if args.quick else 10)
    meta = {"cores": os.cpu_count(), "processes": size, "base": base, "repeats": args.repeats,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    files = write_outputs(args.out, rows, ver, res, meta)
    log(format_table(rows, ver))
    log("wrote " + ", ".join([os.path.join(args.out, "scaling.csv"),
                              os.path.join(args.out, "scaling.json")] + files))
    return rows


def _dense_settings(args, model):
    """(dtype, activation) of ``bench scaling``'s --dtype and --activation: the dense ResNet's
    (default float64 tanh); other models have their own, and naming them is a ValueError."""
    dtype, activation = getattr(args, "dtype", None), getattr(args, "activation", None)
    if model != "dense":
        for flag, v in (("--dtype", dtype), ("--activation", activation)):
            if v is not None:
                raise ValueError(f"bench scaling {flag} {v} needs --model dense, got --model "
                                 f"{model}")
        return None, None
    return dtype or "float64", activation or "tanh"


def _spatial(text, model):
    """--spatial-levels of ``bench scaling`` as a tuple (conv only; ValueError naming it)."""
    text = (text or "").strip()
    if not text:
        return ()
    if model != "conv":
        raise ValueError(f"bench scaling --spatial-levels {text} needs --model conv, got "
                         f"--model {model}")
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--spatial-levels must be comma-separated ints, got {text!r}") from None


def _relaunch(args, n, log):
    """Run this study under ``mpiexec -n n`` (when started without MPI)."""
    import subprocess
    from .predict import _mpiexec
    mpiexec = _mpiexec()
    if mpiexec is None:
        raise ValueError("mpiexec not found (pip install 'mgnn[mpi]')")
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    argv = [a for a in sys.argv[1:]] if sys.argv and sys.argv[0].endswith("__main__.py") \
        else None
    if argv is None:
        raise ValueError(f"run this study under mpiexec -n {n}")
    log(f"launching: mpiexec -n {n} python -m mgnn {' '.join(argv)}")
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, "-m", "mgnn", *argv], env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the scaling study under mpiexec failed (exit {proc.returncode})")
    return []
