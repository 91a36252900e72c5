"""Benchmarks behind ``python -m mgnn bench``: each measures mgnn against a baseline side by side in
the same run and reports the ratio (timings are never asserted by tests)."""
import contextlib
import time

import numpy as np

from ..backend import get_backend
from ..network import LayerParallel, dense_resnet


def time_samples(fn, repeats=7, warmup=2, min_time=0.05):
    """``repeats`` samples of the wall time (s) of one ``fn()``, each the mean over a loop
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
    return samples


def median_time(fn, repeats=7, warmup=2, min_time=0.05, stat=np.median):
    """Wall time (s) of one ``fn()``: ``stat`` (median) over ``repeats`` samples, each a loop
    lasting >= ``min_time``."""
    return float(stat(time_samples(fn, repeats, warmup, min_time)))


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


#: Shapes of the per-kernel conv rows of ``bench kernels``: (channels, batch, spatial size, d).
CONV_PARTS = ((8, 32, 28, 2), (16, 32, 28, 2), (32, 32, 28, 2), (8, 8, 16, 3), (16, 8, 16, 3))


def numba_threads():
    """Numba's thread count now (a baseline library is timed with as many)."""
    import numba
    return numba.get_num_threads()


def bench_conv_parts(channels=16, batch=32, size=28, nd=2, dtype="float32", seed=0,
                     baseline=None):
    """One row per conv kernel (forward with the relu + residual + derivative epilogue, input
    vjp, kernel + bias gradient) of the Numba backend at C -> C, ``size``^nd: time and GFLOP/s
    (2 B C^2 3^nd size^nd per kernel). ``baseline``: None, or ``(name, parts)`` with
    ``parts(u, K, s)`` returning {part: function} that times the same convolution in another
    library (``scripts/torch_baseline.py --conv-parts`` passes PyTorch's: mgnn never imports
    a deep-learning framework); its time and ratio (its time / mgnn's: > 1 is mgnn faster)
    join each row."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    shape = (batch, channels) + (size,) * nd
    u = rng.standard_normal(shape).astype(dt)
    K = (rng.standard_normal((channels, channels) + (3,) * nd) / np.sqrt(3 ** nd * channels)
         ).astype(dt)
    b = rng.standard_normal(channels).astype(dt)
    lam = rng.standard_normal(shape).astype(dt)
    h = dt.type(0.1)
    bk = get_backend("numba")
    p = "conv" if nd == 2 else "conv3d"
    _, d = getattr(bk, p + "_forward_deriv")(u, K, b, h, 1, True)
    ours = {"forward": lambda: getattr(bk, p + "_forward_deriv")(u, K, b, h, 1, True),
            "input vjp": lambda: getattr(bk, p + "_vjp_input")(lam, d, K, h, True),
            "kernel grad": lambda: getattr(bk, p + "_vjp_params")(lam, d, u, h)}
    theirs = None if baseline is None else baseline[1](u, K, d * lam)
    flops = 2.0 * batch * size ** nd * channels * channels * 3 ** nd
    rows = []
    for part, fn in ours.items():
        t = kernel_time(fn)
        row = {"name": f"{p} {part} C={channels} B={batch} {size}^{nd} {dt.name}",
               "time_us": 1e6 * t, "gflops": flops / t / 1e9,
               "target": ">= 1 against PyTorch (oneDNN) at the same threads"}
        if theirs is not None:
            tt = kernel_time(theirs[part])
            row.update(baseline=f"{baseline[0]} ({flops / tt / 1e9:.0f} GFLOP/s)",
                       ratio=tt / t)
        rows.append(row)
    return rows


#: Shape of the ``bench kernels`` conv3d case (issue 14): C=8 channels, 16^3 volumes, B=8.
CONV3D_STEP = dict(channels=8, batch=8, size=16)
_TAPS3 = tuple((dz, dy, dx) for dz in range(3) for dy in range(3) for dx in range(3))


def conv3d_im2col_step(u, K, b, lam, h):
    """The NumPy baseline of a residual conv3d step with tanh, forward + vjp, by im2col + matmul:
    ``cols`` (B, C*27, D*H*W) gathers the 27 shifted copies of the zero-padded input, then
    z = K (C, C*27) @ cols + b, y = u + h tanh(z); s = tanh'(z) * lam, gK = h sum_B s @ cols^T,
    gb = h sum s, gx = lam + h col2im(K^T @ s) (27 shifted adds). u, lam (B, C, D, H, W),
    K (C, C, 3, 3, 3), b (C,); returns (y, deriv, gx, gK, gb) as ``numpy_ref`` would."""
    B, C, D, H, W = u.shape
    n = D * H * W
    up = np.pad(u, ((0, 0), (0, 0), (1, 1), (1, 1), (1, 1)))
    cols = np.empty((B, C, 27, D, H, W), dtype=u.dtype)
    for t, (dz, dy, dx) in enumerate(_TAPS3):
        cols[:, :, t] = up[:, :, dz:dz + D, dy:dy + H, dx:dx + W]
    cols = cols.reshape(B, C * 27, n)
    Km = K.reshape(K.shape[0], C * 27)
    z = np.matmul(Km, cols)
    z += b[:, None]
    t = np.tanh(z)
    y = u + h * t.reshape(u.shape)
    deriv = 1 - t * t
    s = deriv * lam.reshape(B, -1, n)
    gK = h * np.matmul(s, cols.transpose(0, 2, 1)).sum(axis=0)
    gb = h * s.sum(axis=(0, 2))
    gcols = np.matmul(Km.T, s).reshape(B, C, 27, D, H, W)
    gp = np.zeros_like(up)
    for t, (dz, dy, dx) in enumerate(_TAPS3):
        gp[:, :, dz:dz + D, dy:dy + H, dx:dx + W] += gcols[:, :, t]
    gx = lam + h * gp[:, :, 1:-1, 1:-1, 1:-1]
    return y, deriv.reshape(u.shape), gx, gK.reshape(K.shape), gb


def conv3d_step_case(channels=8, batch=8, size=16, dtype="float32", backend="numba", seed=0):
    """(step, baseline): a residual conv3d step with tanh, forward + vjp, of ``backend``
    (conv3d_forward_deriv + conv3d_vjp) and :func:`conv3d_im2col_step` on the same inputs, as
    functions of no argument (both return (y, deriv, gx, gK, gb))."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    shape = (batch, channels, size, size, size)
    u, lam = (rng.standard_normal(shape).astype(dt) for _ in range(2))
    K = (rng.standard_normal((channels, channels, 3, 3, 3)) / np.sqrt(27 * channels)).astype(dt)
    b = rng.standard_normal(channels).astype(dt)
    h = dt.type(0.1)
    bk = get_backend(backend)

    def step():
        y, d = bk.conv3d_forward_deriv(u, K, b, h, 0, True)
        return (y, d, *bk.conv3d_vjp(lam, d, u, K, h, True))

    return step, lambda: conv3d_im2col_step(u, K, b, lam, h)


