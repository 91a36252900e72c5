"""Cases for the Numba CUDA kernels of :mod:`mgnn.backend.numba_cuda` against the NumPy references
(GenericOps, SGD, Adam), run by tests/backend/test_numba_cuda.py in a subprocess: under the
simulator (``NUMBA_ENABLE_CUDASIM=1``, NumPy arrays) and, where a GPU exists, on it (CuPy arrays).

Not named test_*.py: the outer pytest must not import it (the simulator is chosen at import time).
Threads per block are patched to 4 so the small sizes span several blocks with a ragged last one.
"""
import numpy as np
import pytest
from numba import config

SIM = bool(config.ENABLE_CUDASIM)
if not SIM:
    try:
        import cupy
        _gpu = bool(cupy.cuda.is_available())
    except ImportError:
        _gpu = False
    if not _gpu:
        pytest.skip("neither the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1) nor a GPU",
                    allow_module_level=True)

from mgnn.backend import numba_cuda as nc  # noqa: E402 -- after the skip
from mgnn.backend.fas_ops import GenericOps  # noqa: E402
from mgnn.optim import SGD, Adam  # noqa: E402

xp = np if SIM else cupy
REF = GenericOps()
OPS = nc.CudaOps()
RTOL = {"float32": 1e-5, "float64": 1e-12}
DTYPES = ["float32", "float64"]
#: 1 entry, one ragged block, several blocks (33 = 8 full blocks of 4 and one of 1), 2-D.
SHAPES = [(1,), (3,), (17,), (3, 11)]


class _Poisoned:
    """Array module whose fresh arrays are full of NaN (an entry a kernel misses shows up)."""

    def __init__(self, mod):
        self.mod = mod

    def empty_like(self, a):
        return self.mod.full_like(a, np.nan)

    def empty(self, shape, dtype=float):
        return self.mod.full(shape, np.nan, dtype=dtype)


@pytest.fixture(autouse=True, params=[None, 2], ids=["grid", "stride"])
def small_blocks(request, monkeypatch):
    """4 threads per block; 'stride' also caps the grid at 2 blocks (grid-stride loops)."""
    monkeypatch.setattr(nc, "THREADS", 4)
    if request.param is not None:
        monkeypatch.setattr(nc, "MAX_BLOCKS", request.param)
    real = nc._xp
    monkeypatch.setattr(nc, "_xp", lambda a: _Poisoned(real(a)))


def _rand(rng, shape, dtype, lo=0.5):
    """Random entries of magnitude in [lo, lo + 1) with random signs (never zero)."""
    mag = lo + rng.random(shape)
    return (mag * rng.choice([-1.0, 1.0], size=shape)).astype(dtype)


def dev(a):
    return xp.asarray(a)


def host(a):
    return a if isinstance(a, np.ndarray) else cupy.asnumpy(a)


def check(actual, expected, dtype, what):
    """Same shape and dtype, and equal to ``rtol`` of the dtype with no absolute slack. Under the
    simulator the kernels run as NumPy scalar arithmetic, so the same operations in the same order
    must give the reference bit for bit: that is asserted too (it catches a reordered formula)."""
    actual = host(actual)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == np.dtype(dtype), (what, actual.dtype)
    np.testing.assert_allclose(actual, expected, rtol=RTOL[dtype], atol=0, err_msg=what)
    if SIM:
        np.testing.assert_array_equal(actual, expected, err_msg=f"{what} (bit for bit)")


def check_scalar(actual, expected, dtype, what):
    assert isinstance(actual, float), (what, type(actual))
    np.testing.assert_allclose(actual, expected, rtol=RTOL[dtype], atol=0, err_msg=what)


def _sq64(a):
    """||a||^2 summed in float64 (what the kernels compute, to round-off of the summation)."""
    a = a.astype(np.float64).reshape(-1)
    return float(np.dot(a, a))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_g", [True, False])
