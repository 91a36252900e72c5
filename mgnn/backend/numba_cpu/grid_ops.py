"""The grid transfers of spatial coarsening on the CPU: fixed windows over whole arrays (even
axes), sparse 1D operators along an axis (any)."""

import numba
import numpy as np
from numba import prange

from .activations import njit


@njit(cache=True, parallel=True)
def _axis_operator(x, indptr, cols, weights, m):
    """out[p, i, q] = sum_k weights[k] x[p, cols[k], q] over k in indptr[i]:indptr[i + 1]."""
    pre, _, post = x.shape
    out = np.zeros((pre, m, post), dtype=x.dtype)
    for p in prange(pre):
        for i in range(m):
            for k in range(indptr[i], indptr[i + 1]):
                j, w = cols[k], weights[k]
                for q in range(post):
                    out[p, i, q] += w * x[p, j, q]
    return out


def apply_axis_operator(x, indptr, cols, weights, m):
    """A sparse 1D operator (CSR rows ``indptr`` (m + 1,), ``cols``, ``weights`` of x's dtype)
    applied along axis 1 of ``x`` (pre, n, post), C-contiguous: a new (pre, m, post) array
    (the grid transfers of :mod:`mgnn.backend.grid_transfer` on the CPU)."""
    return _axis_operator(x, indptr, cols, weights, m)


# -- structured operators: the cell-centred transfers (even sizes) as fixed windows ------------
# The interior rows of a cell-centred operator repeat one pattern: restriction-like (n = 2m),
# out[i] = sum_t w_t x[2i + a + t]; interpolation-like (m = 2n), out[2k + r] = sum_t
# w_rt x[k + a_r + t]. Over a whole array the line index folds into the flat one (input row
# 2 (p m + i) + a + t of the (pre n) rows), so one loop with constant strides covers every line:
# LLVM turns the stride-2 reads (writes) into vector shuffles, where the sparse rows gather one
# element at a time. The loops start at the first interior output of the first line and end at
# the last interior one of the last line (every read in bounds); the outputs between lines they
# compute wrongly are the edge rows, recomputed from the sparse rows after (_edge_rows). Indices
# start at 0 in views that begin at the first window, so Numba's negative-index wrap is provably
# off and the loops vectorise (with offsets that may be negative they ran 3.6x slower).

@njit(cache=True)
def _down_flat(xs, os, n, T, w):
    """os[k] = sum_{t < T} w[t] xs[2k + t] for k < n (T of 1, 2, 3 or 4)."""
    w0, w1, w2, w3 = w[0], w[1 % w.size], w[2 % w.size], w[3 % w.size]
    if T == 4:
        for k in range(n):
            os[k] = ((w0 * xs[2 * k] + w1 * xs[2 * k + 1]) + w2 * xs[2 * k + 2]) + \
                w3 * xs[2 * k + 3]
    elif T == 3:
        for k in range(n):
            os[k] = (w0 * xs[2 * k] + w1 * xs[2 * k + 1]) + w2 * xs[2 * k + 2]
    elif T == 2:
        for k in range(n):
            os[k] = w0 * xs[2 * k] + w1 * xs[2 * k + 1]
    else:
        for k in range(n):
            os[k] = w0 * xs[2 * k]


@njit(cache=True)
def _down_rows(xs, os, n, post, T, w):
    """Rows of ``post`` elements: os[k, q] = sum_{t < T} w[t] xs[2k + t, q] for k < n (flat)."""
    w0, w1, w2, w3 = w[0], w[1 % w.size], w[2 % w.size], w[3 % w.size]
    for k in range(n):
        o = os[k * post:(k + 1) * post]
        x0 = xs[2 * k * post:(2 * k + T) * post]
        if T == 4:
            for q in range(post):
                o[q] = ((w0 * x0[q] + w1 * x0[post + q]) + w2 * x0[2 * post + q]) + \
                    w3 * x0[3 * post + q]
        elif T == 3:
            for q in range(post):
                o[q] = (w0 * x0[q] + w1 * x0[post + q]) + w2 * x0[2 * post + q]
        elif T == 2:
            for q in range(post):
                o[q] = w0 * x0[q] + w1 * x0[post + q]
        else:
            for q in range(post):
                o[q] = w0 * x0[q]


