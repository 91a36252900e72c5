"""Batch norm + activation (:data:`mgnn.backend.BN_KERNELS`, PyTorch semantics) and dropout masks."""

import numpy as np

from .activations import _act, _act_deriv
from .stacked import _int


# ------------------------------------------------------------ batch norm + activation
# The fused path of a block BN -> sigma (:data:`mgnn.backend.BN_KERNELS`, PyTorch semantics): z is
# (B, C) (dense) or (B, C, H, W) (conv), channel axis 1, statistics per channel c over the other
# axes, M = B (dense) or B H W elements per channel; mean, invstd, gamma, beta, s1, s2 are (C,);
# everything is of z's dtype (float32 sums are accumulated in float64).
def bn_dims(z):
    """(B, C, S) of a BN input z (B, C, *spatial): S = prod(spatial) (1 for dense)."""
    if z.ndim < 2:
        raise ValueError(f"batch norm needs z of shape (B, C, ...), got shape {z.shape}")
    B, C = z.shape[:2]
    return B, C, (z.size // (B * C) if B * C else 0)


def _chan(v, z):
    """Per-channel v (C,) broadcast against z (B, C, ...)."""
    return v.reshape((1, -1) + (1,) * (z.ndim - 2))


def _chan_axes(z):
    return (0,) + tuple(range(2, z.ndim))


def bn_stats(z):
    """Per-channel (mean (C,), m2 (C,)) of z (B, C, ...): the mean and the sum of squared
    deviations from it (two-pass, in float64), so that the biased variance is m2 / M."""
    bn_dims(z)
    z64 = z.astype(np.float64)
    mean = z64.mean(axis=_chan_axes(z))
    m2 = ((z64 - _chan(mean, z)) ** 2).sum(axis=_chan_axes(z))
    return mean.astype(z.dtype), m2.astype(z.dtype)


def bn_act_forward(z, mean, invstd, gamma, beta, act):
    """(a, xhat, deriv), each shaped like z (B, C, ...): xhat = (z - mean) invstd,
    y = gamma xhat + beta, a = sigma(y), deriv = sigma'(y); mean, invstd, gamma, beta (C,)."""
    bn_dims(z)
    xhat = (z - _chan(mean, z)) * _chan(invstd, z)
    y = _chan(gamma, z) * xhat + _chan(beta, z)
    return _act(y, act), xhat, _act_deriv(y, act)


def bn_act_vjp_sums(ga, deriv, xhat):
    """Per-channel (s1, s2) (C,): s1 = sum gy, s2 = sum gy xhat with gy = ga * deriv (all shaped
    like z); also the gradients of beta and gamma."""
    bn_dims(ga)
    gy = ga * deriv
    ax = _chan_axes(ga)
    return (gy.sum(axis=ax, dtype=np.float64).astype(ga.dtype),
            (gy * xhat).sum(axis=ax, dtype=np.float64).astype(ga.dtype))


def bn_act_vjp_input(ga, deriv, xhat, invstd, gamma, s1, s2, count):
    """gz = gamma invstd (gy - s1 / count - xhat s2 / count), gy = ga * deriv, shaped like z:
    the input gradient of BN -> sigma given (s1, s2) of :func:`bn_act_vjp_sums` summed over the
    ``count`` (int) elements per channel that the statistics cover (the global batch under
    synchronised BN)."""
    bn_dims(ga)
    count = _int("count", count)
    gy = ga * deriv
    return _chan(gamma * invstd, ga) * ((gy - _chan(s1 / count, ga))
                                        - xhat * _chan(s2 / count, ga))


def dropout_mask(seed, step, layer, sample0, batch, n_elements, threshold, out=None):
    """Dropout keep mask (batch, n_elements) uint8: the counter-based Philox mask of
    :func:`mgnn.backend.counter_rng.dropout_mask` (1 = keep)."""
    from ..counter_rng import dropout_mask as mask
    return mask(seed, step, layer, sample0, batch, n_elements, threshold, out=out)
