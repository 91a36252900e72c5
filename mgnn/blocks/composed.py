"""Composed residual functions: F(u) as a short chain of blocks, each with forward + vjp.

A block maps an array ``x`` (channel axis 1: (B, C) or (B, C, H, W)) to ``y`` of the same
batch, given one layer's parameters ``theta`` (dict of the names in :attr:`params`) and a
:class:`StepContext`. ``forward`` returns ``(y, cache)``; ``vjp`` maps the cotangent of ``y``
to the cotangent of ``x`` and, when a gradient dict is passed, writes ``scale`` times the
parameter gradients into it. Blocks are stateless descriptions; arrays and the backend ``bk``
(``mgnn.backend``) are passed to every call.

:class:`ComposedStep` chains blocks into a step kind ``u_next = u + h F(u)`` with the
layer-indexed protocol of :mod:`mgnn.blocks.layers` (``forward_layer``, ``forward_linearize``,
``vjp_state_layer``, ``vjp_params_layer``, ``commit_buffers``): a layer's function depends on
its index ``n`` (parameters, dropout mask) and on the context (train/eval, training step,
global sample offset, replica statistics), never on how often or where it is evaluated.
"""
import math
import numbers

import numpy as np

from ..backend import activation_code, is_device_array
from ..backend.counter_rng import _check as _counter_rng_check
from ..backend.counter_rng import dropout_mask, dropout_threshold
from .layers import serial_scratch


class StepContext:
    """What a layer evaluation may depend on besides the state and the parameters.

    Attributes
    ----------
    training : bool
        Train mode (batch statistics, dropout) or eval mode (running statistics, no dropout).
    step : int
        Training step t (counter of the dropout masks).
    sample0 : int
        Global index of this replica's first sample (dropout masks follow the global sample).
    seed : int
        Seed of the dropout masks (0 <= seed < 2**64).
    buffers : dict or None
        Every layer's buffers by name (leading axis N), read in eval mode (running statistics).
    replicas : object or None
        Data-parallel statistics hook (synchronised batch norm): ``allgather(a)`` returns the
        (D, ...) host stack of ``a`` (1-D host array) over the replicas, in replica order, on
        every replica. None: statistics of this replica's batch.
    """

    def __init__(self, training=True, step=0, sample0=0, seed=0, buffers=None, replicas=None):
        self.training, self.step, self.sample0 = training, step, sample0
        self.seed, self.buffers, self.replicas = seed, buffers, replicas
        self.x, self.memo = None, {}
        #: (lo, hi): the time steps whose inputs this rank's steps read (a layer rank's block;
        #: sequence models project only those), or None: every step
        self.steps = None

    def begin(self, x):
        """A new call on the input batch ``x`` (per-step inputs of sequence models): forget what
        was memoised for the previous one (input projections, the recurrent kernels' stacked
        weights). What is memoised holds until the next ``begin``: a caller that changes the
        parameters in between (a line search, finite differences) calls ``begin`` again."""
        self.x, self.memo = x, {}

    def mask(self, bk, layer, shape, dtype, threshold):
        """Dropout keep mask of ``layer`` for a batch shaped ``shape`` (B, ...), as 0/1 of
        ``dtype``: a pure function of (seed, step, layer, global sample, element)."""
        B, E = shape[0], int(np.prod(shape[1:]))
        fast = getattr(bk, "dropout_mask", None)
        if callable(fast):
            m = fast(self.seed, self.step, layer, self.sample0, B, E, threshold)
        else:
            m = dropout_mask(self.seed, self.step, layer, self.sample0, B, E, threshold,
                             xp=getattr(bk, "xp", np))
        return m.reshape(shape).astype(dtype)


def _xp(a):
    """NumPy or CuPy, whichever holds ``a``."""
    if is_device_array(a):
        import cupy
        return cupy
    return np


def _channel_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _per_channel(v, x):
    """(C,) -> broadcastable against x (B, C, ...)."""
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


