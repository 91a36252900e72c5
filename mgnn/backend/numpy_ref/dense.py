"""Dense steps ``y = x + h sigma(x W^T + b)``: the reference forward, derivative, vjps, sweeps."""

from .activations import _act, _act_deriv


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