def bench_conv3d_kernel(channels=8, batch=8, size=16, dtype="float32", seed=0):
    """GFLOP/s of the numba conv3d step forward + vjp (3 convolutions: forward, state and kernel
    gradients) against the NumPy im2col + matmul formulation of the same step
    (:func:`conv3d_im2col_step`), BLAS limited to as many threads as Numba uses."""
    import numba
    threads = numba.get_num_threads()
    step, baseline = conv3d_step_case(channels, batch, size, dtype, "numba", seed)
    with _blas_threads(threads):
        t_step, t_base = kernel_time(step), kernel_time(baseline)
    flops = 3 * 2.0 * batch * size ** 3 * channels * channels * 27
    g_step, g_base = flops / t_step / 1e9, flops / t_base / 1e9
    return {"name": f"conv3d step fwd+vjp numba C={channels} B={batch} {size}^3 "
                    f"{np.dtype(dtype).name} {threads} thr",
            "time_us": 1e6 * t_step, "gflops": g_step,
            "baseline": "numpy im2col + matmul (same step)", "baseline_gflops": g_base,
            "baseline_time_us": 1e6 * t_base, "ratio": g_step / g_base, "target": ">= 0.5"}


def bench_bn_conv(channels=16, batch=64, size=28, dtype="float32", seed=0, eps=1e-5):
    """numba conv step with batch norm (conv (identity) -> bn_stats -> bn_act_forward, and back
    through bn_act_vjp_sums -> bn_act_vjp_input -> conv_vjp) against the plain conv step with
    tanh (conv_forward_deriv + conv_vjp), forward + vjp each: the ratio is the cost of BN."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((batch, channels, size, size)).astype(dt)
    K = (rng.standard_normal((channels, channels, 3, 3)) / np.sqrt(9 * channels)).astype(dt)
    b, gamma, beta = (rng.standard_normal(channels).astype(dt) for _ in range(3))
    lam = rng.standard_normal(u.shape).astype(dt)
    ones, h, one, M = np.ones_like(u), dt.type(0.1), dt.type(1), batch * size * size
    bk = get_backend("numba")

    def plain():
        y, d = bk.conv_forward_deriv(u, K, b, h, 0, True)
        bk.conv_vjp(lam, d, u, K, h, True)

    def with_bn():
        z = bk.conv_forward(u, K, b, one, 2, False)
        mean, m2 = bk.bn_stats(z)
        invstd = (1 / np.sqrt(m2 / M + eps)).astype(dt)
        a, xhat, deriv = bk.bn_act_forward(z, mean, invstd, gamma, beta, 0)
        s1, s2 = bk.bn_act_vjp_sums(lam, deriv, xhat)
        gz = bk.bn_act_vjp_input(lam, deriv, xhat, invstd, gamma, s1, s2, M)
        bk.conv_vjp(gz, ones, u, K, one, False)

    t_plain, t_bn = (median_time(f, repeats=5, warmup=1, stat=min) for f in (plain, with_bn))
    return {"name": f"conv+BN+tanh fwd+vjp numba C={channels} B={batch} {size}x{size} {dt.name}",
            "time_us": 1e6 * t_bn, "baseline": "conv step tanh, no BN",
            "baseline_time_us": 1e6 * t_plain, "ratio": t_bn / t_plain, "target": "<= 1.5"}


def gru_step_case(batch=64, hidden=128, dtype="float32", seed=0):
    """(mgnn, numpy): one GRU step forward + vjp at dt = 1 (PyTorch's cell) as functions of no
    argument, the input projection gi (B, 3H) given: mgnn's = the gh GEMM by ``np.dot`` (BLAS),
    the numba gate kernels, then ``dh_direct + dgh @ W_hh``; numpy's = the same GEMMs with the gate
    arithmetic as NumPy array expressions."""
    dt, H = np.dtype(dtype), hidden
    rng = np.random.default_rng(seed)
    gi, h, g = (rng.standard_normal(s).astype(dt) for s in ((batch, 3 * H), (batch, H),
                                                             (batch, H)))
    W_hh = (rng.standard_normal((3 * H, H)) / np.sqrt(H)).astype(dt)
    W_hhT, b_hh = np.ascontiguousarray(W_hh.T), rng.standard_normal(3 * H).astype(dt)
    bk = get_backend("numba")

    def mgnn_step():
        gh = np.dot(h, W_hhT)
        gh += b_hh
        h_next, cache = bk.gru_gates_forward(gi, gh, h, 1.0, 0)
        dh, dgi, dgh = bk.gru_gates_vjp(g, h, cache, 1.0, 0)
        dh += np.dot(dgh, W_hh)
        return h_next, dh

    def numpy_step():
        gh = h @ W_hh.T + b_hh
        r = 1 / (1 + np.exp(-(gi[:, :H] + gh[:, :H])))
        z = 1 / (1 + np.exp(-(gi[:, H:2 * H] + gh[:, H:2 * H])))
        n = np.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
        h_next = (1 - z) * n + z * h
        dpn = g * (1 - z) * (1 - n * n)
        dpr = dpn * gh[:, 2 * H:] * r * (1 - r)
        dpz = g * (h - n) * z * (1 - z)
        dgh = np.concatenate([dpr, dpz, dpn * r], axis=1)
        return h_next, g * z + dgh @ W_hh

    return mgnn_step, numpy_step


def bench_gru_step(batch=64, hidden=128, tiny=(4, 4), dtype="float32", seed=0):
    """Two rows: a GRU step forward + vjp (numba gate kernels + BLAS GEMMs) against the same step
    in NumPy (matmul + array gate arithmetic), ratio = speed relative to NumPy; and the same for a
    tiny GRU (``tiny`` = (batch, hidden)), whose time per step is the target there."""
    dt = np.dtype(dtype)
    t_mgnn, t_np = (kernel_time(f) for f in gru_step_case(batch, hidden, dtype, seed))
    t_tiny, t_tiny_np = (kernel_time(f) for f in gru_step_case(*tiny, dtype, seed))
    base = "numpy matmul + gate arithmetic"
    return [{"name": f"GRU step fwd+vjp numba B={batch} H={hidden} {dt.name}",
             "time_us": 1e6 * t_mgnn, "baseline": base, "baseline_time_us": 1e6 * t_np,
             "ratio": t_np / t_mgnn, "target": ">= 0.5"},
            {"name": f"tiny GRU step fwd+vjp numba B={tiny[0]} H={tiny[1]} {dt.name}",
             "time_us": 1e6 * t_tiny, "baseline": base, "baseline_time_us": 1e6 * t_tiny_np,
             "ratio": t_tiny_np / t_tiny, "target": "<= 10 us/step"}]


def bench_gru_sequence(seq_len=1024, batch=4, hidden=4, dtype="float32", seed=0, repeats=5):
    """Microseconds per time step of a whole training step (forward, adjoint, parameter
    gradients: ``loss_and_grad``) of a tiny GRU over ``seq_len`` steps: serially (the
    whole-sequence sweeps, one call each way) and with MGRIT (2 levels, cf 4, 2 forward / 1
    adjoint cycles, one process). The per-step target of issue 13 is <= 10 us."""
    from ..mgrit import MGRITOptions
    from ..network import gru_classifier
    rng = np.random.default_rng(seed)
    model = gru_classifier(4, hidden, 4, seq_len, dtype=dtype, seed=seed)
    x = rng.standard_normal((batch, seq_len, 4)).astype(model.dtype)
    y = rng.integers(0, 4, batch)
    o = dict(cf=4, max_levels=2, nrelax=[0, 1], tol=0.0, warn_not_converged=False)
    rows = []
    for name, fwd, bwd in (("serial", None, None),
                           ("MGRIT", MGRITOptions(max_iter=2, **o), MGRITOptions(max_iter=1, **o))):
        lp = LayerParallel(model, fwd=fwd, bwd=bwd, guard=None)
        t = median_time(lambda: lp.loss_and_grad(x, y), repeats=repeats, warmup=1)
        rows.append({"name": f"tiny GRU training step per time step, {name}, B={batch} "
                             f"H={hidden} L={seq_len} {np.dtype(dtype).name}",
                     "time_us": 1e6 * t / seq_len, "target": "<= 10 us/step"})
    return rows


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
        for C, B, S, nd in CONV_PARTS:
            out += bench_conv_parts(C, B, S, nd)
        out.append(bench_conv3d_kernel(**CONV3D_STEP))
        out.append(bench_bn_conv())
        out += bench_gru_step()
        out += bench_gru_sequence()
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
    """Wraps a propagator and counts its layer evaluations (steps, chain steps and points of
    the stacked methods); same ``fresh_outputs``, ``pull``, ``stacked`` as the wrapped one."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        for attr in ("fresh_outputs", "pull", "stacked"):
            setattr(self, attr, getattr(inner, attr, False))

    def step(self, u, start, stop, level):
        self.calls += 1
        return self.inner.step(u, start, stop, level)

    def advance(self, U, G, chains, *args):
        self.calls += int(chains[:, 1].sum())
        return self.inner.advance(U, G, chains, *args)

    def points(self, U, G, R, slots, *args):
        self.calls += len(slots)
        return self.inner.points(U, G, R, slots, *args)


def bench_mgrit(n_layers=256, width=64, batch=128, cf=4, levels=3, nrelax=(0, 1), cycles=2,
                backend="numba", dtype="float32", activation="relu", skip=True, seed=0,
                repeats=15, rounds=6, threads=1, model="dense", image=28):
    """Forward and adjoint MGRIT solves of a dense net (``model='conv'``: a conv ResNet with
    ``width`` channels on ``image`` x ``image`` states) against the cost model: time of the solve
    over (its layer evaluations x the serial sweep's time per layer evaluation), same kernels and
    run. The serial sweep: the fastest of the exact layer-by-layer solve (``max_levels=1``),
    its one stacked kernel call of N steps without the solver around it (``chain``: the
    solver's few tens of microseconds are no layer work) and, forward, the serial training
    path's sweep; the adjoint's evaluations are state vjps only, as MGRIT's. Target: <= 1.1.

    Times are taken as the kernel benchmarks take them (:func:`kernel_time`): ``rounds`` x
    ``repeats`` short samples (>= 5 ms each), the candidates interleaved round by round; the
    ratio uses the fastest sample of each, since other processes on a shared machine only add
    time (and add more to a solve whose working set is larger). ``*_median`` gives the same
    with the medians, which show how much the machine added.

    ``threads``: the thread counts of the run (:func:`mgnn.comm.configure_threads`, the
    process's counts put back afterwards): 1 (default) pins BLAS and Numba to one thread, the
    issue's configuration, where the ratio measures work efficiency alone; 'auto' is what
    :class:`LayerParallel` sets by default (one BLAS thread, Numba threads on every core), so
    MGRIT's intervals run in parallel while the serial sweep cannot."""
    with _thread_setting(threads) as info:
        rows = _bench_mgrit(n_layers, width, batch, cf, levels, nrelax, cycles, backend, dtype,
                            activation, skip, seed, repeats, rounds, model, image)
    label = f" threads={threads} (BLAS {info['blas']}, Numba {info['numba']})"
    return [dict(r, name=r["name"] + label, threads=threads, blas_threads=info["blas"],
                 numba_threads=info["numba"]) for r in rows]


@contextlib.contextmanager
def _thread_setting(threads):
    """Context: :func:`mgnn.comm.configure_threads` (one process) with ``threads``; yields its
    report, and sets Numba's and every BLAS's counts back to what they were on exit."""
    import numba  # noqa: F401 (Numba's count is part of the snapshot)

    from ..comm import configure_threads, restore_threads, snapshot_threads
    saved = snapshot_threads()
    try:
        yield configure_threads(None, threads)
    finally:
        restore_threads(saved)


def _bench_mgrit(n_layers, width, batch, cf, levels, nrelax, cycles, backend, dtype, activation,
                 skip, seed, repeats, rounds, kind="dense", image=28):
    """:func:`bench_mgrit` under the thread setting it chose."""
    from ..backend import vector_ops
    from ..mgrit import MGRITOptions, MGRITSolver, cycle_work, level_sizes
    from ..network import AdjointPropagator, ForwardPropagator, conv_resnet
    if kind == "conv":
        model = conv_resnet(1, width, (image, image), 10, n_layers, activation=activation,
                            dtype=dtype, seed=seed)
        shape, label = (batch, width, image, image), f"conv C={width} {image}x{image}"
    else:
        model = dense_resnet(width, width, 10, n_layers, activation=activation, dtype=dtype,
                             seed=seed)
        shape, label = (batch, width), f"w={width}"
    bk, ops = get_backend(backend), vector_ops(backend)
    rng = np.random.default_rng(seed)
    u0 = rng.standard_normal(shape).astype(model.dtype)
    opts = MGRITOptions(cf=cf, max_levels=levels, nrelax=list(nrelax), tol=0.0, max_iter=cycles,
                        skip_downcycle=skip)
    sizes = level_sizes(n_layers, cf, levels, opts.min_coarse)
    model_evals = sum(cycle_work(sizes, cf, opts.nrelax_on, skip and k == 0)
                      for k in range(cycles)) + sizes[0] - sizes[1]
    U, D = LayerParallel(model, backend=backend, threads=None)._serial_states(u0, store=True)
    steps = model.group("steps")
    out = []
    for name, make in (("forward", lambda: ForwardPropagator(model, bk)),
                       ("adjoint", lambda: AdjointPropagator(model, U, D, bk))):
        counter = _CountingPropagator(make())
        MGRITSolver(counter, n_layers, opts, ops=ops).solve(u0)
        solver = MGRITSolver(make(), n_layers, opts, ops=ops, reuse_states=True)
        engine = MGRITSolver(make(), n_layers, opts, ops=ops, reuse_states=True, capture=False)
        exact = MGRITSolver(make(), n_layers, MGRITOptions(max_levels=1), ops=ops,
                            reuse_states=True)
        # its level-0 store: slot 1 holds u0, the bare chain refills slots 2 .. N + 1
        final = np.array(exact.solve(u0).final)
        bare_chain = _bare_chain(exact)
        exact._states[2:] = 0
        bare_chain()
        if not np.array_equal(exact._states[n_layers + 1], final):
            raise RuntimeError(f"bench mgrit ({name}): the bare chain does not reproduce the "
                               "exact solve")
        runs = {"mgrit": lambda: solver.solve(u0), "uncaptured": lambda: engine.solve(u0),
                "exact": lambda: exact.solve(u0), "chain": bare_chain}
        if name == "forward":  # the serial training path's sweep, if it is faster
            V = np.empty_like(U)
            V[0] = u0
            E = np.empty((0,) + u0.shape, model.dtype)
            runs["sweep"] = lambda: model.step.sweep_forward(steps["weight"], steps["bias"], V,
                                                             model.h, E, bk)
        samples = {k: [] for k in runs}
        for _ in range(rounds):
            for k, fn in runs.items():
                samples[k] += time_samples(fn, repeats=repeats, min_time=0.005)
        stats = {}
        for stat in (min, np.median):
            t = {k: float(stat(v)) for k, v in samples.items()}
            stats[stat] = (t["mgrit"], t["uncaptured"],
                           min(t["exact"], t["chain"], t.get("sweep", np.inf)))
        mgrit, uncaptured, serial = stats[min]
        mgrit_median, _, serial_median = stats[np.median]
        per_eval = serial / n_layers
        out.append({"name": f"MGRIT {name} N={n_layers} {label} B={batch} {dtype} {activation} "
                            f"cf={cf} levels={sizes} nrelax={list(nrelax)} {cycles} cycles"
                            f"{' skip' if skip else ''} {backend}",
                    "direction": name, "model": kind, "width": width, "mgrit_s": mgrit,
                    "serial_s": serial,
                    "uncaptured_s": uncaptured, "captured": bool(solver._tapes),
                    "evals": counter.calls, "model_evals": model_evals,
                    "work_ratio": counter.calls / n_layers, "time_ratio": mgrit / serial,
                    "cost_model_ratio": mgrit / (counter.calls * per_eval),
                    "mgrit_median_s": mgrit_median, "serial_median_s": serial_median,
                    "cost_model_ratio_median": mgrit_median * n_layers / (counter.calls
                                                                          * serial_median),
                    "stacked": solver.engine.stacked, "target": "cost_model_ratio <= 1.1"})
    return out


def format_mgrit(results):
    """Plain-text lines for :func:`bench_mgrit` results."""
    lines = []
    for r in results:
        replayed = (f" (cycles replayed; through the engine {1e3 * r['uncaptured_s']:.2f} ms)"
                    if r.get("captured") else "")
        lines += [r["name"],
                  f"    MGRIT {1e3 * r['mgrit_s']:8.2f} ms{replayed}, serial sweep "
                  f"{1e3 * r['serial_s']:7.2f} ms; layer evaluations {r['evals']} (model "
                  f"{r['model_evals']}) = {r['work_ratio']:.3f} N; time ratio "
                  f"{r['time_ratio']:.3f}; time / (evaluations x serial time per evaluation) = "
                  f"{r['cost_model_ratio']:.3f}  [target {r['target']}]",
                  f"    medians: MGRIT {1e3 * r['mgrit_median_s']:8.2f} ms, serial sweep "
                  f"{1e3 * r['serial_median_s']:7.2f} ms; ratio {r['cost_model_ratio_median']:.3f}"
                  " (the fastest samples above: what the machine adds least to)"]
    return "\n".join(lines)


def _training_step_cases(quick):
    """(label, model builder, x shape, LayerParallel keywords) of :func:`bench_training_steps`."""
    from ..models import conv_resnet, gru_classifier
    n = 64 if quick else 256
    m = 32 if quick else 64
    return [
        ("dense w=16", lambda: dense_resnet(16, 16, 10, n, activation="relu",
                                            dtype="float32"), (128, 16), {}),
        ("dense w=64", lambda: dense_resnet(64, 64, 10, n, activation="relu",
                                            dtype="float32"), (128, 64), {}),
        ("batch norm w=64", lambda: dense_resnet(64, 64, 10, m, activation="relu",
                                                 dtype="float32", batch_norm=True),
         (128, 64), {}),
        ("dropout 0.1 w=64", lambda: dense_resnet(64, 64, 10, m, activation="relu",
                                                  dtype="float32", dropout=0.1), (128, 64), {}),
        ("GRU H=32", lambda: gru_classifier(8, 32, 10, m, dtype="float32"), (64, m, 8), {}),
        ("conv C=8 16x16, spatial level 0",
         lambda: conv_resnet(1, 8, (16, 16), 10, 32 if quick else 64, activation="relu",
                             dtype="float32"), (32, 1, 16, 16), {"spatial_levels": (0,)}),
    ]


def bench_training_steps(quick=False, cf=4, levels=3, cycles=(2, 2), repeats=5, rounds=4,
                         seed=0, threads=1, cases=None):
    """Whole training steps of each model kind on one process (threads pinned to 1 by default):
    the MGRIT step (``levels`` levels, ``cf``, F on level 0 and FCF below, ``cycles`` forward /
    adjoint cycles, skipped down-cycle, no guard) against its algorithmic work, the serial
    step's time x (W_fwd + W_adj + N) / 3N, where W is the solve's propagator steps in fine-step
    equivalents (:func:`mgnn.mgrit.cycle_work` with the model's level costs, plus the final
    F-relaxation) and N the layers (time steps): the serial step does N forward steps, N
    adjoint steps and N parameter-gradient steps (issue 36's definition; MGRIT also
    re-linearises its owned layers at the final states, forward-equivalent evaluations that the
    serial step gets from its forward sweep: N for fused and recurrent kinds, N / cf for composed
    ones, which keep the final sweep's caches; they count against MGRIT here). Beside it the
    model per phase: a forward evaluation priced at a step of the bare forward chain (one
    ``advance`` over all N layers, no caches kept), an adjoint one at a step of the bare adjoint
    chain, and the rest of the serial step (its linearisation caches, parameter gradients,
    loss, opening and closing) once; ``fwd_solve_ratio`` / ``adj_solve_ratio``: each MGRIT
    solve over its evaluations at those prices (what the solves add to their steps). float32 relu
    models of fixed sizes (``quick``: smaller), whatever ``bench``'s other flags say. Fastest
    samples, interleaved rounds. ``cases``: the labels to run (prefixes; None: all). Returns one
    dict per case."""
    from ..mgrit import MGRITOptions, cycle_work, level_sizes
    rng = np.random.default_rng(seed)
    out = []
    with _thread_setting(threads):
        for label, build, xshape, kw in _training_step_cases(quick):
            if cases is not None and not any(label.startswith(c) for c in cases):
                continue
            model = build()
            x = rng.standard_normal(xshape).astype(model.dtype)
            y = rng.integers(0, 10, xshape[0])
            opts = [MGRITOptions(cf=cf, max_levels=levels, nrelax=[0, 1], tol=0.0, max_iter=c,
                                 skip_downcycle=True, warn_not_converged=False) for c in cycles]
            one_level = MGRITOptions(max_levels=1)
            serial = LayerParallel(model, backend="numba", guard=None, threads=None)
            lp = LayerParallel(model, *opts, backend="numba", guard=None, threads=None, **kw)
            # the same propagators on one level (N steps a solve): the price of one evaluation
            exact = LayerParallel(model, one_level, one_level, backend="numba", guard=None,
                                  threads=None)
            N = model.n_layers
            sizes = level_sizes(N, cf, levels, opts[0].min_coarse)
            cost = getattr(lp, "level_cost", None)
            work = [sum(cycle_work(sizes, cf, o.nrelax_on, k == 0, level_cost=cost)
                        for k in range(o.max_iter)) + sizes[0] - sizes[1] for o in opts]
            exact.loss_and_grad(x, y)  # its solvers, their stores and linearisations
            runs = {"serial": lambda: serial.loss_and_grad(x, y),
                    "mgrit": lambda: lp.loss_and_grad(x, y),
                    "forward chain": _bare_chain(exact._solver("forward", one_level)),
                    "adjoint chain": _bare_chain(exact._solver("adjoint", one_level))}
            lp.loss_and_grad(x, y)  # builds its solvers
            solves = {kind: _timed_solves(lp._solver(kind, o))
                      for kind, o in zip(("forward", "adjoint"), opts)}
            samples = {k: [] for k in runs}
            for _ in range(rounds):
                for k, fn in runs.items():
                    samples[k] += time_samples(fn, repeats=repeats, min_time=0.005)
            t = {k: float(min(v)) for k, v in samples.items()}
            algorithmic = t["serial"] * (work[0] + work[1] + N) / (3 * N)
            # per phase: an evaluation costs what a step of the bare chain costs (forward and
            # adjoint apart), the rest of the serial step (linearisation caches, gradients,
            # loss, opening and closing) once
            solve_s = {k: float(min(v)) for k, v in solves.items()}
            t_fwd, t_adj = t["forward chain"] / N, t["adjoint chain"] / N
            rest = max(t["serial"] - N * (t_fwd + t_adj), 0.0)
            phases = work[0] * t_fwd + work[1] * t_adj + rest
            engines = sorted({type(lp._solver(k, o).engine).__name__
                              for k, o in zip(("forward", "adjoint"), opts)})
            out.append({"name": f"training step {label} N={N} B={xshape[0]} float32 cf={cf} "
                                f"levels={sizes} {cycles[0]}/{cycles[1]} cycles",
                        "serial_s": t["serial"], "mgrit_s": t["mgrit"],
                        "work_fwd": float(work[0]), "work_adj": float(work[1]), "layers": N,
                        "algorithmic_s": algorithmic, "ratio": t["mgrit"] / algorithmic,
                        "step_fwd_s": t_fwd, "step_adj_s": t_adj, "rest_s": rest,
                        "phases_s": phases, "phase_ratio": t["mgrit"] / phases,
                        "fwd_solve_ratio": solve_s["forward"] / (work[0] * t_fwd),
                        "adj_solve_ratio": solve_s["adjoint"] / (work[1] * t_adj),
                        "engines": engines, "target": "ratio <= 1.1 (dense), 1.15 (others)"})
    return out


def _bare_chain(solver):
    """A function that steps ``solver``'s propagator over all N layers of its level-0 store
    from slot 1 (one ``advance`` of one chain: the F-relaxation's call, no caches kept), after
    a solve has filled the store (and, adjoint, the propagator's linearisation)."""
    origin, stride = solver.engine._origin(0)
    chain = np.array([[2, solver.n_steps]], dtype=np.int64)

    def run():
        with solver._solve_context():  # the BLAS setting the solves run under
            solver.prop.advance(solver._states, None, chain, origin, stride, 0)
    return run


def _timed_solves(solver):
    """Wrap ``solver.solve`` (an instance attribute) so that each call's seconds are appended
    to the returned list."""
    seconds, solve = [], solver.solve

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return solve(*args, **kw)
        finally:
            seconds.append(time.perf_counter() - t0)
    solver.solve = timed
    return seconds


def format_training_steps(rows):
    """Plain-text lines for :func:`bench_training_steps`."""
    lines = ["Training steps against their algorithmic work (one process, threads 1): MGRIT "
             "time / (serial step x (W_fwd + W_adj + N) / 3N)"]
    for r in rows:
        lines.append(f"  {r['name']}: serial {1e3 * r['serial_s']:.2f} ms, MGRIT "
                     f"{1e3 * r['mgrit_s']:.2f} ms, work {r['work_fwd']:.0f} + "
                     f"{r['work_adj']:.0f} + {r['layers']} over {3 * r['layers']} -> "
                     f"{1e3 * r['algorithmic_s']:.2f} ms; ratio {r['ratio']:.3f} "
                     f"({', '.join(r['engines'])})  [target {r['target']}]")
        lines.append(f"      per phase: a forward evaluation {1e6 * r['step_fwd_s']:.1f} us, an "
                     f"adjoint one {1e6 * r['step_adj_s']:.1f} us (bare chains), the rest "
                     f"{1e3 * r['rest_s']:.2f} ms once -> {1e3 * r['phases_s']:.2f} ms; ratio "
                     f"{r['phase_ratio']:.3f} (forward solves {r['fwd_solve_ratio']:.3f}, "
                     f"adjoint solves {r['adj_solve_ratio']:.3f} of their evaluations)")
    return "\n".join(lines)


class _QueuedArray(np.ndarray):
    """A "device" array of :class:`CountingLauncher` (what its allocators return, and views of
    it): an array operation that writes into one (an assignment, a ufunc with ``out``, ``fill``,
    ``copyto``) is one CuPy launch on a GPU, whose host only queues it: counted in the
    launcher's ``array_ops`` (or in the graph being captured) and not computed. Operations that
    make a new array run as NumPy (small here: norms, scalars) and are counted too."""

    launcher = None

    def __array_finalize__(self, obj):
        self.launcher = getattr(obj, "launcher", None)

    def _queue(self):
        if self.launcher is not None:
            self.launcher.array_op()

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out")
        for a in inputs + tuple(outs or ()):
            if isinstance(a, _QueuedArray) and a.launcher is not None:
                a._queue()
                break
        if outs is not None and any(isinstance(o, _QueuedArray) for o in outs):
            return outs[0] if len(outs) == 1 else outs  # queued, not computed
        args = [a.view(np.ndarray) if isinstance(a, _QueuedArray) else a for a in inputs]
        if outs is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, _QueuedArray) else o
                                  for o in outs)
        return getattr(ufunc, method)(*args, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.copyto and isinstance(args[0], _QueuedArray):
            args[0]._queue()
            return None
        return super().__array_function__(func, types, args, kwargs)

    def __setitem__(self, key, value):
        self._queue()

    def fill(self, value):
        self._queue()


class CountingLauncher:
    """A RawKernel launcher that launches nothing: it counts the launches of each kernel and
    the allocations through its array module (``empty``, ``zeros``, ``ones``, ``full`` and their
    ``_like`` forms, all zero-filled), so a training step through
    :class:`mgnn.backend.cupy_raw.RawBackend` measures the host side of the GPU backend (Python
    orchestration, pointer arrays, allocations, launches) and its launch counts on any machine.
    Its arrays are :class:`_QueuedArray`: array work on them (e.g. the MGRIT engine's strided
    copies / corrections, CuPy launches on a GPU) is counted in ``array_ops`` and not done, as
    a GPU's host only queues it; arrays of plain NumPy (``to_device`` returns its input) work as
    usual."""

    name = "counting"
    on_device = False
    captures = True  #: graphs are counted (:meth:`begin_capture`)
    #: array constructors that are counted as allocations (each returns zeros)
    ALLOCATORS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like",
                  "full_like")

    def __init__(self):
        import collections
        from ..backend.cupy_raw import GPU_GEOMETRY
        self.geometry = dict(GPU_GEOMETRY)
        self.xp = self  # numpy, except that the ALLOCATORS are counted and zero-filled
        self.launches = collections.Counter()
        self.pointers = self.allocations = 0
        self._captured = None  # the launches of a graph being captured
        self.graph_kernels = 0  # kernels run by graph launches
        self.array_ops = 0  # CuPy array operations queued outside graphs (see _QueuedArray)

    def begin_capture(self):
        """Record the launches that follow into a graph (:meth:`end_capture`) instead of counting
        them, as CUDA stream capture would."""
        import collections
        self._captured = collections.Counter()

    def end_capture(self):
        """The graph of the launches since :meth:`begin_capture`; its ``launch()`` counts as
        one launch ('graph')."""
        kernels, self._captured = self._captured, None
        return _CountedGraph(self, kernels)

    def __getattr__(self, name):
        if name in CountingLauncher.ALLOCATORS:
            def allocate(shape_or_a, *args, **kw):
                self.allocations += 1
                pos = args[1:] if name.startswith("full") else args  # full: after the value
                dtype = kw["dtype"] if "dtype" in kw else (pos[0] if pos else None)
                if name.endswith("_like"):
                    out = np.zeros(np.shape(shape_or_a), dtype=dtype or shape_or_a.dtype)
                else:
                    out = np.zeros(shape_or_a, float if dtype is None else dtype)
                out = out.view(_QueuedArray)
                out.launcher = self
                return out
            return allocate
        return getattr(np, name)

    def array_op(self):
        """One CuPy array operation: in the graph being captured, else in ``array_ops``."""
        if self._captured is not None:
            self._captured["array op"] += 1
        else:
            self.array_ops += 1

    #: its "device" arrays are host NumPy arrays: on several ranks the halo hands them to MPI
    #: directly (:func:`mgnn.comm.make_device_halo`), as a CUDA-aware MPI takes device buffers
    cuda_aware_mpi = True

    @property
    def cuda(self):
        """The stream synchronisation the halo calls (nothing runs: nothing to wait for)."""
        import types
        stream = types.SimpleNamespace(synchronize=lambda: None)
        return types.SimpleNamespace(get_current_stream=lambda: stream)

    def ptr(self, a):
        self.pointers += 1
        return a.__array_interface__["data"][0]

    def to_device(self, a):
        return np.ascontiguousarray(a)

    def launch(self, name, dtype, grid, block, args):
        (self.launches if self._captured is None else self._captured)[name] += 1

    def gemm(self, A, B, C, trans_a=False, trans_b=False):
        """A cuBLAS strided-batched GEMM: counted as one launch ('gemm'), computes nothing."""
        self.launch("gemm", None, None, None, ())

    def synchronize(self):
        """Nothing runs."""


