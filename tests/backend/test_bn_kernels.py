"""Batch-norm + activation kernels (mgnn.backend.BN_KERNELS): every kernel x backend x dtype
against plain NumPy formulas written here, and a finite-difference proof that the kernels compose
to the exact vjp of z -> sigma(gamma (z - mean(z)) / sqrt(var(z) + eps) + beta)."""
from types import SimpleNamespace

import numpy as np
import pytest

from mgnn.backend import BN_KERNELS, available_backends, get_backend, gpu_available, to_host
from tests.conftest import assert_close

EPS = 1e-5
#: Dense (B, C) and conv (B, C, H, W) shapes: odd sizes, C = 1, B = 1 with H W > 1, channel sizes
#: that are no multiple of the emulation's 8-thread blocks and span several grid-stride passes.
SHAPES = [(7, 5), (13, 1), (1, 3), (3, 2, 5, 3), (1, 3, 4, 5), (2, 1, 3, 3), (4, 3, 7, 9)]
DTYPES = ["float32", "float64"]


def _gpu_geometry_backend():
    """The RawKernels under emulation at the GPU's block sizes (256 threads; grid capped at 4)."""
    from mgnn.backend.cupy_raw import GPU_GEOMETRY, KERNEL_FILES, RawBackend
    from mgnn.backend.host_emulation import EmulationLauncher
    launcher = EmulationLauncher(list(KERNEL_FILES), KERNEL_FILES, dict(GPU_GEOMETRY, MAX_GRID=4))
    return RawBackend(launcher, "cuda-emulated")


BACKENDS = [pytest.param(b, marks=pytest.mark.gpu) if b == "cuda" else b
            for b in available_backends()]
if "cuda-emulated" in available_backends():
    BACKENDS.append("cuda-emulated-gpu-geometry")
_made = {}


def poisoned_backend(name, made, special=None):
    """Backend ``name`` (or ``special[name]()``), kept in ``made``; RawKernel backends fill new
    outputs with NaN (an unwritten element fails the comparison)."""
    if name not in made:
        if special and name in special:
            bk = special[name]()
        else:
            bk = _gpu_geometry_backend() if name.endswith("gpu-geometry") else get_backend(name)
        if hasattr(bk, "poison_outputs"):
            bk.poison_outputs = True
        made[name] = bk
    return made[name]


def _backend(name):
    return poisoned_backend(name, _made)


def call_kernel(bk, name, *args):
    """``bk.name(*args)`` with the arrays moved to the backend's array module and back."""
    xp = getattr(bk, "xp", np)
    out = getattr(bk, name)(*(xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args))
    return tuple(to_host(o) for o in out) if isinstance(out, tuple) else to_host(out)


_call = call_kernel


# ------------------------------------------------------------------ the formulas (float64)
def _axes(z):
    return (0,) + tuple(range(2, z.ndim))


def _ch(v, z):
    return np.asarray(v, dtype=np.float64).reshape((1, -1) + (1,) * (z.ndim - 2))


def _sigma(y, act):
    """(sigma(y), sigma'(y)) for act 0 tanh, 1 relu, 2 identity."""
    if act == 0:
        return np.tanh(y), 1 / np.cosh(y) ** 2
    if act == 1:
        return np.maximum(y, 0), (y > 0) * 1.0
    return y, np.ones_like(y)


def _f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def stats_formula(z):
    z, = _f64(z)
    mean = np.mean(z, axis=_axes(z))
    return mean, ((z - _ch(mean, z)) ** 2).sum(axis=_axes(z))


def forward_formula(z, mean, invstd, gamma, beta, act):
    z, = _f64(z)
    xhat = (z - _ch(mean, z)) * _ch(invstd, z)
    a, deriv = _sigma(_ch(gamma, z) * xhat + _ch(beta, z), act)
    return a, xhat, deriv


def sums_formula(ga, deriv, xhat):
    ga, deriv, xhat = _f64(ga, deriv, xhat)
    gy = ga * deriv
    return gy.sum(axis=_axes(gy)), (gy * xhat).sum(axis=_axes(gy))


