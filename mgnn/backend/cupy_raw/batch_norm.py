"""Batch norm + activation and dropout masks."""

from ..numpy_ref import _int, bn_dims


class BatchNormKernels:
    """The batch norm and dropout kernels of :class:`mgnn.backend.cupy_raw.RawBackend` (a
    mixin)."""

    def _bn_reduce(self, name, z, *arrays):
        """Two (C,) outputs of the per-channel reduction ``name`` over z-shaped ``arrays``."""
        B, C, S = bn_dims(z)
        outs = (self._empty((C,), z.dtype), self._empty((C,), z.dtype))
        self._launch(name, z.dtype, (C, 1, 1), (self.geometry["REDUCE"], 1, 1), *arrays, *outs,
                     B, C, S)
        return outs

    def dropout_mask(self, seed, step, layer, sample0, batch, n_elements, threshold, out=None):
        """:func:`mgnn.backend.counter_rng.dropout_mask` in one launch of kernels/rng.cu."""
        from ..counter_rng import launch_dropout_mask
        return launch_dropout_mask(self, seed, step, layer, sample0, batch, n_elements,
                                   threshold, out=out)

    def bn_stats(self, z):
        """Per-channel (mean (C,), m2 (C,)) of z (B, C, ...); contract of
        :func:`mgnn.backend.numpy_ref.bn_stats`. One block per channel."""
        return self._bn_reduce("bn_stats", z, z)

    def bn_act_forward(self, z, mean, invstd, gamma, beta, act):
        """(a, xhat, deriv) shaped like z; contract of
        :func:`mgnn.backend.numpy_ref.bn_act_forward`. One elementwise launch."""
        B, C, S = bn_dims(z)
        outs = tuple(self._empty(z.shape, z.dtype) for _ in range(3))
        self._elementwise("bn_act_forward", z.size, z.dtype, z, mean, invstd, gamma, beta, *outs,
                          z.size, C, S, act)
        return outs

    def bn_act_vjp_sums(self, ga, deriv, xhat):
        """Per-channel (s1, s2) (C,); contract of :func:`mgnn.backend.numpy_ref.bn_act_vjp_sums`.
        One block per channel."""
        return self._bn_reduce("bn_act_vjp_sums", ga, ga, deriv, xhat)

    def bn_act_vjp_input(self, ga, deriv, xhat, invstd, gamma, s1, s2, count):
        """gz shaped like z; contract of :func:`mgnn.backend.numpy_ref.bn_act_vjp_input`. One
        elementwise launch."""
        B, C, S = bn_dims(ga)
        gz = self._empty(ga.shape, ga.dtype)
        self._elementwise("bn_act_vjp_input", ga.size, ga.dtype, ga, deriv, xhat, invstd, gamma,
                          s1, s2, gz, ga.size, C, S, self._h(_int("count", count), ga.dtype))
        return gz
