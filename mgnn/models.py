"""Models: an opening layer, N residual steps and a closing layer with the loss.

A model owns its parameters as a :class:`mgnn.params.ParamDict` with the names of docs/design.md,
"Public API": ``opening.weight``, ``opening.bias``, ``steps.weight`` (N, ...), ``steps.bias`` (N, ...),
``closing.weight``, ``closing.bias``. The builders (:func:`dense_resnet`, :func:`conv_resnet`,
:func:`gru_classifier`, :func:`rnn_classifier`) choose the layer kinds of :mod:`mgnn.blocks`.
"""
import numbers

import numpy as np

from .backend import check_dtype
from .blocks import (Conv3dOpening, ConvOpening, ConvStep, DenseClosing, DenseOpening, DenseStep,
                     PoolClosing, SoftmaxCrossEntropy)
from .blocks.recurrent import LastHiddenClosing, RecurrentStep, ZeroOpening
from .blocks.composed import Activation, Affine, BatchNormAct, ComposedStep, Dropout
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

    def __init__(self, opening, step, closing, n_layers, t_final, dtype, seed, config,
                 dropout_seed=None):
        self.opening, self.step, self.closing = opening, step, closing
        self.loss = SoftmaxCrossEntropy()
        self.n_layers = n_layers
        self.t_final = float(t_final)
        self.dtype = dtype
        self.config = dict(config)
        shapes = {}
        #: name prefix of the step parameters: 'steps' (one row per layer, leading axis N), or
        #: the kind's own (e.g. 'gru') for weights shared by every step (no leading axis)
        self.step_prefix = step.prefix if step.shared else "steps"
        lead = () if step.shared else (n_layers,)
        for prefix, kind, lead in (("opening", opening, ()), (self.step_prefix, step, lead),
                                   ("closing", closing, ())):
            for pname, shape in kind.param_shapes().items():
                shapes[f"{prefix}.{pname}"] = lead + tuple(shape)
        self.params = ParamDict.allocate(shapes, dtype)
        self.buffers = ParamDict.allocate(
            {f"steps.{k}": (n_layers,) + tuple(s) for k, s in step.buffer_shapes().items()},
            dtype)
        if "steps.running_var" in self.buffers:
            self.buffers["steps.running_var"][...] = 1  # PyTorch's initial running statistics
        self.training = True
        #: training steps taken (LayerParallel.loss_and_grad in train mode): the step counter t
        #: of the dropout masks; saved in checkpoints
        self.train_steps = 0
        self.dropout_seed = int(seed if dropout_seed is None else dropout_seed) % 2 ** 64
        self._initialise(seed)

    def train(self, mode=True):
        """Train mode (batch statistics, dropout) or, with ``mode=False``, eval mode; returns
        the model (PyTorch's convention)."""
        if not isinstance(mode, bool):
            raise TypeError(f"mode must be a bool, got {mode!r}")
        self.training = mode
        return self

    def eval(self):
        """Eval mode: running statistics, no dropout (:meth:`train` with False)."""
        return self.train(False)

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
        return self.params.group(prefix)

    def step_params(self):
        """The step kind's parameters by name (views; 'steps.*' or the shared prefix)."""
        return self.group(self.step_prefix)

    def group_buffers(self):
        """{'running_mean': ..., 'running_var': ...} views of the steps' buffers (empty
        without batch norm)."""
        return self.buffers.group()

    def _initialise(self, seed):
        """Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) for every weight and bias (PyTorch's default
        for Linear/Conv2d), drawn in float64 from ``seed`` alone in name order, then rounded."""
        rng = np.random.default_rng(seed)
        for name, arr in self.params.items():
            if name.split(".")[1] in ("bn_weight", "bn_bias"):  # PyTorch: gamma 1, beta 0; no
                arr[...] = 1.0 if name.endswith("weight") else 0.0  # draw (other seeds kept)
                continue
            prefix = name.split(".")[0]
            if prefix == self.step_prefix and callable(getattr(self.step, "init_bound", None)):
                b = self.step.init_bound(name.split(".", 1)[1])
                arr[...] = rng.uniform(-b, b, size=arr.shape)
                continue
            wshape = self.params[prefix + ".weight"].shape
            fan_in = int(np.prod(wshape[2:] if prefix == "steps" else wshape[1:]))
            bound = 1.0 / np.sqrt(fan_in)
            arr[...] = rng.uniform(-bound, bound, size=arr.shape)


def _common(n_classes, n_layers, t_final, activation, dtype):
    n_classes = _positive_int("n_classes", n_classes)
    if n_classes < 2:
        raise ValueError(f"n_classes must be >= 2 (a classifier), got {n_classes}")
    n_layers = _positive_int("n_layers", n_layers)
    if not isinstance(t_final, numbers.Real) or not np.isfinite(t_final) or t_final <= 0:
        raise ValueError(f"t_final must be a positive finite number, got {t_final!r}")
    if activation not in ("tanh", "relu"):
        raise ValueError(f"activation must be 'tanh' or 'relu', got {activation!r}")
    return n_classes, n_layers, float(t_final), check_dtype(dtype)


