"""Benchmarks behind ``python -m mgnn bench``: each measures mgnn against a baseline side by side in
the same run and reports the ratio (timings are never asserted by tests)."""
import time

import numpy as np

from .backend import get_backend
from .network import LayerParallel, dense_resnet


def median_time(fn, repeats=7, warmup=2, min_time=0.05, stat=np.median):
    """Wall time (s) of one ``fn()``: ``stat`` (median) over ``repeats`` samples, each a loop
    lasting >= ``min_time``."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(min_time / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return float(stat(samples))


def kernel_time(fn):
    """Time (s) of one ``fn()`` as the kernel benchmarks report it: the fastest of 15 short
    samples (>= 5 ms each), so that other processes on a shared machine, which can only add
    time, inflate it least (it then agrees with the asv suite's ``KernelsCLI`` timings)."""
    return median_time(fn, repeats=15, warmup=2, min_time=0.005, stat=min)


#: Shapes of the ``bench kernels`` cases; the asv suite times the same cases (``KernelsCLI``).
DENSE_STEP = dict(width=256, batch=128)
LAYER_OVERHEAD = dict(width=4, batch=4, n_layers=256)


def dense_step_case(width=256, batch=128, dtype="float32", backend="numba", seed=0):
    """(step, matmul): a dense step forward + vjp (3 GEMMs) of ``backend`` and NumPy's matmul of
    the same shape (1 GEMM), as functions of no argument."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((batch, width)).astype(dt)
    W = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(dt)
    b = rng.standard_normal(width).astype(dt)
    lam = rng.standard_normal((batch, width)).astype(dt)
    h = dt.type(0.1)
    bk = get_backend(backend)

    def step():
        y, d = bk.dense_forward_deriv(u, W, b, h, 0, True)
        bk.dense_vjp(lam, d, u, W, h, True)

    return step, lambda: np.matmul(u, W.T)


def layer_overhead_case(width=4, batch=4, n_layers=256, backend="numba", seed=0):
    """A function of no argument: loss and gradient of a tiny dense network (serial sweeps)."""
    model = dense_resnet(width, width, 2, n_layers, dtype="float64", seed=seed)
    lp = LayerParallel(model, backend=backend)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, width))
    y = rng.integers(0, 2, batch)
    return lambda: lp.loss_and_grad(x, y)


def bench_dense_kernel(width=256, batch=128, dtype="float32", backend="numba", seed=0):
    """GFLOP/s of a dense step forward + vjp (3 GEMMs) against numpy's BLAS matmul (1 GEMM)."""
    step, matmul = dense_step_case(width, batch, dtype, backend, seed)
    t_step = kernel_time(step)
    t_mm = kernel_time(matmul)
    gemm = 2.0 * batch * width * width
    g_step, g_mm = 3 * gemm / t_step / 1e9, gemm / t_mm / 1e9
    return {"name": f"dense step fwd+vjp {backend} w={width} B={batch} {np.dtype(dtype).name}",
            "time_us": 1e6 * t_step, "gflops": g_step, "baseline": "numpy matmul (same shape)",
            "baseline_gflops": g_mm, "baseline_time_us": 1e6 * t_mm, "ratio": g_step / g_mm,
            "target": ">= 0.5"}


def bench_layer_overhead(width=4, batch=4, n_layers=256, backend="numba", seed=0):
    """Microseconds per layer of forward + backward (loss_and_grad) for a tiny dense network."""
    t = kernel_time(layer_overhead_case(width, batch, n_layers, backend, seed))
    return {"name": f"per-layer fwd+bwd {backend} w={width} B={batch} N={n_layers}",
            "time_us": 1e6 * t, "us_per_layer": 1e6 * t / n_layers,
            "target": "<= 20 us/layer (PyTorch CPU ~130, TorchBraid ~400)"}


def bench_conv_kernel(channels=8, batch=32, size=28, dtype="float32", seed=0):
    """Conv step forward + vjp: numba against the numpy reference (speed-up ratio)."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((batch, channels, size, size)).astype(dt)
    K = (rng.standard_normal((channels, channels, 3, 3)) / np.sqrt(9 * channels)).astype(dt)
    b = rng.standard_normal(channels).astype(dt)
    lam = rng.standard_normal(u.shape).astype(dt)
    h = dt.type(0.1)
    times = {}
    for name in ("numba", "numpy"):
        bk = get_backend(name)

        def step():
            y, d = bk.conv_forward_deriv(u, K, b, h, 0, True)
            bk.conv_vjp(lam, d, u, K, h, True)

        times[name] = median_time(step, repeats=3, warmup=1)
    flops = 3 * 2.0 * batch * size * size * channels * channels * 9
    return {"name": f"conv step fwd+vjp C={channels} B={batch} {size}x{size} {dt.name}",
            "time_us": 1e6 * times["numba"], "gflops": flops / times["numba"] / 1e9,
            "baseline": "numpy reference backend", "ratio": times["numpy"] / times["numba"],
            "target": "speed-up over the reference (informational)"}


def _blas_threads(n):
    """Context limiting BLAS threads to ``n`` (threadpoolctl), or a no-op if it is missing."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        import contextlib
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


def run_kernels(quick=False):
    """All kernel benchmarks; returns a list of result dicts.

    The dense step is measured with the default BLAS threads and with 1 BLAS thread (the setting
    of every MPI rank), kernel and baseline always under the same setting.
    """
    out = []
    for dtype in ("float32", "float64"):
        out.append(bench_dense_kernel(dtype=dtype, **DENSE_STEP))
        with _blas_threads(1):
            r = bench_dense_kernel(dtype=dtype, **DENSE_STEP)
        r["name"] += " 1 BLAS thread"
        out.append(r)
    out += [bench_layer_overhead(**LAYER_OVERHEAD),
            bench_layer_overhead(backend="numpy", **LAYER_OVERHEAD)]
    if not quick:
        out.append(bench_conv_kernel())
    return out


def format_results(results):
    """A plain-text table of benchmark results."""
    lines = []
    for r in results:
        s = f"{r['name']:<52} {r['time_us']:>11.1f} us"
        if "gflops" in r:
            s += f"  {r['gflops']:7.2f} GFLOP/s"
        if "ratio" in r:
            s += f"  ratio {r['ratio']:6.2f} vs {r['baseline']}"
        if "us_per_layer" in r:
            s += f"  {r['us_per_layer']:7.2f} us/layer"
        s += f"   [target {r['target']}]"
        lines.append(s)
    return "\n".join(lines)


class _CountingPropagator:
    """Wraps a propagator: counts step calls and the wall time spent inside them (point by point,
    with the wrapped propagator's ``fresh_outputs`` and ``pull``, so the solver makes the copies
    it makes for the real one: none for mgnn's)."""

    def __init__(self, inner):
        self.inner, self.calls, self.seconds = inner, 0, 0.0
        self.fresh_outputs = getattr(inner, "fresh_outputs", False)
        self.pull = getattr(inner, "pull", False)

    def step(self, u, start, stop, level):
        t0 = time.perf_counter()
        out = self.inner.step(u, start, stop, level)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def bench_mgrit(n_layers=256, width=64, batch=128, cf=4, levels=3, nrelax=(0, 1), cycles=2,
                backend="numba", dtype="float64", seed=0, repeats=3):
    """Layer evaluations per cycle / N (counted against the cost model) and the share of solve time
    spent outside the step kernels, for the forward and the adjoint MGRIT solve of a dense net."""
    from .mgrit import MGRITOptions, MGRITSolver, cycle_work, level_sizes
    from .backend import vector_ops
    from .network import AdjointPropagator, ForwardPropagator
    model = dense_resnet(width, width, 10, n_layers, dtype=dtype, seed=seed)
    bk = get_backend(backend)
    ops = vector_ops(backend)
    rng = np.random.default_rng(seed)
    u0 = rng.standard_normal((batch, width)).astype(model.dtype)
    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=list(nrelax), tol=0.0, max_iter=cycles)
    sizes = level_sizes(n_layers, cf, levels, opts.min_coarse)
    per_cycle_model = cycle_work(sizes, cf, opts.nrelax_on) / n_layers
    final_relax = sizes[0] - sizes[1] if len(sizes) > 1 else 0
    lp = LayerParallel(model, backend=backend)
    U, _ = lp._serial_states(u0, store=False)
    steps = model.group("steps")
    D = [model.step.deriv(steps["weight"][n], steps["bias"][n], U[n], bk)
         for n in range(n_layers)]
    out = []
    for name, make, start in (("forward", lambda: ForwardPropagator(model, bk), u0),
                              ("adjoint", lambda: AdjointPropagator(model, U, D, bk), u0)):
        make().step(start, 0, 1, 0)  # compile / warm up
        best = None
        for _ in range(repeats):
            prop = _CountingPropagator(make())
            t0 = time.perf_counter()
            res = MGRITSolver(prop, n_layers, opts, ops=ops).solve(start)
            total = time.perf_counter() - t0
            if best is None or total < best[0]:
                best = (total, prop, res.timings["vector"])
        total, prop, vector = best
        per_cycle = (prop.calls - final_relax) / cycles / n_layers
        out.append({"name": f"MGRIT {name} N={n_layers} w={width} B={batch} cf={cf} "
                            f"levels={sizes} nrelax={list(nrelax)} {cycles} cycles {backend}",
                    "time_us": 1e6 * total, "evals_per_cycle_over_N": per_cycle,
                    "model_evals_per_cycle_over_N": per_cycle_model,
                    "vector_kernels_fraction": vector / total,
                    "outside_kernels_fraction": (total - prop.seconds - vector) / total,
                    "target": "outside-kernel time <= 10% of the solve"})
    return out


