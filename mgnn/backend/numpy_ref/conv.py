"""2D 3x3 convolution steps (PyTorch's Conv2d, padding 1): the reference kernels."""

import numpy as np

from .activations import _act, _act_deriv


# ---------------------------------------------------------------------------------------- conv
def _conv3x3(x, K):
    """Cross-correlation, padding 1: x (B, ci, H, W), K (co, ci, 3, 3) -> (B, co, H, W)."""
    B, _, H, Wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((B, K.shape[0], H, Wd), dtype=x.dtype)
    for dy in range(3):
        for dx in range(3):
            out += np.einsum("bchw,oc->bohw", xp[:, :, dy:dy + H, dx:dx + Wd], K[:, :, dy, dx])
    return out


def _conv3x3_transpose(s, K):
    """Adjoint of :func:`_conv3x3` in x: s (B, co, H, W) -> (B, ci, H, W)."""
    B, _, H, Wd = s.shape
    gp = np.zeros((B, K.shape[1], H + 2, Wd + 2), dtype=s.dtype)
    for dy in range(3):
        for dx in range(3):
            gp[:, :, dy:dy + H, dx:dx + Wd] += np.einsum("bohw,oc->bchw", s, K[:, :, dy, dx])
    return gp[:, :, 1:-1, 1:-1]


def _conv3x3_kernel_grad(s, x):
    """Adjoint of :func:`_conv3x3` in K: (co, ci, 3, 3)."""
    H, Wd = x.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    gK = np.empty((s.shape[1], x.shape[1], 3, 3), dtype=x.dtype)
    for dy in range(3):
        for dx in range(3):
            gK[:, :, dy, dx] = np.einsum("bohw,bchw->oc", s, xp[:, :, dy:dy + H, dx:dx + Wd])
    return gK


def _conv_z(x, K, b):
    return _conv3x3(x, K) + b[None, :, None, None]


def conv_forward(x, K, b, h, act, residual):
    """y = [x +] h sigma(conv3x3(x, K) + b); x (B, ci, H, W), K (co, ci, 3, 3), b (co,)."""
    y = h * _act(_conv_z(x, K, b), act)
    return x + y if residual else y


def conv_forward_deriv(x, K, b, h, act, residual):
    """:func:`conv_forward` and sigma'(z) (B, co, H, W)."""
    z = _conv_z(x, K, b)
    y = h * _act(z, act)
    return (x + y if residual else y), _act_deriv(z, act)


def conv_deriv(x, K, b, act):
    """sigma'(conv3x3(x, K) + b), (B, co, H, W)."""
    return _act_deriv(_conv_z(x, K, b), act)


def conv_vjp_input(gy, deriv, K, h, residual):
    """gx = [gy +] h conv3x3^T(sigma' * gy, K), (B, ci, H, W)."""
    gx = h * _conv3x3_transpose(deriv * gy, K)
    return gy + gx if residual else gx


def conv_vjp(gy, deriv, x, K, h, residual):
    """(gx (B, ci, H, W), gK (co, ci, 3, 3), gb (co,)) with s = sigma' * gy."""
    s = deriv * gy
    gx = h * _conv3x3_transpose(s, K)
    return ((gy + gx if residual else gx), h * _conv3x3_kernel_grad(s, x),
            h * s.sum(axis=(0, 2, 3)))


def conv_vjp_params(gy, deriv, x, h):
    """(gK (co, ci, 3, 3), gb (co,)) with s = sigma' * gy (no input gradient)."""
    s = deriv * gy
    return h * _conv3x3_kernel_grad(s, x), h * s.sum(axis=(0, 2, 3))