def _residual_kind(fused, conv, channels, sample_shape, activation, batch_norm, dropout,
                   bn_eps, bn_momentum, config):
    """The step kind: the fused one, or F = dropout(sigma(BN(affine(u)))) composed of blocks
    when batch norm or dropout is asked for (recorded in ``config``)."""
    if not isinstance(batch_norm, bool):
        raise TypeError(f"batch_norm must be a bool, got {batch_norm!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"dropout must be a number in [0, 1), got {dropout!r}")
    dropout = float(dropout)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if not batch_norm and dropout == 0.0:
        return fused
    blocks, shapes, buffers = [Affine(conv)], dict(fused.param_shapes()), {}
    if batch_norm:  # BN + activation in the fused kernels (the composed pair is the reference)
        blocks.append(BatchNormAct(channels, activation, bn_eps, bn_momentum))
        shapes.update(bn_weight=(channels,), bn_bias=(channels,))
        buffers.update(running_mean=(channels,), running_var=(channels,))
        config.update(batch_norm=True, bn_eps=float(bn_eps), bn_momentum=float(bn_momentum))
    else:
        blocks.append(Activation(activation))
    if dropout:
        blocks.append(Dropout(dropout))
        config.update(dropout=dropout)
    return ComposedStep(blocks, sample_shape, shapes, buffers)


def dense_resnet(in_features, width, n_classes, n_layers, t_final=1.0, activation="tanh",
                 dtype="float64", seed=0, batch_norm=False, dropout=0.0, bn_eps=1e-5,
                 bn_momentum=0.1):
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
        The initial parameters depend on this seed only; it also seeds the dropout masks.
    batch_norm : bool
        F(u) = sigma(BN(u W^T + b)) with PyTorch's BatchNorm1d per layer (parameters
        ``steps.bn_weight``, ``steps.bn_bias`` (N, w); running statistics in
        ``model.buffers``: ``steps.running_mean``, ``steps.running_var`` (N, w)).
    dropout : float
        p in [0, 1): F(u) = dropout(sigma(...)), inverted dropout with counter-based masks (a
        function of seed, training step, layer, global sample and element).
    bn_eps, bn_momentum : float
        Batch-norm epsilon and running-statistics momentum (PyTorch's defaults).

    Returns
    -------
    Model
    """
    n_classes, n_layers, t_final, dt = _common(n_classes, n_layers, t_final, activation, dtype)
    in_features = _positive_int("in_features", in_features)
    width = _positive_int("width", width)
    config = dict(model="dense", in_features=in_features, width=width, n_classes=n_classes,
                  n_layers=n_layers, t_final=t_final, activation=activation, dtype=dt.name)
    step = _residual_kind(DenseStep(width, activation), False, width, (width,), activation,
                          batch_norm, dropout, bn_eps, bn_momentum, config)
    return Model(DenseOpening(in_features, width, activation), step,
                 DenseClosing(width, n_classes), n_layers, t_final, dt, seed, config)


def conv_resnet(in_channels, channels, image_size, n_classes, n_layers, t_final=1.0,
                activation="tanh", dtype="float64", seed=0, pool=1, batch_norm=False,
                dropout=0.0, bn_eps=1e-5, bn_momentum=0.1):
    """Conv ResNet: sigma(conv3x3(x) + a) to ``channels``, N conv steps, avgpool + affine closing;
    3x3x3 convolutions (NCDHW, PyTorch's Conv3d layout) when ``image_size`` has three entries.

    Parameters
    ----------
    in_channels, channels : int
        Input channels ci and state channels C.
    image_size : (int, int) or (int, int, int)
        (H, W) of the input images, or (D, H, W) of input volumes (kept by every layer:
        padding 1, stride 1). 3D: ``steps.weight`` is (N, C, C, 3, 3, 3), the steps are
        composed of the conv3d and activation blocks (the single-state protocol).
    pool : int
        The closing averages u_N over a pool^d grid (1 = global average pooling) before the
        affine map; every image axis must be divisible by ``pool``.
    n_classes, n_layers, t_final, activation, dtype, seed
        As in :func:`dense_resnet`.
    batch_norm, dropout, bn_eps, bn_momentum
        As in :func:`dense_resnet`: F(u) = dropout(sigma(BN(conv3x3(u, K) + b))) with
        BatchNorm2d per layer (``steps.bn_weight``, ``steps.bn_bias`` (N, C)).
    """
    n_classes, n_layers, t_final, dt = _common(n_classes, n_layers, t_final, activation, dtype)
    in_channels = _positive_int("in_channels", in_channels)
    channels = _positive_int("channels", channels)
    pool = _positive_int("pool", pool)
    if (not isinstance(image_size, (tuple, list)) or len(image_size) not in (2, 3)):
        raise ValueError(f"image_size must be (H, W) or (D, H, W), got {image_size!r}")
    image_size = tuple(_positive_int("image_size", s) for s in image_size)
    if any(s % pool for s in image_size):
        raise ValueError(f"image_size {image_size} is not divisible by pool={pool}")
    config = dict(model="conv", in_channels=in_channels, channels=channels,
                  image_size=list(image_size), n_classes=n_classes, n_layers=n_layers,
                  t_final=t_final, activation=activation, dtype=dt.name, pool=pool)
    state = (channels,) + image_size
    if len(image_size) == 2:
        kind, conv, opening = ConvStep(channels, image_size, activation), True, ConvOpening
    else:  # no stacked 3D kernels: the conv3d block composed with the activation
        kind = ComposedStep([Affine("conv3d"), Activation(activation)], state,
                            {"weight": (channels, channels, 3, 3, 3), "bias": (channels,)})
        conv, opening = "conv3d", Conv3dOpening
    step = _residual_kind(kind, conv, channels, state, activation, batch_norm, dropout, bn_eps,
                          bn_momentum, config)
    return Model(opening(in_channels, channels, image_size, activation), step,
                 PoolClosing(channels, image_size, n_classes, pool), n_layers, t_final, dt, seed,
                 config)


def gru_classifier(in_features, hidden, n_classes, seq_len, n_layers=1, cell="gru",
                   coarse="implicit", dtype="float64", seed=0):
    """A GRU over a sequence (PyTorch's ``torch.nn.GRU``, ``batch_first``, h0 = 0) with an affine
    map of the last layer's last hidden state to the logits; MGRIT runs over sequence time.

    Parameters
    ----------
    in_features, hidden, n_classes : int
        Input features I per step, hidden size H, classes K.
    seq_len : int
        L >= 2, the number of time steps (inputs x are (B, L, I)).
    n_layers : int
        Stacked GRU layers, advanced together in time (the state at time t is every layer's
        hidden state, (B, n_layers, H)).
    cell : {'gru', 'implicit_gru'}
        PyTorch's GRU, or the implicit GRU ``h' = (h + (1 - z) n) / (1 + (1 - z))``.
    coarse : {'implicit', 'rediscretise'}
        Coarse MGRIT propagator (:mod:`mgnn.blocks.recurrent`): 'implicit' (default) reads the
        GRU as an ODE with dt = the level's stride and its linear term implicit; it converges
        3-30x faster per cycle than 'rediscretise' at cf 4 and 8 (docs/recurrent.md).
    dtype, seed
        As in :func:`dense_resnet`; PyTorch's initialisation U(-1/sqrt(H), 1/sqrt(H)).

    Returns
    -------
    Model
        Parameters ``gru.weight_ih_l0``, ``gru.weight_hh_l0``, ``gru.bias_ih_l0``,
        ``gru.bias_hh_l0``, ..._l1, ..., ``closing.weight``, ``closing.bias`` (PyTorch's names
        and layouts, gates (r, z, n) stacked); ``model.n_layers`` is L (the time steps).
    """
    if cell not in ("gru", "implicit_gru"):
        raise ValueError(f"cell must be 'gru' or 'implicit_gru', got {cell!r}")
    return _sequence_model(in_features, hidden, n_classes, seq_len, n_layers, cell, coarse,
                           dtype, seed)


def rnn_classifier(in_features, hidden, n_classes, seq_len, n_layers=1, dtype="float64", seed=0):
    """A tanh RNN (PyTorch's ``torch.nn.RNN``; parameters ``rnn.weight_ih_l0`` ...) with the
    closing of :func:`gru_classifier`; coarse MGRIT levels rediscretise."""
    return _sequence_model(in_features, hidden, n_classes, seq_len, n_layers, "rnn",
                           "rediscretise", dtype, seed)


def _sequence_model(in_features, hidden, n_classes, seq_len, n_layers, cell, coarse, dtype,
                    seed):
    n_classes, n_steps, _, dt = _common(n_classes, seq_len, 1.0, "tanh", dtype)
    if n_steps < 2:
        raise ValueError(f"seq_len must be >= 2 (a sequence), got {seq_len!r}")
    in_features = _positive_int("in_features", in_features)
    hidden = _positive_int("hidden", hidden)
    n_layers = _positive_int("n_layers", n_layers)
    step = RecurrentStep(cell, in_features, hidden, n_layers, coarse)
    config = dict(model=cell, in_features=in_features, hidden=hidden, n_classes=n_classes,
                  seq_len=n_steps, n_layers=n_layers, coarse=coarse, dtype=dt.name)
    # t_final = L: the fine step is 1 (a coarse step's size is its stride)
    return Model(ZeroOpening(n_steps, in_features, hidden, n_layers), step,
                 LastHiddenClosing(hidden, n_classes), n_steps, float(n_steps), dt, seed, config)


