"""Models (opening + residual steps + closing) and :class:`LayerParallel`, their training front.

A model owns its parameters as a :class:`mgnn.params.ParamDict` with the names of DESIGN.md
section 6: ``opening.weight``, ``opening.bias``, ``steps.weight`` (N, ...), ``steps.bias`` (N, ...),
``closing.weight``, ``closing.bias``.
"""
import numbers

import numpy as np

from .backend import check_dtype, get_backend
from .mgrit import MGRITOptions, MGRITSolver
from .blocks import (ConvOpening, ConvStep, DenseClosing, DenseOpening, DenseStep, PoolClosing,
                     SoftmaxCrossEntropy)
from .params import ParamDict


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return int(value)


class Model:
    """A residual network u_0 = opening(x), u_{n+1} = u_n + h F(u_n; theta_n), logits = closing(u_N).

    Build one with :func:`dense_resnet` or :func:`conv_resnet`.

    Attributes
    ----------
    opening, step, closing : layer kinds of :mod:`mgnn.blocks`
    loss : SoftmaxCrossEntropy
    n_layers : int
        N, the number of residual steps.
    t_final : float
        T; the step size is h = T / N.
    dtype : numpy.dtype
        float32 or float64, of every parameter and state.
    params : ParamDict
        The parameters (views into ``params.flat``).
    config : dict
        The constructor arguments (what a checkpoint records to check compatibility).
    """

    def __init__(self, opening, step, closing, n_layers, t_final, dtype, seed, config):
        self.opening, self.step, self.closing = opening, step, closing
        self.loss = SoftmaxCrossEntropy()
        self.n_layers = n_layers
        self.t_final = float(t_final)
        self.dtype = dtype
        self.config = dict(config)
        shapes = {}
        for prefix, kind, lead in (("opening", opening, ()), ("steps", step, (n_layers,)),
                                   ("closing", closing, ())):
            for pname, shape in kind.param_shapes().items():
                shapes[f"{prefix}.{pname}"] = lead + tuple(shape)
        self.params = ParamDict.allocate(shapes, dtype)
        self._initialise(seed)

    @property
    def h(self):
        """Fine step size T / N as a scalar of the model's dtype."""
        return self.dtype.type(self.t_final / self.n_layers)

    @property
    def n_classes(self):
        """Number of classes K of the closing layer."""
        return self.closing.n_classes

    def input_shape(self):
        """Shape of one input sample, e.g. (64,) or (1, 28, 28)."""
        return self.opening.input_shape()

    def group(self, prefix):
        """{'weight': ..., 'bias': ...} views of 'opening', 'steps' or 'closing'."""
        return {k.split(".", 1)[1]: v for k, v in self.params.items() if k.startswith(prefix + ".")}

    def _initialise(self, seed):
        """Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) for every weight and bias (PyTorch's default
        for Linear/Conv2d), drawn in float64 from ``seed`` alone in name order, then rounded."""
        rng = np.random.default_rng(seed)
        for name, arr in self.params.items():
            prefix = name.split(".")[0]
            wshape = self.params[prefix + ".weight"].shape
            fan_in = int(np.prod(wshape[2:] if prefix == "steps" else wshape[1:]))
            bound = 1.0 / np.sqrt(fan_in)
            arr[...] = rng.uniform(-bound, bound, size=arr.shape)


def _common(n_classes, n_layers, t_final, activation, dtype):
    n_classes = _positive_int("n_classes", n_classes)
    n_layers = _positive_int("n_layers", n_layers)
    if not isinstance(t_final, numbers.Real) or not np.isfinite(t_final) or t_final <= 0:
        raise ValueError(f"t_final must be a positive finite number, got {t_final!r}")
    if activation not in ("tanh", "relu"):
        raise ValueError(f"activation must be 'tanh' or 'relu', got {activation!r}")
    return n_classes, n_layers, float(t_final), check_dtype(dtype)