class Affine:
    """``y = x W^T + b`` (dense, x (B, w)), ``conv3x3(x, K) + b`` (conv, x (B, C, H, W)) or
    ``conv3x3x3(x, K) + b`` (conv3d, x (B, C, D, H, W)), padding 1, through the backend's
    dense / conv / conv3d kernels with the identity activation.

    Parameters
    ----------
    kind : {'dense', 'conv', 'conv3d'} or bool (True: 'conv', False: 'dense')
    """

    params = ("weight", "bias")
    KINDS = ("dense", "conv", "conv3d")

    def __init__(self, kind):
        if isinstance(kind, bool):
            kind = "conv" if kind else "dense"
        if kind not in self.KINDS:
            raise ValueError(f"Affine kind must be one of {self.KINDS}, got {kind!r}")
        self._k = kind
        self.conv = kind != "dense"
        self._ones = {}  # the vjp's sigma' = 1, one array per shape, dtype and array library

    def forward(self, theta, x, n, ctx, bk):
        one = x.dtype.type(1)
        y = getattr(bk, self._k + "_forward")(x, theta["weight"], theta["bias"], one,
                                              activation_code("identity"), False)
        return y, x

    def _unit_deriv(self, gy):
        key = (gy.shape, gy.dtype.str, type(gy))
        ones = self._ones.get(key)
        if ones is None:
            ones = self._ones[key] = _xp(gy).ones_like(gy)
        return ones

    def vjp(self, theta, cache, gy, n, ctx, bk, grads=None, scale=1.0):
        x = cache
        ones = self._unit_deriv(gy)
        one = x.dtype.type(1)
        if grads is None:
            return getattr(bk, self._k + "_vjp_input")(gy, ones, theta["weight"], one, False)
        gx, gW, gb = getattr(bk, self._k + "_vjp")(gy, ones, x, theta["weight"], one, False)
        grads["weight"][...] = scale * gW
        grads["bias"][...] = scale * gb
        return gx


class BatchNorm:
    """PyTorch's BatchNorm1d/2d per channel: ``y = gamma (x - mean) / sqrt(var + eps) + beta``.

    Train mode: mean and biased variance of the batch at hand (over the replicas when the
    context has a replica hook); eval mode: the running statistics. Parameters ``bn_weight``
    (gamma), ``bn_bias`` (beta); buffers ``running_mean``, ``running_var`` (updated only by
    :meth:`commit`, with the unbiased variance and ``momentum``).
    """

    params = ("bn_weight", "bn_bias")
    buffers = ("running_mean", "running_var")

    def __init__(self, channels, eps=1e-5, momentum=0.1):
        self.channels = int(channels)
        for name, v in (("eps", eps), ("momentum", momentum)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"batch norm {name} must be a real number, got {v!r}")
        if not (eps > 0 and math.isfinite(eps)):
            raise ValueError(f"batch norm eps must be a positive number, got {eps!r}")
        if not 0 <= momentum <= 1:
            raise ValueError(f"batch norm momentum must be in [0, 1], got {momentum!r}")
        self.eps, self.momentum = float(eps), float(momentum)

    def batch_statistics(self, x, ctx):
        """(count, mean (C,), biased var (C,)) of x over every axis but 1 (and the replicas)."""
        axes = _channel_axes(x)
        mean = x.mean(axis=axes)
        m2 = ((x - _per_channel(mean, x)) ** 2).sum(axis=axes)
        return self._merged(x, mean, m2, ctx)

    @staticmethod
    def _merged(x, mean, m2, ctx):
        """(count, mean, biased var) from this replica's per-channel mean and M2 (sum of squared
        deviations): merged over the replicas (Chan et al., in replica order) if ``ctx`` has
        them."""
        count = x.size // x.shape[1]
        if ctx.replicas is not None:
            rows = ctx.replicas.allgather(np.concatenate(
                [[count], _host(mean), _host(m2)]).astype(np.float64))
            C, xp = x.shape[1], _xp(x)
            n_r, mean_r, m2_r = rows[:, 0], rows[:, 1:1 + C], rows[:, 1 + C:]
            count = int(round(n_r.sum()))
            mean_g = (n_r[:, None] * mean_r).sum(axis=0) / count
            m2_g = m2_r.sum(axis=0) + (n_r[:, None] * (mean_r - mean_g) ** 2).sum(axis=0)
            mean, m2 = xp.asarray(mean_g, dtype=x.dtype), xp.asarray(m2_g, dtype=x.dtype)
        return count, mean, m2 / count

    @staticmethod
    def _summed(s1, s2, ctx):
        """Per-channel sums (C,) summed over the replicas (replica order) if ``ctx`` has them."""
        if ctx.replicas is None:
            return s1, s2
        sums = ctx.replicas.allgather(np.concatenate([_host(s1), _host(s2)]))
        C, xp = s1.shape[0], _xp(s1)
        return (xp.asarray(sums[:, :C].sum(axis=0), dtype=s1.dtype),
                xp.asarray(sums[:, C:].sum(axis=0), dtype=s1.dtype))

    def forward(self, theta, x, n, ctx, bk):
        gamma, beta = theta["bn_weight"], theta["bn_bias"]
        if ctx.training:
            count, mean, var = self.batch_statistics(x, ctx)
        else:
            count, mean, var = 0, ctx.buffers["running_mean"][n], ctx.buffers["running_var"][n]
        invstd = 1.0 / _xp(x).sqrt(var + x.dtype.type(self.eps))
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        y = _per_channel(gamma, x) * xhat + _per_channel(beta, x)
        return y, (xhat, invstd, count, mean, var)

    def vjp(self, theta, cache, gy, n, ctx, bk, grads=None, scale=1.0):
        xhat, invstd, count, _, _ = cache
        gamma = theta["bn_weight"]
        axes = _channel_axes(gy)
        s1, s2 = gy.sum(axis=axes), (gy * xhat).sum(axis=axes)
        if grads is not None:
            grads["bn_weight"][...] = scale * s2
            grads["bn_bias"][...] = scale * s1
        gx = gy * _per_channel(gamma * invstd, gy)
        if not count:  # eval mode: an affine map per channel
            return gx
        s1, s2 = self._summed(s1, s2, ctx)
        return gx - _per_channel(gamma * invstd / count, gy) * (
            _per_channel(s1, gy) + xhat * _per_channel(s2, gy))

    def commit(self, buffers, n, cache):
        """Running statistics of layer n from the batch statistics in ``cache`` (train mode)."""
        _, _, count, mean, var = cache
        m = self.momentum
        unbiased = var * (count / max(count - 1, 1))
        buffers["running_mean"][n] = (1 - m) * buffers["running_mean"][n] + m * mean
        buffers["running_var"][n] = (1 - m) * buffers["running_var"][n] + m * unbiased

    def check_count(self, count, layer):
        """ValueError unless a train-mode batch gives more than one value per channel."""
        if count < 2:
            raise ValueError(f"batch norm of layer {layer} (steps.bn_weight[{layer}]) needs more "
                             f"than one value per channel in train mode, got {count} (the "
                             "variance of one value is undefined): use a larger batch")


