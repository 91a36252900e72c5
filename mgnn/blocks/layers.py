"""Layer kinds: forward and vjp side by side, over the kernels of a backend.

Every layer kind is a small stateless description (sizes, activation); arrays and the backend module
``bk`` (see :mod:`mgnn.backend`) are passed to each call. Parameters are dicts ``{"weight", "bias"}``.

Step kinds (the residual functions ``F`` of docs/design.md, "Mathematics") act on a state ``u`` with a step
size ``h``: ``u_next = u + h F(u; W, b)``. Opening kinds map the input batch to the state ``u_0``;
closing kinds map ``u_N`` to the logits.
"""
import numpy as np

from ..backend import activation_code


def serial_scratch(scratch):
    """The host arrays of a step kind's serial sweeps (``sweep_forward_layers`` /
    ``sweep_backward_layers``): ``get(name, shape, dtype)`` from the caller's
    ``scratch(name, shape, dtype)`` under names of their own ("serial <name>": the same caller
    also keeps MGRIT's arrays of the same shapes), or fresh arrays where ``scratch`` is None."""
    if scratch is None:
        return lambda name, shape, dtype: np.empty(shape, dtype)
    return lambda name, shape, dtype: scratch("serial " + name, shape, dtype)


class _StepKind:
    """Shared code of the residual step kinds; subclasses name their kernels."""

    _fwd = _fwd_deriv = _deriv = _vjp = _vjp_input = _vjp_params = None  # backend kernel names
    _fwd_batched = _vjp_input_batched = _deriv_batched = _vjp_params_batched = None

    def __init__(self, activation):
        self.activation = activation
        self.act = activation_code(activation)

    fused = True  # the stacked / batched kernels exist (mgnn.blocks.composed.ComposedStep: no)
    shared = False  # per-layer parameters (leading axis N)

    # layer-indexed protocol (every step kind; mgnn.blocks.composed documents it): P holds every
    # layer's parameters by name (leading axis N), ctx is a StepContext (unused here)
    def forward_layer(self, P, n, u, h, bk, ctx=None):
        """u + h F(u; layer n of P)."""
        return self.forward(P["weight"][n], P["bias"][n], u, h, bk)

    def forward_linearize(self, P, n, u, h, bk, ctx=None):
        """(u + h F(u; layer n), its linearisation cache: sigma'(z))."""
        return self.forward_deriv(P["weight"][n], P["bias"][n], u, h, bk)

    def linearize(self, P, n, u, bk, ctx=None):
        """sigma'(z) of layer n at u: what the vjps need (independent of h)."""
        return self.deriv(P["weight"][n], P["bias"][n], u, bk)

    def vjp_state_layer(self, P, n, cache, lam, h, bk, ctx=None):
        """lam + h J_n(u)^T lam from the cache of :meth:`linearize` at u."""
        return self.vjp_state(P["weight"][n], None, None, h, lam, bk, deriv=cache)

    def vjp_layer(self, P, n, u, cache, lam, h, bk, ctx, G):
        """The state vjp (returned) and, in place, G[name][n] = h (dF_n/dtheta)^T lam."""
        lam, G["weight"][n], G["bias"][n] = self.vjp(P["weight"][n], None, u, h, lam, bk,
                                                     deriv=cache)
        return lam

    def vjp_params_layer(self, P, n, u, cache, lam, h, bk, ctx, G):
        """In place: G[name][n] = h (dF_n/dtheta)^T lam (no state vjp)."""
        G["weight"][n], G["bias"][n] = self.vjp_params(u, h, lam, cache, bk)

    def commit_buffers(self, buffers, n, cache):
        """No buffers: nothing to update."""

    def buffer_shapes(self):
        """No buffers."""
        return {}

    def check_batch(self, batch, layer=0):
        """Any batch works."""

    def forward(self, W, b, u, h, bk):
        """u + h F(u; W, b), same shape and dtype as u; ``h`` a scalar of u's dtype."""
        return getattr(bk, self._fwd)(u, W, b, h, self.act, True)

    def forward_deriv(self, W, b, u, h, bk):
        """(u_next, sigma'(z)) for a vjp that follows."""
        return getattr(bk, self._fwd_deriv)(u, W, b, h, self.act, True)

    def deriv(self, W, b, u, bk):
        """sigma'(z) at state u (recomputed; used when the forward did not store it)."""
        return getattr(bk, self._deriv)(u, W, b, self.act)

    def vjp_state(self, W, b, u, h, lam, bk, deriv=None):
        """lam + h J(u)^T lam: the state vjp of one step at u for the cotangent lam of u_next."""
        if deriv is None:
            deriv = self.deriv(W, b, u, bk)
        return getattr(bk, self._vjp_input)(lam, deriv, W, h, True)

    def forward_batched(self, W, b, us, layers, h, bk, rhs=None):
        """[us[p] + h F(us[p]; W[l], b[l]) (+ rhs[p]) for l = layers[p]] in one batched kernel
        call; W and b hold every layer (leading axis)."""
        return getattr(bk, self._fwd_batched)(us, W, b, layers, h, self.act, False, rhs)[0]

    def vjp_state_batched(self, W, lams, derivs, layers, h, bk, rhs=None):
        """[lams[p] + h J_l^T lams[p] (+ rhs[p])] for l = layers[p], from sigma' ``derivs[p]``
        at the states of those layers, in one batched kernel call."""
        return getattr(bk, self._vjp_input_batched)(lams, derivs, W, layers, h, rhs)

    def deriv_batched(self, W, b, us, layers, bk):
        """[sigma'(z) of layer layers[p] at state us[p]] in one batched kernel call."""
        return getattr(bk, self._deriv_batched)(us, W, b, layers, self.act)

    def vjp_params_batched(self, us, h, lams, derivs, layers, gW, gb, bk):
        """In place: gW[l], gb[l] = :meth:`vjp_params` of every (us[p], lams[p], derivs[p]) with
        l = layers[p] (distinct), in one batched kernel call."""
        getattr(bk, self._vjp_params_batched)(lams, derivs, us, layers, h, gW, gb)

    # stacked states (one array per MGRIT level; see mgnn.backend.STACKED_KERNELS): the step
    # into slot i uses layer layer0 + i * layer_step
    def chains_forward(self, W, b, U, G, chains, layer0, layer_step, h, bk):
        """In place: U[i] = U[i-1] + h F(U[i-1]; layer of i) (+ G[i]) along each chain
        (rows (first slot, length) of the int64 array ``chains``)."""
        getattr(bk, self._prefix + "_chains_forward")(U, G, W, b, chains, layer0, layer_step, h,
                                                      self.act)

    def can_keep_derivs(self, bk):
        """Whether ``bk`` has :meth:`chains_forward_derivs` and :meth:`deriv_missing` for this
        kind (a forward solve's final sweep then keeps sigma' for the adjoint)."""
        return all(callable(getattr(bk, self._prefix + k, None))
                   for k in ("_chains_forward_derivs", "_deriv_missing"))

    def chains_forward_derivs(self, W, b, U, chains, layer0, layer_step, h, D, d_lo, done, bk):
        """:meth:`chains_forward` without right-hand sides, bit for bit, each step out of slot
        i - 1 through layer l also writing sigma'(z + b) into D[l - d_lo] (where 0 <= l - d_lo <
        len(D)) and setting the int8 flag done[l - d_lo]."""
        getattr(bk, self._prefix + "_chains_forward_derivs")(U, W, b, chains, layer0, layer_step,
                                                             h, self.act, D, d_lo, done)

    def points_forward(self, W, b, U, G, R, slots, out_slots, layer0, layer_step, h, mode, bk):
        """The step into each of U's ``slots``, combined into R's ``out_slots`` by ``mode``
        (0 residual, returns the squared norm; 1 FAS; 2 plain)."""
        return getattr(bk, self._prefix + "_points_forward")(U, G, R, W, b, slots, out_slots,
                                                             layer0, layer_step, h, self.act, mode)

    def chains_adjoint(self, W, D, d0, L, G, chains, layer0, layer_step, h, bk):
        """:meth:`chains_forward` of the state vjp L[i] = L[i-1] + h J_l^T L[i-1], sigma' of
        layer l in D[l - d0]."""
        getattr(bk, self._prefix + "_chains_adjoint")(L, G, W, D, d0, chains, layer0, layer_step,
                                                      h)

    def points_adjoint(self, W, D, d0, L, G, R, slots, out_slots, layer0, layer_step, h, mode,
                       bk):
        """:meth:`points_forward` of the state vjp."""
        return getattr(bk, self._prefix + "_points_adjoint")(L, G, R, W, D, d0, slots, out_slots,
                                                             layer0, layer_step, h, mode)

    def can_replay(self, bk):
        """Whether ``bk`` replays captured cycles of this kind (``<kind>_run_tape``)."""
        return callable(getattr(bk, self._prefix + "_run_tape", None))

    def run_tape(self, W, P, d0, stores, rows, hs, norms, adjoint, bk):
        """Replay a captured cycle (:mod:`mgnn.backend.tape`): forward (P = b) or adjoint (P = D,
        sigma' of layers d0, d0 + 1, ...)."""
        getattr(bk, self._prefix + "_run_tape")(stores, rows, hs, W, P, d0,
                                                2 if adjoint else self.act, adjoint, norms)

    def deriv_stacked(self, W, b, U, first, count, layer0, D, bk):
        """In place: D[p] = sigma'(z) of layer layer0 + p at state U[first + p], p < count
        (see mgnn.backend.STACKED_GRAD_KERNELS)."""
        getattr(bk, self._prefix + "_deriv_stacked")(U, first, count, W, b, layer0, self.act, D)

    def deriv_missing(self, W, b, U, first, count, layer0, D, done, bk):
        """:meth:`deriv_stacked` for the rows p < count with ``done[p] == 0`` only."""
        getattr(bk, self._prefix + "_deriv_missing")(U, first, count, W, b, layer0, self.act, D,
                                                     done)

    def vjp_params_stacked(self, L, l_first, l_stride, D, U, u_first, count, layer0, h, gW, gb,
                           bk):
        """In place: gW[l], gb[l] = :meth:`vjp_params` of (U[u_first + p], h,
        L[l_first + p l_stride], D[p]) for l = layer0 + p, p < count."""
        getattr(bk, self._prefix + "_vjp_params_stacked")(L, l_first, l_stride, D, U, u_first,
                                                          count, layer0, h, gW, gb)

    def vjp(self, W, b, u, h, lam, bk, deriv=None):
        """(state vjp, gW, gb) of one step at u for the cotangent lam of u_next."""
        if deriv is None:
            deriv = self.deriv(W, b, u, bk)
        return getattr(bk, self._vjp)(lam, deriv, u, W, h, True)

    def vjp_params(self, u, h, lam, deriv, bk):
        """(gW, gb) = h (dF/dtheta at u)^T lam, from sigma'(z) ``deriv`` at u."""
        return getattr(bk, self._vjp_params)(lam, deriv, u, h)

    def sweep_forward(self, W, b, U, h, D, bk):
        """U[n+1] = U[n] + h F(U[n]; W[n], b[n]) for n = 0..len(W)-1, in place.

        U (N+1, B, ...) with U[0] set; D (N, B, ...) receives sigma'(z_n) or has length 0.
        """
        for n in range(W.shape[0]):
            if D.shape[0]:
                U[n + 1], D[n] = self.forward_deriv(W[n], b[n], U[n], h, bk)
            else:
                U[n + 1] = self.forward(W[n], b[n], U[n], h, bk)

    def sweep_backward(self, W, b, U, D, h, lam, gW, gb, bk):
        """Adjoint of :meth:`sweep_forward`: lam_0 from lam = lam_N; fills gW (N, ...), gb (N, ...)."""
        for n in range(W.shape[0] - 1, -1, -1):
            lam, gW[n], gb[n] = self.vjp(W[n], b[n], U[n], h, lam, bk, deriv=D[n])
        return lam


