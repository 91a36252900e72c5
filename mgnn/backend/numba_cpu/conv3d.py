"""3D 3x3x3 convolution steps: the conv core with 27 taps."""

import numpy as np

from ..numpy_ref import conv3d_check
from .conv import _conv_fwd_call, _conv_vjp_call


# -------------------------------------------------------------------------------------- conv3d
# The 3x3x3 convolutions run the same core (27 taps, rows = D H).
def conv3d_forward(x, K, b, h, act, residual):
    h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
    return _conv_fwd_call(x, K, b, h, act, residual, True, False)[0]


def conv3d_forward_deriv(x, K, b, h, act, residual):
    h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
    return _conv_fwd_call(x, K, b, h, act, residual, True, True)


def conv3d_deriv(x, K, b, act):
    conv3d_check(x=x, K=K, b=b, act=act)
    return _conv_fwd_call(x, K, b, x.dtype.type(1), act, False, False, True)[1]


def conv3d_vjp_input(gy, deriv, K, h, residual):
    h = conv3d_check(K=K, gy=gy, deriv=deriv, h=h, residual=residual)
    return _conv_vjp_call(gy, deriv, gy, K, h, residual, True, False)[0]


def conv3d_vjp(gy, deriv, x, K, h, residual):
    h = conv3d_check(x=x, K=K, gy=gy, deriv=deriv, h=h, residual=residual)
    return _conv_vjp_call(gy, deriv, x, K, h, residual, True, True)


def conv3d_vjp_params(gy, deriv, x, h):
    h = conv3d_check(x=x, gy=gy, deriv=deriv, h=h)
    K = np.empty((gy.shape[1], x.shape[1], 3, 3, 3), dtype=gy.dtype)  # shape only
    return _conv_vjp_call(gy, deriv, x, K, h, False, False, True)[1:]


for _f in (conv3d_forward, conv3d_forward_deriv, conv3d_deriv, conv3d_vjp_input, conv3d_vjp,
           conv3d_vjp_params):
    _f.__doc__ = (f"Numba kernel (the conv core with 27 taps); contract of "
                  f":func:`mgnn.backend.numpy_ref.{_f.__name__}`.")