class BatchNormAct(BatchNorm):
    """:class:`BatchNorm` followed by :class:`Activation` in the backend's fused kernels
    (``mgnn.backend.BN_KERNELS``: one pass for the statistics, one for normalise + affine +
    activation, two for the vjp); same results as the two blocks composed, which remain the
    reference (and the path on a backend without the kernels)."""

    def __init__(self, channels, activation, eps=1e-5, momentum=0.1):
        super().__init__(channels, eps, momentum)
        self.activation = Activation(activation)
        self.act = activation_code(activation)

    def forward(self, theta, x, n, ctx, bk):
        if not _has_bn_kernels(bk):
            y, c_bn = BatchNorm.forward(self, theta, x, n, ctx, bk)
            a, c_act = self.activation.forward(theta, y, n, ctx, bk)
            return a, (c_bn, c_act)
        if ctx.training:
            count, mean, var = self._merged(x, *bk.bn_stats(x), ctx)
        else:
            count, mean, var = 0, ctx.buffers["running_mean"][n], ctx.buffers["running_var"][n]
        invstd = 1.0 / _xp(x).sqrt(var + x.dtype.type(self.eps))
        a, xhat, deriv = bk.bn_act_forward(x, mean, invstd, theta["bn_weight"],
                                           theta["bn_bias"], self.act)
        return a, ((xhat, invstd, count, mean, var), deriv)

    def vjp(self, theta, cache, ga, n, ctx, bk, grads=None, scale=1.0):
        c_bn, c_act = cache
        if not _has_bn_kernels(bk):
            gy = self.activation.vjp(theta, c_act, ga, n, ctx, bk)
            return BatchNorm.vjp(self, theta, c_bn, gy, n, ctx, bk, grads, scale)
        xhat, invstd, count, _, _ = c_bn
        gamma = theta["bn_weight"]
        s1, s2 = bk.bn_act_vjp_sums(ga, c_act, xhat)
        if grads is not None:
            grads["bn_weight"][...] = scale * s2
            grads["bn_bias"][...] = scale * s1
        if not count:  # eval mode
            return ga * c_act * _per_channel(gamma * invstd, ga)
        s1, s2 = self._summed(s1, s2, ctx)
        return bk.bn_act_vjp_input(ga, c_act, xhat, invstd, gamma, s1, s2, count)

    def commit(self, buffers, n, cache):
        BatchNorm.commit(self, buffers, n, cache[0])