class _CountedGraph:
    """A captured launch sequence of :class:`CountingLauncher` (``kernels``: its launches)."""

    def __init__(self, launcher, kernels):
        self.launcher, self.kernels = launcher, kernels

    def launch(self):
        self.launcher.launches["graph"] += 1
        self.launcher.graph_kernels += sum(self.kernels.values())


def bench_gpu_launches(n_layers=1024, width=64, batch=64, cf=4, levels=3, fwd_iters=2,
                       bwd_iters=1, repeats=3, seed=0, comm=None):
    """Kernel launches and host-side seconds of one training step of the GPU backend, with
    interval-batched MGRIT and layer by layer, without running any kernel (see
    :class:`CountingLauncher`): the launch-bound part of the GPU cost, measurable anywhere.

    Here a device pointer costs a NumPy ``__array_interface__`` read (~2 us; CuPy's
    ``.data.ptr`` is ~10x cheaper) and an allocation a zero fill, so ``host_seconds`` is an upper
    bound of the GPU's host side; ``pointers`` and ``allocations`` count both. The array
    operations on the device arrays (the MGRIT engine's strided copies, FAS corrections,
    injections, zero fills: CuPy launches on a GPU) are counted in ``array_ops`` (outside
    graphs) and not done, as a GPU's host only queues them (:class:`_QueuedArray`). Each step
    fills one gradient buffer (``loss_and_grad(x, y, out=grads)``), as :func:`mgnn.train.fit`
    does. On several ranks a step also waits for its neighbours and reductions:
    ``mpi_seconds`` (the step's ``halo_wait``, ``allreduce`` and ``staging`` timings) and
    ``busy_seconds`` (the rest: what the host itself does) say how much.

    Methods: 'mgrit' (each fixed MGRIT cycle captured as a graph on the second step and
    launched from the third on: a graph launch counts as one, 'graph'), 'mgrit no graphs' and
    'serial'.

    ``comm``: an mpi4py communicator of P > 1 processes runs every method on P layer ranks
    (layer by layer for 'serial'); the halo hands the host stand-in arrays to MPI as a
    CUDA-aware MPI library takes device buffers. The counts are rank 0's, ``host_seconds`` the
    slowest rank's median (collective: every rank calls this).

    Returns a list of dicts: method, launches, launches_by_kernel, pointers, allocations,
    array_ops (of the third step: the first allocates the step's buffers, the second captures
    the graphs), host_seconds, mpi_seconds, busy_seconds (medians; several ranks: the slowest
    rank's), graph_kernels (the kernels and array operations the step's graph launches ran),
    ranks.
    """
    from ..backend.cupy_raw import RawBackend
    from ..mgrit import MGRITOptions
    from ..params import ParamDict
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, width)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    out = []
    for method in ("mgrit", "mgrit no graphs", "serial"):
        launcher = CountingLauncher()
        bk = RawBackend(launcher, "counting")
        model = dense_resnet(width, width, 10, n_layers, dtype="float32", seed=seed)
        if method != "serial":
            fwd = MGRITOptions(cf=cf, max_levels=levels, max_iter=fwd_iters, tol=0.0)
            bwd = MGRITOptions(cf=cf, max_levels=levels, max_iter=bwd_iters, tol=0.0)
            lp = LayerParallel(model, fwd, bwd, backend=bk, capture=method == "mgrit",
                               guard=None, comm=comm)
        else:
            lp = LayerParallel(model, backend=bk, comm=comm)
        # the gradient buffer on the "device" (as model.params.zeros_like() is on a GPU)
        grads = ParamDict.allocate(model.params.shapes(), model.params.flat.dtype, launcher)

        def step():
            return lp.loss_and_grad(x, y, out=grads)

        def timed():  # (seconds, of which in MPI: halo waits, reductions, staging)
            t0 = time.perf_counter()
            step()
            seconds = time.perf_counter() - t0
            t = lp.stats.get("timings") or {}
            return seconds, sum(t.get(k, 0.0) for k in ("halo_wait", "allreduce", "staging"))

        step()
        step()
        launcher.launches.clear()
        launcher.pointers = launcher.allocations = launcher.graph_kernels = 0
        launcher.array_ops = 0
        step()
        counts, graph_kernels = dict(launcher.launches), launcher.graph_kernels
        pointers, allocations, array_ops = (launcher.pointers, launcher.allocations,
                                            launcher.array_ops)
        if comm is not None:
            comm.Barrier()
        samples = np.array([timed() for _ in range(max(1, repeats))])
        seconds, mpi = float(np.median(samples[:, 0])), float(np.median(samples[:, 1]))
        busy = float(np.median(samples[:, 0] - samples[:, 1]))
        if comm is not None:
            seconds, mpi, busy = (comm.allreduce(v, op=_mpi_max()) for v in (seconds, mpi, busy))
        out.append({"method": method, "n_layers": n_layers, "width": width, "batch": batch,
                    "launches": sum(counts.values()), "launches_by_kernel": counts,
                    "pointers": pointers, "allocations": allocations, "host_seconds": seconds,
                    "mpi_seconds": mpi, "busy_seconds": busy, "array_ops": array_ops,
                    "graph_kernels": graph_kernels,
                    "ranks": 1 if comm is None else comm.Get_size()})
    return out


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


