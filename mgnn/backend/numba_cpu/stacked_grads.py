"""The stacked gradient kernels (:data:`mgnn.backend.STACKED_GRAD_KERNELS`): sigma' and the
parameter gradients of every owned layer from the solvers' stores, one call each."""

import numpy as np

from ..blas_threads import one_blas_thread
from . import dense as _dense_module
from .dense import _dense_deriv, _dense_vjp_params, _wide
from .dense import dense_deriv, dense_vjp_params  # noqa: F401 -- stacked_grad_loops' singles
from .conv import _blocks, _conv_forward_all, _conv_vjp_all
from .conv import conv_deriv, conv_vjp_params  # noqa: F401 -- stacked_grad_loops' singles
from .activations import njit
from .stacked import check_kept


# ------------------------------------------------------------ stacked gradient kernels
# Contract: mgnn.backend.numpy_ref (k_deriv_stacked, k_vjp_params_stacked). One njit call for
# every layer, through the same per-layer code as the single kernels (bit-identical to them);
# where a single dense kernel takes the NumPy route (WIDE / WIDE_TANH_F32) the layers loop here
# over that single kernel instead, so the results stay bit-identical and fast.
@njit(cache=True)
def _dense_deriv_stacked(U, first, count, W, b, layer0, act, D, done):
    for p in range(count):  # done empty: every row; else the rows not flagged
        if done.size == 0 or done[p] == 0:
            D[p] = _dense_deriv(U[first + p], W[layer0 + p], b[layer0 + p], act)


@njit(cache=True)
def _dense_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gW, gb):
    for p in range(count):
        gWl, gbl = _dense_vjp_params(L[l_first + p * l_stride], D[p], U[u_first + p], h)
        gW[layer0 + p] = gWl
        gb[layer0 + p] = gbl


@njit(cache=True)
def _conv_deriv_stacked(U, first, count, K, b, layer0, act, D, done, nblk):
    one = U.dtype.type(1)
    H, Wd = U.shape[3], U.shape[4]
    for p in range(count):  # done empty: every row; else the rows not flagged
        if done.size == 0 or done[p] == 0:
            Kl = K[layer0 + p]
            D[p] = _conv_forward_all(U[first + p], Kl.reshape((Kl.shape[0], Kl.shape[1] * 9)),
                                     b[layer0 + p], one, act, False, False, True, 2, (H, Wd),
                                     nblk)[1]


@njit(cache=True)
def _conv_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gK, gb,
                             nblk):
    H, Wd = U.shape[3], U.shape[4]
    for p in range(count):
        Kl = gK[layer0 + p]  # shape only: no input vjp
        _, gKl, gbl = _conv_vjp_all(L[l_first + p * l_stride], D[p], U[u_first + p],
                                    Kl.reshape((Kl.shape[0], Kl.shape[1] * 9)), h, False, False,
                                    True, 2, (H, Wd), nblk)
        gK[layer0 + p] = gKl.reshape(Kl.shape)
        gb[layer0 + p] = gbl


_EVERY_ROW = np.zeros(0, dtype=np.int8)  # the flags of a call that computes every row


def _stacked_grads():
    import sys
    from ..numpy_ref import check_stacked_grads, stacked_grad_loops
    loops = stacked_grad_loops(sys.modules[__name__])

    def dense_deriv_stacked(U, first, count, W, b, layer0, act, D):
        count = check_stacked_grads("dense", U, first, count, W, layer0, D, b)
        if count and _wide(U.shape[1] * W.shape[1], U.dtype, act):
            return loops["dense_deriv_stacked"](U, first, count, W, b, layer0, act, D)
        _dense_deriv_stacked(U, first, count, W, b, layer0, act, D, _EVERY_ROW)

    def dense_deriv_missing(U, first, count, W, b, layer0, act, D, done):
        """:func:`dense_deriv_stacked` for the rows p with ``done[p] == 0`` only (the rows a
        forward solve's final sweep did not write: :func:`dense_chains_forward_derivs`). Where
        a single dense step takes the NumPy route (WIDE) these rows come from it and the
        others from the chains' fused epilogue: the same values to rounding (tanh in float32),
        bit for bit for relu."""
        count = check_stacked_grads("dense", U, first, count, W, layer0, D, b)
        check_kept(done, count)
        if count and _wide(U.shape[1] * W.shape[1], U.dtype, act):
            for p in np.flatnonzero(done[:count] == 0):
                D[p] = dense_deriv(U[first + p], W[layer0 + p], b[layer0 + p], act)
            return
        _dense_deriv_stacked(U, first, count, W, b, layer0, act, D, done)

    def conv_deriv_missing(U, first, count, K, b, layer0, act, D, done):
        """:func:`conv_deriv_stacked` for the rows p with ``done[p] == 0`` only (see
        :func:`dense_deriv_missing`)."""
        count = check_stacked_grads("conv", U, first, count, K, layer0, D, b)
        check_kept(done, count)
        with one_blas_thread():
            _conv_deriv_stacked(U, first, count, K, b, layer0, act, D, done, _blocks())

    def dense_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gW, gb):
        count = check_stacked_grads("dense", U, u_first, count, gW, layer0, D, gb, L, l_first,
                                    l_stride)
        args = (L, l_first, l_stride, D, U, u_first, count, layer0, U.dtype.type(h), gW, gb)
        if count and U[0].size >= _dense_module.WIDE:  # read at call time, as _wide reads it
            return loops["dense_vjp_params_stacked"](*args)
        _dense_vjp_params_stacked(*args)

    def conv_deriv_stacked(U, first, count, K, b, layer0, act, D):
        count = check_stacked_grads("conv", U, first, count, K, layer0, D, b)
        with one_blas_thread():
            _conv_deriv_stacked(U, first, count, K, b, layer0, act, D, _EVERY_ROW, _blocks())

    def conv_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0, h, gK, gb):
        count = check_stacked_grads("conv", U, u_first, count, gK, layer0, D, gb, L, l_first,
                                    l_stride)
        with one_blas_thread():
            _conv_vjp_params_stacked(L, l_first, l_stride, D, U, u_first, count, layer0,
                                     U.dtype.type(h), gK, gb, _blocks())

    fns = {}
    for fn in (dense_deriv_stacked, dense_vjp_params_stacked, conv_deriv_stacked,
               conv_vjp_params_stacked):
        fn.__doc__ = ("Numba kernel, one call for every layer; contract of "
                      ":data:`mgnn.backend.STACKED_GRAD_KERNELS`.")
        fns[fn.__name__] = fn
    fns["dense_deriv_missing"] = dense_deriv_missing
    fns["conv_deriv_missing"] = conv_deriv_missing
    return fns


globals().update(_stacked_grads())