_NO_MASKS = np.empty((0, 1, 1), np.uint8)  # the composed kernels' masks without dropout


def _has_bn_kernels(bk):
    from ..backend import BN_KERNELS
    return all(callable(getattr(bk, k, None)) for k in BN_KERNELS)


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


class Activation:
    """Elementwise ``sigma`` ('tanh', 'relu', 'identity'); the cache is sigma'."""

    params = ()

    def __init__(self, name):
        activation_code(name)  # validates
        self.name = name

    def forward(self, theta, x, n, ctx, bk):
        xp = _xp(x)
        if self.name == "tanh":
            y = xp.tanh(x)
            return y, 1 - y * y
        if self.name == "relu":
            pos = x > 0
            return x * pos, pos.astype(x.dtype)
        return x, None

    def vjp(self, theta, cache, gy, n, ctx, bk, grads=None, scale=1.0):
        return gy if cache is None else gy * cache


class Dropout:
    """Inverted dropout with counter-based masks: in train mode ``y = x m / (1 - p)``, m the keep
    mask of (seed, step, layer, global sample, element) (:meth:`StepContext.mask`); identity
    in eval mode."""

    params = ()

    def __init__(self, p):
        self.threshold = dropout_threshold(p)
        self.p = float(p)

    def forward(self, theta, x, n, ctx, bk):
        if not ctx.training or self.threshold == 0:
            return x, None
        m = ctx.mask(bk, n, x.shape, x.dtype, self.threshold)
        m *= x.dtype.type(1.0 / (1.0 - self.p))
        return x * m, m

    def vjp(self, theta, cache, gy, n, ctx, bk, grads=None, scale=1.0):
        return gy if cache is None else gy * cache


