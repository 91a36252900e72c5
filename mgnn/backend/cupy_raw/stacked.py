"""The stacked-state kernels (one launch per relaxation wave, no pointer arrays) and the
stacked gradients."""
import operator

import numpy as np

from ..numpy_ref import check_stacked_grads
from .plans import (PLAN_CACHE_SIZE, _cdiv, _chain_plan, _check_count, _host_index,
                    _points_plan)
from .launch import state_run


class StackedKernels:
    """The stacked-state and stacked-gradient kernels of
    :class:`mgnn.backend.cupy_raw.RawBackend` (a mixin)."""

    # The kernels of mgnn.backend.STACKED_KERNELS: whole relaxation waves of one stacked array
    # (m, *state) per launch; slots and layers are arithmetic progressions computed in the kernel
    # (no pointer arrays), the launch plan of a chains / points array is cached by its bytes, the
    # scratch of the residual norm by its size: no allocation and no ptr() after the first call.
    def _plan(self, tag, *arrays):
        key = (tag,) + tuple(a.tobytes() for a in arrays)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLAN_CACHE_SIZE:
                self._plans.clear()
            plan = self._plans[key] = (_chain_plan(*arrays) if tag == "chains"
                                       else _points_plan(*arrays))
        return plan

    def _buffer(self, name, size):
        """A cached float64 scratch array of ``size`` elements (:meth:`_work`); the 0-d norm
        buffer for ``size`` None."""
        return self._work(name, () if size is None else (max(size, 1),), np.float64)

    def _work(self, name, shape, dtype):
        """A cached scratch array of ``shape`` and ``dtype``: a view of a buffer that grows and
        never shrinks (growing it bumps :attr:`buffer_generation`: a captured graph wrote to
        the old one, so it is recaptured)."""
        dtype = np.dtype(dtype)
        size = int(np.prod(shape))
        key = (name, dtype.str)
        buf = self._scratch.get(key)
        if buf is None or buf.size < size:
            buf = self._scratch[key] = self._empty(max(size, 1), dtype, reuse=False)
            self.buffer_generation += 1
        return buf[:size].reshape(shape)

    def wide(self, w):
        """Dense layers of width ``w`` take the cuBLAS path (the launcher has ``gemm`` and
        ``w >= gemm_min_width``)."""
        return w >= self.gemm_min_width and callable(getattr(self.launcher, "gemm", None))

    def _stacked(self, kind, adjoint, U, G, R, P, X, d0, runs, span, out_span, layer0,
                 layer_step, h, act, mode, norm_out=None):
        """Check the arguments, then launch ``runs`` [(slot0, stride, out0, out_stride, count)]
        of the stacked kernel of ``kind``; X = b (forward) or D (adjoint). Returns the mode-0
        norm (device 0-d array or float), else 0.0."""
        xp_name = "L" if adjoint else "U"
        layer0, layer_step, d0, mode = (operator.index(v) for v in (layer0, layer_step, d0, mode))
        nd = 3 if kind == "dense" else 5
        if getattr(U, "ndim", None) != nd or U.dtype not in (np.float32, np.float64):
            raise ValueError(f"{kind}: {xp_name} must be a float32/float64 stack of {nd - 1}-d "
                             f"states, got {getattr(U, 'dtype', type(U).__name__)} "
                             f"{getattr(U, 'shape', '')}")
        dt, state, m, N = U.dtype, U.shape[1:], U.shape[0], P.shape[0]
        per = (state[1], state[1]) if kind == "dense" else (state[1], state[1], 3, 3)
        want = [(xp_name, U, U.shape), ("G", G, U.shape),
                ("W" if kind == "dense" else "K", P, (N,) + per),
                ("D", X, X.shape[:1] + state) if adjoint else ("b", X, (N, state[1]))]
        if R is not None:
            want.append(("R", R, R.shape[:1] + state))
        for name, a, shape in want:
            if a is not None and (a.shape != shape or a.dtype != dt or not a.flags.c_contiguous):
                raise ValueError(f"{kind}: {name} must be a C-contiguous {dt} array of shape "
                                 f"{shape}, got {a.dtype} {a.shape}")
        if mode not in (0, 1, 2):
            raise ValueError(f"mode must be 0 (residual), 1 (FAS) or 2 (plain), got {mode!r}")
        if not adjoint and act not in (0, 1, 2):
            raise ValueError(f"act={act!r}: expected an activation code 0, 1 or 2")
        out = None
        if mode == 0:
            out = self._buffer("norm", None) if norm_out is None else norm_out
            if out.shape != () or out.dtype != np.float64:
                raise ValueError(f"norm_out must be a 0-d float64 array, got {out.dtype} "
                                 f"{out.shape}")
        if span[0] <= span[1]:  # some step: its slots, layers (and sigma') must exist
            if span[0] < 1 or span[1] >= m:
                raise ValueError(f"slots {span[0]}..{span[1]} out of range 1..{m - 1} "
                                 f"({xp_name} has {m} slots; slot i reads slot i-1)")
            lay = sorted((layer0 + span[0] * layer_step, layer0 + span[1] * layer_step))
            if lay[0] < 0 or lay[1] >= N:
                raise ValueError(f"layers {lay[0]}..{lay[1]} (layer0={layer0}, layer_step="
                                 f"{layer_step}) out of range 0..{N - 1}")
            if adjoint and (lay[0] - d0 < 0 or lay[1] - d0 >= X.shape[0]):
                raise ValueError(f"layers {lay[0]}..{lay[1]} have no sigma' in D: it holds "
                                 f"layers {d0}..{d0 + X.shape[0] - 1} (d0={d0})")
            if R is not None and (out_span[0] < 0 or out_span[1] >= R.shape[0]):
                raise ValueError(f"out_slots {out_span[0]}..{out_span[1]} out of range "
                                 f"0..{R.shape[0] - 1}")
        if R is None:
            R = U
        elif (U if U.base is None else U.base) is (R if R.base is None else R.base):
            raise ValueError("R shares memory with U (the points kernels only read U)")
        g = self.geometry
        wide = kind == "dense" and self.wide(state[1])
        if kind == "dense" and not wide:  # blocks per problem: GEMM tiles
            per_problem = _cdiv(state[1], g["BN"]) * _cdiv(state[0], g["BM"])
        elif kind == "conv":  # the implicit GEMM's tiles: channels x positions
            per_problem = _cdiv(state[0] * int(np.prod(state[2:])), g["BN"]) * _cdiv(state[1],
                                                                                     g["BM"])
        else:  # elementwise blocks (wide dense: the epilogue)
            per_problem = max(1, min(_cdiv(int(np.prod(state)), g["ELEM"]), g["MAX_GRID"]))
        head = (U, G, R, P, X) + ((d0,) if adjoint else ())
        tail = (self._h(h, dt),) + (() if adjoint else (operator.index(act),)) + (mode,)
        name = f"{kind}_stacked_{'adjoint' if adjoint else 'forward'}"
        partial = (self._buffer("partial", sum(r[4] for r in runs) * per_problem) if mode == 0
                   else None)
        part = 0
        for slot0, stride, out0, out_stride, count in runs:
            args = (head + (slot0, stride, out0, out_stride, layer0, layer_step, *state) + tail
                    + (partial, part))
            if wide:
                self._wide_run(adjoint, U, G, R, P, X, d0, (slot0, stride, out0, out_stride,
                               count), layer0, layer_step, h, act, mode, partial, part)
            elif kind == "dense":
                self._gemm(name, state[0], state[1], count, dt, *args)
            else:
                self._gemm(name, state[1], state[0] * int(np.prod(state[2:])), count, dt, *args)
            part += count * per_problem
        if mode != 0:
            return 0.0
        self._launch("sum_partials", dt, (1, 1, 1), (g["REDUCE"], 1, 1), partial, out, part)
        return out if self.launcher.on_device else float(out)

    def _wide_run(self, adjoint, U, G, R, P, X, d0, run, layer0, layer_step, h, act, mode,
                  partial, part):
        """One run of a stacked dense launch through cuBLAS: the GEMM of every problem into a
        scratch stack Z, then the epilogue kernel (the adjoint first forms D_l * L[i-1])."""
        slot0, stride, out0, out_stride, count = run
        B, w = U.shape[1:]
        dt = U.dtype
        Z = self._work("gemm_z", (count, B, w), dt)
        weights = state_run(P, layer0 + slot0 * layer_step, stride * layer_step, count, self.xp)
        if adjoint:
            S = self._work("gemm_s", (count, B, w), dt)
            self._elementwise("stacked_product", B * w, dt, U, slot0 - 1, stride, X,
                              layer0 + slot0 * layer_step - d0, stride * layer_step, S, B * w,
                              self._h(1.0, dt), count=count)
            self.launcher.gemm(S, weights, Z)
            self._elementwise("dense_stacked_adjoint_epilogue", B * w, dt, Z, U, G, R, slot0,
                              stride, out0, out_stride, B, w, self._h(h, dt), mode, partial,
                              part, count=count)
        else:
            self.launcher.gemm(state_run(U, slot0 - 1, stride, count, self.xp), weights, Z,
                               trans_b=True)
            self._elementwise("dense_stacked_forward_epilogue", B * w, dt, Z, U, G, R, X, slot0,
                              stride, out0, out_stride, layer0, layer_step, B, w,
                              self._h(h, dt), operator.index(act), mode, partial, part,
                              count=count)

    def _chains(self, kind, adjoint, U, G, P, X, d0, chains, layer0, layer_step, h, act):
        launches, span = self._plan("chains", _host_index(chains, "chains", 2))
        self._stacked(kind, adjoint, U, G, None, P, X, d0, launches, span, None, layer0,
                      layer_step, h, act, 2)

    def _points(self, kind, adjoint, U, G, R, P, X, d0, slots, out_slots, layer0, layer_step, h,
                act, mode, norm_out):
        if R is None:
            raise ValueError("R (the output states) is required")
        runs, span, out_span = self._plan("points", _host_index(slots, "slots", 1),
                                          _host_index(out_slots, "out_slots", 1))
        return self._stacked(kind, adjoint, U, G, R, P, X, d0, runs, span, out_span, layer0,
                             layer_step, h, act, mode, norm_out)

    def dense_chains_forward(self, U, G, W, b, chains, layer0, layer_step, h, act):
        """In place, one launch per wave (per arithmetic run of a wave's slots): for each chain
        (first, length) of ``chains`` and k < length, i = first + k,
        U[i] = U[i-1] + h sigma(U[i-1] W_l^T + b_l) [+ G[i]], l = layer0 + i * layer_step.

        U, G (m, B, w) (G None: no rhs), W (N, w, w), b (N, w). ``chains`` (n, 2) int, a host
        array (a device array costs a copy and a sync); its launch plan is cached by its bytes.
        Chains must be independent (ValueError otherwise)."""
        self._chains("dense", False, U, G, W, b, 0, chains, layer0, layer_step, h, act)

    def dense_points_forward(self, U, G, R, W, b, slots, out_slots, layer0, layer_step, h, act,
                             mode, norm_out=None):
        """phi_p = Phi_l(U[i-1]) for i = slots[p] (U only read), into R[out_slots[p]]: mode 0
        R[o] = (phi - U[i]) [+ G[i]], mode 1 R[o] = (R[o] + U[i]) - phi, mode 2 R[o] = phi
        [+ G[i]]; one launch per arithmetic run of (slots, out_slots), plus one reduction
        launch in mode 0.

        Returns
        -------
        Mode 0: sum_p ||R[o]||^2 accumulated in float64 on the device: a 0-d float64 array of
        ``xp`` when the launcher is on a device (no sync; it is a cached buffer, overwritten by
        the next mode-0 call unless ``norm_out``, a 0-d float64 array, is given), a Python
        float under emulation / counting. Modes 1, 2: 0.0.
        """
        return self._points("dense", False, U, G, R, W, b, 0, slots, out_slots, layer0,
                            layer_step, h, act, mode, norm_out)

    def dense_chains_adjoint(self, L, G, W, D, d0, chains, layer0, layer_step, h):
        """As :meth:`dense_chains_forward` with the adjoint step
        L[i] = L[i-1] + h (D_l * L[i-1]) W_l [+ G[i]], D_l = D[l - d0] (D (n_d, B, w): sigma' of
        layers d0 ..)."""
        self._chains("dense", True, L, G, W, D, d0, chains, layer0, layer_step, h, None)

    def dense_points_adjoint(self, L, G, R, W, D, d0, slots, out_slots, layer0, layer_step, h,
                             mode, norm_out=None):
        """As :meth:`dense_points_forward` with the adjoint step (returns the same)."""
        return self._points("dense", True, L, G, R, W, D, d0, slots, out_slots, layer0,
                            layer_step, h, None, mode, norm_out)

    def conv_chains_forward(self, U, G, K, b, chains, layer0, layer_step, h, act):
        """As :meth:`dense_chains_forward` for conv states U (m, B, C, H, W), K (N, C, C, 3, 3),
        b (N, C): U[i] = U[i-1] + h sigma(conv3x3(U[i-1], K_l) + b_l) [+ G[i]]."""
        self._chains("conv", False, U, G, K, b, 0, chains, layer0, layer_step, h, act)

    def conv_points_forward(self, U, G, R, K, b, slots, out_slots, layer0, layer_step, h, act,
                            mode, norm_out=None):
        """As :meth:`dense_points_forward` for conv states (returns the same)."""
        return self._points("conv", False, U, G, R, K, b, 0, slots, out_slots, layer0,
                            layer_step, h, act, mode, norm_out)

    def conv_chains_adjoint(self, L, G, K, D, d0, chains, layer0, layer_step, h):
        """As :meth:`dense_chains_adjoint` for conv states:
        L[i] = L[i-1] + h conv_vjp_input(D_l * L[i-1], K_l) [+ G[i]]."""
        self._chains("conv", True, L, G, K, D, d0, chains, layer0, layer_step, h, None)

    def conv_points_adjoint(self, L, G, R, K, D, d0, slots, out_slots, layer0, layer_step, h,
                            mode, norm_out=None):
        """As :meth:`dense_points_adjoint` for conv states (returns the same)."""
        return self._points("conv", True, L, G, R, K, D, d0, slots, out_slots, layer0,
                            layer_step, h, None, mode, norm_out)

    # ----------------------------------------------------------------- stacked gradients
    def _count(self, count):
        _check_count(count)
        return count

    def dense_deriv_stacked(self, U, first, count, W, b, layer0, act, D):
        """D[p] = sigma'(U[first + p] W_l^T + b_l), l = layer0 + p, p < count: one launch, no
        pointer arrays (contract: :data:`mgnn.backend.STACKED_GRAD_KERNELS`)."""
        count = self._count(check_stacked_grads("dense", U, first, count, W, layer0, D, b))
        if count and self.wide(U.shape[2]):
            B, w = U.shape[1:]
            Z = self._work("gemm_z", (count, B, w), U.dtype)
            self.launcher.gemm(U[first:first + count], W[layer0:layer0 + count], Z,
                               trans_b=True)
            self._elementwise("dense_bias_act", B * w, U.dtype, Z, None, 0, b, layer0, None, 0,
                              D, 0, B, w, self._h(1.0, U.dtype), operator.index(act), 0,
                              count=count)
        elif count:
            B, w = U.shape[1:]
            self._gemm("dense_deriv_stacked", B, w, count, U.dtype, U, first, W, b, layer0, D,
                       B, w, operator.index(act))

    def dense_vjp_params_stacked(self, L, l_first, l_stride, D, U, u_first, count, layer0, h,
                                 gW, gb):
        """(gW[l], gb[l]) = dense_vjp_params(L[l_first + p l_stride], D[p], U[u_first + p], h),
        l = layer0 + p, p < count: two launches (weights, biases), no pointer arrays."""
        count = self._count(check_stacked_grads("dense", U, u_first, count, gW, layer0, D, gb,
                                                L, l_first, l_stride))
        if count:
            B, w = U.shape[1:]
            hh, args = self._h(h, U.dtype), (L, l_first, l_stride, D)
            if self.wide(w):  # gW[l] = (h D_p * Lam_p)^T U[u_first + p] by cuBLAS
                S = self._work("gemm_s", (count, B, w), U.dtype)
                self._elementwise("stacked_product", B * w, U.dtype, L, l_first, l_stride, D, 0,
                                  1, S, B * w, hh, count=count)
                self.launcher.gemm(S, U[u_first:u_first + count], gW[layer0:layer0 + count],
                                   trans_a=True)
            else:
                self._gemm("dense_weight_grad_stacked", w, w, count, U.dtype, *args, U,
                           u_first, layer0, gW, B, w, hh)
            self._launch("bias_grad_stacked", U.dtype, (w, count, 1),
                         (self.geometry["REDUCE"], 1, 1), *args, layer0, gb, B, w, 1, hh)

    def conv_deriv_stacked(self, U, first, count, K, b, layer0, act, D):
        """As :meth:`dense_deriv_stacked` for conv states (one launch)."""
        count = self._count(check_stacked_grads("conv", U, first, count, K, layer0, D, b))
        if count:
            B, C, H, Wd = U.shape[1:]
            self._gemm("conv_deriv_stacked", C, B * H * Wd, count, U.dtype, U, first, K, b,
                       layer0, D, B, C, H, Wd, operator.index(act))

    def conv_vjp_params_stacked(self, L, l_first, l_stride, D, U, u_first, count, layer0, h,
                                gK, gb):
        """As :meth:`dense_vjp_params_stacked` for conv states (two launches)."""
        count = self._count(check_stacked_grads("conv", U, u_first, count, gK, layer0, D, gb, L,
                                                l_first, l_stride))
        if count:
            B, C, H, Wd = U.shape[1:]
            hh, args, red = self._h(h, U.dtype), (L, l_first, l_stride, D), \
                (self.geometry["REDUCE"], 1, 1)
            self._kernel_grad("conv_kernel_grad_stacked", args + (U, u_first), (B, C, H, Wd),
                              B * H * Wd, C, C * 9, count, None, layer0, gK, hh)
            self._launch("bias_grad_stacked", U.dtype, (C, count, 1), red, *args, layer0, gb, B,
                         C, H * Wd, hh)
