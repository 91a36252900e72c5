"""Average pooling and the softmax cross-entropy."""


class PoolLossKernels:
    """The pooling and loss kernels of :class:`mgnn.backend.cupy_raw.RawBackend` (a mixin)."""

    def avgpool_forward(self, u, p):
        """(B, C, p, p) window means of u (B, C, H, W)."""
        B, C, H, Wd = u.shape
        v = self._empty((B, C, p, p), u.dtype)
        self._elementwise("avgpool_forward", B * C * p * p, u.dtype, u, v, B, C, H, Wd, p)
        return v

    def avgpool_vjp(self, g, H, Wd):
        """Adjoint of :meth:`avgpool_forward`: (B, C, H, W)."""
        B, C, p = g.shape[:3]
        gu = self._empty((B, C, H, Wd), g.dtype)
        self._elementwise("avgpool_vjp", B * C * H * Wd, g.dtype, g, gu, B, C, H, Wd, p)
        return gu

    def softmax_xent(self, logits, y):
        """(mean loss, dlogits (B, K)); y (B,) int64 of the same array module. The loss is a
        0-d array of the logits' dtype (on a GPU it stays on the device until asked for)."""
        B, K = logits.shape
        g = self._empty((B, K), logits.dtype)
        rows = self._empty((B,), logits.dtype)
        self._launch("softmax_xent", logits.dtype, (B, 1, 1), (self.geometry["REDUCE"], 1, 1),
                     logits, y, g, rows, B, K)
        return rows.mean(out=self._empty((), logits.dtype)), g