def test_residual(dtype, with_g, rng):
    for shape in SHAPES:
        phi, u, g = (_rand(rng, shape, dtype) for _ in range(3))
        r_ref, n_ref = REF.residual(phi, u, g if with_g else None)
        r, n2 = OPS.residual(dev(phi), dev(u), dev(g) if with_g else None)
        check(r, r_ref, dtype, f"r {shape}")
        check_scalar(n2, n_ref, dtype, f"||r||^2 {shape}")
        check_scalar(n2, _sq64(r_ref), "float64", f"||r||^2 in float64 {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fas_rhs_in_place(dtype, rng):
    for shape in SHAPES:
        r, v, phi_c = (_rand(rng, shape, dtype) for _ in range(3))
        expected = REF.fas_rhs(r.copy(), v, phi_c)
        rd = dev(r)
        out = OPS.fas_rhs(rd, dev(v), dev(phi_c))
        assert out is rd
        check(rd, expected, dtype, f"fas_rhs {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_correct(dtype, rng):
    for shape in SHAPES:
        u, uc, v = (_rand(rng, shape, dtype) for _ in range(3))
        ud = dev(u)
        out = OPS.correct(ud, dev(uc), dev(v))
        assert out is not ud
        check(out, REF.correct(u, uc, v), dtype, f"correct {shape}")
        check(ud, u, dtype, "u unchanged")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add(dtype, rng):
    for shape in SHAPES:
        a, b = _rand(rng, shape, dtype), _rand(rng, shape, dtype)
        check(OPS.add(dev(a), dev(b)), REF.add(a, b), dtype, f"add {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm2_and_sq_norm(dtype, rng):
    for shape in SHAPES:
        a = _rand(rng, shape, dtype)
        check_scalar(OPS.norm2(dev(a)), REF.norm2(a), dtype, f"norm2 {shape}")
        check_scalar(nc.sq_norm(dev(a)), _sq64(a), "float64", f"sq_norm {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_axpy(dtype, rng):
    for shape in SHAPES:
        x, y = _rand(rng, shape, dtype), _rand(rng, shape, dtype)
        a = -0.7
        expected = y + np.dtype(dtype).type(a) * x
        yd = dev(y)
        assert nc.axpy(a, dev(x), yd) is yd
        check(yd, expected, dtype, f"axpy {shape}")


def test_empty_arrays():
    e = xp.zeros(0, np.float64)
    r, n2 = OPS.residual(e, e, None)
    assert r.shape == (0,) and n2 == 0.0
    assert nc.sq_norm(e) == 0.0
    nc.sgd_update(e, e, e, 0.1, 0.9, 0.0, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sgd_steps(dtype, momentum, weight_decay, rng):
    for shape in SHAPES:
        p0 = _rand(rng, shape, dtype).reshape(-1)
        ref = SGD(p0.copy(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
        p, buf = dev(p0), dev(_rand(rng, p0.shape, dtype))  # the first step overwrites buf
        buf0 = host(buf).copy()
        for step in range(3):
            grad = _rand(rng, p0.shape, dtype)
            first = ref.t == 0
            ref.step(grad)
            assert nc.sgd_update(p, dev(grad), buf, 0.1, momentum, weight_decay, first) is p
            check(p, ref.params, dtype, f"params after step {step}")
            check(buf, ref.buf if momentum else buf0, dtype, f"buf after step {step}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_steps(dtype, weight_decay, rng):
    for shape in SHAPES:
        p0 = _rand(rng, shape, dtype).reshape(-1)
        ref = Adam(p0.copy(), lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
        m0, v0 = _rand(rng, p0.shape, dtype), np.abs(_rand(rng, p0.shape, dtype))
        ref.m[...], ref.v[...] = m0, v0  # a state other than zeros (as after a restart)
        p, m, v = dev(p0), dev(m0), dev(v0)
        for t in (1, 2, 3):
            grad = _rand(rng, p0.shape, dtype)
            ref.step(grad)
            assert ref.t == t
            out = nc.adam_update(p, dev(grad), m, v, 0.01, 0.8, 0.95, 1e-6, weight_decay, t)
            assert out is p
            check(m, ref.m, dtype, f"m at t={t}")
            check(v, ref.v, dtype, f"v at t={t}")
            check(p, ref.params, dtype, f"params at t={t}")


def test_generic_fallback(rng):
    """Arrays the kernels do not take (strided, mixed dtypes, complex) go to GenericOps."""
    a = _rand(rng, (6, 4), "float64")
    b = _rand(rng, (6, 4), "float64")
    at, bt = dev(a).T, dev(b).T
    check(OPS.add(at, bt), a.T + b.T, "float64", "strided add")
    r, n2 = OPS.residual(dev(a), dev(b.astype(np.float32)), None)
    check(r, a - b.astype(np.float32), "float64", "mixed residual")
    z = dev(a + 1j * b)
    assert OPS.norm2(z) == pytest.approx(REF.norm2(a + 1j * b), rel=1e-12)


def test_wrapper_checks(rng):
    p = dev(_rand(rng, (4, 3), "float32"))
    with pytest.raises(ValueError, match="C-contiguous"):
        nc.sgd_update(p.T, p.T, p.T, 0.1, 0.0, 0.0, True)
    with pytest.raises(ValueError, match="differ"):
        nc.axpy(1.0, p, dev(_rand(rng, (4, 3), "float64")))
    with pytest.raises(TypeError, match="int64"):
        nc.sq_norm(xp.ones(3, np.int64))
    with pytest.raises(ValueError, match="t must be"):
        nc.adam_update(p, p, p, p, 0.1, 0.9, 0.99, 1e-8, 0.0, 0)


def test_threads_read_at_call_time(monkeypatch):
    monkeypatch.setattr(nc, "THREADS", 8)
    monkeypatch.setattr(nc, "MAX_BLOCKS", 4096)
    assert nc._grid(33) == (5, 8)
    assert nc._grid(1) == (1, 8)
    monkeypatch.setattr(nc, "MAX_BLOCKS", 2)
    assert nc._grid(33) == (2, 8)


@pytest.mark.parametrize("threads", [3, 6])
def test_reductions_with_a_block_size_not_a_power_of_two(threads, monkeypatch, rng):
    monkeypatch.setattr(nc, "THREADS", threads)
    for shape in SHAPES:
        phi, u = _rand(rng, shape, "float64"), _rand(rng, shape, "float64")
        r_ref, _ = REF.residual(phi, u, None)
        r, n2 = OPS.residual(dev(phi), dev(u), None)
        check(r, r_ref, "float64", f"r {shape}")
        check_scalar(n2, _sq64(r_ref), "float64", f"||r||^2 {shape}")
        check_scalar(nc.sq_norm(dev(phi)), _sq64(phi), "float64", f"sq_norm {shape}")


def test_simulator_launches_are_capped(rng):
    """Under the simulator (a Python thread per CUDA thread) a launch starts at most
    SIM_MAX_THREADS threads; the grid-stride loops cover a larger input, with the same results.
    On a GPU the grid grows with the input up to MAX_BLOCKS."""
    blocks, threads = nc._grid(10 ** 6)
    if SIM:
        assert blocks * threads <= nc.SIM_MAX_THREADS and blocks > 1
    else:
        assert blocks == min(-(-10 ** 6 // threads), nc.MAX_BLOCKS)
    n = nc.SIM_MAX_THREADS * 3 + 5
    for dtype in DTYPES:
        a, b = _rand(rng, n, dtype), _rand(rng, n, dtype)
        check(nc.CudaOps().add(dev(a), dev(b)), a + b, dtype, "add beyond the cap")
        check_scalar(nc.CudaOps().norm2(dev(a)), _sq64(a), dtype, "norm beyond the cap")