def dense_resnet(in_features, width, n_classes, n_layers, t_final=1.0, activation="tanh",
                 dtype="float64", seed=0):
    """Dense ResNet: sigma(x A^T + a), N steps F(u) = sigma(u W^T + b), affine closing.

    Parameters
    ----------
    in_features, width, n_classes, n_layers : int
        Input size i, state width w, classes K, residual steps N.
    t_final : float
        T (h = T / N).
    activation : {'tanh', 'relu'}
    dtype : {'float32', 'float64'}
    seed : int
        The initial parameters depend on this seed only.

    Returns
    -------
    Model
    """
    n_classes, n_layers, t_final, dt = _common(n_classes, n_layers, t_final, activation, dtype)
    in_features = _positive_int("in_features", in_features)
    width = _positive_int("width", width)
    config = dict(model="dense", in_features=in_features, width=width, n_classes=n_classes,
                  n_layers=n_layers, t_final=t_final, activation=activation, dtype=dt.name)
    return Model(DenseOpening(in_features, width, activation), DenseStep(width, activation),
                 DenseClosing(width, n_classes), n_layers, t_final, dt, seed, config)


def conv_resnet(in_channels, channels, image_size, n_classes, n_layers, t_final=1.0,
                activation="tanh", dtype="float64", seed=0, pool=1):
    """Conv ResNet: sigma(conv3x3(x) + a) to ``channels``, N conv steps, avgpool + affine closing.

    Parameters
    ----------
    in_channels, channels : int
        Input channels ci and state channels C.
    image_size : (int, int)
        (H, W) of the input images (kept by every layer: padding 1, stride 1).
    pool : int
        The closing averages u_N over a (pool, pool) grid (1 = global average pooling) before the
        affine map; H and W must be divisible by ``pool``.
    n_classes, n_layers, t_final, activation, dtype, seed
        As in :func:`dense_resnet`.
    """
    n_classes, n_layers, t_final, dt = _common(n_classes, n_layers, t_final, activation, dtype)
    in_channels = _positive_int("in_channels", in_channels)
    channels = _positive_int("channels", channels)
    pool = _positive_int("pool", pool)
    if (not isinstance(image_size, (tuple, list)) or len(image_size) != 2):
        raise ValueError(f"image_size must be (H, W), got {image_size!r}")
    image_size = tuple(_positive_int("image_size", s) for s in image_size)
    if image_size[0] % pool or image_size[1] % pool:
        raise ValueError(f"image_size {image_size} is not divisible by pool={pool}")
    config = dict(model="conv", in_channels=in_channels, channels=channels,
                  image_size=list(image_size), n_classes=n_classes, n_layers=n_layers,
                  t_final=t_final, activation=activation, dtype=dt.name, pool=pool)
    return Model(ConvOpening(in_channels, channels, image_size, activation),
                 ConvStep(channels, image_size, activation),
                 PoolClosing(channels, image_size, n_classes, pool), n_layers, t_final, dt, seed,
                 config)


def build_model(config, seed=0):
    """A model from its :attr:`Model.config` dict (checkpoints use this)."""
    cfg = dict(config)
    kind = cfg.pop("model", None)
    if kind == "dense":
        return dense_resnet(seed=seed, **cfg)
    if kind == "conv":
        return conv_resnet(seed=seed, **cfg)
    raise ValueError(f"unknown model kind {kind!r}; expected 'dense' or 'conv'")


class ForwardPropagator:
    """The forward residual steps of a model as an MGRIT propagator.

    ``step(u, start, stop, level)`` applies layer ``start`` (injection of the parameters of the
    layer at the coarse point) with step size ``(stop - start) h``.
    """

    def __init__(self, model, bk):
        self.kind, self.bk = model.step, bk
        steps = model.group("steps")
        self.W, self.b = steps["weight"], steps["bias"]
        self.h, self.dtype = model.t_final / model.n_layers, model.dtype

    def step(self, u, start, stop, level):
        """State at fine index ``stop`` from ``u`` at ``start``: u + (stop-start) h F(u; theta_start)."""
        h = self.dtype.type((stop - start) * self.h)
        return self.kind.forward(self.W[start], self.b[start], u, h, self.bk)


class AdjointPropagator:
    """The adjoint recursion lam_n = lam_{n+1} + h J_n^T lam_{n+1} as a forward-in-index propagator.

    Reversed index m stands for forward index N - m. ``step(lam, start, stop, level)`` is the state
    vjp of the (coarse) forward step out of n = N - stop with step size (stop - start) h, at the
    stored forward state u_n, with sigma'(z_n) ``derivs[n]`` (the same on every level: z_n does not
    depend on the step size).
    """

    def __init__(self, model, states, derivs, bk):
        self.kind, self.bk = model.step, bk
        steps = model.group("steps")
        self.W, self.b = steps["weight"], steps["bias"]
        self.N, self.h, self.dtype = model.n_layers, model.t_final / model.n_layers, model.dtype
        self.U, self.D = states, derivs

    def step(self, lam, start, stop, level):
        """Adjoint at reversed index ``stop`` from ``lam`` at reversed index ``start``."""
        n = self.N - stop
        h = self.dtype.type((stop - start) * self.h)
        return self.kind.vjp_state(self.W[n], self.b[n], self.U[n], h, lam, self.bk,
                                   deriv=self.D[n])