class DenseStep(_StepKind):
    """F(u) = sigma(u W^T + b); u (B, w), W (w, w), b (w,)."""

    _prefix = "dense"
    _fwd, _fwd_deriv, _deriv = "dense_forward", "dense_forward_deriv", "dense_deriv"
    _vjp, _vjp_input, _vjp_params = "dense_vjp", "dense_vjp_input", "dense_vjp_params"
    _fwd_batched, _vjp_input_batched = "dense_forward_batched", "dense_vjp_input_batched"
    _deriv_batched, _vjp_params_batched = "dense_deriv_batched", "dense_vjp_params_batched"

    def __init__(self, width, activation="tanh"):
        super().__init__(activation)
        self.width = int(width)

    def param_shapes(self):
        """Shapes of one layer's parameters: {'weight': (w, w), 'bias': (w,)}."""
        return {"weight": (self.width, self.width), "bias": (self.width,)}

    def state_shape(self, batch):
        """Shape of the state for ``batch`` samples: (B, w)."""
        return (batch, self.width)

    def sweep_forward(self, W, b, U, h, D, bk):
        bk.dense_sweep_forward(U, W, b, h, self.act, D)

    def sweep_backward(self, W, b, U, D, h, lam, gW, gb, bk):
        return bk.dense_sweep_backward(U, D, W, h, lam, gW, gb)