def format_mgrit(results):
    """Plain-text lines for :func:`bench_mgrit` results."""
    return "\n".join(
        f"{r['name']}\n    {r['time_us'] / 1e3:9.1f} ms  layer evaluations per cycle / N: "
        f"measured {r['evals_per_cycle_over_N']:.4f}, model {r['model_evals_per_cycle_over_N']:.4f}"
        f"\n    time in step kernels {100 - 100 * r['outside_kernels_fraction'] - 100 * r['vector_kernels_fraction']:.1f}%, "
        f"in FAS vector kernels {100 * r['vector_kernels_fraction']:.1f}%, outside kernels "
        f"(Python, bookkeeping) {100 * r['outside_kernels_fraction']:.1f}%  "
        f"[target {r['target']}]" for r in results)


class CountingLauncher:
    """A RawKernel launcher that launches nothing: it counts the launches of each kernel and
    allocates zero-filled NumPy arrays, so a training step through
    :class:`mgnn.backend.cupy_raw.RawBackend` measures the host side of the GPU backend (Python
    orchestration, pointer arrays, allocations) and its launch counts on any machine."""

    name = "counting"
    on_device = False

    def __init__(self):
        import collections
        from .backend.cupy_raw import GPU_GEOMETRY
        self.geometry = dict(GPU_GEOMETRY)
        self.xp = self  # numpy, except that ``empty`` is counted and zero-filled
        self.launches = collections.Counter()
        self.pointers = self.allocations = 0

    def __getattr__(self, name):
        return getattr(np, name)

    def empty(self, shape, dtype=float):
        """Zero-filled (no kernel writes the outputs; zeros keep every value finite)."""
        self.allocations += 1
        return np.zeros(shape, dtype)

    def ptr(self, a):
        self.pointers += 1
        return a.__array_interface__["data"][0]

    def to_device(self, a):
        return np.ascontiguousarray(a)

    def launch(self, name, dtype, grid, block, args):
        self.launches[name] += 1

    def synchronize(self):
        """Nothing runs."""


