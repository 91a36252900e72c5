"""Average pooling and the softmax cross-entropy of the closing layer."""

import numpy as np


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
