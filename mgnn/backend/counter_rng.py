"""Counter-based dropout masks: Philox4x32-10, bit-identical on NumPy (CuPy), Numba and CUDA C.

MGRIT evaluates every layer many times per training step, so the dropout mask of layer ``n`` at
training step ``t`` for global sample ``s`` and element ``e`` must be a pure function of
``(seed, t, n, s, e)``, the same on every backend and however the batch is split over processes.
It is (integer arithmetic only, so exact everywhere):

- Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC'11; Random123's reference, checked against its
  known-answer vectors) of counter ``(e, s, n, t)`` (each mod 2**32) and key
  ``(seed & 0xffffffff, seed >> 32)``; ``r`` = the first output word;
- keep (mask 1) iff ``(r >> 8) >= threshold``, ``threshold = ceil(p * 2**24)``
  (:func:`dropout_threshold`), so ``P(keep) = 1 - threshold / 2**24``.

Three implementations of one definition: :func:`dropout_mask` (vectorised NumPy, or CuPy with
``xp=cupy``), :func:`dropout_mask_numba` (``@njit`` over samples) and
:func:`launch_dropout_mask` (the ``dropout_mask`` RawKernel of ``kernels/rng.cu`` through a
:class:`mgnn.backend.cupy_raw.RawBackend`).
"""
import math
import numbers
import operator

import numpy as np
from numba import prange

from .jit import njit

from . import is_device_array

#: Philox4x32 multipliers (of counter words 0 and 2) and Weyl key increments (key words 0, 1).
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LO32, _S32, _S8 = np.uint64(0xFFFFFFFF), np.uint64(32), np.uint64(8)
#: Resolution of the keep test: thresholds are integers in [0, 2**24].
THRESHOLD_BITS = 24
_ONE32 = 1 << 32