class LayerParallel:
    """Forward and adjoint propagation of a model, with the loss and its gradient.

    Parameters
    ----------
    model : Model
    fwd, bwd : MGRITOptions or None
        MGRIT options of the forward and the adjoint solve; ``None`` propagates layer after layer
        (exact). Training usually uses a fixed small cycle count (e.g. ``max_iter`` 2 and 1), so
        gradients are inexact: :attr:`stats` reports both residual histories of every call.
    comm : None
        Communicator; ``None`` (serial) is what this version supports.
    backend : {'numba', 'numpy'}
    warm_start : bool
        Start the forward solve from the previous call's states (same batch size), as TorchBraid
        and DLMG do.

    Attributes
    ----------
    stats : dict
        ``{'forward': {'residuals': [...], 'iterations': k}, 'adjoint': {...}}`` of the last call.
    """

    def __init__(self, model, fwd=None, bwd=None, comm=None, backend="numba", warm_start=False):
        if not isinstance(model, Model):
            raise TypeError(f"model must be an mgnn Model, got {type(model).__name__}")
        for name, opt in (("fwd", fwd), ("bwd", bwd)):
            if opt is not None and not isinstance(opt, MGRITOptions):
                raise TypeError(f"{name} must be MGRITOptions or None, got {type(opt).__name__}")
            if opt is not None:  # validates the hierarchy against N before any kernel runs
                MGRITSolver(ForwardPropagator(model, None), model.n_layers, opt)
        if comm is not None and getattr(comm, "Get_size", lambda: 1)() != 1:
            raise ValueError(f"comm of size {comm.Get_size()} is not supported yet; pass None")
        if not isinstance(warm_start, bool):
            raise TypeError(f"warm_start must be a bool, got {warm_start!r}")
        self.model = model
        self.fwd, self.bwd, self.warm_start = fwd, bwd, warm_start
        self.backend = backend
        self.bk = get_backend(backend)
        self.stats = {}
        self._previous_states = None

    # ------------------------------------------------------------------------------ validation
    def _check_x(self, x):
        m = self.model
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x must be a numpy array, got {type(x).__name__}")
        if x.dtype != m.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the model is {m.dtype}; "
                            "convert explicitly (mgnn never casts silently)")
        want = m.input_shape()
        if x.ndim != len(want) + 1 or x.shape[1:] != want or x.shape[0] < 1:
            raise ValueError(f"x has shape {x.shape}, expected (B,) + {want} with B >= 1")
        if not np.isfinite(x).all():
            raise ValueError(f"x contains {np.count_nonzero(~np.isfinite(x))} non-finite values")
        return np.ascontiguousarray(x)

    def _check_y(self, y, batch):
        if not isinstance(y, np.ndarray) or not np.issubdtype(y.dtype, np.integer):
            raise TypeError(f"y must be an integer numpy array, got "
                            f"{getattr(y, 'dtype', type(y).__name__)}")
        if y.shape != (batch,):
            raise ValueError(f"y has shape {y.shape}, expected ({batch},) to match x")
        k = self.model.n_classes
        bad = (y < 0) | (y >= k)
        if bad.any():
            raise ValueError(f"labels out of range [0, {k}): {np.unique(y[bad])[:10].tolist()}")
        return np.ascontiguousarray(y, dtype=np.int64)

    # ------------------------------------------------------------------------------ computation
    def _serial_states(self, u0, store):
        """Layer after layer: U (N+1, B, ...) and, if ``store``, D = sigma'(z_n) (N, B, ...)."""
        m = self.model
        steps = m.group("steps")
        U = np.empty((m.n_layers + 1,) + u0.shape, dtype=m.dtype)
        U[0] = u0
        D = np.empty((m.n_layers if store else 0,) + u0.shape, dtype=m.dtype)
        m.step.sweep_forward(steps["weight"], steps["bias"], U, m.h, D, self.bk)
        return U, D

    def _forward(self, x, store):
        m, bk = self.model, self.bk
        u0, d_open = m.opening.forward(m.group("opening"), x, bk)
        U, D = self._serial_states(u0, store)
        logits, c_close = m.closing.forward(m.group("closing"), U[-1], bk)
        return logits, (d_open, U, D, c_close)

    def _serial_loss_and_grad(self, x, y):
        m, bk = self.model, self.bk
        logits, (d_open, U, D, c_close) = self._forward(x, store=True)
        loss, g = m.loss.forward_grad(logits, y, bk)
        grads = m.params.zeros_like()
        lam, gc = m.closing.vjp(m.group("closing"), U[-1], c_close, g, bk)
        steps = m.group("steps")
        lam = m.step.sweep_backward(steps["weight"], steps["bias"], U, D, m.h, lam,
                                    grads["steps.weight"], grads["steps.bias"], bk)
        _, go = m.opening.vjp(m.group("opening"), x, d_open, lam, bk)
        for prefix, gd in (("opening", go), ("closing", gc)):
            for k, v in gd.items():
                grads[f"{prefix}.{k}"][...] = v
        self.stats = {"forward": {"residuals": [], "iterations": 0},
                      "adjoint": {"residuals": [], "iterations": 0}}
        return loss, grads

    def logits(self, x):
        """Logits (B, K) of the model's dtype for inputs x (B, ...), by exact serial forward
        propagation (the network's function, whatever the training solver options)."""
        return self._forward(self._check_x(x), store=False)[0]

    def predict(self, x):
        """Predicted class indices (B,) int64 for inputs x (B, ...)."""
        return np.argmax(self.logits(x), axis=1)

    def loss_and_grad(self, x, y):
        """Mean softmax cross-entropy of the batch and its gradient.

        Parameters
        ----------
        x : ndarray (B, ...) of the model's dtype
        y : ndarray (B,) of integers in [0, K)

        Returns
        -------
        loss : float
        grads : ParamDict
            Same names and shapes as ``model.params`` (a new buffer each call).
        """
        x = self._check_x(x)
        y = self._check_y(y, x.shape[0])
        m, bk = self.model, self.bk
        if self.fwd is None and self.bwd is None:
            return self._serial_loss_and_grad(x, y)
        steps = m.group("steps")
        W, b = steps["weight"], steps["bias"]
        u0, d_open = m.opening.forward(m.group("opening"), x, bk)
        stats = {"forward": {"residuals": [], "iterations": 0},
                 "adjoint": {"residuals": [], "iterations": 0}}
        if self.fwd is None:
            U, D = self._serial_states(u0, store=True)
        else:
            guess = None
            prev = self._previous_states
            if self.warm_start and prev is not None and prev[0].shape == u0.shape:
                guess = prev.__getitem__
            res = MGRITSolver(ForwardPropagator(m, bk), m.n_layers, self.fwd).solve(u0, guess)
            U = res.states
            D = [m.step.deriv(W[n], b[n], U[n], bk) for n in range(m.n_layers)]
            stats["forward"] = {"residuals": list(res.residuals), "iterations": res.iterations}
            if self.warm_start:
                self._previous_states = U
        logits, c_close = m.closing.forward(m.group("closing"), U[-1], bk)
        loss, g = m.loss.forward_grad(logits, y, bk)
        grads = m.params.zeros_like()
        lam_N, gc = m.closing.vjp(m.group("closing"), U[-1], c_close, g, bk)
        N = m.n_layers
        if self.bwd is None:
            lam = [None] * (N + 1)
            lam[N] = lam_N
            for n in range(N - 1, -1, -1):
                lam[n] = m.step.vjp_state(W[n], b[n], U[n], m.h, lam[n + 1], bk, deriv=D[n])
        else:
            res = MGRITSolver(AdjointPropagator(m, U, D, bk), N, self.bwd).solve(lam_N)
            lam = res.states[::-1]
            stats["adjoint"] = {"residuals": list(res.residuals), "iterations": res.iterations}
        gW, gb = grads["steps.weight"], grads["steps.bias"]
        for n in range(N):
            gW[n], gb[n] = m.step.vjp_params(U[n], m.h, lam[n + 1], D[n], bk)
        _, go = m.opening.vjp(m.group("opening"), x, d_open, lam[0], bk)
        for prefix, gd in (("opening", go), ("closing", gc)):
            for k, v in gd.items():
                grads[f"{prefix}.{k}"][...] = v
        self.stats = stats
        return loss, grads
