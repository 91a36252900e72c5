"""Numba CUDA kernels of the ``cuda`` backend: the MGRIT vector operations and optimizer updates.

Every kernel works on flattened C-contiguous 1-D views of float32/float64 device arrays (CuPy
arrays on a GPU; NumPy arrays under the simulator, ``NUMBA_ENABLE_CUDASIM=1``) with a grid-stride
loop over ``n`` entries; reductions accumulate in float64 and write one partial sum per block
(shared-memory tree sum), which the host adds up. Importing this module touches no device: the
kernels are compiled at their first launch. Host wrappers launch on CuPy's current stream and read
:data:`THREADS` at call time (tests patch it small so tiny inputs span several blocks).
"""
import math
import os
import sys

import numpy as np
from numba import config, cuda, float64

from .fas_ops import GenericOps

#: Threads per block of every launch (read at call time; at most :data:`_SMEM`).
THREADS = 256
#: Most blocks of one launch; the grid-stride loops cover the rest (bounds the partial sums).
MAX_BLOCKS = 4096
#: Most threads of one launch under the simulator (``NUMBA_ENABLE_CUDASIM=1``), where every CUDA
#: thread is a Python thread started and joined per launch; the grid-stride loops cover the rest.
SIM_MAX_THREADS = 512
#: float64 entries of the static shared buffer of the reductions (CUDA's maximum block size).
_SMEM = 1024
_SIM = bool(config.ENABLE_CUDASIM)
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _load_numba_cuda_registries():
    """Import numba-cuda's NumPy typing registries now, working around numba-cuda <= 0.30 on NumPy >= 2.5.

    numba-cuda 0.30.4 registers ``overload(np.row_stack)`` unconditionally when its typing context
    first loads (at the first kernel compilation); NumPy 2.5 removed ``np.row_stack``, so every
    compilation then fails with ``AttributeError`` (seen on the H200 image: numpy 2.5.2,
    numba-cuda 0.30.4). The alias is lent for the import only and removed again, so NumPy itself
    is left as it was. No-op under the simulator and where ``np.row_stack`` exists.
    """
    if _SIM or hasattr(np, "row_stack"):
        return
    np.row_stack = np.vstack
    try:
        import numba.cuda.cudaimpl  # noqa: F401 -- loads numba.cuda.np.arrayobj under the alias
        import numba.cuda.np.arraymath  # noqa: F401 -- and the rest of the target's registries
    finally:
        del np.row_stack


_load_numba_cuda_registries()
if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in os.environ:
    # small MGRIT levels launch few blocks by design; numba-cuda would warn at every such launch
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _block_sum(sh, acc):
    """Sum of ``acc`` over the threads of the block (any block size <= ``_SMEM``).

    Parameters
    ----------
    sh : float64[_SMEM], shared
        Scratch buffer of the block.
    acc : float64
        This thread's contribution.

    Returns
    -------
    float64
        The block total (valid in every thread).
    """
    tid = cuda.threadIdx.x
    bdim = cuda.blockDim.x
    sh[tid] = acc
    cuda.syncthreads()
    half = 1
    while half < bdim:
        half *= 2
    half //= 2
    while half > 0:
        if tid < half and tid + half < bdim:
            sh[tid] += sh[tid + half]
        cuda.syncthreads()
        half //= 2
    return sh[0]


@cuda.jit
def _residual_kernel(phi, u, g, has_g, r, partial):
    """r = phi - u (+ g) and the per-block partial sums of r**2.

    Parameters
    ----------
    phi, u, g : float32[n] or float64[n]
        Inputs (``g`` is read only when ``has_g``).
    has_g : bool
    r : float32[n] or float64[n]
        Output.
    partial : float64[gridDim.x]
        Output: sum of r[i]**2 (in float64) over the entries of each block.
    """
    sh = cuda.shared.array(_SMEM, float64)
    n = r.size
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    acc = 0.0
    while i < n:
        v = phi[i] - u[i]
        if has_g:
            v += g[i]
        r[i] = v
        w = float64(v)
        acc += w * w
        i += stride
    total = _block_sum(sh, acc)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = total


@cuda.jit
def _sq_norm_kernel(x, partial):
    """Per-block partial sums of x**2 (in float64).

    Parameters
    ----------
    x : float32[n] or float64[n]
    partial : float64[gridDim.x]
        Output.
    """
    sh = cuda.shared.array(_SMEM, float64)
    n = x.size
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    acc = 0.0
    while i < n:
        w = float64(x[i])
        acc += w * w
        i += stride
    total = _block_sum(sh, acc)
    if cuda.threadIdx.x == 0:
        partial[cuda.blockIdx.x] = total