def input_formula(ga, deriv, xhat, invstd, gamma, s1, s2, count):
    ga, deriv, xhat = _f64(ga, deriv, xhat)
    gy = ga * deriv
    return _ch(np.multiply(gamma, invstd, dtype=np.float64), ga) * (
        gy - _ch(s1, ga) / count - xhat * _ch(s2, ga) / count)


def _case(rng, shape, dt, offset=3.0):
    """z with per-channel offsets, gamma, beta, and the float64 mean / invstd of z."""
    C = shape[1]
    z = (rng.standard_normal(shape) * 2 + offset * _ch(np.arange(C) - 1, np.empty(shape)))
    z = z.astype(dt)
    mean, m2 = stats_formula(z)
    invstd = 1 / np.sqrt(m2 / (z.size // C) + EPS)
    gamma, beta = rng.standard_normal(C) + 1, rng.standard_normal(C)
    return z, *(v.astype(dt) for v in (mean, invstd, gamma, beta))


# ---------------------------------------------------------------------------------- tests
def test_every_backend_has_the_bn_kernels():
    for name in available_backends():
        bk = get_backend(name)
        assert [k for k in BN_KERNELS if not callable(getattr(bk, k, None))] == [], name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bn_kernels_against_the_formulas(backend, dtype, shape, rng):
    bk, dt = _backend(backend), np.dtype(dtype)
    z, mean, invstd, gamma, beta = _case(rng, shape, dt)
    for got, want, what in zip(_call(bk, "bn_stats", z), stats_formula(z), ("mean", "m2")):
        assert got.shape == (shape[1],)
        assert_close(got, want, dt, what)
    for act in (0, 1, 2):
        got = _call(bk, "bn_act_forward", z, mean, invstd, gamma, beta, act)
        want = forward_formula(z, mean, invstd, gamma, beta, act)
        for g, w, what in zip(got, want, ("a", "xhat", "deriv")):
            assert_close(g, w, dt, f"{what} act={act}")
    r = lambda: rng.standard_normal(shape).astype(dt)  # noqa: E731
    ga, deriv, xhat = r(), r(), r()
    s1, s2 = _call(bk, "bn_act_vjp_sums", ga, deriv, xhat)
    for got, want, what in zip((s1, s2), sums_formula(ga, deriv, xhat), ("s1", "s2")):
        assert_close(got, want, dt, what)
    count = 3 * z.size // shape[1]  # e.g. sums over three replicas' batches (synchronised BN)
    got = _call(bk, "bn_act_vjp_input", ga, deriv, xhat, invstd, gamma, s1, s2, count)
    assert_close(got, input_formula(ga, deriv, xhat, invstd, gamma, s1, s2, count), dt, "gz")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_stats_is_accurate_on_a_large_offset_batch(backend, dtype, rng):
    """Two-pass statistics: a B=64, 28x28 batch far from zero (mean 100, std 1); float64 agrees
    with np.mean / ((z - mean)**2).sum() to 1e-13 relative."""
    dt = np.dtype(dtype)
    z = (100 + rng.standard_normal((64, 2, 28, 28))).astype(dt)
    mean, m2 = _call(_backend(backend), "bn_stats", z)
    want_mean, want_m2 = stats_formula(z)
    rtol = 1e-13 if dt == np.float64 else 1e-6
    np.testing.assert_allclose(mean, want_mean, rtol=rtol)
    np.testing.assert_allclose(m2, want_m2, rtol=rtol)


def _bn_act(z, gamma, beta, act):
    """sigma(gamma (z - mean(z)) / sqrt(var(z) + eps) + beta), statistics recomputed from z."""
    mean = z.mean(axis=_axes(z), keepdims=True)
    var = ((z - mean) ** 2).mean(axis=_axes(z), keepdims=True)
    return _sigma(_ch(gamma, z) * (z - mean) / np.sqrt(var + EPS) + _ch(beta, z), act)[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(5, 3), (3, 2, 3, 2), (1, 2, 2, 3)], ids=str)
@pytest.mark.parametrize("act", [0, 2])
def test_kernels_compose_to_the_bn_vjp(backend, shape, act, rng):
    """Central differences (float64) of L(z, gamma, beta) = sum ga * BN-sigma(z): gz from
    bn_stats -> bn_act_forward -> bn_act_vjp_sums -> bn_act_vjp_input, and s1, s2 as the
    gradients of beta, gamma."""
    bk = _backend(backend)
    z, _, _, gamma, beta = _case(rng, shape, np.float64, offset=1.0)
    ga = rng.standard_normal(shape)
    M = z.size // shape[1]
    mean, m2 = _call(bk, "bn_stats", z)
    invstd = 1 / np.sqrt(m2 / M + EPS)
    a, xhat, deriv = _call(bk, "bn_act_forward", z, mean, invstd, gamma, beta, act)
    assert_close(a, _bn_act(z, gamma, beta, act), "float64", "a")
    s1, s2 = _call(bk, "bn_act_vjp_sums", ga, deriv, xhat)
    gz = _call(bk, "bn_act_vjp_input", ga, deriv, xhat, invstd, gamma, s1, s2, M)

    def fd(arr, loss):
        g, h = np.empty(arr.shape), 1e-6
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + h
            up = loss()
            arr[i] = old - h
            g[i] = (up - loss()) / (2 * h)
            arr[i] = old
        return g

    loss = lambda: float((ga * _bn_act(z, gamma, beta, act)).sum())  # noqa: E731
    for got, arr, what in ((gz, z, "z"), (s2, gamma, "gamma"), (s1, beta, "beta")):
        want = fd(arr, loss)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * np.abs(want).max(),
                                   err_msg=what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_names_the_value(backend):
    bk = _backend(backend)
    z = np.ones(4)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        _call(bk, "bn_stats", z)
    g, c = np.ones((2, 3)), np.ones(3)
    with pytest.raises(TypeError, match="count.*2.5"):
        _call(bk, "bn_act_vjp_input", g, g, g, c, c, c, c, 2.5)


def bn_chain(bk, dt, B=9, w=10):
    """The four BN kernels of ``bk`` once each on fixed dense and conv inputs (a forward and a
    backward of BN -> tanh): a list of every output, for comparing two backends (the
    every-kernel check of test_raw_kernels.py)."""
    rng = np.random.default_rng(7)
    out = []
    for shape in ((B, w), (2, 3, 4, 5)):
        z, _, _, gamma, beta = _case(rng, shape, dt)
        ga = rng.standard_normal(shape).astype(dt)
        mean, m2 = bk.bn_stats(z)
        invstd = (1 / np.sqrt(np.asarray(m2) / (z.size // shape[1]) + EPS)).astype(dt)
        a, xhat, deriv = bk.bn_act_forward(z, mean, invstd, gamma, beta, 0)
        s1, s2 = bk.bn_act_vjp_sums(ga, deriv, xhat)
        out += [mean, m2, a, xhat, deriv, s1, s2,
                bk.bn_act_vjp_input(ga, deriv, xhat, invstd, gamma, s1, s2, z.size // shape[1])]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_chain_matches_the_reference_backend(backend, dtype):
    bk, dt = _backend(backend), np.dtype(dtype)
    wrapped = SimpleNamespace(**{k: lambda *a, k=k: _call(bk, k, *a) for k in BN_KERNELS})
    for i, (got, want) in enumerate(zip(bn_chain(wrapped, dt), bn_chain(get_backend("numpy"),
                                                                        dt))):
        assert_close(got, want, dt, f"output {i}")


@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_bn_reductions_are_deterministic_on_the_gpu(rng):
    bk = get_backend("cuda")
    z = bk.xp.asarray(rng.standard_normal((64, 16, 28, 28)).astype(np.float32))
    first = [to_host(v) for v in bk.bn_stats(z) + bk.bn_act_vjp_sums(z, z, z)]
    for _ in range(3):
        again = [to_host(v) for v in bk.bn_stats(z) + bk.bn_act_vjp_sums(z, z, z)]
        assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_bn_bench_row_runs_on_a_small_case():
    """The ``bench kernels`` BN row (timings are reported, never asserted)."""
    from mgnn.studies.bench import bench_bn_conv, format_results
    r = bench_bn_conv(channels=2, batch=2, size=4)
    assert r["time_us"] > 0 and r["baseline_time_us"] > 0 and np.isfinite(r["ratio"])
    assert "conv+BN+tanh" in format_results([r])
