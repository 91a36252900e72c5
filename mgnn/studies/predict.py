"""Calibrated predictions of the time per training step on P ranks: ``bench calibrate`` and
``bench predict``.

The prediction runs mgnn's real training code (``LayerParallel``, ``PipelineParallel``, the
MGRIT solver, their messages and collectives) on P virtual ranks
(:func:`mgnn.comm.virtual.run_virtual`) with a cost-only model (:func:`mgnn.studies.costs.cost_model`):
every kernel call charges its calibrated time, every message ``alpha + bytes / beta``. Methods:

* ``serial``: one process, layer after layer (``LayerParallel(model)``);
* ``layerwise``: each rank its block of layers, the state handed from rank to rank
  (``LayerParallel(model, comm)``);
* ``pipeline``: GPipe with M micro-batches (``PipelineParallel(model, comm, M)``);
* ``mgrit``: layer-parallel MGRIT (``LayerParallel(model, fwd, bwd, comm)``).

``cores`` models running more ranks than cores on one machine (the validation runs here): with
P > cores every compute charge is stretched by ``1 + (ceil(P / cores) - 1) u``, ``u`` the ranks'
mean compute fraction in the run without sharing: the busiest core holds ceil(P / cores) ranks
and a coupled step moves at its pace (:func:`core_stretch`), and every message costs the table's ``meta["oversubscribed_hop_s"]`` more (0 unless set: ``bench
predict --oversubscribed-hop US``): a rank whose message arrives while the cores run other ranks
waits for one of them to yield. A ping-pong does not show it (two ranks that only message each
other stay scheduled), so it is a fitted parameter, not a measured one.
"""
import contextlib
import gc
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from ..comm.halo import ping_pong
from ..comm.virtual import Network, run_virtual
from .costs import (CostTable, Recorder, cost_model, machine_meta, recording_model,
                    vector_samples, with_tape_entries)

#: Networks with published figures (docs/virtual_ranks.md cites the sources): alpha s, beta B/s
NETWORKS = {
    "shared": {"alpha": 0.4e-6, "beta": 10e9,
               "what": "shared memory inside one node (MPICH/Open MPI intra-node, CPU buffers)"},
    "ib-hdr": {"alpha": 1.0e-6, "beta": 24e9,
               "what": "InfiniBand HDR 200 Gb/s between nodes (ConnectX-6)"},
    "nvlink": {"alpha": 2.0e-6, "beta": 400e9,
               "what": "NVLink 4 / NVSwitch between GPUs of one node (H100/H200 SXM, "
                       "CUDA-aware MPI)"},
}
METHODS = ("serial", "layerwise", "pipeline", "mgrit")


def default_config(**kw):
    """The network and MGRIT configuration of a prediction (``bench predict``'s flags)."""
    cfg = dict(model="dense", n_layers=256, width=64, in_features=None, channels=8,
               image_size=28, batch=128, dtype="float32", levels=3, cf=4, fwd_iters=2,
               bwd_iters=1, coarsest="redundant", micro=(4,), spatial_levels=(), backend="numba",
               data_ranks=1)
    unknown = set(kw) - set(cfg)
    if unknown:
        raise ValueError(f"unknown configuration keys {sorted(unknown)}")
    cfg.update(kw)
    return cfg


#: a GRU prediction's input features per step when not given (``bench recurrent``'s)
GRU_IN_FEATURES = 4


def chain_ops(cfg):
    """The (forward, adjoint) stacked chain kernels of ``cfg``'s model kind in a cost table."""
    if cfg["model"] == "gru":
        return "chains_forward_layers", "chains_adjoint_layers"
    return "chains_forward", "chains_adjoint"


def build_model(cfg, n_layers=None):
    """(model, x, y) of ``cfg``: dense (inputs of ``in_features``, default the width) or conv
    (1 input channel, ``image_size``^2 images), 10 classes, zero inputs."""
    from ..models import gru_classifier
    from ..network import conv_resnet, dense_resnet
    N = cfg["n_layers"] if n_layers is None else n_layers
    B = cfg["batch"]
    if cfg["model"] == "dense":
        f = cfg["in_features"] or cfg["width"]
        model = dense_resnet(f, cfg["width"], 10, N, dtype=cfg["dtype"], seed=0)
        x = np.zeros((B, f), dtype=cfg["dtype"])
    elif cfg["model"] == "conv":
        s = cfg["image_size"]
        model = conv_resnet(1, cfg["channels"], (s, s), 10, N, dtype=cfg["dtype"], seed=0)
        x = np.zeros((B, 1, s, s), dtype=cfg["dtype"])
    elif cfg["model"] == "gru":  # over N time steps, hidden = width, one GRU layer
        f = cfg["in_features"] or GRU_IN_FEATURES
        model = gru_classifier(f, cfg["width"], 10, N, dtype=cfg["dtype"], seed=0)
        x = np.zeros((B, N, f), dtype=cfg["dtype"])
    else:
        raise ValueError(f"--model {cfg['model']!r}: predictions cover dense and conv ResNets "
                         "and GRUs")
    return model, x, np.zeros(B, dtype=np.int64)


def mgrit_options(cfg):
    """(fwd, bwd) MGRITOptions of ``cfg`` (as ``bench scaling``: F then FCF, skip, tol 0)."""
    from ..mgrit import MGRITOptions
    common = dict(cf=cfg["cf"], max_levels=cfg["levels"], nrelax=[0, 1], tol=0.0,
                  skip_downcycle=True, warn_not_converged=False)
    return (MGRITOptions(max_iter=cfg["fwd_iters"], **common),
            MGRITOptions(max_iter=cfg["bwd_iters"], **common))