@cuda.jit
def _fas_rhs_kernel(r, v, phi_c):
    """In place: r = (r + v) - phi_c (all float32[n] or all float64[n])."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < r.size:
        r[i] = (r[i] + v[i]) - phi_c[i]
        i += stride


@cuda.jit
def _correct_kernel(u, uc, v, out):
    """out = u + (uc - v) (all float32[n] or all float64[n])."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        out[i] = u[i] + (uc[i] - v[i])
        i += stride


@cuda.jit
def _add_kernel(a, b, out):
    """out = a + b (all float32[n] or all float64[n])."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        out[i] = a[i] + b[i]
        i += stride


# The updates multiply through round-to-nearest intrinsics: NVVM would otherwise contract
# a * b + c into one FMA (a single rounding), and the results would differ from the NumPy
# optimizers in the last bit. The simulator runs plain Python, which never contracts.
if _SIM:
    @cuda.jit(device=True)
    def _mul_sim(a, b):
        return a * b

    _MUL = {np.dtype(np.float32): _mul_sim, np.dtype(np.float64): _mul_sim}
else:
    from numba.cuda import libdevice
    _MUL = {np.dtype(np.float32): libdevice.fmul_rn, np.dtype(np.float64): libdevice.dmul_rn}


def _update_kernels(mul):
    """The in-place update kernels (axpy, sgd, adam) whose products are rounded by ``mul``."""

    @cuda.jit
    def axpy(a, x, y):
        """In place: y = y + a * x (x, y float32[n] or float64[n]; a a scalar of their dtype)."""
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < y.size:
            y[i] = y[i] + mul(a, x[i])
            i += stride

    @cuda.jit
    def sgd(p, grad, buf, lr, mu, wd, use_wd, use_mom, first):
        """In place, the update of :meth:`mgnn.optim.SGD.step`.

        g = grad + wd p (if ``use_wd``); buf = g (``first``) or buf mu + g (if ``use_mom``,
        then g = buf); p = p - lr g.

        Parameters
        ----------
        p, grad, buf : float32[n] or float64[n]
            Parameters (updated), gradient, momentum buffer (updated when ``use_mom``).
        lr, mu, wd : scalars of the arrays' dtype
        use_wd, use_mom, first : bool
        """
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < p.size:
            gi = grad[i]
            if use_wd:
                gi = gi + mul(wd, p[i])
            if use_mom:
                if first:
                    b = gi
                else:
                    b = mul(buf[i], mu) + gi
                buf[i] = b
                gi = b
            p[i] = p[i] - mul(lr, gi)
            i += stride

    @cuda.jit
    def adam(p, grad, m, v, step, b1, omb1, b2, omb2, sc2, eps, wd, use_wd):
        """In place, the update of :meth:`mgnn.optim.Adam.step`.

        g = grad + wd p (if ``use_wd``); m = m b1 + (1-b1) g; v = v b2 + (1-b2) g g;
        p = p - step m / (sqrt(v) / sc2 + eps).

        Parameters
        ----------
        p, grad, m, v : float32[n] or float64[n]
            Parameters, gradient, first and second moments (p, m, v updated).
        step, b1, omb1, b2, omb2, sc2, eps, wd : scalars of the arrays' dtype
            lr / (1 - b1**t), b1, 1 - b1, b2, 1 - b2, sqrt(1 - b2**t), eps, weight decay.
        use_wd : bool
        """
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < p.size:
            gi = grad[i]
            if use_wd:
                gi = gi + mul(wd, p[i])
            mi = mul(m[i], b1) + mul(omb1, gi)
            vi = mul(v[i], b2) + mul(mul(omb2, gi), gi)
            m[i] = mi
            v[i] = vi
            denom = math.sqrt(vi) / sc2 + eps
            p[i] = p[i] - mul(step, mi) / denom
            i += stride

    return axpy, sgd, adam


#: dtype -> (axpy, sgd, adam) kernels.
_UPDATE = {dt: _update_kernels(mul) for dt, mul in _MUL.items()}


def launch_signatures():
    """Every kernel launch of this module with the Numba argument types the host wrappers pass.

    The registry the PTX compile check (``tests/backend/test_numba_cuda.py``) compiles for sm_90
    without a GPU; a ``cuda.jit`` kernel of the module missing from it fails that test. Arrays are
    1-D C-contiguous views (:func:`_dev`), scalars NumPy scalars of the arrays' dtype, flags bool.

    Returns
    -------
    dict
        ``(kernel name, dtype name) -> (dispatcher, tuple of numba types)``.
    """
    from numba import types
    from numba.np.numpy_support import from_dtype

    out = {}
    part, flag = types.Array(types.float64, 1, "C"), types.boolean
    for dt in _FLOATS:
        s = from_dtype(dt)
        a = types.Array(s, 1, "C")
        axpy_k, sgd_k, adam_k = _UPDATE[dt]
        for name, kernel, sig in (
                ("residual", _residual_kernel, (a, a, a, flag, a, part)),
                ("sq_norm", _sq_norm_kernel, (a, part)),
                ("fas_rhs", _fas_rhs_kernel, (a, a, a)),
                ("correct", _correct_kernel, (a, a, a, a)),
                ("add", _add_kernel, (a, a, a)),
                ("axpy", axpy_k, (s, a, a)),
                ("sgd", sgd_k, (a, a, a, s, s, s, flag, flag, flag)),
                ("adam", adam_k, (a, a, a, a) + (s,) * 8 + (flag,))):
            out[name, dt.name] = (kernel, sig)
    return out


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

def _is_cupy(a):
    """Whether ``a`` is a CuPy array (a CuPy array implies that CuPy is imported)."""
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(a, cp.ndarray)


def _xp(a):
    """The array module of ``a``: ``cupy`` for a CuPy array, else ``numpy``."""
    return sys.modules["cupy"] if _is_cupy(a) else np


def _stream(a):
    """Launch stream for work on ``a``: CuPy's current stream (GPU), else the default stream."""
    if _SIM or not _is_cupy(a):
        return 0
    ptr = sys.modules["cupy"].cuda.get_current_stream().ptr
    return cuda.external_stream(ptr) if ptr else 0