class ConvStep(_StepKind):
    """F(u) = sigma(conv3x3(u, K) + b); u (B, C, H, W), K (C, C, 3, 3), b (C,)."""

    _prefix = "conv"
    _fwd, _fwd_deriv, _deriv = "conv_forward", "conv_forward_deriv", "conv_deriv"
    _vjp, _vjp_input, _vjp_params = "conv_vjp", "conv_vjp_input", "conv_vjp_params"
    _fwd_batched, _vjp_input_batched = "conv_forward_batched", "conv_vjp_input_batched"
    _deriv_batched, _vjp_params_batched = "conv_deriv_batched", "conv_vjp_params_batched"

    def __init__(self, channels, image_size, activation="tanh"):
        super().__init__(activation)
        self.channels = int(channels)
        self.image_size = tuple(int(s) for s in image_size)

    def param_shapes(self):
        """{'weight': (C, C, 3, 3), 'bias': (C,)}."""
        c = self.channels
        return {"weight": (c, c, 3, 3), "bias": (c,)}

    def state_shape(self, batch):
        """(B, C, H, W)."""
        return (batch, self.channels) + self.image_size

    def sweep_forward(self, W, b, U, h, D, bk):
        sweep = getattr(bk, "conv_sweep_forward", None)  # in place, where the backend has it
        if sweep is None or not (U.flags.c_contiguous and D.flags.c_contiguous):
            return super().sweep_forward(W, b, U, h, D, bk)
        sweep(U, W, b, h, self.act, D)

    def sweep_backward(self, W, b, U, D, h, lam, gW, gb, bk):
        sweep = getattr(bk, "conv_sweep_backward", None)  # no state allocated per layer
        if sweep is None or not (U.flags.c_contiguous and D.flags.c_contiguous
                                 and D.shape[0] == W.shape[0]):
            return super().sweep_backward(W, b, U, D, h, lam, gW, gb, bk)
        return sweep(U, D, W, h, lam, gW, gb)