def format_gpu_launches(results):
    """Table of :func:`bench_gpu_launches` results."""
    ranks = results[0].get("ranks", 1) if results else 1
    lines = ["GPU backend, one training step, no kernel run (host side only)"
             + (f", {ranks} layer ranks (counts: rank 0; ms: the slowest rank):"
                if ranks > 1 else ":"),
             f"{'method':>16} {'N':>6} {'launches':>9} {'in graphs':>10} {'array ops':>10} "
             f"{'pointers':>9} {'allocs':>7} {'host ms':>8} {'in MPI':>7} {'busy ms':>8}"]
    for r in results:
        lines.append(f"{r['method']:>16} {r['n_layers']:>6} {r['launches']:>9} "
                     f"{r.get('graph_kernels', 0):>10} {r.get('array_ops', 0):>10} "
                     f"{r['pointers']:>9} {r['allocations']:>7} "
                     f"{1e3 * r['host_seconds']:8.2f} {1e3 * r.get('mpi_seconds', 0.0):7.2f} "
                     f"{1e3 * r.get('busy_seconds', r['host_seconds']):8.2f}")
    by = {r["method"]: r for r in results}
    s = by.get("serial")
    for name in ("mgrit", "mgrit no graphs"):
        m = by.get(name)
        if m is not None and s is not None:
            lines.append(f"{name}: launches serial / MGRIT {s['launches'] / m['launches']:.1f}x; "
                         f"host time MGRIT / serial {m['host_seconds'] / s['host_seconds']:.2f}x")
    lines.append("(third step; a graph launch counts as one, array ops are CuPy array "
                 "operations outside graphs, queued and not done here; busy ms: host ms less "
                 "the time in MPI waits and reductions)")
    return "\n".join(lines)