@njit(cache=True)
def _up_flat(x0, x1, os, n, T, u, v):
    """os[2k] = sum_{t < T} u[t] x0[k + t], os[2k + 1] = sum_{t < T} v[t] x1[k + t], k < n
    (T of 1 or 2 for both classes)."""
    u0, u1, v0, v1 = u[0], u[1 % u.size], v[0], v[1 % v.size]
    if T == 2:
        for k in range(n):
            os[2 * k] = u0 * x0[k] + u1 * x0[k + 1]
            os[2 * k + 1] = v0 * x1[k] + v1 * x1[k + 1]
    else:
        for k in range(n):
            os[2 * k] = u0 * x0[k]
            os[2 * k + 1] = v0 * x1[k]


@njit(cache=True)
def _up_rows(x0, x1, os, n, post, T, u, v):
    """:func:`_up_flat` on rows of ``post`` elements (flat arrays, row k at k post)."""
    u0, u1, v0, v1 = u[0], u[1 % u.size], v[0], v[1 % v.size]
    for k in range(n):
        e = os[2 * k * post:(2 * k + 1) * post]
        f = os[(2 * k + 1) * post:(2 * k + 2) * post]
        a = x0[k * post:(k + T) * post]
        b = x1[k * post:(k + T) * post]
        if T == 2:
            for q in range(post):
                e[q] = u0 * a[q] + u1 * a[post + q]
                f[q] = v0 * b[q] + v1 * b[post + q]
        else:
            for q in range(post):
                e[q] = u0 * a[q]
                f[q] = v0 * b[q]


@njit(cache=True)
def _edge_rows(xf, of, n, m, post, p0, p1, rows, indptr, cols, weights):
    """out[p, i, q] = sum_k weights[k] x[p, cols[k], q] over k in indptr[i]:indptr[i + 1] (in
    that order, as the windows sum) for the lines p0 <= p < p1, every i in ``rows`` and every
    q (x (pre, n, post), out (pre, m, post), flat: ``xf``, ``of``); an empty row gives 0."""
    for e in range(rows.size):
        i = rows[e]
        k0, k1 = indptr[i], indptr[i + 1]
        if post == 1 and 1 <= k1 - k0 <= 4:  # one element a row: no views (a view each cost
            _edge_column(xf, of, n, m, p0, p1, i, k1 - k0, cols[k0:k1], weights[k0:k1])
            continue  # 4x the sum), the terms unrolled: a loop over the lines (vectorised)
        for p in range(p0, p1):
            o = of[(p * m + i) * post:(p * m + i + 1) * post]
            if k1 == k0:
                o[:] = 0
                continue
            xr, w0 = xf[(p * n + cols[k0]) * post:(p * n + cols[k0] + 1) * post], weights[k0]
            for q in range(post):
                o[q] = w0 * xr[q]
            for k in range(k0 + 1, k1):
                xr, wk = xf[(p * n + cols[k]) * post:(p * n + cols[k] + 1) * post], weights[k]
                for q in range(post):
                    o[q] = o[q] + wk * xr[q]


@njit(cache=True)
def _edge_column(xf, of, n, m, p0, p1, i, T, c, w):
    """of[p m + i] = sum_{t < T} w[t] xf[p n + c[t]] for p0 <= p < p1 (T of 1 to 4)."""
    c0, c1, c2, c3 = c[0], c[1 % T], c[2 % T], c[3 % T]
    w0, w1, w2, w3 = w[0], w[1 % T], w[2 % T], w[3 % T]
    o = of[p0 * m + i:]
    x0, x1, x2, x3 = xf[p0 * n + c0:], xf[p0 * n + c1:], xf[p0 * n + c2:], xf[p0 * n + c3:]
    if T == 4:
        for p in range(p1 - p0):
            o[p * m] = ((w0 * x0[p * n] + w1 * x1[p * n]) + w2 * x2[p * n]) + w3 * x3[p * n]
    elif T == 3:
        for p in range(p1 - p0):
            o[p * m] = (w0 * x0[p * n] + w1 * x1[p * n]) + w2 * x2[p * n]
    elif T == 2:
        for p in range(p1 - p0):
            o[p * m] = w0 * x0[p * n] + w1 * x1[p * n]
    else:
        for p in range(p1 - p0):
            o[p * m] = w0 * x0[p * n]