class _Opening:
    """Shared code of the opening kinds: u_0 = sigma(A x + a) with the kernels named below."""

    _fwd_deriv = _vjp = None  # backend kernel names

    def forward(self, params, x, bk):
        """(u_0, sigma'(z) for :meth:`vjp`)."""
        one = x.dtype.type(1)
        return getattr(bk, self._fwd_deriv)(x, params["weight"], params["bias"], one, self.act,
                                            False)

    def vjp(self, params, x, deriv, g, bk):
        """(gx shaped like x, {'weight', 'bias'}) for the cotangent g of u_0."""
        one = x.dtype.type(1)
        gx, gW, gb = getattr(bk, self._vjp)(g, deriv, x, params["weight"], one, False)
        return gx, {"weight": gW, "bias": gb}


class DenseOpening(_Opening):
    """u_0 = sigma(x A^T + a); x (B, i) -> (B, w); A (w, i), a (w,)."""

    _fwd_deriv, _vjp = "dense_forward_deriv", "dense_vjp"

    def __init__(self, in_features, width, activation="tanh"):
        self.in_features, self.width = int(in_features), int(width)
        self.activation, self.act = activation, activation_code(activation)

    def param_shapes(self):
        """{'weight': (w, i), 'bias': (w,)}."""
        return {"weight": (self.width, self.in_features), "bias": (self.width,)}

    def input_shape(self):
        """Shape of one sample: (i,)."""
        return (self.in_features,)