def bench_gru_coarse(seq_lens=(128, 512, 1024), cfs=(2, 4, 8), hidden=32, in_features=4,
                     batch=16, cycles=5, levels=2, seed=0, log=None):
    """The coarse-propagator study of docs/recurrent.md: forward and adjoint residual per cycle
    (XBraid's r_k) of a GRU over sequence time, for each coarse propagator, sequence length and
    cf (float64, numba, PyTorch's initialisation, random inputs, FCF relaxation).

    Returns
    -------
    list of dict: seq_len, cf, coarse, forward, adjoint (lists of floats), seconds.
    """
    from .. import MGRITOptions, gru_classifier
    rng = np.random.default_rng(seed)
    rows = []
    for L in seq_lens:
        x = rng.standard_normal((batch, L, in_features))
        y = rng.integers(0, 4, batch)
        for cf in cfs:
            for coarse in ("rediscretise", "implicit"):
                model = gru_classifier(in_features, hidden, 4, L, coarse=coarse, seed=seed + 1)
                opts = MGRITOptions(cf=cf, max_levels=levels, tol=0.0, max_iter=cycles)
                lp = LayerParallel(model, fwd=opts, bwd=opts, backend="numba", guard=None)
                t0 = time.perf_counter()
                lp.loss_and_grad(x, y)
                rows.append({"seq_len": L, "cf": cf, "coarse": coarse,
                             "forward": lp.stats["forward"]["residuals"],
                             "adjoint": lp.stats["adjoint"]["residuals"],
                             "seconds": time.perf_counter() - t0})
                if log:
                    log(format_gru_coarse(rows[-1:], header=len(rows) == 1))
    return rows


def format_gru_coarse(rows, header=True):
    """Markdown table rows of :func:`bench_gru_coarse`."""
    out = ["| L | cf | coarse | forward r_0 .. | adjoint r_0 .. |", "|---|---|---|---|---|"] \
        if header else []
    for r in rows:
        out.append(f"| {r['seq_len']} | {r['cf']} | {r['coarse']} | "
                   + " ".join(f"{v:.1e}" for v in r["forward"]) + " | "
                   + " ".join(f"{v:.1e}" for v in r["adjoint"]) + " |")
    return "\n".join(out)