def _dev(a):
    """Flat 1-D kernel argument viewing ``a`` (C-contiguous), without the CAI stream sync (the
    kernels run on the stream the arrays were produced on)."""
    flat = a.reshape(-1)
    if not _SIM and _is_cupy(a):
        return cuda.as_cuda_array(flat, sync=False)
    return flat


def _grid(n):
    """(blocks, threads) of a launch over ``n`` > 0 entries (under the simulator at most
    :data:`SIM_MAX_THREADS` threads in all, or one block where :data:`THREADS` is larger)."""
    threads = THREADS
    cap = MAX_BLOCKS if not _SIM else max(1, min(MAX_BLOCKS, SIM_MAX_THREADS // threads))
    return max(1, min(-(-n // threads), cap)), threads


def _launch(kernel, n, like, *args):
    """``kernel`` over ``n`` entries on the stream of ``like``; nothing when n == 0."""
    if n:
        blocks, threads = _grid(n)
        kernel[blocks, threads, _stream(like)](*args)


def _reduce(kernel, n, like, *args, lazy=False):
    """Launch a reduction ``kernel(*args, partial)`` and return the sum of its partials: a float,
    or with ``lazy`` on a GPU a 0-d float64 CuPy array (summed on the device, no sync)."""
    if not n:
        return 0.0
    blocks, threads = _grid(n)
    partial = _xp(like).empty(blocks, dtype=np.float64)
    kernel[blocks, threads, _stream(like)](*args, _dev(partial))
    if lazy and _is_cupy(partial):
        return partial.sum()
    host = partial.get() if _is_cupy(partial) else partial  # .get() syncs the current stream
    return float(host.sum())


def _kernel_ok(*arrays):
    """True when the kernels apply: arrays of the launch kind (CuPy; NumPy under the simulator)
    of one float dtype and one shape, C-contiguous."""
    kind = np.ndarray if _SIM else getattr(sys.modules.get("cupy"), "ndarray", None)
    a0 = arrays[0]
    if kind is None or not isinstance(a0, kind) or a0.dtype not in _FLOATS:
        return False
    return all(isinstance(a, kind) and a.dtype == a0.dtype and a.shape == a0.shape
               and a.flags.c_contiguous for a in arrays)


def _check(*arrays):
    """Light checks of the in-place wrappers (a non-contiguous array would be updated through a
    copy, i.e. not at all)."""
    a0 = arrays[0]
    if a0.dtype not in _FLOATS:
        raise TypeError(f"dtype {a0.dtype} is not supported; expected float32 or float64")
    for a in arrays:
        if a.dtype != a0.dtype or a.shape != a0.shape:
            raise ValueError(f"arrays differ: {a.dtype}{a.shape} vs {a0.dtype}{a0.shape}")
        if not a.flags.c_contiguous:
            raise ValueError("arrays must be C-contiguous")
    return a0.dtype.type


class CudaOps(GenericOps):
    """The MGRIT vector operations of :class:`~mgnn.backend.fas_ops.GenericOps`, one fused kernel
    each for C-contiguous float32/float64 device arrays (the generic code for anything else)."""

    name = "cuda"

    def residual(self, phi, u, g):
        """(r = phi - u [+ g], ||r||^2); g may be None.

        Parameters
        ----------
        phi, u, g : array of any shape, float32 or float64 (g may be None)

        Returns
        -------
        r : array like ``phi`` (new)
        float
            ||r||^2, accumulated in float64 (a synchronisation; the solver uses the batched
            RawKernel form, whose norm stays on the device until the cycle's total is read).
        """
        arrays = (phi, u) if g is None else (phi, u, g)
        if not _kernel_ok(*arrays):
            return super().residual(phi, u, g)
        r = _xp(phi).empty_like(phi)
        gf = _dev(phi if g is None else g)
        total = _reduce(_residual_kernel, phi.size, phi, _dev(phi), _dev(u), gf, g is not None,
                        _dev(r))
        return r, total

    def fas_rhs(self, r, v, phi_c):
        """In place: r += v - phi_c, as (r + v) - phi_c; returns r (arrays of one shape/dtype)."""
        if not _kernel_ok(r, v, phi_c):
            return super().fas_rhs(r, v, phi_c)
        _launch(_fas_rhs_kernel, r.size, r, _dev(r), _dev(v), _dev(phi_c))
        return r

    def correct(self, u, uc, v):
        """u + (uc - v) as a new array (arrays of one shape/dtype)."""
        if not _kernel_ok(u, uc, v):
            return super().correct(u, uc, v)
        out = _xp(u).empty_like(u)
        _launch(_correct_kernel, u.size, u, _dev(u), _dev(uc), _dev(v), _dev(out))
        return out

    def add(self, a, b):
        """a + b as a new array (arrays of one shape/dtype)."""
        if not _kernel_ok(a, b):
            return super().add(a, b)
        out = _xp(a).empty_like(a)
        _launch(_add_kernel, a.size, a, _dev(a), _dev(b), _dev(out))
        return out

    def norm2(self, a):
        """||a||^2 as a Python float (float64 accumulation)."""
        if not _kernel_ok(a):
            return super().norm2(a)
        return sq_norm(a)


def axpy(a, x, y):
    """In place: y += a * x.

    Parameters
    ----------
    a : float
        Scalar, converted to the arrays' dtype.
    x, y : array of any shape, float32 or float64, C-contiguous (same shape and dtype)

    Returns
    -------
    y
    """
    dt = _check(y, x)
    _launch(_UPDATE[y.dtype][0], y.size, y, dt(a), _dev(x), _dev(y))
    return y


def sq_norm(x):
    """||x||^2 of a float32/float64 C-contiguous array, accumulated in float64, as a float."""
    _check(x)
    return _reduce(_sq_norm_kernel, x.size, x, _dev(x))


def sgd_update(params, grad, buf, lr, momentum, weight_decay, first):
    """In place, one step of :meth:`mgnn.optim.SGD.step` (same arithmetic and rounding).

    Parameters
    ----------
    params, grad, buf : array of any shape, float32 or float64, C-contiguous (one shape/dtype)
        Parameters (updated), gradient, momentum buffer (updated when ``momentum`` is nonzero).
    lr, momentum, weight_decay : float
        Converted to the arrays' dtype; zero momentum / weight decay skip those terms.
    first : bool
        The optimizer's first step (t == 0): the buffer is set to the gradient.

    Returns
    -------
    params
    """
    dt = _check(params, grad, buf)
    _launch(_UPDATE[params.dtype][1], params.size, params, _dev(params), _dev(grad), _dev(buf),
            dt(lr), dt(momentum), dt(weight_decay), bool(weight_decay), bool(momentum), bool(first))
    return params


def adam_update(params, grad, m, v, lr, b1, b2, eps, weight_decay, t):
    """In place, one step of :meth:`mgnn.optim.Adam.step` (same arithmetic and rounding).

    Parameters
    ----------
    params, grad, m, v : array of any shape, float32 or float64, C-contiguous (one shape/dtype)
        Parameters, gradient, first and second moments (params, m, v updated).
    lr, b1, b2, eps, weight_decay : float
    t : int
        Step number after this update, >= 1 (the bias corrections use it).

    Returns
    -------
    params
    """
    dt = _check(params, grad, m, v)
    if isinstance(t, bool) or int(t) != t or t < 1:
        raise ValueError(f"t must be an integer >= 1, got {t!r}")
    c1 = 1 - b1 ** t
    c2 = 1 - b2 ** t
    _launch(_UPDATE[params.dtype][2], params.size, params, _dev(params), _dev(grad), _dev(m),
            _dev(v), dt(lr / c1), dt(b1), dt(1 - b1), dt(b2), dt(1 - b2), dt(np.sqrt(c2)), dt(eps),
            dt(weight_decay), bool(weight_decay))
    return params
