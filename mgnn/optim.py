"""Optimizers over flat parameter buffers (PyTorch's update rules, so runs are comparable)."""
import copy
import numbers

import numpy as np

from .backend import is_device_array
from .params import ParamDict


def _nonneg(name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not np.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


class Optimizer:
    """Base class: updates ``params`` (1-D float array, in place) from a gradient of equal shape.

    ``params`` may be given as a :class:`ParamDict` (its ``flat`` buffer is updated) and each
    gradient as one (``grads.flat`` is used: same layout as ``model.params.flat``).
    """

    def __init__(self, params, lr):
        if isinstance(params, ParamDict):
            params = params.flat
        if not hasattr(params, "dtype") or getattr(params, "ndim", None) != 1:
            raise TypeError("params must be a 1-D numpy or cupy array (e.g. model.params.flat)")
        #: fused Numba CUDA updates for device parameters (mgnn.backend.numba_cuda), else numpy
        self.device = is_device_array(params)
        self.params = params
        self.lr = _nonneg("lr", lr)
        self.t = 0

    def _check(self, grad):
        """The flat gradient (``grad.flat`` of a ParamDict), checked against the parameters."""
        if isinstance(grad, ParamDict):
            grad = grad.flat
        if type(grad) is not type(self.params):
            raise TypeError(f"gradient must be a {type(self.params).__name__} like the parameters "
                            f"(a ParamDict or its .flat), got {type(grad).__name__}")
        if grad.shape != self.params.shape:
            raise ValueError(f"gradient of shape {grad.shape} does not match the parameters "
                             f"{self.params.shape}")
        if grad.dtype != self.params.dtype:
            raise TypeError(f"gradient dtype {grad.dtype} != parameter dtype {self.params.dtype}")
        return grad

    def state_dict(self):
        """Arrays and scalars that restore the optimizer exactly (for checkpoints)."""
        return {"t": np.int64(self.t), **{k: v.copy() for k, v in self._buffers().items()}}

    def load_state_dict(self, state):
        """Restore from :meth:`state_dict` output."""
        self.t = int(state["t"])
        for k, v in self._buffers().items():
            if k not in state or state[k].shape != v.shape:
                raise ValueError(f"optimizer state {k!r} missing or of the wrong shape")
            v[...] = _device_array(state[k]) if self.device else state[k]

    def _buffers(self):
        return {}

    def warm_up(self):
        """Compile the update now, so that the first :meth:`step` is not a JIT compilation
        (device parameters: a Numba CUDA kernel per dtype); it runs on scratch one-entry copies,
        so the parameters, the state and the step count are unchanged. A no-op on the CPU."""
        if not self.device:
            return
        scratch = copy.copy(self)
        for name, value in vars(self).items():
            if is_device_array(value) and value.shape == self.params.shape:
                setattr(scratch, name, value[:1].copy())
        scratch.step(scratch.params * 0)


class SGD(Optimizer):
    """SGD with momentum and weight decay: g += wd p; buf = mu buf + g; p -= lr buf."""

    def __init__(self, params, lr=0.1, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr)
        self.momentum = _nonneg("momentum", momentum)
        if self.momentum >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.weight_decay = _nonneg("weight_decay", weight_decay)
        self.buf = _zeros_like(self.params)

    def _buffers(self):
        return {"momentum_buffer": self.buf}

    def step(self, grad):
        """One update from ``grad`` (same shape and dtype as the parameters, or a ParamDict of
        the same layout)."""
        grad = self._check(grad)
        if self.device:  # one fused kernel, same arithmetic
            from .backend.numba_cuda import sgd_update
            sgd_update(self.params, grad, self.buf, self.lr, self.momentum, self.weight_decay,
                       self.t == 0)
            self.t += 1
            return
        dt = self.params.dtype.type
        g = grad + dt(self.weight_decay) * self.params if self.weight_decay else grad
        if self.momentum:
            if self.t == 0:
                self.buf[...] = g
            else:
                self.buf *= dt(self.momentum)
                self.buf += g
            g = self.buf
        self.params -= dt(self.lr) * g
        self.t += 1


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction and optional (L2) weight decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr)
        self.b1, self.b2 = (_nonneg("beta", b) for b in betas)
        if not (self.b1 < 1 and self.b2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        self.eps = _nonneg("eps", eps)
        self.weight_decay = _nonneg("weight_decay", weight_decay)
        self.m = _zeros_like(self.params)
        self.v = _zeros_like(self.params)

    def _buffers(self):
        return {"exp_avg": self.m, "exp_avg_sq": self.v}

    def step(self, grad):
        """One update from ``grad`` (same shape and dtype as the parameters, or a ParamDict of
        the same layout)."""
        grad = self._check(grad)
        if self.device:  # one fused kernel, same arithmetic
            from .backend.numba_cuda import adam_update
            self.t += 1
            adam_update(self.params, grad, self.m, self.v, self.lr, self.b1, self.b2, self.eps,
                        self.weight_decay, self.t)
            return
        dt = self.params.dtype.type
        g = grad + dt(self.weight_decay) * self.params if self.weight_decay else grad
        self.t += 1
        self.m *= dt(self.b1)
        self.m += dt(1 - self.b1) * g
        self.v *= dt(self.b2)
        self.v += dt(1 - self.b2) * g * g
        c1 = 1 - self.b1 ** self.t
        c2 = 1 - self.b2 ** self.t
        denom = np.sqrt(self.v) / dt(np.sqrt(c2)) + dt(self.eps)
        self.params -= dt(self.lr / c1) * self.m / denom


def _device_array(a):
    import cupy
    return cupy.asarray(a)


def _zeros_like(a):
    """Zeros of ``a``'s shape, dtype and array module (numpy or cupy)."""
    z = a.copy()
    z.fill(0)
    return z


def make_optimizer(name, params, lr, momentum=0.9, weight_decay=0.0):
    """'sgd' (with ``momentum``) or 'adam' over the flat ``params``."""
    if name == "sgd":
        return SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; expected 'sgd' or 'adam'")


class CosineLR:
    """Cosine learning-rate decay (PyTorch's ``CosineAnnealingLR``, one half period of
    ``epochs``): ``lr(e) = lr_min + (lr - lr_min) (1 + cos(pi min(e / epochs, 1))) / 2`` after
    ``e`` epochs of training (a float: epoch + batch / batches), then ``lr_min``.

    Parameters
    ----------
    lr : float
        The rate at the start (``e = 0``).
    epochs : float
        Length of the decay; > 0.
    lr_min : float
        The rate from ``e = epochs`` on; at most ``lr``.
    """

    def __init__(self, lr, epochs, lr_min=0.0):
        self.lr = _nonneg("lr", lr)
        self.lr_min = _nonneg("lr_min", lr_min)
        if self.lr_min > self.lr:
            raise ValueError(f"lr_min {lr_min!r} is above lr {lr!r}")
        if not _nonneg("epochs", epochs) > 0:
            raise ValueError(f"epochs must be > 0, got {epochs!r}")
        self.epochs = float(epochs)

    def __call__(self, epochs_done):
        if not epochs_done >= 0:
            raise ValueError(f"epochs done must be >= 0, got {epochs_done!r}")
        f = min(epochs_done / self.epochs, 1.0)
        return self.lr_min + (self.lr - self.lr_min) * 0.5 * (1.0 + np.cos(np.pi * f))


def make_lr_schedule(name, lr, epochs, lr_min=0.0):
    """None (a constant rate) for 'constant', a :class:`CosineLR` over ``epochs`` for 'cosine'."""
    if name == "constant":
        return None
    if name == "cosine":
        return CosineLR(lr, epochs, lr_min)
    raise ValueError(f"unknown learning-rate schedule {name!r}; expected 'constant' or 'cosine'")
