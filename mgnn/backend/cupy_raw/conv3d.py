"""3D 3x3x3 convolution steps."""

import numpy as np

from ..numpy_ref import conv3d_check


class Conv3dKernels:
    """The 3D convolution steps of :class:`mgnn.backend.cupy_raw.RawBackend` (a mixin)."""

    # kernels/conv3d.cu; arguments are validated on the host (numpy_ref.conv3d_check, O(1)):
    # a kernel of the wrong rank would otherwise be read past its end.
    def _conv3d_size(self, *shape):
        """Elements of ``shape``; ValueError unless the int indices of conv3d.cu hold them."""
        n = int(np.prod(shape, dtype=np.int64))
        g = self.geometry
        if n + g["ELEM"] * g["MAX_GRID"] >= 2**31:
            raise ValueError(f"conv3d state of shape {tuple(shape)} has {n} elements; the GPU "
                             "kernels index with 32-bit ints (< 2^31 with the grid): use a "
                             "smaller batch")
        return n

    def _conv3d(self, x, K, b, h, act, residual, want_y, want_d):
        B, Ci, D, H, Wd = x.shape
        Co = K.shape[0]
        self._conv3d_size(B, max(Ci, Co), D, H, Wd)
        y = self._empty((B, Co, D, H, Wd), x.dtype) if want_y else None
        d = self._empty((B, Co, D, H, Wd), x.dtype) if want_d else None
        self._gemm("conv3d_forward", Co, B * D * H * Wd, 1, x.dtype, x, K, b, y, d, B, Ci, Co, D,
                   H, Wd, h, act, int(residual))
        return y, d

    def conv3d_forward(self, x, K, b, h, act, residual):
        """y = [x +] h sigma(conv3x3x3(x, K) + b) (B, co, D, H, W); contract of
        :func:`mgnn.backend.numpy_ref.conv3d_forward`."""
        h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
        return self._conv3d(x, K, b, h, act, residual, True, False)[0]

    def conv3d_forward_deriv(self, x, K, b, h, act, residual):
        """(y, sigma'(z)) in one launch."""
        h = conv3d_check(x=x, K=K, b=b, h=h, act=act, residual=residual)
        return self._conv3d(x, K, b, h, act, residual, True, True)

    def conv3d_deriv(self, x, K, b, act):
        """sigma'(conv3x3x3(x, K) + b) (B, co, D, H, W)."""
        h = conv3d_check(x=x, K=K, b=b, h=1, act=act)
        return self._conv3d(x, K, b, h, act, False, False, True)[1]

    def _conv3d_vjp_input(self, gy, deriv, K, h, residual):
        B, Co, D, H, Wd = gy.shape
        Ci = K.shape[1]
        self._conv3d_size(B, max(Ci, Co), D, H, Wd)
        gx = self._empty((B, Ci, D, H, Wd), gy.dtype)
        self._gemm("conv3d_vjp_input", Ci, B * D * H * Wd, 1, gy.dtype, gy, deriv, K, gx, B, Ci,
                   Co, D, H, Wd, h, int(residual))
        return gx

    def _conv3d_vjp_params(self, gy, deriv, x, h):
        B, Co, D, H, Wd = gy.shape
        Ci = x.shape[1]
        self._conv3d_size(B, max(Ci, Co), D, H, Wd)
        gK = self._empty((Co, Ci, 3, 3, 3), gy.dtype)
        gb = self._empty((Co,), gy.dtype)
        red = (self.geometry["REDUCE"], 1, 1)
        if Co * Ci:
            self._kernel_grad("conv3d_kernel_grad", (gy, deriv, x), (B, Ci, Co, D, H, Wd),
                              B * D * H * Wd, Co, Ci * 27, 1, None, 0, gK, h)
        if Co:
            self._launch("bias_grad", gy.dtype, (Co, 1, 1), red, gy, deriv, gb, B, Co,
                         D * H * Wd, h)
        return gK, gb

    def conv3d_vjp_input(self, gy, deriv, K, h, residual):
        """gx (B, ci, D, H, W) = [gy +] h conv3x3x3^T(sigma' * gy, K)."""
        h = conv3d_check(K=K, gy=gy, deriv=deriv, h=h, residual=residual)
        return self._conv3d_vjp_input(gy, deriv, K, h, residual)

    def conv3d_vjp_params(self, gy, deriv, x, h):
        """(gK (co, ci, 3, 3, 3), gb (co,)) with s = sigma' * gy; two launches."""
        h = conv3d_check(x=x, gy=gy, deriv=deriv, h=h)
        return self._conv3d_vjp_params(gy, deriv, x, h)

    def conv3d_vjp(self, gy, deriv, x, K, h, residual):
        """(gx, gK, gb) of one conv3d step; three launches."""
        h = conv3d_check(x=x, K=K, gy=gy, deriv=deriv, h=h, residual=residual)
        return (self._conv3d_vjp_input(gy, deriv, K, h, residual),
                *self._conv3d_vjp_params(gy, deriv, x, h))