def bench_gpu_launches(n_layers=1024, width=64, batch=64, cf=4, levels=3, fwd_iters=2,
                       bwd_iters=1, repeats=3, seed=0):
    """Kernel launches and host-side seconds of one training step of the GPU backend, with
    interval-batched MGRIT and layer by layer, without running any kernel (see
    :class:`CountingLauncher`): the launch-bound part of the GPU cost, measurable anywhere.

    Here a device pointer costs a NumPy ``__array_interface__`` read (~2 us; CuPy's
    ``.data.ptr`` is ~10x cheaper) and an allocation a zero fill, so ``host_seconds`` is an upper
    bound of the GPU's host side; ``pointers`` and ``allocations`` count both.

    Returns a list of dicts: method, launches, launches_by_kernel, pointers, allocations,
    host_seconds (median).
    """
    from .backend.cupy_raw import RawBackend
    from .mgrit import MGRITOptions
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    out = []
    for method in ("mgrit", "serial"):
        launcher = CountingLauncher()
        bk = RawBackend(launcher, "counting")
        model = dense_resnet(width, width, 10, n_layers, dtype="float32", seed=seed)
        if method == "mgrit":
            fwd = MGRITOptions(cf=cf, max_levels=levels, max_iter=fwd_iters, tol=0.0)
            bwd = MGRITOptions(cf=cf, max_levels=levels, max_iter=bwd_iters, tol=0.0)
            lp = LayerParallel(model, fwd, bwd, backend=bk)
        else:
            lp = LayerParallel(model, backend=bk)
        lp.loss_and_grad(x, y)
        launcher.launches.clear()
        launcher.pointers = launcher.allocations = 0
        lp.loss_and_grad(x, y)
        counts = dict(launcher.launches)
        pointers, allocations = launcher.pointers, launcher.allocations
        seconds = median_time(lambda: lp.loss_and_grad(x, y), repeats=repeats, warmup=0,
                              min_time=0.0)
        out.append({"method": method, "n_layers": n_layers, "width": width, "batch": batch,
                    "launches": sum(counts.values()), "launches_by_kernel": counts,
                    "pointers": pointers, "allocations": allocations, "host_seconds": seconds})
    return out


def format_gpu_launches(results):
    """Table of :func:`bench_gpu_launches` results."""
    lines = ["GPU backend, one training step, no kernel run (host side only):",
             f"{'method':>8} {'N':>6} {'launches':>9} {'pointers':>9} {'allocs':>7} "
             f"{'host ms':>9}"]
    for r in results:
        lines.append(f"{r['method']:>8} {r['n_layers']:>6} {r['launches']:>9} "
                     f"{r['pointers']:>9} {r['allocations']:>7} {1e3 * r['host_seconds']:9.1f}")
    if len(results) == 2:
        m, s = results
        lines.append(f"launches serial / MGRIT: {s['launches'] / m['launches']:.1f}x; host time "
                     f"MGRIT / serial: {m['host_seconds'] / s['host_seconds']:.1f}x")
    return "\n".join(lines)