def _philox_words(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64 values < 2**32 (NumPy/CuPy arrays that broadcast, or Numba
    scalars): ten rounds, the key bumped before each round but the first."""
    for r in range(10):
        if r:
            k0 = (k0 + _W0) & _LO32
            k1 = (k1 + _W1) & _LO32
        p0 = _M0 * c0  # < 2**64: exact in uint64; hi = p >> 32, lo = p & (2**32 - 1)
        p1 = _M1 * c2
        c0, c1, c2, c3 = (p1 >> _S32) ^ c1 ^ k0, p1 & _LO32, (p0 >> _S32) ^ c3 ^ k1, p0 & _LO32
    return c0, c1, c2, c3


_philox_scalar = njit(cache=True, inline="always")(_philox_words)


def _xp_of(a):
    if is_device_array(a):
        import cupy
        return cupy
    return np


def philox4x32_10(counter, key):
    """Philox4x32-10 block function, vectorised.

    Parameters
    ----------
    counter : integer array (..., 4), values in [0, 2**32) (uint32 typically); NumPy or CuPy
    key : integer array (2,), values in [0, 2**32)

    Returns
    -------
    uint32 array (..., 4) of the same array module as ``counter``.
    """
    xp = _xp_of(counter)
    counter, key = xp.asarray(counter), xp.asarray(key)
    for name, a, shape in (("counter", counter, "(..., 4)"), ("key", key, "(2,)")):
        if a.dtype.kind not in "iu":
            raise TypeError(f"philox4x32_10: {name} must be an integer array, got {a.dtype}")
        if a.ndim < 1 or a.shape[-1] != (4 if name == "counter" else 2) or (
                name == "key" and a.ndim != 1):
            raise ValueError(f"philox4x32_10: {name} must have shape {shape}, got {a.shape}")
    c = counter.astype(np.uint64) & _LO32
    k = [np.uint64(int(v) & 0xFFFFFFFF) for v in (key.get() if hasattr(key, "get") else key)]
    words = _philox_words(c[..., 0], c[..., 1], c[..., 2], c[..., 3], k[0], k[1])
    out = xp.empty(counter.shape, dtype=np.uint32)
    for j, w in enumerate(words):
        out[..., j] = w.astype(np.uint32)
    return out


def dropout_threshold(p):
    """The integer keep threshold ``ceil(p * 2**24)`` of drop probability ``p``.

    Parameters
    ----------
    p : real, 0 <= p < 1

    Returns
    -------
    int in [0, 2**24]; an element is kept iff ``(r >> 8) >= threshold``.

    Raises
    ------
    TypeError
        ``p`` is not a real number.
    ValueError
        ``p`` is outside [0, 1) (or NaN).
    """
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real):
        raise TypeError(f"dropout probability p must be a real number, got {p!r}")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got p={p!r}")
    return math.ceil(p * (1 << THRESHOLD_BITS))  # exact: scaling by a power of two


def _index(value, name, limit=None):
    """``value`` as an int in [0, limit) (no limit: >= 0); TypeError / ValueError naming it."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"dropout_mask: {name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"dropout_mask: {name} must be an integer, got {value!r}") from None
    if v < 0 or (limit is not None and v >= limit):
        bound = f"[0, {limit})" if limit is not None else ">= 0"
        raise ValueError(f"dropout_mask: {name} must be {bound}, got {name}={v}")
    return v


def _check(seed, step, layer, sample0, batch, n_elements, threshold):
    """Validated (k0, k1, layer, step, sample0 (all mod 2**32), batch, n_elements, threshold)."""
    seed = _index(seed, "seed", 1 << 64)
    step, layer, sample0 = (_index(v, k) % _ONE32 for v, k in
                            ((step, "step"), (layer, "layer"), (sample0, "sample0")))
    batch, n_elements = _index(batch, "batch"), _index(n_elements, "n_elements")
    threshold = _index(threshold, "threshold", (1 << THRESHOLD_BITS) + 1)
    return seed & 0xFFFFFFFF, seed >> 32, layer, step, sample0, batch, n_elements, threshold


def _check_out(out, batch, n_elements, xp):
    if out is None:
        return xp.empty((batch, n_elements), dtype=np.uint8)
    if (not isinstance(out, xp.ndarray) or out.dtype != np.uint8
            or tuple(out.shape) != (batch, n_elements) or not out.flags.c_contiguous):
        raise ValueError(f"dropout_mask: out must be a C-contiguous uint8 {xp.__name__} array of "
                         f"shape {(batch, n_elements)}, got {type(out).__name__} "
                         f"{getattr(out, 'dtype', None)} {getattr(out, 'shape', None)}")
    return out


def dropout_mask(seed, step, layer, sample0, batch, n_elements, threshold, xp=np, out=None):
    """Dropout keep mask of samples ``sample0 .. sample0 + batch - 1`` (NumPy or CuPy reference).

    Parameters
    ----------
    seed : int in [0, 2**64)
    step, layer, sample0 : int >= 0
        Training step t, layer n, global index of the first sample (each used mod 2**32).
    batch, n_elements : int >= 0
        Samples, and elements per sample (flat index e inside one sample).
    threshold : int in [0, 2**24]
        :func:`dropout_threshold` of the drop probability (0 keeps everything).
    xp : module
        ``numpy`` or ``cupy`` (uses only functions both have).
    out : uint8 array (batch, n_elements) of ``xp``, optional

    Returns
    -------
    uint8 array (batch, n_elements) of ``xp``: ``mask[i, e] = 1`` iff element e of sample
    ``sample0 + i`` is kept (module docstring).
    """
    k0, k1, n, t, s0, batch, n_el, thr = _check(seed, step, layer, sample0, batch, n_elements,
                                                threshold)
    out = _check_out(out, batch, n_el, xp)
    e = (xp.arange(n_el, dtype=np.uint64) & _LO32).reshape(1, n_el)
    s = ((xp.arange(batch, dtype=np.uint64) + np.uint64(s0)) & _LO32).reshape(batch, 1)
    r = _philox_words(e, s, np.uint64(n), np.uint64(t), np.uint64(k0), np.uint64(k1))[0]
    out[...] = ((r >> _S8) >= np.uint64(thr)).astype(np.uint8)
    return out


@njit(cache=True, parallel=True)
def _dropout_kernel(out, k0, k1, n, t, s0, thr):
    """Fill ``out`` (batch, E) uint8 with the keep mask; uint64 arguments < 2**32 (thr <= 2**24)."""
    for i in prange(out.shape[0]):
        s = (s0 + np.uint64(i)) & _LO32
        for e in range(out.shape[1]):
            r = _philox_scalar(np.uint64(e) & _LO32, s, n, t, k0, k1)[0]
            out[i, e] = np.uint8(1) if (r >> _S8) >= thr else np.uint8(0)


def dropout_mask_numba(seed, step, layer, sample0, batch, n_elements, threshold, out=None):
    """:func:`dropout_mask` on the CPU with Numba (samples in parallel), bit for bit the same.

    Parameters and result as :func:`dropout_mask` (NumPy arrays); ``out`` is filled in place.
    """
    k0, k1, n, t, s0, batch, n_el, thr = _check(seed, step, layer, sample0, batch, n_elements,
                                                threshold)
    out = _check_out(out, batch, n_el, np)
    _dropout_kernel(out, *(np.uint64(v) for v in (k0, k1, n, t, s0, thr)))
    return out


def _int32(v):
    """A value < 2**32 as the int32 with the same bits (kernel ``int`` arguments are 32-bit)."""
    return v - _ONE32 if v >= 1 << 31 else v


def launch_dropout_mask(backend, seed, step, layer, sample0, batch, n_elements, threshold,
                        out=None):
    """:func:`dropout_mask` through the ``dropout_mask`` RawKernel of ``kernels/rng.cu``.

    Parameters
    ----------
    backend : mgnn.backend.cupy_raw.RawBackend
        Its launcher must have ``rng.cu`` loaded (``KERNEL_FILES``); its ``xp`` arrays are used
        (CuPy on a GPU: the launch is asynchronous, on the current stream).
    seed, step, layer, sample0, batch, n_elements, threshold
        As :func:`dropout_mask`; ``batch`` and ``n_elements`` also below 2**31 minus the grid.
    out : uint8 array (batch, n_elements) of ``backend.xp``, optional

    Returns
    -------
    uint8 array (batch, n_elements) of ``backend.xp``, equal bit for bit to :func:`dropout_mask`.
    """
    k0, k1, n, t, s0, batch, n_el, thr = _check(seed, step, layer, sample0, batch, n_elements,
                                                threshold)
    g = backend.geometry
    gx = max(1, min(-(-n_el // g["ELEM"]), g["MAX_GRID"]))
    gy = max(1, min(batch, g["MAX_GRID"], 65535))
    if batch + gy >= 1 << 31 or n_el + gx * g["ELEM"] >= 1 << 31:
        raise ValueError(f"dropout_mask: batch={batch} and n_elements={n_elements} must each be "
                         "below 2**31 minus the launch grid (the kernel indexes with int)")
    fresh = out is None
    out = _check_out(out, batch, n_el, backend.xp)
    if fresh and getattr(backend, "poison_outputs", False):
        out.fill(2)  # neither keep nor drop: an element the kernel skips shows up
    if batch and n_el:
        backend._launch("dropout_mask", np.float32, (gx, gy, 1), (g["ELEM"], 1, 1), out,
                        batch, n_el, _int32(s0), _int32(n), _int32(t), _int32(k0), _int32(k1),
                        thr)
    return out
