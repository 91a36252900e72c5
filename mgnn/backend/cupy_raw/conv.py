"""2D 3x3 convolution steps: implicit GEMMs, kernel gradients split along their depth."""


class ConvKernels:
    """The 2D convolution steps of :class:`mgnn.backend.cupy_raw.RawBackend` (a mixin)."""

    def _conv(self, x, K, b, h, act, residual, want_y, want_d):
        B, Ci, H, Wd = x.shape
        Co = K.shape[0]
        y = self._empty((B, Co, H, Wd), x.dtype) if want_y else None
        d = self._empty((B, Co, H, Wd), x.dtype) if want_d else None
        self._gemm("conv_forward", Co, B * H * Wd, 1, x.dtype, x, K, b, y, d, B, Ci, Co, H, Wd,
                   self._h(h, x.dtype), act, int(residual))
        return y, d

    def conv_forward(self, x, K, b, h, act, residual):
        """y = [x +] h sigma(conv3x3(x, K) + b) (B, co, H, W)."""
        return self._conv(x, K, b, h, act, residual, True, False)[0]

    def conv_forward_deriv(self, x, K, b, h, act, residual):
        """(y, sigma'(z)) in one launch."""
        return self._conv(x, K, b, h, act, residual, True, True)

    def conv_deriv(self, x, K, b, act):
        """sigma'(conv3x3(x, K) + b)."""
        return self._conv(x, K, b, 1.0, act, False, False, True)[1]

    def conv_vjp_input(self, gy, deriv, K, h, residual):
        """gx (B, ci, H, W) = [gy +] h conv3x3^T(sigma' * gy, K)."""
        B, Co, H, Wd = gy.shape
        Ci = K.shape[1]
        gx = self._empty((B, Ci, H, Wd), gy.dtype)
        self._gemm("conv_vjp_input", Ci, B * H * Wd, 1, gy.dtype, gy, deriv, K, gx, B, Ci, Co, H,
                   Wd, self._h(h, gy.dtype), int(residual))
        return gx

    def conv_vjp_params(self, gy, deriv, x, h):
        """(gK (co, ci, 3, 3), gb (co,)) with s = sigma' * gy."""
        B, Co, H, Wd = gy.shape
        Ci = x.shape[1]
        gK = self._empty((Co, Ci, 3, 3), gy.dtype)
        gb = self._empty((Co,), gy.dtype)
        hh = self._h(h, gy.dtype)
        red = (self.geometry["REDUCE"], 1, 1)
        self._kernel_grad("conv_kernel_grad", (gy, deriv, x), (B, Ci, Co, H, Wd), B * H * Wd,
                          Co, Ci * 9, 1, None, 0, gK, hh)
        self._launch("bias_grad", gy.dtype, (Co, 1, 1), red, gy, deriv, gb, B, Co, H * Wd, hh)
        return gK, gb

    def conv_vjp(self, gy, deriv, x, K, h, residual):
        """(gx, gK, gb) of one conv step."""
        return (self.conv_vjp_input(gy, deriv, K, h, residual),
                *self.conv_vjp_params(gy, deriv, x, h))

    def conv_forward_batched(self, xs, K, b, layers, h, act, store_deriv, gs=None):
        """One launch for len(xs) residual conv steps with layers ``layers`` [+ gs[p]];
        (ys, derivs|None)."""
        B, C, H, Wd = xs[0].shape
        dt = xs[0].dtype
        ys, ptr_y = self._outputs(len(xs), xs[0].shape, dt)
        ds, ptr_d = self._outputs(len(xs), xs[0].shape, dt) if store_deriv else (None, None)
        self._gemm("conv_forward_batched", C, B * H * Wd, len(xs), dt, self._pointers(xs), K, b,
                   ptr_y, ptr_d, self._pointers(gs), self._layers(layers), B, C, H, Wd,
                   self._h(h, dt), act)
        return ys, ds

    def conv_vjp_input_batched(self, gys, derivs, K, layers, h, gs=None):
        """One launch for len(gys) residual conv state vjps [+ gs[p]]."""
        B, C, H, Wd = gys[0].shape
        dt = gys[0].dtype
        gxs, ptr_gx = self._outputs(len(gys), gys[0].shape, dt)
        self._gemm("conv_vjp_input_batched", C, B * H * Wd, len(gys), dt, self._pointers(gys),
                   self._pointers(derivs), K, ptr_gx, self._pointers(gs), self._layers(layers), B,
                   C, H, Wd, self._h(h, dt))
        return gxs

    def conv_deriv_batched(self, xs, K, b, layers, act):
        """[sigma'(conv3x3(xs[p], K_l) + b_l)] for l = layers[p], one launch."""
        if not xs:
            return []
        B, C, H, Wd = xs[0].shape
        dt = xs[0].dtype
        ds, ptr_d = self._outputs(len(xs), xs[0].shape, dt)
        self._gemm("conv_forward_batched", C, B * H * Wd, len(xs), dt, self._pointers(xs), K, b,
                   None, ptr_d, None, self._layers(layers), B, C, H, Wd, self._h(1.0, dt), act)
        return ds

    def conv_vjp_params_batched(self, gys, derivs, xs, layers, h, gK, gb):
        """In place, two launches: gK[l], gb[l] of every (state, layer) pair (layers distinct)."""
        if not xs:
            return
        B, C, H, Wd = xs[0].shape
        dt = xs[0].dtype
        hh, ptr_g, ptr_d = self._h(h, dt), self._pointers(gys), self._pointers(derivs)
        lay, red = self._layers(layers), (self.geometry["REDUCE"], 1, 1)
        self._kernel_grad("conv_kernel_grad_batched", (ptr_g, ptr_d, self._pointers(xs)),
                          (B, C, H, Wd), B * H * Wd, C, C * 9, len(xs), lay, 0, gK, hh)
        self._launch("bias_grad_batched", dt, (C, len(xs), 1), red, ptr_g, ptr_d, gb, lay, B, C,
                     H * Wd, hh)
