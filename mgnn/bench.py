"""Benchmarks behind ``python -m mgnn bench``: each measures mgnn against a baseline side by side in
the same run and reports the ratio (timings are never asserted by tests)."""
import time

import numpy as np

from .backend import get_backend
from .network import LayerParallel, dense_resnet


def median_time(fn, repeats=7, warmup=2, min_time=0.05):
    """Median wall time (s) of ``fn()`` over ``repeats`` samples, each looped to last >= min_time."""
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
    return float(np.median(samples))


def bench_dense_kernel(width=256, batch=128, dtype="float32", backend="numba", seed=0):
    """GFLOP/s of a dense step forward + vjp (3 GEMMs) against numpy's BLAS matmul (1 GEMM)."""
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

    t_step = median_time(step)
    t_mm = median_time(lambda: np.matmul(u, W.T))
    gemm = 2.0 * batch * width * width
    g_step, g_mm = 3 * gemm / t_step / 1e9, gemm / t_mm / 1e9
    return {"name": f"dense step fwd+vjp {backend} w={width} B={batch} {dt.name}",
            "time_us": 1e6 * t_step, "gflops": g_step, "baseline": "numpy matmul (same shape)",
            "baseline_gflops": g_mm, "ratio": g_step / g_mm, "target": ">= 0.5"}


def bench_layer_overhead(width=4, batch=4, n_layers=256, backend="numba", seed=0):
    """Microseconds per layer of forward + backward (loss_and_grad) for a tiny dense network."""
    model = dense_resnet(width, width, 2, n_layers, dtype="float64", seed=seed)
    lp = LayerParallel(model, backend=backend)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, width))
    y = rng.integers(0, 2, batch)
    t = median_time(lambda: lp.loss_and_grad(x, y))
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


def run_kernels(quick=False):
    """All kernel benchmarks; returns a list of result dicts."""
    out = [bench_dense_kernel(), bench_dense_kernel(dtype="float64"),
           bench_layer_overhead(), bench_layer_overhead(backend="numpy")]
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