class ConvOpening(_Opening):
    """u_0 = sigma(conv3x3(x, K) + a); x (B, ci, H, W) -> (B, C, H, W); K (C, ci, 3, 3)."""

    _fwd_deriv, _vjp = "conv_forward_deriv", "conv_vjp"

    def __init__(self, in_channels, channels, image_size, activation="tanh"):
        self.in_channels, self.channels = int(in_channels), int(channels)
        self.image_size = tuple(int(s) for s in image_size)
        self.activation, self.act = activation, activation_code(activation)

    def param_shapes(self):
        """{'weight': (C, ci, 3, 3), 'bias': (C,)}."""
        return {"weight": (self.channels, self.in_channels, 3, 3), "bias": (self.channels,)}

    def input_shape(self):
        """(ci, H, W)."""
        return (self.in_channels,) + self.image_size


class Conv3dOpening(ConvOpening):
    """u_0 = sigma(conv3x3x3(x, K) + a); x (B, ci, D, H, W) -> (B, C, D, H, W);
    K (C, ci, 3, 3, 3) (PyTorch's Conv3d layout)."""

    _fwd_deriv, _vjp = "conv3d_forward_deriv", "conv3d_vjp"

    def param_shapes(self):
        """{'weight': (C, ci, 3, 3, 3), 'bias': (C,)}."""
        return {"weight": (self.channels, self.in_channels, 3, 3, 3), "bias": (self.channels,)}


class DenseClosing:
    """logits = u C^T + c; u (B, w) -> (B, K); C (K, w), c (K,)."""

    def __init__(self, width, n_classes):
        self.width, self.n_classes = int(width), int(n_classes)

    def param_shapes(self):
        """{'weight': (K, w), 'bias': (K,)}."""
        return {"weight": (self.n_classes, self.width), "bias": (self.n_classes,)}

    def _features(self, u, bk):
        return u

    def _features_vjp(self, u, g, bk):
        return g

    def forward(self, params, u, bk):
        """(logits (B, K), cache for :meth:`vjp`)."""
        f = self._features(u, bk)
        one = u.dtype.type(1)
        logits, deriv = bk.dense_forward_deriv(f, params["weight"], params["bias"], one, 2, False)
        return logits, (f, deriv)

    def vjp(self, params, u, cache, g, bk):
        """(gu shaped like u, {'weight', 'bias'}) for the cotangent g (B, K) of the logits."""
        f, deriv = cache
        one = u.dtype.type(1)
        gf, gC, gc = bk.dense_vjp(g, deriv, f, params["weight"], one, False)
        return self._features_vjp(u, gf, bk), {"weight": gC, "bias": gc}


class PoolClosing(DenseClosing):
    """logits = avgpool_p(u).reshape(B, C p^d) C^T + c; u (B, C, H, W) (d = 2, the backend's
    pooling kernels) or (B, C, D, H, W) (d = 3, array arithmetic); p = 1 is global pooling."""

    def __init__(self, channels, image_size, n_classes, pool=1):
        self.channels, self.pool = int(channels), int(pool)
        self.image_size = tuple(int(s) for s in image_size)
        super().__init__(self.channels * self.pool ** len(self.image_size), n_classes)

    def _blocks(self, u):
        """(B, C, p, D/p, p, H/p, p, W/p): the pooling cells of a 3D state as axes."""
        p = self.pool
        return u.reshape(u.shape[:2] + tuple(x for s in u.shape[2:] for x in (p, s // p)))

    def _features(self, u, bk):
        if u.ndim == 4:
            return bk.avgpool_forward(u, self.pool).reshape(u.shape[0], -1)
        return self._blocks(u).mean(axis=(3, 5, 7)).reshape(u.shape[0], -1)

    def _features_vjp(self, u, g, bk):
        p = self.pool
        if u.ndim == 4:
            g4 = g.reshape(u.shape[0], self.channels, p, p)  # C-contiguous (a vjp output)
            return bk.avgpool_vjp(g4, u.shape[2], u.shape[3])
        cells = int(np.prod(u.shape[2:])) // p ** 3
        g6 = g.reshape(u.shape[0], self.channels, p, 1, p, 1, p, 1) / u.dtype.type(cells)
        out = u * 0  # a new contiguous array: its block view writes through
        self._blocks(out)[...] = g6
        return out


class SoftmaxCrossEntropy:
    """Mean softmax cross-entropy over the batch (numerically stable)."""

    def forward_grad(self, logits, y, bk):
        """(loss: Python float, dlogits (B, K)) for integer labels y (B,)."""
        loss, g = bk.softmax_xent(logits, y)
        return float(loss), g