class ComposedStep:
    """Step kind ``u_next = u + h F(u)``, ``F`` = ``blocks`` applied in order.

    Parameters
    ----------
    blocks : list of blocks (:class:`Affine`, :class:`BatchNorm`, :class:`Activation`,
        :class:`Dropout`, or any object with the same methods)
    state_shape : tuple
        Shape of one sample's state, e.g. (w,) or (C, H, W); F keeps it.
    param_shapes : dict
        name -> shape of one layer's parameters (every block's ``params``).
    """

    fused = False  # no stacked / batched kernels: the propagators use the layer-indexed protocol
    shared = False  # per-layer parameters (leading axis N)

    def __init__(self, blocks, state_shape, param_shapes, buffer_shapes=None):
        self.blocks = list(blocks)
        self.sample_shape = tuple(state_shape)
        self._param_shapes = dict(param_shapes)
        self._buffer_shapes = dict(buffer_shapes or {})
        names = [p for blk in self.blocks for p in blk.params]
        if sorted(names) != sorted(self._param_shapes):
            raise ValueError(f"blocks use parameters {names}, shapes given for "
                             f"{sorted(self._param_shapes)}")

    def param_shapes(self):
        """One layer's parameter shapes: {'weight': ..., 'bias': ..., 'bn_weight': (C,), ...}."""
        return dict(self._param_shapes)

    def buffer_shapes(self):
        """One layer's buffer shapes ({'running_mean': (C,), 'running_var': (C,)} with BN)."""
        return dict(self._buffer_shapes)

    def state_shape(self, batch):
        """(B,) + the sample shape."""
        return (batch,) + self.sample_shape

    def check_batch(self, batch, layer=0):
        """ValueError if a train-mode batch of ``batch`` samples (the statistics' batch: the
        global one with synchronised BN) cannot be normalised."""
        per_sample = int(np.prod(self.sample_shape[1:]))
        for blk in self.blocks:
            if callable(getattr(blk, "check_count", None)):
                blk.check_count(batch * per_sample, layer)

    @staticmethod
    def _theta(P, n):
        return {k: v[n] for k, v in P.items()}

    def evaluate(self, P, n, u, bk, ctx):
        """(F(u) of layer n, per-block caches)."""
        theta = self._theta(P, n)
        x, caches = u, []
        for blk in self.blocks:
            x, c = blk.forward(theta, x, n, ctx, bk)
            caches.append(c)
        return x, caches

    def forward_layer(self, P, n, u, h, bk, ctx):
        """u + h F(u; layer n)."""
        return u + h * self.evaluate(P, n, u, bk, ctx)[0]

    def forward_linearize(self, P, n, u, h, bk, ctx):
        """(u + h F(u; layer n), the linearisation cache for the vjps at u)."""
        f, caches = self.evaluate(P, n, u, bk, ctx)
        return u + h * f, caches

    def linearize(self, P, n, u, bk, ctx):
        """The linearisation cache of layer n at u (what the vjps need; independent of h)."""
        return self.evaluate(P, n, u, bk, ctx)[1]

    def _back(self, P, n, caches, g, bk, ctx, grads=None, scale=1.0):
        theta = self._theta(P, n)
        rows = None if grads is None else {k: v[n] for k, v in grads.items()}
        for blk, c in zip(reversed(self.blocks), reversed(caches)):
            g = blk.vjp(theta, c, g, n, ctx, bk, rows, scale)
        return g

    def vjp_state_layer(self, P, n, cache, lam, h, bk, ctx):
        """lam + h J_n(u)^T lam from the cache of :meth:`linearize` at u."""
        return lam + h * self._back(P, n, cache, lam, bk, ctx)

    def vjp_layer(self, P, n, u, cache, lam, h, bk, ctx, G):
        """The state vjp lam + h J_n^T lam (returned) and, in place, G[name][n] =
        h (dF_n/dtheta)^T lam for every parameter name (one pass through the blocks)."""
        return lam + h * self._back(P, n, cache, lam, bk, ctx, G, h)

    def vjp_params_layer(self, P, n, u, cache, lam, h, bk, ctx, G):
        """In place: G[name][n] = h (dF_n/dtheta)^T lam for every parameter name."""
        self._back(P, n, cache, lam, bk, ctx, G, h)

    def vjp_params_steps(self, P, steps, U, caches, lams, h, bk, ctx, G):
        """:meth:`vjp_params_layer` of every layer n in ``steps`` with state U[n], cache
        caches[n] and cotangent lams[n + 1]."""
        for n in steps:
            self.vjp_params_layer(P, n, U[n], caches[n], lams[n + 1], h, bk, ctx, G)

    def commit_buffers(self, buffers, n, cache):
        """Update layer n's buffers (running statistics) from a train-mode cache."""
        for blk, c in zip(self.blocks, cache):
            if callable(getattr(blk, "commit", None)) and c is not None:
                blk.commit(buffers, n, c)

    # ------------------------------------------ stacked kernels (dense composed steps, host)
    # The layer-indexed stacked protocol of the recurrent kinds (mgnn.blocks.recurrent), on the
    # backend's composed kernels (mgnn.backend.numba_cpu.composed): F = dropout(sigma(BN(u W^T +
    # b))) with batch norm and dropout optional, in train mode (batch statistics) or eval mode
    # (running statistics), without data-parallel statistics. Other compositions, conv affines
    # and synchronised batch norm step one state per call (the propagators' stepped protocol).
    def _pattern(self):
        """(batch-norm block or None, activation code, dropout block or None) when the blocks
        are a dense :class:`Affine`, :class:`BatchNormAct` or :class:`Activation`, then an
        optional :class:`Dropout`; None for any other composition."""
        blocks = self.blocks
        if not (2 <= len(blocks) <= 3 and type(blocks[0]) is Affine and blocks[0]._k == "dense"):
            return None
        mid, drop = blocks[1], blocks[2] if len(blocks) == 3 else None
        if drop is not None and type(drop) is not Dropout:
            return None
        if type(mid) is BatchNormAct:
            return mid, mid.act, drop
        if type(mid) is Activation:
            return None, activation_code(mid.name), drop
        return None

    def can_stack(self, bk, ctx=None):
        """Whether the stacked kernels run this composition on ``bk`` (host arrays; with batch
        norm, not with data-parallel batch statistics in ``ctx``: those step one state per
        call, with an allgather in each)."""
        pattern = self._pattern()
        return (pattern is not None and bool(getattr(bk, "composed_stacked", False))
                and (pattern[0] is None or getattr(ctx, "replicas", None) is None))

    def can_stack_adjoint(self, bk, ctx=None):
        """The adjoint's stacked kernels: as :meth:`can_stack`."""
        return self.can_stack(bk, ctx)

    def can_keep_derivs(self, bk):
        """A final sweep keeps its linearisation (:meth:`chains_forward_layers_keep`)."""
        return bool(getattr(bk, "composed_stacked", False))

    def can_replay(self, bk):
        """Whether ``bk`` replays captured cycles of composed steps (``composed_run_tape``)."""
        return callable(getattr(bk, "composed_run_tape", None))

    def run_tape_layers(self, P, stores, rows, hs, norms, bk, ctx):
        """Replay a captured forward cycle (:mod:`mgnn.backend.tape`) with the parameters
        ``P`` under ``ctx`` (this batch's dropout masks, batch norm's mode)."""
        bk.composed_run_tape(stores, rows, hs, self.kernel_args(P, ctx, stores[0], bk), norms)

    def run_tape_adjoint_layers(self, P, stores, rows, hs, norms, lin, bk, ctx=None):
        """Replay a captured adjoint cycle at the linearisation ``lin``
        (:class:`ComposedLinearization`)."""
        bk.composed_run_tape_adjoint(stores, rows, hs, P["weight"], lin.gamma(P), lin.bn,
                                     lin.arrays[:4], lin.d0, norms)

    def kernel_args(self, P, ctx, state, bk):
        """The layer tuple of the composed kernels (module docstring of
        :mod:`mgnn.backend.numba_cpu.composed`) for parameters ``P`` under ``ctx``, for the
        states of the store ``state`` (m, B, w)."""
        bn_blk, act, drop = self._pattern()
        W, b = P["weight"], P["bias"]
        dt = state.dtype
        empty = np.empty((0, W.shape[1]), dt)
        gam = bet = rmu = rvar = empty
        bn, eps = 0, dt.type(1)
        if bn_blk is not None:
            gam, bet, eps = P["bn_weight"], P["bn_bias"], dt.type(bn_blk.eps)
            bn = 1 if ctx.training else 2
            if not ctx.training:
                rmu, rvar = ctx.buffers["running_mean"], ctx.buffers["running_var"]
        thr, dscale = 0, dt.type(1)
        if drop is not None and ctx.training and drop.threshold:
            thr, dscale = drop.threshold, dt.type(1.0 / (1.0 - drop.p))
        k0, k1, _, tstep, s0 = _counter_rng_check(ctx.seed, ctx.step, 0, ctx.sample0, 0, 0,
                                                  thr)[:5]
        masks, m_lo = self._batch_masks(W.shape[0], ctx, thr, (k0, k1, tstep, s0),
                                        state.shape[1:], bk)
        return (W, b, gam, bet, rmu, rvar, eps, act, bn, np.uint64(thr), dscale,
                *(np.uint64(v) for v in (k0, k1, tstep, s0)), masks, m_lo)

    @staticmethod
    def _batch_masks(n_layers, ctx, thr, key, state_shape, bk):
        """(uint8 keep masks (S, B, w) of the layers this rank steps (``ctx.steps``, else
        all), their first layer): made once per batch and kept in ``ctx.memo`` until the next
        ``ctx.begin``; an empty array without dropout."""
        if not thr:
            return _NO_MASKS, 0
        lo, hi = ctx.steps if ctx.steps is not None else (0, n_layers)
        tag = (thr, key, lo, hi, tuple(state_shape))
        got = ctx.memo.get("composed masks")
        if got is None or got[0] != tag:
            masks = np.empty((hi - lo,) + tuple(state_shape), np.uint8)
            bk.composed_masks(masks, lo, *key, thr)
            got = ctx.memo["composed masks"] = (tag, masks)
        return got[1], lo

    def chains_forward_layers(self, P, U, G, chains, layer0, layer_step, h, bk, ctx):
        """Stacked relaxation: along each chain U[i] = U[i - 1] + h F_t(U[i - 1]) (+ G[i]),
        t = layer0 + i layer_step."""
        bk.composed_chains_forward(U, G, chains, layer0, layer_step, h,
                                   self.kernel_args(P, ctx, U, bk))

    def kept_arrays(self, state_shape, count, dtype, scratch):
        """(XH, DA, MK, IS, MU, VR) of :meth:`linearize_stacked` for ``count`` layers of states
        ``state_shape`` (B, w), from ``scratch(name, shape, dtype)``: the same arrays it fills
        (x-hat, sigma', the dropout mask times 1 / (1 - p), 1 / std, mean, variance; the batch
        norm rows empty without batch norm, the mask's without dropout)."""
        bn_blk, _, drop = self._pattern()
        B, w = state_shape
        nb, nd = (count if bn_blk is not None else 0), (count if drop is not None else 0)
        return (scratch("composed xhat", (nb, B, w), dtype),
                scratch("composed sigma'", (count, B, w), dtype),
                scratch("composed mask", (nd, B, w), dtype),
                scratch("composed invstd", (nb, w), dtype),
                scratch("composed mean", (nb, w), dtype),
                scratch("composed var", (nb, w), dtype))

    def chains_forward_layers_keep(self, P, U, chains, layer0, layer_step, h, kept, lo, done,
                                   bk, ctx):
        """:meth:`chains_forward_layers` without right-hand sides, each step t also writing its
        linearisation into row t - lo of ``kept`` (:meth:`kept_arrays`) and flagging
        done[t - lo]."""
        bk.composed_chains_forward(U, None, chains, layer0, layer_step, h,
                                   self.kernel_args(P, ctx, U, bk), kept, lo, done)

    def points_forward_layers(self, P, U, G, R, slots, out_slots, layer0, layer_step, h,
                              point_mode, bk, ctx):
        """The step into each of U's ``slots`` combined into R by ``point_mode`` (0 residual,
        returns the squared norm; 1 FAS; 2 plain)."""
        return bk.composed_points_forward(U, G, R, slots, out_slots, layer0, layer_step, h,
                                          self.kernel_args(P, ctx, U, bk), point_mode)

    def linearize_stacked(self, P, U, first, count, t0, bk, ctx, scratch, done=None):
        """The linearisation of layers t0 .. t0 + count - 1 at the states U[first ..] (a
        solver's store (m, B, w)) in one backend call: a :class:`ComposedLinearization`.
        ``done``: int8 flags of the rows a final sweep already wrote; only the others are
        computed."""
        kept = self.kept_arrays(U.shape[1:], count, U.dtype, scratch)
        if done is None:
            done = np.zeros(count, np.int8)
        args = self.kernel_args(P, ctx, U, bk)
        bk.composed_caches(U, first, count, t0, args, kept, done)
        return ComposedLinearization(self, U, first - t0, kept, t0, args[8])

    def chains_adjoint_layers(self, P, L, G, chains, layer0, layer_step, h, lin, bk, ctx):
        """Stacked adjoint relaxation: along each chain L[i] = L[i - 1] + h J_t^T L[i - 1]
        (+ G[i]), t = layer0 + i layer_step, J_t at the linearisation ``lin``."""
        bk.composed_chains_adjoint(L, G, chains, layer0, layer_step, h, P["weight"],
                                   lin.gamma(P), lin.bn, lin.arrays[:4], lin.d0)

    def points_adjoint_layers(self, P, L, G, R, slots, out_slots, layer0, layer_step, h,
                              point_mode, lin, bk, ctx):
        """Stacked adjoint residual / FAS / plain points (see :meth:`chains_adjoint_layers`)."""
        return bk.composed_points_adjoint(L, G, R, slots, out_slots, layer0, layer_step, h,
                                          P["weight"], lin.gamma(P), lin.bn, lin.arrays[:4],
                                          lin.d0, point_mode)

    def sweep_forward_layers(self, P, U, h, store, bk, ctx, scratch=None):
        """Serial propagation over every layer in one backend call: fills U[1:] (U (N + 1, B,
        w), U[0] given) and returns the :class:`ComposedLinearization` of every layer (of none
        unless ``store``; its arrays from ``scratch(name, shape, dtype)``, default fresh ones),
        or None where the stacked kernels do not run this composition (the caller then steps
        layer after layer)."""
        if not self.can_stack(bk, ctx) or not isinstance(U, np.ndarray):
            return None
        scratch = serial_scratch(scratch)
        N = U.shape[0] - 1
        rows = N if store else 0  # without store: an empty linearisation, the states only
        kept = self.kept_arrays(U.shape[1:], rows, U.dtype, scratch)
        done = scratch("composed done", (rows,), np.int8)
        done[...] = 0
        args = self.kernel_args(P, ctx, U, bk)
        bk.composed_chains_forward(U, None, np.array([[1, N]], np.int64), -1, 1, h, args, kept,
                                   0, done)
        return ComposedLinearization(self, U, 0, kept, 0, args[8])

    def sweep_backward_layers(self, P, U, D, lam, h, bk, ctx, G, scratch=None):
        """The adjoint of :meth:`sweep_forward_layers` (``D`` from it) in one backend call for
        the cotangents and one for G[name] = every parameter gradient; returns the cotangent of
        U[0], or None where ``D`` is not a :class:`ComposedLinearization` (the caller then runs
        the layer-by-layer vjps). ``scratch`` as :meth:`sweep_forward_layers`."""
        if not isinstance(D, ComposedLinearization):
            return None
        N = D.arrays[1].shape[0]
        L = serial_scratch(scratch)("composed lam", (N + 1,) + lam.shape, lam.dtype)
        L[0] = lam
        h = lam.dtype.type(h)
        self.chains_adjoint_layers(P, L, None, np.array([[1, N]], np.int64), N, -1, h, D, bk,
                                   ctx)
        self.vjp_params_stacked_layers(P, [(L, N - 1, -1, N)], D, bk, ctx, G, None, h=h)
        return L[N].copy()

    def vjp_params_stacked_layers(self, P, parts, lin, bk, ctx, G, scratch, h=None):
        """G[name][t] = h (dF_t/dtheta)^T lam_{t+1} for every layer t of ``lin`` (written):
        ``parts`` lists (L, l0, l_step, count) runs, in layer order, that hold lam_{t+1} of the
        layers in turn (L[l0 + p l_step] for the p-th layer of the run), or callables returning
        one, called when reached (a run that waits for a message); one backend call per run."""
        if h is None:
            raise TypeError("vjp_params_stacked_layers of a composed step needs the step size h")
        S = lin.arrays[1].shape[0]
        e2 = np.empty((0, P["weight"].shape[1]), lin.arrays[1].dtype)
        Gg, Gbe = (G["bn_weight"], G["bn_bias"]) if lin.bn else (e2, e2)
        row = 0
        for part in parts:
            L, l0, l_step, count = part() if callable(part) else part
            bk.composed_params(L, l0, l_step, count, lin.U, lin.d0 + lin.u_off + row, row,
                               lin.d0, h, lin.gamma(P), lin.bn, lin.arrays[:4], G["weight"],
                               G["bias"], Gg, Gbe)
            row += count
        if row != S:
            raise ValueError(f"the runs cover {row} layers, the linearisation {S}")