@njit(cache=True)
def _structured(xf, of, pre, n, m, post, down, lo, hi, a0, u, a1, v, rows, indptr, cols,
                weights, block):
    """The windows of :func:`apply_structured_axis` over blocks of ``block`` lines, each
    block's edge rows right after its windows (its lines still in cache: a separate pass over
    the edges re-read the whole array, as much time again as the windows)."""
    per = m if down else n  # windows a line
    for p0 in range(0, pre, block):
        p1 = min(p0 + block, pre)
        first = p0 * per + lo  # the block's first window (the first interior one of line p0)
        count = (p1 - 1 - p0) * per + hi - lo
        if down:
            xs, os = xf[(2 * first + a0) * post:], of[first * post:]
            if post == 1:
                _down_flat(xs, os, count, u.size, u)
            else:
                _down_rows(xs, os, count, post, u.size, u)
        else:
            x0, x1 = xf[(first + a0) * post:], xf[(first + a1) * post:]
            os = of[2 * first * post:]
            if post == 1:
                _up_flat(x0, x1, os, count, u.size, u, v)
            else:
                _up_rows(x0, x1, os, count, post, u.size, u, v)
        _edge_rows(xf, of, n, m, post, p0, p1, rows, indptr, cols, weights)


def apply_structured_axis(x, m, form, indptr, cols, weights):
    """A cell-centred 1D operator along axis 1 of ``x`` (pre, n, post), C-contiguous, as fixed
    windows over the whole array plus its edge rows from the sparse rows (CSR ``indptr``,
    ``cols``, ``weights`` of x's dtype): a new (pre, m, post) array. ``form`` (from
    :func:`mgnn.backend.grid_transfer._structure`): ``("down", lo, hi, a, w)`` with n = 2m,
    out[i] = sum_t w[t] x[2i + a + t] for lo <= i < hi, or ``("up", lo, hi, a0, u, a1, v)``
    with m = 2n, out[2k] = sum_t u[t] x[k + a0 + t], out[2k + 1] = sum_t v[t] x[k + a1 + t]
    for lo <= k < hi (u and v of one length); every other output is an edge row."""
    pre, n, post = x.shape
    out = np.empty((pre, m, post), dtype=x.dtype)
    block = max(1, _BLOCK_ELEMENTS // (n * post))
    _structured(x.reshape(-1), out.reshape(-1), pre, n, m, post, form[0] == "down",
                *_form_args(form, m), indptr, cols, weights, block)
    return out


#: input elements of a block of lines (a few L1s' worth: 32 KB of float32)
_BLOCK_ELEMENTS = 8192


@njit(cache=True)
def _structured_planes(xf, of, pre, n0, n1, m0, m1, down, lo0, hi0, a00, u0, a10, v0, rows0,
                       indptr0, cols0, weights0, lo1, hi1, a01, u1, a11, v1, rows1, indptr1,
                       cols1, weights1, block):
    """Both axes of planes (pre, n0, n1) -> (pre, m0, m1) by :func:`_structured`, a block of
    ``block`` planes at a time through a scratch block (the intermediate never leaves the
    cache): towards the coarse grid axis 0 then axis 1, towards the fine grid axis 1 first."""
    tmp = np.empty(block * (m0 * n1 if down else n0 * m1), dtype=xf.dtype)
    for b in range((pre + block - 1) // block):
        _plane_block(xf, of, tmp, b * block, pre, n0, n1, m0, m1, down, lo0, hi0, a00, u0, a10,
                     v0, rows0, indptr0, cols0, weights0, lo1, hi1, a01, u1, a11, v1, rows1,
                     indptr1, cols1, weights1, block)


@njit(cache=True, parallel=True)
def _structured_planes_par(xf, of, pre, n0, n1, m0, m1, down, lo0, hi0, a00, u0, a10, v0,
                           rows0, indptr0, cols0, weights0, lo1, hi1, a01, u1, a11, v1, rows1,
                           indptr1, cols1, weights1, block):
    """:func:`_structured_planes` with the blocks on Numba's threads (a scratch block each;
    every output is computed as in the serial pass: the same bits)."""
    for b in prange((pre + block - 1) // block):
        tmp = np.empty(block * (m0 * n1 if down else n0 * m1), dtype=xf.dtype)
        _plane_block(xf, of, tmp, b * block, pre, n0, n1, m0, m1, down, lo0, hi0, a00, u0, a10,
                     v0, rows0, indptr0, cols0, weights0, lo1, hi1, a01, u1, a11, v1, rows1,
                     indptr1, cols1, weights1, block)


@njit(cache=True)
def _plane_block(xf, of, tmp, b0, pre, n0, n1, m0, m1, down, lo0, hi0, a00, u0, a10, v0, rows0,
                 indptr0, cols0, weights0, lo1, hi1, a01, u1, a11, v1, rows1, indptr1, cols1,
                 weights1, block):
    """The planes b0 .. b0 + block - 1 (fewer at the end) of :func:`_structured_planes`."""
    nb = min(block, pre - b0)
    xb = xf[b0 * n0 * n1:(b0 + nb) * n0 * n1]
    ob = of[b0 * m0 * m1:(b0 + nb) * m0 * m1]
    if down:
        _structured(xb, tmp, nb, n0, m0, n1, True, lo0, hi0, a00, u0, a10, v0, rows0,
                    indptr0, cols0, weights0, nb)
        _structured(tmp, ob, nb * m0, n1, m1, 1, True, lo1, hi1, a01, u1, a11, v1, rows1,
                    indptr1, cols1, weights1, nb * m0)
    else:
        _structured(xb, tmp, nb * n0, n1, m1, 1, False, lo1, hi1, a01, u1, a11, v1, rows1,
                    indptr1, cols1, weights1, nb * n0)
        _structured(tmp, ob, nb, n0, m0, m1, False, lo0, hi0, a00, u0, a10, v0, rows0,
                    indptr0, cols0, weights0, nb)


def _form_args(form, m):
    """(lo, hi, a0, u, a1, v, edge rows) of a ``form`` of :func:`apply_structured_axis` with
    m outputs a line."""
    if form[0] == "down":
        _, lo, hi, a0, u = form
        return lo, hi, a0, u, a0, u, np.array([i for i in range(m) if not lo <= i < hi],
                                              dtype=np.int64)
    _, lo, hi, a0, u, a1, v = form
    return lo, hi, a0, u, a1, v, np.array([i for i in range(m) if not lo <= i // 2 < hi],
                                          dtype=np.int64)


def apply_structured_planes(x, m0, m1, forms, csrs, parallel=None):
    """Both axes of ``x`` (pre, n0, n1), C-contiguous, by their window ``forms`` (two of
    :func:`apply_structured_axis`'s, one direction) and sparse rows ``csrs`` ((indptr, cols,
    weights) each), in one pass over memory: a new (pre, m0, m1) array, equal to the two
    :func:`apply_structured_axis` passes bit for bit. ``parallel`` (default: Numba has threads
    and there are several blocks of planes): the blocks on the threads, the same bits."""
    pre, n0, n1 = x.shape
    out = np.empty((pre, m0, m1), dtype=x.dtype)
    down = forms[0][0] == "down"
    block = max(1, _BLOCK_ELEMENTS // (n0 * n1))
    if parallel is None:
        parallel = numba.get_num_threads() > 1 and pre > block
    (_structured_planes_par if parallel else _structured_planes)(
        x.reshape(-1), out.reshape(-1), pre, n0, n1, m0, m1, down, *_form_args(forms[0], m0),
        *csrs[0], *_form_args(forms[1], m1), *csrs[1], block)
    return out
