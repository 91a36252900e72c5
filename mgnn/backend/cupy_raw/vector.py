"""FAS vector operations of the batched relaxation (residuals, combinations)."""

import numpy as np

from .plans import _cdiv


class VectorKernels:
    """The FAS vector operations of :class:`mgnn.backend.cupy_raw.RawBackend` (a mixin)."""

    def residual_batched(self, phis, us, gs):
        """([r_p = phis[p] - us[p] (+ gs[p])], sum_p ||r_p||^2) in one launch; the norm is a 0-d
        float64 array of ``xp`` (on a GPU it stays on the device)."""
        if not phis:
            return [], 0.0
        n, dt = phis[0].size, phis[0].dtype
        g = self.geometry
        blocks = max(1, min(_cdiv(n, g["REDUCE"]), g["MAX_GRID"]))
        rs, ptr_r = self._outputs(len(phis), phis[0].shape, dt)
        partial = self.xp.empty(len(phis) * blocks, dtype=np.float64)
        self._launch("residual_batched", dt, (blocks, len(phis), 1), (g["REDUCE"], 1, 1),
                     self._pointers(phis), self._pointers(us),
                     None if gs is None else self._pointers(gs), ptr_r, partial, n)
        return rs, partial.sum()

    def combine_batched(self, mode, outs, xs, ys, zs=None):
        """outs[p] = (x + y) - z (mode 0), x + (y - z) (mode 1) or x + y (mode 2), one launch;
        ``outs`` None: new arrays. Returns the outputs."""
        if not xs:
            return []
        n, dt = xs[0].size, xs[0].dtype
        if outs is None:
            outs, ptr_out = self._outputs(len(xs), xs[0].shape, dt)
        else:
            ptr_out = self._pointers(outs)
        self._elementwise("combine_batched", n, dt, ptr_out, self._pointers(xs),
                          self._pointers(ys), None if zs is None else self._pointers(zs), n, mode,
                          count=len(xs))
        return outs