def resolve_levels(cfg, table, P):
    """``cfg`` with ``levels`` 'auto' replaced by :func:`mgnn.mgrit.auto_levels`'s choice for the
    layer ranks of P ranks, as ``train --levels auto`` makes it, from ``table``'s costs: a
    forward chain step per state, a call's cost (its per-call part and MGRIT's overhead) and
    a state's message on the table's network; ``cfg`` itself when its levels are a number."""
    if cfg["levels"] != "auto":
        return cfg
    from ..mgrit import auto_levels
    model, x, _ = build_model(cfg, n_layers=max(cfg["cf"], 1))
    d = max(cfg.get("data_ranks", 1), 1)
    shape = tuple(model.step.state_shape(max(x.shape[0] // d, 1)))  # a replica's shard
    a, b = table._ab(chain_ops(cfg)[0], shape, cfg["dtype"], None)
    call = a + table.overhead_seconds("mgrit", 1)
    message = table.alpha + int(np.prod(shape)) * np.dtype(cfg["dtype"]).itemsize / table.beta
    # as LayerParallel runs it: redundant only for fused kinds without spatial coarsening
    coarsest = cfg["coarsest"] if model.step.fused and not cfg.get("spatial_levels") else \
        "sequential"
    levels, _ = auto_levels(cfg["n_layers"], cfg["cf"], max(P // d, 1),
                            (cfg["fwd_iters"], cfg["bwd_iters"]), lambda lev: min(lev, 1), True,
                            2, (call + message) / max(b, 1e-300), coarsest=coarsest)
    return dict(cfg, levels=levels)


def _trainer(method, model, comm, cfg, micro=1, backend="numba"):
    """The training object of ``method`` (the cost-only predictions run the host path,
    ``backend`` 'numba'; calibration and validation the configured backend)."""
    from ..network import LayerParallel
    from .pipeline import PipelineParallel
    if method == "serial":
        return LayerParallel(model, threads=None, backend=backend)
    d = cfg.get("data_ranks", 1) if comm is not None else 1
    if method == "layerwise":
        return LayerParallel(model, comm=comm, threads=None, backend=backend, data_ranks=d)
    if method == "pipeline":
        return PipelineParallel(model, comm=comm, micro_batches=micro, backend=backend,
                                data_ranks=d)
    if cfg["levels"] == 1:  # (as train --levels 1: layer by layer, no MGRIT solver)
        return LayerParallel(model, comm=comm, threads=None, backend=backend, data_ranks=d)
    fwd, bwd = mgrit_options(cfg)
    return LayerParallel(model, fwd=fwd, bwd=bwd, comm=comm, threads=None, backend=backend,
                         coarsest=cfg["coarsest"], data_ranks=d,
                         spatial_levels=tuple(cfg.get("spatial_levels") or ()), guard=None)


def max_ranks(cfg, method):
    """The most layer ranks ``method`` can use for ``cfg`` (every rank owns a layer, MGRIT's
    blocks start at multiples of cf)."""
    N = cfg["n_layers"]
    if method == "serial":
        return 1
    return -(-N // cfg["cf"]) if method == "mgrit" else N


# -- calibration -----------------------------------------------------------------------------

def calibrate(cfg, repeats=5, layers=None, log=print):
    """Kernel cost table of ``cfg`` on this machine (this process, its current thread counts).

    Every method (serial, layer-wise on one rank, pipeline with each of ``cfg['micro']``, MGRIT)
    runs one untimed training step and then ``repeats`` recorded ones, at two depths: ``layers``
    (default min(N, 256), at least what the MGRIT hierarchy needs) and 4 cf layers (the
    hierarchy as deep as they allow). Every kernel call's wall time becomes a sample (``a + b k`` per op and shape), and
    the step's time outside its kernels the method's overhead per call, ``a_o + b_o k`` with k
    the states the call handles: fitted over both depths, so that it holds from a few layers
    per rank (where the Python per call dominates) to hundreds (where the work that grows with
    the layers does). MGRIT also runs once with its cycles uncaptured: the engine's calls,
    whose per-state costs price the rows of the captured cycles the timed steps replay.
    """
    if cfg["levels"] == "auto":  # (the kernels' costs do not depend on the level count)
        cfg = dict(cfg, levels=3)
    N = cfg["n_layers"]
    if layers is None:
        layers = min(N, max(256, 2 * cfg["cf"] ** max(cfg["levels"] - 1, 1)))
    small = min(layers, 4 * cfg["cf"])  # a few layers: the hierarchy as deep as they allow
    rec = Recorder()
    rec.sync = _device_sync(cfg["backend"])
    points, calls = {}, {}
    runs = [("serial", 1), ("layerwise", 1), ("mgrit-uncaptured", 1), ("mgrit", 1)] + [
        ("pipeline", M) for M in cfg["micro"] if M <= cfg["batch"]]
    for depth in sorted({layers, small}, reverse=True):
        model, x, y = build_model(cfg, depth)
        rm = recording_model(model, rec)
        for method, M in runs:
            # on one rank with a communicator (serial: none), the code path of the predictions
            # and of the measured mpiexec runs: MPI's COMM_SELF where mpi4py is installed (a
            # virtual rank's scheduler would add Python time that real runs do not have)
            # (uncaptured: two cycles each way at least, so that both directions' residual
            # and FAS points are in the table whatever cycle counts are predicted)
            c = cfg if method != "mgrit-uncaptured" else dict(
                cfg, fwd_iters=max(cfg["fwd_iters"], 2), bwd_iters=max(cfg["bwd_iters"], 2))
            walls, kern, ncall, ksum = _on_one_rank(_timed_steps, method, rm, c, x, y, M,
                                                    rec, repeats)
            i = int(np.argsort(walls)[len(walls) // 2])
            if log:
                log(f"  {depth:>4} layers {method:<16}{'' if method != 'pipeline' else f'M={M}':<5}"
                    f" step {walls[i] * 1e3:8.2f} ms, kernels {kern[i] * 1e3:8.2f} ms in "
                    f"{ncall[i]} calls ({ksum[i]} states)")
            if method == "mgrit-uncaptured":
                continue
            points.setdefault(method, []).append((ncall[i], ksum[i], walls[i] - kern[i]))
            if depth == layers:
                calls[f"{method}-{M}" if method == "pipeline" else method] = ncall[i]
        if depth == layers:
            for method in ("layerwise", "mgrit"):  # the calls only P > 1 makes (boundaries)
                rec.enabled = True
                run_virtual(2, _recorded_steps, method, rm, cfg, x, y, repeats + 1, rec)
    overhead = {method: _fit_overhead(pts) for method, pts in points.items()}
    if log:
        for method, (a, b) in overhead.items():
            log(f"  overhead {method:<10} {a * 1e6:8.2f} us per call + {b * 1e6:7.3f} us per "
                f"state")
    meta = dict(machine_meta(), config={k: (list(v) if isinstance(v, tuple) else v)
                                        for k, v in cfg.items()},
                calibration_layers=layers, calibration_small=small,
                repeats=repeats, calls=calls, backend=cfg["backend"],
                numba_threads=_numba_threads())
    shape = _state_shape(rec.samples)
    samples = rec.samples + (vector_samples(shape, model.dtype) if shape else [])
    table = CostTable.from_samples(samples, overhead=overhead, meta=meta)
    return with_tape_entries(table, rec.tapes)


def _on_one_rank(fn, *args):
    """``fn(comm, *args)`` on MPI's COMM_SELF, or on one virtual rank without mpi4py."""
    try:
        from mpi4py import MPI
    except ImportError:
        return run_virtual(1, fn, *args)[0]
    return fn(MPI.COMM_SELF, *args)


def _fit_overhead(points):
    """(a, b) >= 0 with overhead ~ calls a + states b from [(calls, states, seconds)] (least
    squares; a component that comes out negative is left out)."""
    A = np.array([[c, k] for c, k, _ in points], dtype=float)
    t = np.array([max(o, 0.0) for _, _, o in points])
    if len(points) > 1 and np.linalg.matrix_rank(A) == 2:
        a, b = np.linalg.lstsq(A, t, rcond=None)[0]
        if a >= 0 and b >= 0:
            return float(a), float(b)
    cols = [(A[:, 0], 0), (A[:, 1], 1)]
    best = None
    for col, j in cols:  # one component only: the better fit of the two
        if not col.any():
            continue
        x = float(col @ t / (col @ col))
        err = float(np.sum((col * x - t) ** 2))
        if best is None or err < best[0]:
            best = (err, j, max(x, 0.0))
    if best is None:
        return 0.0, 0.0
    return (best[2], 0.0) if best[1] == 0 else (0.0, best[2])


def _state_shape(samples):
    """The state shape of the stacked chains in recorded ``samples`` (the largest, level 0;
    None: no stacked chains were called)."""
    shapes = [s[1] for s in samples if s[0] in ("chains_forward", "run_tape",
                                                 "chains_forward_layers")]
    return max(shapes, key=math.prod) if shapes else None


def _timed_steps(comm, method, model, cfg, x, y, M, rec, repeats):
    """(wall seconds, kernel seconds, kernel calls, states the calls handled) of ``repeats``
    recorded training steps of ``method`` after two unrecorded ones."""
    if method == "layerwise":  # one rank through the solver: the chain path of P > 1
        from ..mgrit import MGRITOptions
        from ..network import LayerParallel
        opts = MGRITOptions(max_levels=1)
        obj = LayerParallel(model, fwd=opts, bwd=opts, comm=comm, threads=None,
                            backend=cfg["backend"], guard=None)
    else:
        obj = _trainer(method.split("-")[0], model, None if method == "serial" else comm, cfg,
                       M, cfg["backend"])
        obj.capture = method != "mgrit-uncaptured"
    rec.enabled = False
    obj.loss_and_grad(x, y)
    obj.loss_and_grad(x, y)
    rec.enabled = True
    walls, kern, ncall, ksum = [], [], [], []
    for _ in range(repeats):
        n0, s0 = len(rec.samples), rec.total()
        t0 = time.perf_counter()
        obj.loss_and_grad(x, y)
        walls.append(time.perf_counter() - t0)
        kern.append(rec.total() - s0)
        ncall.append(len(rec.samples) - n0)
        ksum.append(sum(s[3] for s in rec.samples[n0:]))
    return walls, kern, ncall, ksum


def _device_sync(backend):
    """A callable that waits for the device of ``backend`` (None for host backends): timed
    kernel calls then measure the kernels, not their launches."""
    from ..backend import get_backend
    return getattr(getattr(get_backend(backend), "launcher", None), "synchronize", None)


def resolve_backend(name):
    """'auto': 'cuda' where a GPU is present, else 'numba'; other names as they are."""
    if name == "auto":
        from ..backend import gpu_available
        return "cuda" if gpu_available() else "numba"
    return name


def _recorded_steps(comm, method, model, cfg, x, y, steps, rec):
    """``steps`` training steps on P > 1 ranks, the first one unrecorded (it compiles the
    kernels only rank boundaries call)."""
    obj = _trainer(method, model, comm, cfg, backend=cfg["backend"])
    for k in range(steps):
        if comm.Get_rank() == 0:
            rec.enabled = k > 0  # the ranks run one at a time: rank 0 starts each step
        obj.loss_and_grad(x, y)
        comm.Barrier()


def _build_solvers(obj):
    """Build ``obj``'s MGRIT solvers now (LayerParallel builds them at its first step, each
    duplicating the layer communicator: a collective that is no part of later steps)."""
    solver = getattr(obj, "_solver", None)
    if solver is None:
        return
    fallback = getattr(obj, "_serial_opts", None)
    for kind, opts in (("forward", obj.fwd), ("adjoint", obj.bwd)):
        if (opts or fallback) is not None and obj.layout.layer_size > 1:
            solver(kind, opts or fallback)


def _numba_threads():
    try:
        import numba
        return int(numba.get_num_threads())
    except Exception:  # noqa: BLE001 -- no numba: no threads to report
        return None


def alpha_beta(comm, sizes=(8, 1024, 8192, 65536, 524288), reps=200):
    """(alpha s, beta B/s) of ranks 0 and 1 of ``comm``: half the round-trip time of
    Send/Recv at each size, fitted to ``alpha + n / beta``. Collective; every rank returns it."""
    rank = comm.Get_rank()
    times = []
    for n in sizes:
        buf = np.zeros(max(n // 8, 1), dtype=np.float64)
        best = math.inf
        for _ in range(3):
            comm.Barrier()
            one_way = ping_pong(comm, buf, buf, reps if n < 65536 else max(reps // 10, 10), 11)
            best = min(best, one_way) if rank < 2 else 0.0
        times.append(best)
    nbytes = np.array([max(n // 8, 1) * 8 for n in sizes], dtype=float)
    inv_beta, alpha = np.polyfit(nbytes, np.array(times), 1)
    alpha = max(float(alpha), float(min(times)) * 0.5)
    beta = 1.0 / inv_beta if inv_beta > 0 else 1e12
    return comm.bcast((alpha, float(beta)), root=0)


def _mpiexec():
    """The ``mpiexec`` beside this Python (the ``mpich`` wheel's), else the one on PATH;
    None when there is none."""
    import shutil
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep +
                        os.environ.get("PATH", ""))


def measure_network(log=print, timeout=120):
    """(alpha, beta, how) of the local MPI: ``mpiexec -n 2`` ping-pong in a subprocess, or the
    'shared' preset (with the reason) when MPI is not available."""
    exe = _mpiexec()
    if exe is None:
        n = NETWORKS["shared"]
        return n["alpha"], n["beta"], "preset 'shared' (no mpiexec found)"
    cmd = [exe, "-n", "2", sys.executable, "-m", "mgnn.studies.predict", "pingpong"]
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)} did not finish in {timeout} s") from None
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    alpha, beta = json.loads(out.stdout.strip().splitlines()[-1])
    return alpha, beta, f"ping-pong, {' '.join(cmd[:3])} (MPI Send/Recv, 8 B to 512 KiB)"


# -- prediction ------------------------------------------------------------------------------

def _rank_step(comm, method, model, cfg, x, y, micro):
    obj = _trainer(method, model, None if method == "serial" else comm, cfg, micro)
    lay = getattr(obj, "layout", None)
    if lay is not None and lay.data_ranks > 1:  # each replica passes its own shard
        n = x.shape[0] // lay.data_ranks
        x, y = x[lay.replica * n:(lay.replica + 1) * n], y[lay.replica * n:(lay.replica + 1) * n]
    _build_solvers(obj)  # the steady state: a training run builds them once, before step 1
    if getattr(obj, "fwd", None) is not None or getattr(obj, "bwd", None) is not None:
        # MGRIT: step 1 captures the cycles, later steps replay them (charged as their rows);
        # on one layer rank step 2 merges them into one tape per solve, replayed from step 3
        one = getattr(getattr(obj, "layout", None), "layer_size", 1) == 1
        for _ in range(2 if one else 1):
            with np.errstate(all="ignore"):
                obj.loss_and_grad(x, y)
    st = comm.stats
    comm.Barrier()
    t0, c0, w0, m0 = comm.clock, st.compute_s, st.wait_s, st.message_s
    b0 = comm.shadow_clock
    with np.errstate(all="ignore"):  # placeholders hold no meaningful values
        obj.loss_and_grad(x, y)
    comm.Barrier()  # the step ends when the last rank is done (the others wait for it)
    c1, w1, m1 = st.compute_s, st.wait_s, st.message_s
    return {"time": comm.clock - t0, "compute": c1 - c0, "wait": w1 - w0, "message": m1 - m0,
            "bound": comm.shadow_clock - b0, "start": t0,
            "first": obj.layers.start if hasattr(obj, "layers") else None}


def core_stretch(P, cores, u):
    """The factor by which P ranks sharing ``cores`` cores stretch each compute interval, ``u``
    the ranks' mean compute fraction without sharing (clipped to [0, 1]):
    ``1 + (ceil(P / cores) - 1) u``, 1 where every rank has a core. The scheduler keeps ranks
    on cores, so the busiest core runs ceil(P / cores) of them, and a step whose ranks hand
    states to each other moves at that core's pace, not at the mean share P / cores (3 ranks
    on 2 cores measure as slow as 4 on this machine)."""
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or
                              cores < 1):
        raise ValueError(f"cores {cores!r}: a positive integer (or None: a core each) expected")
    if cores is None or P <= cores:
        return 1.0
    return 1.0 + (math.ceil(P / cores) - 1.0) * min(max(float(u), 0.0), 1.0)


def predict_point(cfg, table, method, P, micro=1, cores=None, trace=False, model=None,
                  timeout_s=None, payloads=False):
    """Predicted seconds of one training step of ``method`` on P ranks, with the per-rank
    breakdown: dict(time, ranks=[{compute, wait, message}...], events (with ``trace``)).
    ``payloads``: move the (meaningless) array values too (the same clocks; for tests)."""
    if method == "mgrit":
        cfg = resolve_levels(cfg, table, P)
        if cfg["levels"] == 1:  # layer by layer (train --levels 1), with its overhead
            method = "serial" if P == 1 else "layerwise"
    if model is None:
        model = build_model(cfg)
    real, x, y = model
    stretch = 1.0
    if cores is not None and P > cores:
        free = predict_point(cfg, table, method, P, micro, None, False, model, timeout_s)
        u = float(np.mean([r["compute"] for r in free["ranks"]])) / max(free["time"], 1e-300)
        stretch = core_stretch(P, cores, u)
    table = table if stretch == 1.0 else _Stretched(table, stretch)
    cm = cost_model(real, table, method)
    # oversubscribed: a message also waits for its receiver to get a core back (a scheduler
    # time slice, spread over the messages): the table's oversubscribed_hop_s, 0 by default
    hop = float(table.meta.get("oversubscribed_hop_s", 0.0)) if cores is not None and \
        P > cores else 0.0
    net = Network(alpha=table.alpha + hop, beta=table.beta)
    with _lean_memory():
        out = run_virtual(P, _rank_step, method, cm, cfg, x, y, micro, network=net,
                          trace=trace, timeout_s=timeout_s, payloads=payloads)
    res = {"time": max(r["time"] for r in out), "bound": max(r["bound"] for r in out),
           "ranks": [{k: r[k] for k in ("compute", "wait", "message")} for r in out]}
    if trace:  # the predicted step's events only (not the warm-up steps')
        res["events"] = [[e for e in s.events if e[1] >= r["start"]]
                         for s, r in zip(out.stats, out)]
    return res


def _libc():
    """glibc through ctypes, or None (another C library or platform)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@contextlib.contextmanager
def _lean_memory():
    """NumPy off huge pages and the cyclic garbage collector paused while the block runs, then
    the ranks' cycles collected and the heap trimmed (glibc keeps freed memory otherwise: GBs
    after a run of thousands of ranks). With millions of live objects each collection the
    allocations trigger walks them all: at P = 4096 (dense N 16384) they were a quarter of the
    run (45.5 -> 32.0 s without them; peak memory 6.9 -> 7.1 GB)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _no_huge_pages():
            yield
    finally:
        if collecting:
            gc.enable()
        gc.collect()
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)


@contextlib.contextmanager
def _no_huge_pages():
    """NumPy off its transparent-huge-page advice for large arrays while the block runs: a
    cost-only run allocates every rank's stores zero-filled and touches only a few rows of each,
    and with huge pages each touched row would commit 2 MiB (4096 virtual ranks: tens of GB)."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    before = setter(False) if setter is not None else None
    try:
        yield
    finally:
        if setter is not None:
            setter(before)


def _child_main(send, fn, args, kwargs):
    """Body of :func:`_in_child`'s process: ``fn``'s result or error into the pipe, large
    blocks mapped fresh (:func:`_fixed_mmap_threshold`: the whole process, which ends here)."""
    _fixed_mmap_threshold()
    try:
        out = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: B036 -- re-raised in the parent
        out = ("error", exc)
    try:
        send.send(out)
    except Exception as exc:  # noqa: BLE001 -- an unpicklable error: its text
        send.send(("error", RuntimeError(f"{type(out[1]).__name__}: {out[1]} ({exc})")))
    send.close()


def check_hop(us):
    """ValueError unless ``us`` (``--oversubscribed-hop``, microseconds) is finite and >= 0."""
    if isinstance(us, bool) or not isinstance(us, (int, float)) or not math.isfinite(us) \
            or us < 0:
        raise ValueError(f"--oversubscribed-hop {us!r}: microseconds, finite and >= 0 expected")


def _fixed_mmap_threshold(nbytes=128 * 1024):
    """glibc's mmap threshold fixed at ``nbytes`` for this process (nothing elsewhere).

    glibc raises the threshold after each large free (up to 32 MiB). Virtual ranks' stores then
    come from the heap, and np.zeros zero-fills each byte by byte: ~100 us a store, 4 s of a
    P = 1024 run. Mapped fresh, they are zero pages, committed only where a rank writes.
    The setting is process-wide and cannot be undone, hence its use in child processes only."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, int(nbytes))  # M_MMAP_THRESHOLD


def _in_child(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a fresh Python process (multiprocessing 'spawn'; ``fn`` and
    the arguments are pickled, the result sent back pickled). The memory of thousands of
    virtual ranks goes back to the system with the child, and a fresh process allocates it
    fresh (a forked one would inherit this process's fragmented heap, whose recycled chunks
    calloc must fill: 24 GB instead of 5 at P = 1024, N = 16384)."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(send, fn, args, kwargs), daemon=True)
    proc.start()
    send.close()
    try:
        while not recv.poll(1.0):
            if not proc.is_alive() and not recv.poll(0.1):
                raise EOFError
        kind, value = recv.recv()
    except EOFError:
        proc.join()
        code = proc.exitcode
        how = (f"was killed by signal {-code}" + (" (out of memory?)" if code == -9 else "")
               if code is not None and code < 0 else f"ended with exit code {code}")
        raise RuntimeError(f"the prediction's child process {how} and sent no result") \
            from None
    except Exception as exc:  # noqa: BLE001 -- a result that cannot be unpickled here
        raise RuntimeError(f"the prediction's child process sent a result that cannot be "
                           f"read: {exc}") from None
    finally:
        recv.close()
    proc.join()
    if kind == "error":
        raise value
    return value


class _Stretched(CostTable):
    """A table whose compute costs are ``factor`` times longer (oversubscribed cores)."""

    def __init__(self, table, factor):
        self.__dict__.update(table.__dict__)
        self._base, self._factor = table, factor
        self._tape_prices = {}  # its own (stretched) prices of captured cycles

    def _ab(self, op, shape, dtype, missing):
        a, b = self._base._ab(op, shape, dtype, missing)
        return self._factor * a, self._factor * b

    def charges(self, op, shape, dtype, k, method=None, missing=None):
        full, bound = self._base.charges(op, shape, dtype, k, method, missing)
        return self._factor * full, self._factor * bound


def predict(cfg, table, ranks, methods=METHODS, cores=None, log=print):
    """Rows (dict: method, micro_batches, ranks, time_s, speedup, compute/wait/message
    fractions, imbalance) for every method and P of ``ranks`` that the method allows."""
    model = build_model(cfg)
    rows = []
    t_serial = None
    for method in methods:
        micros = cfg["micro"] if method == "pipeline" else (0,)
        for M in micros:
            for P in ([1] if method == "serial" else ranks):
                if P > max_ranks(cfg, method) or (method == "pipeline" and M > cfg["batch"]) \
                        or (method == "layerwise" and P == 1):  # = serial
                    continue
                t0 = time.perf_counter()
                r = _point(cfg, table, method, P, max(M, 1), cores, model)
                comp = [q["compute"] for q in r["ranks"]]
                row = {"method": method, "micro_batches": M, "ranks": P, "time_s": r["time"],
                       "compute_max_s": max(comp), "compute_mean_s": float(np.mean(comp)),
                       "wait_mean_s": float(np.mean([q["wait"] for q in r["ranks"]])),
                       "message_mean_s": float(np.mean([q["message"] for q in r["ranks"]])),
                       "imbalance": max(comp) / max(np.mean(comp), 1e-300),
                       "wall_s": time.perf_counter() - t0}
                if method == "serial":
                    t_serial = r["time"]
                if method == "mgrit":  # the same run with zero orchestration cost
                    row["bound_s"] = r["bound"]
                    row["levels"] = resolve_levels(cfg, table, P)["levels"]
                rows.append(row)
                if log:
                    log(f"  {method:<9}{f'M={M}' if M else '':<6}P={P:<6} "
                        + (f"{row['levels']} levels " if cfg["levels"] == "auto" and
                           "levels" in row else "")
                        + 
                        f"{r['time'] * 1e3:10.3f} ms"
                        + (f" (bound {row['bound_s'] * 1e3:.3f} ms)" if "bound_s" in row else "")
                        + f"   (virtual run {row['wall_s']:.1f} s)")
    for row in rows:
        row["speedup"] = t_serial / row["time_s"] if t_serial else None
    return rows


def _point(cfg, table, method, P, micro, cores, model):
    """:func:`predict_point`; from P = 256 in a fresh process (it builds its own model)."""
    if P >= 256:
        return _in_child(predict_point, cfg, table, method, P, micro=micro, cores=cores)
    return predict_point(cfg, table, method, P, micro=micro, cores=cores, model=model)


def crossovers(rows):
    """{'serial', 'layerwise', 'pipeline'}: the least P at which MGRIT is faster than that
    method at the same P (serial: than one process), or None."""
    by = {}
    for r in rows:
        name = r["method"] if r["method"] != "pipeline" else "pipeline"
        best = by.setdefault(name, {})
        best[r["ranks"]] = min(best.get(r["ranks"], math.inf), r["time_s"])
    mg = by.get("mgrit", {})
    out = {}
    t_serial = by.get("serial", {}).get(1)
    for other in ("serial", "layerwise", "pipeline"):
        ps = [P for P in sorted(mg) if (t_serial is not None and mg[P] < t_serial
                                       if other == "serial" else
                                       P in by.get(other, {}) and mg[P] < by[other][P])]
        out[other] = ps[0] if ps else None
    return out


def format_rows(rows):
    """The prediction table; MGRIT rows also show the critical-path bound (zero orchestration
    cost) and how many times it the prediction is."""
    lines = [f"{'method':<10}{'M':>3}{'P':>7}{'time/step':>13}{'speedup':>9}{'compute':>9}"
             f"{'wait':>8}{'msgs':>8}{'imbal':>7}{'bound':>13}{'x bound':>9}",
             "-" * 96]
    for r in rows:
        t = r["time_s"]
        b = r.get("bound_s")
        lines.append(f"{r['method']:<10}{r['micro_batches'] or '':>3}{r['ranks']:>7}"
                     f"{_fmt_time(t):>13}{r['speedup']:>9.2f}"
                     f"{100 * r['compute_max_s'] / t:>8.0f}%{100 * r['wait_mean_s'] / t:>7.0f}%"
                     f"{100 * r['message_mean_s'] / t:>7.0f}%{r['imbalance']:>7.2f}"
                     + (f"{_fmt_time(b):>13}{t / b:>9.2f}" if b else ""))
    return "\n".join(lines)


def _fmt_time(t):
    return f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.3f} s"


def plot_prediction(rows, path, title):
    """Time per step and speedup against P, one line per method (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {}
    for r in rows:
        name = r["method"] + (f" M={r['micro_batches']}" if r["micro_batches"] else "")
        series.setdefault(name, []).append((r["ranks"], r["time_s"], r["speedup"]))
    for name, pts in series.items():
        pts.sort()
        P = [p[0] for p in pts]
        style = dict(marker="o", ms=3)
        if len(P) == 1:
            axes[0].axhline(pts[0][1], ls="--", color="grey", label=name)
            continue
        axes[0].plot(P, [p[1] for p in pts], label=name, **style)
        axes[1].plot(P, [p[2] for p in pts], label=name, **style)
    axes[0].set(xscale="log", yscale="log", xlabel="ranks P", ylabel="s per training step",
                title="predicted time per step")
    axes[1].set(xscale="log", yscale="log", xlabel="ranks P", ylabel="speedup over serial",
                title="predicted speedup")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    _save_figure(fig, path)


def plot_gantt(events, path, title):
    """Each rank's compute / wait / message intervals over the virtual time (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"compute": "tab:blue", "wait": "tab:red", "message": "tab:orange"}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.35 * len(events)))
    t0 = min((e[1] for ev in events for e in ev), default=0.0)
    for r, ev in enumerate(events):
        for kind in colors:
            spans = [((e[1] - t0) * 1e3, (e[2] - e[1]) * 1e3) for e in ev
                     if e[0] == kind and e[2] > e[1]]
            ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=colors[kind], label=kind
                           if r == 0 else None)
    ax.set(xlabel="virtual time (ms)", ylabel="rank", yticks=range(len(events)))
    ax.set_title(title, fontsize=8)
    ax.invert_yaxis()
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout()
    _save_figure(fig, path)


DEFAULT_RANKS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"


def _ints(flag, text):
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be a comma list of ints, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{flag} entries must be >= 1, got {text!r}")
    return vals


def config_from_args(args):
    """:func:`default_config` from ``bench calibrate/predict``'s flags (ValueError naming the
    flag)."""
    if args.model not in ("dense", "conv", "gru"):
        raise ValueError(f"--model {args.model}: bench {args.suite} covers dense, conv and gru")
    if args.model == "gru" and args.micro:
        raise ValueError(f"--micro {args.micro}: bench {args.suite} --model gru predicts no "
                         "pipeline (a GRU's steps share their weights)")
    text = (args.spatial_levels or "").strip()
    try:
        spatial = tuple(int(v) for v in text.split(",")) if text else ()
    except ValueError:
        raise ValueError(f"--spatial-levels must be a comma list of level numbers, got "
                         f"{args.spatial_levels!r}") from None
    if spatial and args.model != "conv":
        raise ValueError("--spatial-levels: spatial coarsening needs --model conv")
    return default_config(model=args.model, n_layers=args.n_layers, width=args.width,
                          in_features=args.in_features, channels=args.channels or 8,
                          batch=args.batch, dtype=args.dtype or "float32",
                          levels=args.levels, cf=args.cf,
                          fwd_iters=args.fwd_iters, bwd_iters=args.bwd_iters,
                          coarsest=args.coarsest, spatial_levels=spatial,
                          backend=resolve_backend(getattr(args, "backend", None) or "numba"),
                          micro=() if args.model == "gru" else
                          tuple(_ints("--micro", args.micro or "4,16")))


def _costs_path(args, cfg):
    return args.costs or os.path.join("results", f"costs-{cfg['model']}-{cfg['dtype']}.json")


def _calibrate_cmd(args, cfg, log):
    from ..comm.threads import configure_threads
    path = _costs_path(args, cfg)
    configure_threads(None, args.threads)
    log(f"calibrating {cfg['model']} ({_describe(cfg)}) on backend {cfg['backend']} with "
        f"{args.threads} Numba thread(s), {args.repeats} recorded steps per method")
    table = calibrate(cfg, repeats=args.repeats, log=log)
    alpha, beta, how = measure_network(log)
    table.alpha, table.beta = alpha, beta
    table.meta.update(network="calibrated", network_how=how, threads=args.threads)
    table.save(path)
    log(f"MPI: alpha {alpha * 1e6:.2f} us, beta {beta / 1e9:.2f} GB/s ({how})")
    log(f"wrote {path} ({len(table.entries)} kernel entries)")
    return table


def _describe(cfg):
    size = {"dense": f"w={cfg['width']}", "gru": f"GRU H={cfg['width']}, "
            f"I={cfg['in_features'] or GRU_IN_FEATURES}, N = time steps",
            "conv": f"C={cfg['channels']}, {cfg['image_size']}x{cfg['image_size']}"}[cfg["model"]]
    spatial = cfg.get("spatial_levels") or ()
    coarsest = "sequential" if spatial else cfg["coarsest"]  # as LayerParallel picks it
    return (f"N={cfg['n_layers']}, {size}, B={cfg['batch']}, {cfg['dtype']}; MGRIT "
            f"{cfg['levels']} levels, cf {cfg['cf']}, {cfg['fwd_iters']} fwd + "
            f"{cfg['bwd_iters']} adj cycles, coarsest {coarsest}"
            + (f", spatial coarsening below levels {','.join(map(str, spatial))}"
               if spatial else ""))


def _load_table(args, cfg, log):
    path = _costs_path(args, cfg)
    if not os.path.exists(path):
        if args.costs:
            raise ValueError(f"--costs {path}: no such file (python -m mgnn bench calibrate "
                             f"--costs {path} ... writes it)")
        log(f"{path} does not exist: calibrating first")
        return _calibrate_cmd(args, cfg, log), path
    table = CostTable.load(path)
    have = table.meta.get("config", {})
    for key in ("model", "dtype"):
        if have.get(key) not in (None, cfg[key]):
            raise ValueError(f"--costs {path} was calibrated for --{key} {have.get(key)}, "
                             f"not {cfg[key]} (calibrate again)")
    keys = ["batch", "in_features", "spatial_levels"] + (
        ["channels", "image_size"] if cfg["model"] == "conv" else ["width"])
    differ = [f"{k} {have[k]} (predicting {_plain(cfg[k])})" for k in keys
              if k in have and have[k] != _plain(cfg[k])]
    if differ:
        log(f"warning: {path} was calibrated with {', '.join(differ)}: kernel costs at other "
            f"shapes are scaled by their number of elements (calibrate at these shapes for "
            f"exact costs)")
    return table, path


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def coarsest_seconds(cfg, table):
    """Modelled seconds of the coarsest MGRIT level per training step (the redundant solve
    every rank repeats, or the sequential chain): its steps times the per-step cost, at the
    coarsest level's state shape (coarsened in space below each of ``spatial_levels``)."""
    from ..backend import grid_transfer
    from ..mgrit import level_sizes
    sizes = level_sizes(cfg["n_layers"], cfg["cf"], cfg["levels"], 2)
    n_c, lev = sizes[-1], len(sizes) - 1
    model, x, _ = build_model(cfg, n_layers=max(cfg["cf"], 1))
    shape = tuple(model.step.state_shape(x.shape[0]))
    spatial = [s for s in (cfg.get("spatial_levels") or ()) if s < lev]
    for _ in spatial:
        shape = shape[:2] + tuple(grid_transfer.coarse_shape(shape[2:]))
    # chains on stacked stores, forward and adjoint (with spatial coarsening too: the coarse
    # adjoint's sigma' is taken at restricted states, its steps are the same chains)
    ops = chain_ops(cfg)
    t = 0.0
    for op, cycles in zip(ops, (cfg["fwd_iters"], cfg["bwd_iters"])):
        try:
            t += cycles * (table.seconds(op, shape, cfg["dtype"], n_c) -
                           table.seconds(op, shape, cfg["dtype"], 0))
        except KeyError:
            pass
    return t


def limits(rows, cfg, table):
    """One line per MGRIT row: what bounds it (coarsest level, messages, waiting, imbalance)."""
    out = []
    for r in rows:
        if r["method"] != "mgrit":
            continue
        levels = r.get("levels", cfg["levels"])  # (1: layer by layer, no coarsest level)
        t_c = coarsest_seconds(dict(cfg, levels=levels), table) if levels != 1 else 0.0
        t = r["time_s"]
        parts = {"coarsest level": t_c / t, "waiting": r["wait_mean_s"] / t,
                 "messages": r["message_mean_s"] / t,
                 "imbalance": (r["compute_max_s"] - r["compute_mean_s"]) / t}
        top = max(parts, key=parts.get)
        out.append({"ranks": r["ranks"], **{k.replace(" ", "_"): v for k, v in parts.items()},
                    "limit": top})
    return out


def _write_text(path, text):
    """``text`` to ``path`` atomically (its folder made first)."""
    from .scaling import _atomic_write
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _atomic_write(path, text.encode())


def _save_figure(fig, path):
    """The PNG of ``fig`` to ``path`` atomically (its folder made first); closes ``fig``."""
    from .scaling import _save_figure as save
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save(fig, path)


def _csv(rows):
    import csv
    import io
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def main(args, log=print):
    """``bench calibrate`` / ``bench predict``; returns the rows (predict) or [table dict].
    ``log``: a print-like callable (None: quiet)."""
    log = log or (lambda *a, **k: None)
    cfg = config_from_args(args)
    if args.suite == "calibrate":
        return [_calibrate_cmd(args, cfg, log).to_dict()]
    ranks = sorted(set(_ints("--ranks", args.ranks or DEFAULT_RANKS)))
    hop = getattr(args, "oversubscribed_hop", None)
    if hop is not None:  # checked before a calibration that may take minutes
        check_hop(hop)
        if not args.cores:
            log("note: --oversubscribed-hop applies only with --cores (P > cores)")
    table, path = _load_table(args, cfg, log)
    if hop is not None:
        table.meta["oversubscribed_hop_s"] = hop * 1e-6
    if args.network != "calibrated":
        n = NETWORKS[args.network]
        table = table.with_network(n["alpha"], n["beta"], args.network)
    out = args.out or "results/predict"
    log(f"predicting {cfg['model']} ({_describe(cfg)}) on {args.network} network "
        f"(alpha {table.alpha * 1e6:.2f} us, beta {table.beta / 1e9:.1f} GB/s), costs {path}"
        + (f", {args.cores} cores shared" if args.cores else ""))
    if getattr(args, "plan", False):
        tol = args.grad_tol
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (
                math.isfinite(tol) and tol > 0):
            raise ValueError(f"--grad-tol must be a number > 0, got {tol!r}")
        out_rows = []
        errors = None
        for P in ranks:
            rows, errors = plan(cfg, table, P, grad_tol=args.grad_tol, cores=args.cores,
                                log=log, errors=errors)
            log(format_plan(rows, cfg, P, args.grad_tol))
            out_rows += rows
        out = args.out or "results/predict"
        _write_text(os.path.join(out, "plan.json"), json.dumps(
            {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
             "costs": path, "grad_tol": args.grad_tol, "rows": out_rows,
             "gradient_errors": [list(k) + [v] for k, v in errors.items()]}, indent=1))
        log(f"wrote {os.path.join(out, 'plan.json')}")
        return out_rows
    if getattr(args, "validate", False):
        small = [P for P in ranks if P <= 8]
        if not small:
            raise ValueError(f"--validate measures the P <= 8 of --ranks; --ranks {args.ranks} "
                             f"has none")
        if table.meta.get("threads", 1) != 1:
            log(f"warning: {path} was calibrated with {table.meta['threads']} threads per rank; "
                f"--validate measures with one (NUMBA_NUM_THREADS=1)")
        vr = validate(cfg, table, small, repeats=args.repeats, log=log)
        log(format_validation(vr))
        worst = max(abs(r["error"]) for r in vr)
        log(f"largest prediction error: {100 * worst:.1f}%")
        _write_text(os.path.join(out, "validate.json"), json.dumps(
            {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
             "costs": path, "rows": vr}, indent=1))
        _write_text(os.path.join(out, "validate.csv"), _csv(vr))
        log(f"wrote {os.path.join(out, 'validate.json')}, {os.path.join(out, 'validate.csv')}")
        return vr
    t0 = time.perf_counter()
    rows = predict(cfg, table, ranks, cores=args.cores, log=log)
    for r in rows:
        r["study"] = "strong"
    cross = crossovers(rows)
    weak = []
    if args.weak:
        per = cfg["n_layers"] / ranks[0]
        for P in ranks:
            wcfg = dict(cfg, n_layers=int(round(per * P)))
            wr = predict(wcfg, table, [P], methods=("serial", "layerwise", "pipeline", "mgrit"),
                         cores=args.cores, log=log)
            for r in wr:
                r.update(study="weak", n_layers=wcfg["n_layers"])
            weak += [r for r in wr if r["method"] != "serial" or P == ranks[0]]
    lim = limits(rows, cfg, table)
    text = format_rows(rows)
    log(text)
    for other, P in cross.items():
        if other == "pipeline" and not cfg["micro"]:  # (a GRU: no pipeline predicted)
            continue
        log(f"MGRIT overtakes {other}: " + (f"from P = {P}" if P else "not in --ranks"))
    if table.inexact:
        log(f"note: {len(table.inexact)} kernel costs were scaled from other shapes: "
            + "; ".join(sorted(table.inexact)[:6]) + (" ..." if len(table.inexact) > 6 else ""))
    for L in lim[-3:]:
        log(f"  mgrit P={L['ranks']}: limited by {L['limit']} (coarsest level "
            f"{100 * L['coarsest_level']:.0f}%, waiting {100 * L['waiting']:.0f}%, messages "
            f"{100 * L['messages']:.0f}%, imbalance {100 * L['imbalance']:.0f}%)")
    gantt_p = [P for P in ranks if 1 < P <= 8 and P <= max_ranks(cfg, "mgrit")]
    files = []
    title = f"{cfg['model']} {_describe(cfg)}; {args.network} network"
    try:
        plot_prediction(rows, os.path.join(out, "predict.png"), title)
        files.append(os.path.join(out, "predict.png"))
        if weak:
            plot_prediction(weak, os.path.join(out, "predict_weak.png"), "weak scaling: " + title)
            files.append(os.path.join(out, "predict_weak.png"))
        if gantt_p:
            P = gantt_p[-1]
            for method in ("mgrit", "pipeline")[:1 + bool(cfg["micro"])]:
                r = predict_point(cfg, table, method, P, micro=(cfg["micro"] or (1,))[0],
                                  cores=args.cores, trace=True)
                f = os.path.join(out, f"gantt_{method}_P{P}.png")
                plot_gantt(r["events"], f, f"{method} on {P} ranks\n{title}")
                files.append(f)
    except ImportError:
        log("matplotlib is not installed: no PNG")
    doc = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
           "network": {"name": args.network, "alpha": table.alpha, "beta": table.beta},
           "cores": args.cores, "costs": path, "costs_meta": table.meta,
           "rows": [{k: v for k, v in r.items() if k != "wall_s"} for r in rows + weak],
           "crossovers": cross, "limits": lim}
    _write_text(os.path.join(out, "predict.json"), json.dumps(doc, indent=1))
    _write_text(os.path.join(out, "predict.csv"), _csv(doc["rows"]))
    log(f"wrote {', '.join([os.path.join(out, 'predict.json'), os.path.join(out, 'predict.csv')] + files)}"
        f" in {time.perf_counter() - t0:.1f} s")
    return rows + weak


# -- validation: the same training steps measured under mpiexec -------------------------------

def measure_steps(comm, cfg, repeats=5, methods=None):
    """Measured seconds per training step (median of ``repeats`` after 2 warm-ups, ranks
    synchronised by a barrier around each step) of every method :func:`predict` models, with
    the same objects (:func:`_trainer`), on the ranks of ``comm`` (P = its size; serial on
    P = 1 only). Collective; returns {label: seconds} on every rank."""
    P = comm.Get_size()
    model, x, y = build_model(cfg)
    runs = [("serial", 1)] if P == 1 else [("layerwise", 1)]
    runs += [("pipeline", M) for M in cfg["micro"] if M <= cfg["batch"]] + [("mgrit", 1)]
    if methods is not None:
        runs = [(m, M) for m, M in runs if m in methods]
    out = {}
    sync = _device_sync(cfg["backend"]) or (lambda: None)
    for method, M in runs:
        obj = _trainer(method, model, None if method == "serial" else comm, cfg, M,
                       cfg["backend"])
        times = []
        for k in range(2 + repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            obj.loss_and_grad(x, y)
            sync()
            comm.Barrier()
            if k >= 2:
                times.append(time.perf_counter() - t0)
        out[f"{method}-{M}" if method == "pipeline" else method] = float(np.median(times))
    return out


def _measure_main(cfg_json, repeats, methods=None):
    from mpi4py import MPI
    cfg = json.loads(cfg_json)
    cfg["micro"] = tuple(cfg["micro"])
    got = measure_steps(MPI.COMM_WORLD, cfg, int(repeats),
                        None if methods is None else methods.split(","))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps(got), flush=True)


def validate(cfg, table, ranks=(1, 2, 4), repeats=5, log=print, timeout=900):
    """Predicted vs measured seconds per step at each P of ``ranks``: ``mpiexec -n P python -m
    mgnn.studies.predict measure`` (NUMBA_NUM_THREADS=1, as the calibration's one thread per rank), and
    the prediction with ``cores`` = this machine's CPUs (P > cores: oversubscribed). Rows of
    (method, micro_batches, ranks, measured_s, predicted_s, error = predicted / measured - 1)."""
    cores = _cores()
    model = build_model(cfg)
    rows = []
    for P in ranks:
        if log:
            log(f"  measuring P={P}: mpiexec -n {P} python -m mgnn.studies.predict measure ..."
                + (f" ({P} ranks on {cores} cores: oversubscribed)" if P > cores else ""))
        measured = _measure(resolve_levels(cfg, table, P), P, repeats, timeout)
        for label, t in measured.items():
            method, _, M = label.partition("-")
            M = int(M) if M else 0
            pred = predict_point(cfg, table, method, P, micro=max(M, 1), cores=cores,
                                 model=model)["time"]
            rows.append({"method": method, "micro_batches": M, "ranks": P, "measured_s": t,
                         "predicted_s": pred, "error": pred / t - 1.0,
                         "oversubscribed": P > cores})
    return rows


def _measure(cfg, P, repeats, timeout, methods=None):
    """{label: measured seconds per step} of ``mpiexec -n P python -m mgnn.studies.predict
    measure`` (one thread per rank, as the calibration)."""
    exe = _mpiexec()
    if exe is None:
        raise ValueError("bench predict --validate needs mpiexec (pip install 'mgnn[mpi]')")
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    doc = json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()})
    cmd = [exe, "-n", str(P), sys.executable, "-m", "mgnn.studies.predict", "measure", doc,
           str(repeats)] + ([",".join(methods)] if methods else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"mpiexec -n {P} measure did not finish in {timeout} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"mpiexec -n {P} measure failed ({proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def validation_points(ranks=(1, 2, 3, 4), per_rank=(1, 2, 4, 8), levels=(3, 4, 5, 6), cf=2,
                      min_coarse=2):
    """The (P, layers per rank, levels) of a validation grid that MGRIT can run: every rank
    owns at least cf layers (blocks start at multiples of cf) and the hierarchy reaches the
    level count; with the reasons for the others: [(P, per_rank, levels, why or None)]."""
    from ..mgrit import level_sizes
    out = []
    for P in ranks:
        for n in per_rank:
            for L in levels:
                why = None
                if n < cf:
                    why = f"a rank owns {n} < cf = {cf} layers"
                elif len(level_sizes(P * n, cf, L, min_coarse)) < L:
                    why = f"{P * n} layers reach {len(level_sizes(P * n, cf, L, min_coarse))} levels"
                out.append((P, n, L, why))
    return out


def validate_grid(cfg, table, points, repeats=9, log=print, timeout=900, launches=1):
    """Measured (``mpiexec -n P``) against predicted MGRIT steps, with the critical-path bound,
    at each runnable (P, layers per rank, levels) of ``points`` (:func:`validation_points`);
    ``cfg`` gives everything else (its n_layers / levels are replaced). Each point is measured
    in ``launches`` separate ``mpiexec`` runs and the fastest run's median counts: a run whose
    ranks the kernel placed badly for its whole life (oversubscribed, a few runs in 40 here:
    medians 2-4x the others) says nothing of the step. Rows of (ranks, layers_per_rank,
    n_layers, levels, measured_s, launches_s (every run's median), predicted_s, bound_s, error,
    oversubscribed)."""
    if not isinstance(launches, int) or launches < 1:
        raise ValueError(f"launches {launches!r}: a positive integer expected")
    cores = _cores()
    rows = []
    for P, n, L, why in points:
        if why is not None:
            continue
        c = dict(cfg, n_layers=P * n, levels=L)
        runs = [_measure(c, P, repeats, timeout, methods=("mgrit",))["mgrit"]
                for _ in range(launches)]
        t = min(runs)
        got = predict_point(c, table, "mgrit", P, cores=cores, model=build_model(c))
        pred, low = got["time"], got["bound"]
        rows.append({"ranks": P, "layers_per_rank": n, "n_layers": P * n, "levels": L,
                     "measured_s": t, "launches_s": runs, "predicted_s": pred, "bound_s": low,
                     "error": pred / t - 1.0, "oversubscribed": P > cores})
        if log:
            more = "" if launches == 1 else \
                f" (fastest of {', '.join(_fmt_time(v) for v in runs)})"
            log(f"  P={P} {n} layers/rank {L} levels: measured {_fmt_time(t)}{more}, predicted "
                f"{_fmt_time(pred)} ({100 * (pred / t - 1):+.1f}%), bound {_fmt_time(low)}")
    return rows


def format_validation_grid(rows):
    """A Markdown table of :func:`validate_grid`'s rows."""
    lines = ["| P | layers/rank | N | levels | measured | predicted | error | bound | "
             "measured / bound |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ranks']}{' (oversubscribed)' if r['oversubscribed'] else ''} | "
                     f"{r['layers_per_rank']} | {r['n_layers']} | {r['levels']} | "
                     f"{_fmt_time(r['measured_s'])} | {_fmt_time(r['predicted_s'])} | "
                     f"{100 * r['error']:+.1f}% | {_fmt_time(r['bound_s'])} | "
                     f"{r['measured_s'] / r['bound_s']:.2f} |")
    return "\n".join(lines)


# -- the planner: the fastest predicted setting at P ranks -------------------------------------

def gradient_errors(cfg, settings, depth=None, seed=0):
    """{(cf, levels, fwd cycles, adjoint cycles): relative error |g - g_exact| / |g_exact| of one
    MGRIT training step's gradient} of ``cfg``'s network, inputs N(0, 1), cycles uncaptured.
    The planner's convergence data: the quantity the gradient guard checks. Each setting runs
    in a fresh process (a deep network's stores take GBs, and this process's heap would keep
    them). ``depth``: a shallower network with the same step size (None: the network itself).
    A shallower one cannot stand in for deep hierarchies: its coarsest level is smaller and
    solved exactly (at N = 16384, cf 4, 6 levels, 2/1 cycles the error is 1.0e-1; at 1024
    layers with the same h and level count, 1.1e-2)."""
    return {tuple(s): _in_child(_gradient_error, cfg, tuple(s), depth, seed) for s in settings}


def _gradient_error(cfg, setting, depth, seed):
    """:func:`gradient_errors` of one setting, in this process."""
    from ..comm.threads import configure_threads
    from ..mgrit import MGRITOptions
    from ..network import LayerParallel
    configure_threads(None, 1)
    N = cfg["n_layers"] if depth is None else min(cfg["n_layers"], depth)
    model, x, y = build_model(cfg, N)
    model.t_final = model.t_final * N / cfg["n_layers"]  # the full network's step size
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x.shape).astype(x.dtype)
    y = rng.integers(0, 10, y.shape[0])
    front = LayerParallel(model, threads=None, guard=None)
    _, exact = front.loss_and_grad(x, y)
    cf, L, f, b = setting
    opts = [MGRITOptions(cf=cf, max_levels=L, nrelax=[0, 1], tol=0.0, max_iter=c,
                         skip_downcycle=True, warn_not_converged=False) for c in (f, b)]
    with np.errstate(all="ignore"):  # (one step: a capture would not pay off)
        _, g = LayerParallel(model, *opts, threads=None, guard=None,
                             capture=False).loss_and_grad(x, y)
        err = front._compare(g, exact)[0]
    return err if math.isfinite(err) else math.inf


def plan(cfg, table, P, grad_tol=0.1, cfs=(2, 4), cycles=((2, 1), (3, 2), (4, 3)),
         data=(1, 2, 4), micro=(4, 16, 64), top=5, cores=None, log=print, errors=None):
    """The fastest predicted training steps of ``cfg``'s network on P ranks: MGRIT over layer
    ranks x data replicas (``data``), cf (``cfs``), every level count the layers allow and the
    fewest cycles (``cycles``) whose gradient error (:func:`gradient_errors`) is within
    ``grad_tol``; the pipeline over ``micro`` x ``data`` and layer by layer (``train --levels
    1``) over ``data`` and P data replicas alone (exact gradients); serial for reference.
    Returns (rows sorted by predicted time, the gradient errors)."""
    from ..mgrit import level_sizes
    N, B = cfg["n_layers"], cfg["batch"]
    if errors is None:
        settings = [(cf, L, f, b) for cf in cfs
                    for L in range(2, len(level_sizes(N, cf, 99, 2)) + 1) for f, b in cycles]
        if log:
            log(f"  gradient errors of {len(settings)} MGRIT settings ...")
        errors = gradient_errors(cfg, settings)
    model = build_model(cfg)
    rows = [dict(method="serial", ranks=1, data=1, time_s=_point(cfg, table, "serial", 1, 1,
                                                                   cores, model)["time"])]
    for d in sorted(set(data) | {P}):  # (P: data-parallel alone)
        if P % d or B % d or P // d < 1 or (d == P == 1):
            continue
        Pl, c = P // d, dict(cfg, data_ranks=d)
        if Pl <= N:  # layer by layer over Pl layer ranks, each replica its shard
            r = _point(c, table, "layerwise", P, 1, cores, model)
            rows.append(dict(method="layerwise", ranks=P, data=d, time_s=r["time"],
                             grad_error=0.0))
        for M in micro if cfg["model"] != "gru" else ():  # (no pipeline over shared weights)
            if M <= B // d and 1 < Pl <= N:
                r = _point(c, table, "pipeline", P, M, cores, model)
                rows.append(dict(method="pipeline", ranks=P, data=d, micro=M, time_s=r["time"],
                                 grad_error=0.0))
        for cf in cfs:
            if Pl > -(-N // cf) or Pl == 1:  # (MGRIT on one layer rank: more work, no gain)
                continue
            for L in range(2, len(level_sizes(N, cf, 99, 2)) + 1):
                ok = [(f, b) for f, b in cycles if errors.get((cf, L, f, b), math.inf) <= grad_tol]
                if not ok:
                    continue
                f, b = ok[0]
                m = dict(c, cf=cf, levels=L, fwd_iters=f, bwd_iters=b)
                r = _point(m, table, "mgrit", P, 1, cores, model)
                rows.append(dict(method="mgrit", ranks=P, data=d, cf=cf, levels=L, fwd_iters=f,
                                 bwd_iters=b, time_s=r["time"], bound_s=r["bound"],
                                 grad_error=errors[(cf, L, f, b)]))
                if log:
                    log(f"  mgrit P={P} ({Pl} layer x {d} data ranks) cf {cf} {L} levels "
                        f"{f}/{b} cycles: {_fmt_time(r['time'])} (bound "
                        f"{_fmt_time(r['bound'])}, gradient error {errors[(cf, L, f, b)]:.1e})")
    t1 = rows[0]["time_s"]
    for r in rows:
        r["speedup"] = t1 / r["time_s"]
    best = sorted(rows[1:], key=lambda r: r["time_s"])
    return best[:top] + [rows[0]], errors


def train_command(cfg, row):
    """The ``mpiexec ... python -m mgnn train`` line of a planned row."""
    net = {"dense": f"--model dense --width {cfg['width']} --layers {cfg['n_layers']}",
           "conv": f"--model conv --channels {cfg['channels']} --layers {cfg['n_layers']}",
           # (sine: one input feature per step; the prediction's GRU reads in_features)
           "gru": f"--model gru --data sine --width {cfg['width']} --seq-len {cfg['n_layers']}"
           }[cfg["model"]]
    head = (f"mpiexec -n {row['ranks']} python -m mgnn train {net} "
            f"--batch-size {cfg['batch']} --dtype {cfg['dtype']}")
    if row["method"] == "mgrit":
        return (f"{head} --layer-ranks {row['ranks'] // row['data']} --data-ranks {row['data']} "
                f"--levels {row['levels']} --cf {row['cf']} --fwd-iters {row['fwd_iters']} "
                f"--bwd-iters {row['bwd_iters']} --skip-downcycle")
    if row["method"] == "layerwise":
        return (f"{head} --layer-ranks {row['ranks'] // row['data']} --data-ranks {row['data']} "
                "--levels 1")
    if row["method"] == "pipeline":
        return (f"(train has no pipeline mode: mgnn.studies.pipeline.PipelineParallel(model, comm, "
                f"micro_batches={row['micro']}, data_ranks={row['data']}) on {row['ranks']} "
                f"ranks)")
    return head.replace(f"mpiexec -n {row['ranks']} ", "")


def format_plan(rows, cfg, P, grad_tol):
    lines = [f"plan for P = {P} ({_describe(cfg)}; gradient error <= {grad_tol:g}):",
             f"{'#':>2} {'method':<9}{'layer x data':>13}{'setting':>28}{'time/step':>12}"
             f"{'speedup':>9}{'bound':>12}{'grad err':>10}"]
    for i, r in enumerate(rows):
        if r["method"] == "mgrit":
            what = f"cf {r['cf']}, {r['levels']} levels, {r['fwd_iters']}/{r['bwd_iters']}"
        elif r["method"] == "pipeline":
            what = f"M = {r['micro']}"
        elif r["method"] == "layerwise":
            what = "levels 1"
        else:
            what = ""
        split = f"{r['ranks'] // r['data']} x {r['data']}"
        lines.append(f"{i + 1:>2} {r['method']:<9}{split:>13}{what:>28}{_fmt_time(r['time_s']):>12}"
                     f"{r['speedup']:>8.2f}x{_fmt_time(r['bound_s']) if 'bound_s' in r else '':>12}"
                     f"{r.get('grad_error', 0.0):>10.1e}")
    best = next((r for r in rows if r["method"] == "mgrit"), None)
    lines.append("run the best:")
    lines.append("  " + train_command(cfg, rows[0]))
    if best is not None and best is not rows[0]:
        lines.append("the best MGRIT setting:")
        lines.append("  " + train_command(cfg, best))
    return "\n".join(lines)


def _cores():
    """CPUs this process may run on (its affinity; all CPUs where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def format_validation(rows):
    lines = [f"{'method':<10}{'M':>3}{'P':>4}{'measured':>12}{'predicted':>12}{'error':>8}",
             "-" * 49]
    for r in rows:
        lines.append(f"{r['method']:<10}{r['micro_batches'] or '':>3}{r['ranks']:>4}"
                     f"{_fmt_time(r['measured_s']):>12}{_fmt_time(r['predicted_s']):>12}"
                     f"{100 * r['error']:>+7.1f}%" + ("  oversubscribed" if r["oversubscribed"]
                                                      else ""))
    return "\n".join(lines)


def _pingpong_main():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        raise SystemExit("pingpong needs mpiexec -n 2")
    alpha, beta = alpha_beta(comm)
    if comm.Get_rank() == 0:
        print(json.dumps([alpha, beta]), flush=True)


if __name__ == "__main__":  # helpers run under mpiexec by calibrate and --validate
    if sys.argv[1:] == ["pingpong"]:
        _pingpong_main()
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "measure":
        _measure_main(*sys.argv[2:])
    else:
        raise SystemExit("usage: mpiexec -n 2 python -m mgnn.studies.predict pingpong | "
                         "mpiexec -n P python -m mgnn.studies.predict measure CONFIG_JSON REPEATS "
                         "[METHODS]")
