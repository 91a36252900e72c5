"""Dense steps: single, serial sweeps (cuBLAS above ``gemm_min_width``) and interval-batched."""


class DenseKernels:
    """The dense steps of :class:`mgnn.backend.cupy_raw.RawBackend` (a mixin)."""

    def _dense(self, x, W, b, h, act, residual, want_y, want_d):
        B, I = x.shape
        O = W.shape[0]
        y = self._empty((B, O), x.dtype) if want_y else None
        d = self._empty((B, O), x.dtype) if want_d else None
        self._gemm("dense_forward", B, O, 1, x.dtype, x, W, b, y, d, B, I, O,
                   self._h(h, x.dtype), act, int(residual))
        return y, d

    def dense_forward(self, x, W, b, h, act, residual):
        """y (B, o) = [x +] h sigma(x W^T + b)."""
        return self._dense(x, W, b, h, act, residual, True, False)[0]

    def dense_forward_deriv(self, x, W, b, h, act, residual):
        """(y, sigma'(z)) in one launch."""
        return self._dense(x, W, b, h, act, residual, True, True)

    def dense_deriv(self, x, W, b, act):
        """sigma'(x W^T + b) (B, o)."""
        return self._dense(x, W, b, 1.0, act, False, False, True)[1]

    def dense_vjp_input(self, gy, deriv, W, h, residual, out=None):
        """gx (B, i) = [gy +] h (sigma' * gy) W."""
        B, O = gy.shape
        I = W.shape[1]
        gx = self._empty((B, I), gy.dtype) if out is None else out
        self._gemm("dense_vjp_input", B, I, 1, gy.dtype, gy, deriv, W, gx, B, I, O,
                   self._h(h, gy.dtype), int(residual))
        return gx

    def dense_vjp_params(self, gy, deriv, x, h, out=None):
        """(gW (o, i), gb (o,)) = (h s^T x, h sum_B s), s = sigma' * gy; ``out`` = (gW, gb)."""
        B, O = gy.shape
        I = x.shape[1]
        gW, gb = out if out is not None else (self._empty((O, I), gy.dtype),
                                              self._empty((O,), gy.dtype))
        hh = self._h(h, gy.dtype)
        self._gemm("dense_weight_grad", O, I, 1, gy.dtype, gy, deriv, x, gW, B, I, O, hh)
        self._launch("bias_grad", gy.dtype, (O, 1, 1), (self.geometry["REDUCE"], 1, 1), gy, deriv,
                     gb, B, O, 1, hh)
        return gW, gb

    def dense_vjp(self, gy, deriv, x, W, h, residual):
        """(gx, gW, gb) of one dense step."""
        return (self.dense_vjp_input(gy, deriv, W, h, residual),
                *self.dense_vjp_params(gy, deriv, x, h))

    def dense_sweep_forward(self, U, W, b, h, act, D):
        """Layer after layer, one launch per layer (the GPU's serial baseline); see numpy_ref."""
        N, (B, w) = W.shape[0], U.shape[1:]
        hh = self._h(h, U.dtype)
        if self.wide(w):  # per layer: cuBLAS GEMM, then bias + activation + residual
            Z = self._work("gemm_z", (1, B, w), U.dtype)
            for n in range(N):
                self.launcher.gemm(U[n:n + 1], W[n:n + 1], Z, trans_b=True)
                self._elementwise("dense_bias_act", B * w, U.dtype, Z, U, n, b, n, U, n + 1,
                                  D if D.shape[0] else None, n, B, w, hh, act, 1)
            return
        for n in range(N):
            self._gemm("dense_forward", B, w, 1, U.dtype, U[n], W[n], b[n], U[n + 1],
                       D[n] if D.shape[0] else None, B, w, w, hh, act, 1)

    def dense_sweep_backward(self, U, D, W, h, lam, gW, gb):
        """Adjoint of :meth:`dense_sweep_forward`; returns lam_0, fills gW and gb."""
        if self.wide(lam.shape[1]):
            return self._wide_sweep_backward(U, D, W, h, lam, gW, gb)
        for n in range(W.shape[0] - 1, -1, -1):
            self.dense_vjp_params(lam, D[n], U[n], h, out=(gW[n], gb[n]))
            lam = self.dense_vjp_input(lam, D[n], W[n], h, True)
        return lam

    def _wide_sweep_backward(self, U, D, W, h, lam, gW, gb):
        """:meth:`dense_sweep_backward` through cuBLAS: per layer S = h D_n * lam, gW[n] = S^T
        U[n] and Z = S W_n (two GEMMs), gb[n] (the bias kernel), lam <- lam + Z (epilogue)."""
        (B, w), dt = lam.shape, lam.dtype
        hh, one = self._h(h, dt), self._h(1.0, dt)
        S, Z = self._work("gemm_s", (1, B, w), dt), self._work("gemm_z", (1, B, w), dt)
        for n in range(W.shape[0] - 1, -1, -1):
            self._elementwise("stacked_product", B * w, dt, lam, 0, 0, D, n, 0, S, B * w, hh)
            self.launcher.gemm(S, U[n:n + 1], gW[n:n + 1], trans_a=True)
            self._launch("bias_grad", dt, (w, 1, 1), (self.geometry["REDUCE"], 1, 1), lam, D[n],
                         gb[n], B, w, 1, hh)
            self.launcher.gemm(S, W[n:n + 1], Z)
            out = self._empty((B, w), dt)
            self._elementwise("dense_stacked_adjoint_epilogue", B * w, dt, Z, lam, None, out, 1,
                              0, 0, 0, B, w, one, 2, None, 0)
            lam = out
        return lam

    def dense_forward_batched(self, xs, W, b, layers, h, act, store_deriv, gs=None):
        """One launch for len(xs) residual steps: ys[p] = xs[p] + h sigma(xs[p] W_l^T + b_l)
        [+ gs[p]], l = layers[p]; returns (ys, derivs or None), lists of new (B, w) arrays."""
        B, w = xs[0].shape
        dt = xs[0].dtype
        ys, ptr_y = self._outputs(len(xs), (B, w), dt)
        ds, ptr_d = self._outputs(len(xs), (B, w), dt) if store_deriv else (None, None)
        self._gemm("dense_forward_batched", B, w, len(xs), dt, self._pointers(xs), W, b, ptr_y,
                   ptr_d, self._pointers(gs), self._layers(layers), B, w, self._h(h, dt), act)
        return ys, ds

    def dense_vjp_input_batched(self, gys, derivs, W, layers, h, gs=None):
        """One launch for len(gys) state vjps: gys[p] + h (derivs[p] gys[p]) W_l [+ gs[p]]."""
        B, w = gys[0].shape
        dt = gys[0].dtype
        gxs, ptr_gx = self._outputs(len(gys), (B, w), dt)
        self._gemm("dense_vjp_input_batched", B, w, len(gys), dt, self._pointers(gys),
                   self._pointers(derivs), W, ptr_gx, self._pointers(gs), self._layers(layers), B,
                   w, self._h(h, dt))
        return gxs

    def dense_deriv_batched(self, xs, W, b, layers, act):
        """[sigma'(xs[p] W_l^T + b_l)] for l = layers[p], one launch (new (B, w) arrays)."""
        if not xs:
            return []
        B, w = xs[0].shape
        dt = xs[0].dtype
        ds, ptr_d = self._outputs(len(xs), (B, w), dt)
        self._gemm("dense_forward_batched", B, w, len(xs), dt, self._pointers(xs), W, b, None,
                   ptr_d, None, self._layers(layers), B, w, self._h(1.0, dt), act)
        return ds

    def dense_vjp_params_batched(self, gys, derivs, xs, layers, h, gW, gb):
        """In place, two launches: gW[l] = h s_p^T xs[p], gb[l] = h sum_B s_p with
        s_p = derivs[p] * gys[p], l = layers[p] (distinct), into the stacked gW (L, w, w), gb (L, w)."""
        if not xs:
            return
        B, w = xs[0].shape
        dt = xs[0].dtype
        hh, ptr_g, ptr_d = self._h(h, dt), self._pointers(gys), self._pointers(derivs)
        lay = self._layers(layers)
        self._gemm("dense_weight_grad_batched", w, w, len(xs), dt, ptr_g, ptr_d,
                   self._pointers(xs), gW, lay, B, w, hh)
        self._launch("bias_grad_batched", dt, (w, len(xs), 1), (self.geometry["REDUCE"], 1, 1),
                     ptr_g, ptr_d, gb, lay, B, w, 1, hh)