class ComposedLinearization:
    """The linearisation of layers d0 .. d0 + S - 1 of a composed dense step at given states,
    in arrays (:meth:`ComposedStep.kept_arrays`): the state of layer t is U[t + u_off] (a
    solver's store). ``lin[t]`` is layer t's cache in the block-by-block protocol (None outside
    d0 .. d0 + S - 1), for the list engine's steps and the running statistics' commit."""

    __slots__ = ("kind", "U", "u_off", "arrays", "d0", "bn")

    def __init__(self, kind, U, u_off, arrays, d0, bn):
        self.kind, self.U, self.u_off, self.arrays, self.d0 = kind, U, u_off, arrays, d0
        self.bn = int(bn)  #: 0 no batch norm, 1 batch statistics, 2 running statistics

    def gamma(self, P):
        """Batch norm's gamma (N, w), or an empty (0, w) array without batch norm."""
        return P["bn_weight"] if self.bn else self.arrays[3]

    def __getitem__(self, t):
        k = t - self.d0
        XH, DA, MK, IS, MU, VR = self.arrays
        if not 0 <= k < DA.shape[0]:
            return None
        x = self.U[t + self.u_off]
        bn_blk, act, drop = self.kind._pattern()
        if bn_blk is not None:
            count = x.shape[0] if self.bn == 1 else 0
            mid = ((XH[k], IS[k], count, MU[k], VR[k]), DA[k])
        else:
            mid = None if act == activation_code("identity") else DA[k]
        caches = [x, mid]
        if drop is not None:
            caches.append(MK[k] if MK.shape[0] else None)
        return caches
