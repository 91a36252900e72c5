"""NumPy reference backend: slow, obvious, the test oracle for every other backend.

Conventions shared by every backend (see :mod:`mgnn.backend`):

* arrays are C-contiguous float32 or float64, all of one dtype; ``h`` is a scalar of that dtype;
* ``act`` is an integer activation code (0 tanh, 1 relu, 2 identity; see ``mgnn._config``);
* ``residual`` selects ``y = x + h sigma(z)`` (a residual step) or ``y = h sigma(z)`` (opening
  layers and affine closings use ``h = 1``);
* ``deriv`` is ``sigma'(z)`` at the pre-activation ``z``, shape of ``y``.
"""
import numpy as np

name = "numpy"
xp = np  #: array module of this backend
batched_relaxation = False  #: MGRIT advances F-intervals one by one here


def _act(z, act):
    if act == 0:
        return np.tanh(z)
    if act == 1:
        return np.maximum(z, 0)
    return z.copy()


def _act_deriv(z, act):
    if act == 0:
        t = np.tanh(z)
        return 1 - t * t
    if act == 1:
        return (z > 0).astype(z.dtype)
    return np.ones_like(z)


# --------------------------------------------------------------------------------------- dense
def _dense_z(x, W, b):
    return x @ W.T + b


def dense_forward(x, W, b, h, act, residual):
    """y = [x +] h sigma(x W^T + b).

    x (B, i), W (o, i), b (o,), y (B, o); o == i when ``residual``.
    """
    y = h * _act(_dense_z(x, W, b), act)
    return x + y if residual else y


def dense_forward_deriv(x, W, b, h, act, residual):
    """:func:`dense_forward` and ``sigma'(z)`` (B, o) for a later vjp."""
    z = _dense_z(x, W, b)
    y = h * _act(z, act)
    return (x + y if residual else y), _act_deriv(z, act)


def dense_deriv(x, W, b, act):
    """sigma'(x W^T + b), (B, o)."""
    return _act_deriv(_dense_z(x, W, b), act)


def dense_vjp_input(gy, deriv, W, h, residual):
    """gx = [gy +] h (sigma' * gy) W, (B, i)."""
    gx = h * ((deriv * gy) @ W)
    return gy + gx if residual else gx


def dense_vjp(gy, deriv, x, W, h, residual):
    """(gx (B, i), gW = h s^T x (o, i), gb = h sum_B s (o,)) with s = sigma' * gy."""
    s = deriv * gy
    gx = h * (s @ W)
    return (gy + gx if residual else gx), h * (s.T @ x), h * s.sum(axis=0)


def dense_vjp_params(gy, deriv, x, h):
    """(gW = h s^T x (o, i), gb = h sum_B s (o,)) with s = sigma' * gy (no input gradient)."""
    s = deriv * gy
    return h * (s.T @ x), h * s.sum(axis=0)


def dense_sweep_forward(U, W, b, h, act, D):
    """Residual steps n = 0..N-1 in place: U[n+1] = U[n] + h sigma(U[n] W[n]^T + b[n]).

    U (N+1, B, w) with U[0] set; W (N, w, w); b (N, w); D (N, B, w) receives sigma'(z_n), or has
    length 0 to skip storing it.
    """
    for n in range(W.shape[0]):
        if D.shape[0]:
            U[n + 1], D[n] = dense_forward_deriv(U[n], W[n], b[n], h, act, True)
        else:
            U[n + 1] = dense_forward(U[n], W[n], b[n], h, act, True)


def dense_sweep_backward(U, D, W, h, lam, gW, gb):
    """Adjoint of :func:`dense_sweep_forward`: returns lam_0 (B, w) from lam = lam_N.

    U (N+1, B, w) and D (N, B, w) from the forward sweep; gW (N, w, w) and gb (N, w) are
    overwritten with the parameter gradients.
    """
    for n in range(W.shape[0] - 1, -1, -1):
        lam, gW[n], gb[n] = dense_vjp(lam, D[n], U[n], W[n], h, True)
    return lam


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


# ------------------------------------------------------------------------------ pooling, loss
def avgpool_forward(u, p):
    """Average pool to a (p, p) grid: u (B, C, H, W) with H, W divisible by p -> (B, C, p, p)."""
    B, C, H, Wd = u.shape
    return u.reshape(B, C, p, H // p, p, Wd // p).mean(axis=(3, 5))


def avgpool_vjp(g, H, Wd):
    """Adjoint of :func:`avgpool_forward`: g (B, C, p, p) -> (B, C, H, W)."""
    p = g.shape[2]
    scale = g.dtype.type(1.0 / ((H // p) * (Wd // p)))
    return np.repeat(np.repeat(g, H // p, axis=2), Wd // p, axis=3) * scale


def softmax_xent(logits, y):
    """Mean softmax cross-entropy and its gradient.

    logits (B, K) float, y (B,) int64 in [0, K) -> (loss: float of logits' dtype, dlogits (B, K)).
    """
    B = logits.shape[0]
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    ssum = e.sum(axis=1, keepdims=True)
    logp = logits - m - np.log(ssum)
    loss = -logp[np.arange(B), y].mean()
    g = e / ssum
    g[np.arange(B), y] -= 1
    return logits.dtype.type(loss), g / logits.dtype.type(B)


# ------------------------------------------------------------------- interval-batched steps
def _export_batched():
    import sys
    from .batched_loops import batched_kernels
    globals().update(batched_kernels(sys.modules[__name__]))


_export_batched()
