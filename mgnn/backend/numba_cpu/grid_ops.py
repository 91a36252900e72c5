"""Sparse 1D operators along an axis: the grid transfers of spatial coarsening on the CPU."""

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
