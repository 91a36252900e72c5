"""asv suite of mgnn: kernels per backend and dtype at small and large shapes, the cases of
``python -m mgnn bench kernels`` at its shapes, one MGRIT cycle (forward and adjoint), and a whole
training step serial against layer-parallel MGRIT.

Every benchmark times kernels, never compilation or cache loading: ``setup`` prepares the inputs
(``prepare``) and then calls every timed method (twice the first time in a process), which
compiles the Numba kernels (or loads them from Numba's cache) and warms BLAS and the CPU caches;
``tests/test_asv_suite.py`` checks that no timed call compiles after setup. ``timeout`` allows for
a cold Numba cache, where setup compiles.

The suite runs with the allocator setting of the command line (``mgnn.__main__._tune_malloc``), as
``python -m mgnn bench`` does, so that both time the same thing (without it a float64 dense step
of w=256, B=128 pays ~1.6x in page faults).

``MGNN_ASV_FAST=1`` (what ``make bench`` sets) keeps only the small shapes so that the quick
profile finishes in a few minutes; GPU benchmarks skip without a GPU.
"""
import os

import numpy as np

import mgnn
from mgnn import MGRITOptions, MGRITSolver
from mgnn.backend import get_backend, vector_ops
from mgnn.studies.bench import DENSE_STEP, LAYER_OVERHEAD, dense_step_case, layer_overhead_case
from mgnn.__main__ import _tune_malloc
from mgnn.network import AdjointPropagator, ForwardPropagator, LayerParallel

_tune_malloc()

FAST = os.environ.get("MGNN_ASV_FAST") == "1"
SIZES = ["small"] if FAST else ["small", "large"]
DENSE = {"small": (32, 16), "large": (128, 256)}      # (batch, width)
CONV = {"small": (4, 4, 8), "large": (32, 8, 28)}     # (batch, channels, image side)


def _dense_inputs(size, dtype):
    B, w = DENSE[size]
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    return (rng.standard_normal((B, w)).astype(dt), (rng.standard_normal((w, w)) / w).astype(dt),
            rng.standard_normal(w).astype(dt), rng.standard_normal((B, w)).astype(dt),
            dt.type(0.1))


_WARMED = set()  # (class, params) warmed up in this process


class _Warm:
    """Base of every benchmark class: ``setup`` = ``prepare`` + calls of each timed method (two
    the first time in a process: compilation or cache loading, then warm caches; one after)."""

    timeout = 600  #: seconds; a cold Numba cache compiles every kernel in setup

    def setup(self, *params):
        self.prepare(*params)
        key = (type(self).__name__, params)
        for name in dir(self):
            if name.startswith(("time_", "peakmem_")):
                for _ in range(1 if key in _WARMED else 2):
                    getattr(self, name)(*params)
        _WARMED.add(key)


class KernelsCLI(_Warm):
    """The dense step of ``python -m mgnn bench kernels`` (forward + vjp, numba) and its NumPy
    matmul baseline, at the same shape (w=256, B=128; compare with its "1 BLAS thread" rows)."""

    params = (["float32", "float64"],)
    param_names = ["dtype"]

    def prepare(self, dtype):
        self.step, self.matmul = dense_step_case(dtype=dtype, backend="numba", **DENSE_STEP)

    def time_dense_step_fwd_vjp(self, dtype):
        self.step()

    def time_numpy_matmul_baseline(self, dtype):
        self.matmul()


class LayerOverheadCLI(_Warm):
    """Loss and gradient of the tiny network of ``python -m mgnn bench kernels`` (w=4, B=4,
    N=256, float64): per-layer call overhead."""

    params = (["numpy", "numba"],)
    param_names = ["backend"]

    def prepare(self, backend):
        self.fn = layer_overhead_case(backend=backend, **LAYER_OVERHEAD)

    def time_loss_and_grad(self, backend):
        self.fn()


class DenseStep(_Warm):
    params = (["numpy", "numba"], ["float32", "float64"], SIZES)
    param_names = ["backend", "dtype", "size"]

    def prepare(self, backend, dtype, size):
        self.bk = get_backend(backend)
        self.u, self.W, self.b, self.lam, self.h = _dense_inputs(size, dtype)
        _, self.d = self.bk.dense_forward_deriv(self.u, self.W, self.b, self.h, 0, True)

    def time_forward(self, backend, dtype, size):
        self.bk.dense_forward_deriv(self.u, self.W, self.b, self.h, 0, True)

    def time_vjp(self, backend, dtype, size):
        self.bk.dense_vjp(self.lam, self.d, self.u, self.W, self.h, True)

    def peakmem_forward_vjp(self, backend, dtype, size):
        _, d = self.bk.dense_forward_deriv(self.u, self.W, self.b, self.h, 0, True)
        self.bk.dense_vjp(self.lam, d, self.u, self.W, self.h, True)


class ConvStep(_Warm):
    params = (["numpy", "numba"], ["float32", "float64"], SIZES)
    param_names = ["backend", "dtype", "size"]

    def prepare(self, backend, dtype, size):
        B, C, S = CONV[size]
        rng = np.random.default_rng(0)
        dt = np.dtype(dtype)
        self.bk = get_backend(backend)
        self.u = rng.standard_normal((B, C, S, S)).astype(dt)
        self.K = (rng.standard_normal((C, C, 3, 3)) / (3 * C)).astype(dt)
        self.b = rng.standard_normal(C).astype(dt)
        self.lam = rng.standard_normal(self.u.shape).astype(dt)
        self.h = dt.type(0.1)
        _, self.d = self.bk.conv_forward_deriv(self.u, self.K, self.b, self.h, 0, True)

    def time_forward(self, backend, dtype, size):
        self.bk.conv_forward_deriv(self.u, self.K, self.b, self.h, 0, True)

    def time_vjp(self, backend, dtype, size):
        self.bk.conv_vjp(self.lam, self.d, self.u, self.K, self.h, True)


class MGRITCycle(_Warm):
    """One V-cycle (3 levels, cf 4, F then FCF) of the forward and of the adjoint solve."""

    params = (["numpy", "numba"], [64] if FAST else [64, 256])
    param_names = ["backend", "n_layers"]

    def prepare(self, backend, n_layers):
        self.model = mgnn.dense_resnet(32, 32, 10, n_layers, seed=0)
        self.bk = get_backend(backend)
        self.ops = vector_ops(backend)
        self.u0 = np.random.default_rng(0).standard_normal((32, 32))
        U, _ = LayerParallel(self.model, backend=backend)._serial_states(self.u0, False)
        st = self.model.group("steps")
        D = [self.model.step.deriv(st["weight"][n], st["bias"][n], U[n], self.bk)
             for n in range(n_layers)]
        self.opts = MGRITOptions(cf=4, max_levels=3, nrelax=[0, 1], tol=0.0, max_iter=1)
        self.fwd = MGRITSolver(ForwardPropagator(self.model, self.bk), n_layers, self.opts,
                               ops=self.ops)
        self.adj = MGRITSolver(AdjointPropagator(self.model, U, D, self.bk), n_layers,
                               self.opts, ops=self.ops)

    def time_forward_cycle(self, backend, n_layers):
        self.fwd.solve(self.u0)

    def time_adjoint_cycle(self, backend, n_layers):
        self.adj.solve(self.u0)


class TrainStep(_Warm):
    """A whole training step (loss and gradient) serial against layer-parallel MGRIT (2/1
    cycles, one process)."""

    params = (["serial", "mgrit"], [64] if FAST else [64, 256])
    param_names = ["method", "n_layers"]

    def prepare(self, method, n_layers):
        model = mgnn.dense_resnet(64, 64, 10, n_layers, seed=0)
        common = dict(cf=4, max_levels=3, nrelax=[0, 1], tol=0.0, skip_downcycle=True)
        if method == "serial":
            self.lp = LayerParallel(model)
        else:
            self.lp = LayerParallel(model, fwd=MGRITOptions(max_iter=2, **common),
                                    bwd=MGRITOptions(max_iter=1, **common), guard=None)
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((64, 64))
        self.y = rng.integers(0, 10, 64)

    def time_loss_and_grad(self, method, n_layers):
        self.lp.loss_and_grad(self.x, self.y)

    def peakmem_loss_and_grad(self, method, n_layers):
        self.lp.loss_and_grad(self.x, self.y)


class GPUKernels(_Warm):
    """GPU kernels of the cuda backend against CuPy baselines at the same shape (skipped where no
    GPU is available): the fused dense step and cupy.matmul + a separate epilogue, the batched
    step of 16 F-intervals, and a device-to-device copy."""

    params = (["float32", "float64"],)
    param_names = ["dtype"]

    def prepare(self, dtype):
        from mgnn.backend import get_backend, gpu_available
        if not gpu_available():
            raise NotImplementedError("no CUDA GPU")
        import cupy
        self.cp, self.bk = cupy, get_backend("cuda")
        dt = np.dtype(dtype)
        rng = cupy.random.default_rng(0)
        w = 1024
        self.x = rng.standard_normal((w, w), dtype=dt)
        self.W = (rng.standard_normal((w, w), dtype=dt) / w ** 0.5).astype(dt)
        self.b = rng.standard_normal(w, dtype=dt)
        self.h = dt.type(0.1)
        self.xs = [rng.standard_normal((64, 64), dtype=dt) for _ in range(16)]
        self.Ws = rng.standard_normal((16, 64, 64), dtype=dt) / 8
        self.bs = rng.standard_normal((16, 64), dtype=dt)
        self.big = rng.standard_normal(1 << 24, dtype=dt)
        self.out = cupy.empty_like(self.big)

    def _sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    def time_dense_step(self, dtype):
        self.bk.dense_forward(self.x, self.W, self.b, self.h, 0, True)
        self._sync()

    def time_matmul_plus_epilogue(self, dtype):
        z = self.cp.matmul(self.x, self.W.T)
        _ = self.x + self.h * self.cp.tanh(z + self.b)
        self._sync()

    def time_batched_step_16_intervals(self, dtype):
        self.bk.dense_forward_batched(self.xs, self.Ws, self.bs, list(range(16)), self.h, 0,
                                      False)
        self._sync()

    def time_device_copy(self, dtype):
        self.out[...] = self.big
        self._sync()


class OtherKernels(_Warm):
    """The remaining kernels: layer sweeps, pooling, the loss and the FAS vector operations."""

    params = (["numpy", "numba"], ["float32", "float64"])
    param_names = ["backend", "dtype"]

    def prepare(self, backend, dtype):
        dt = np.dtype(dtype)
        rng = np.random.default_rng(0)
        self.bk = get_backend(backend)
        self.ops = vector_ops(backend)
        n, B, w = 16, 32, 16
        self.W = (rng.standard_normal((n, w, w)) / w).astype(dt)
        self.b = rng.standard_normal((n, w)).astype(dt)
        self.U = np.empty((n + 1, B, w), dtype=dt)
        self.U[0] = rng.standard_normal((B, w))
        self.D = np.empty((n, B, w), dtype=dt)
        self.h = dt.type(0.1)
        self.gW, self.gb = np.empty_like(self.W), np.empty_like(self.b)
        self.lam = rng.standard_normal((B, w)).astype(dt)
        self.img = rng.standard_normal((B, 8, 8, 8)).astype(dt)
        self.logits = rng.standard_normal((B, 10)).astype(dt)
        self.y = rng.integers(0, 10, B)
        self.a, self.c, self.e = (rng.standard_normal((B, w)).astype(dt) for _ in range(3))

    def time_dense_sweeps(self, backend, dtype):
        self.bk.dense_sweep_forward(self.U, self.W, self.b, self.h, 0, self.D)
        self.bk.dense_sweep_backward(self.U, self.D, self.W, self.h, self.lam, self.gW, self.gb)

    def time_pool_loss_fas(self, backend, dtype):
        g = self.bk.avgpool_forward(self.img, 2)
        self.bk.avgpool_vjp(g, 8, 8)
        self.bk.softmax_xent(self.logits, self.y)
        r, _ = self.ops.residual(self.a, self.c, self.e)
        self.ops.fas_rhs(r, self.a, self.c)
        self.ops.correct(self.a, self.c, self.e)


class GRUTrainStep(_Warm):
    """A GRU over sequence time (H=32, B=32): serial (backpropagation through time) against
    MGRIT over time (2 levels, cf 4, 2 forward / 1 adjoint cycles, implicit coarse GRU)."""

    params = (["serial", "mgrit"], [128] if FAST else [128, 1024])
    param_names = ["method", "seq_len"]
    hidden = 32

    def prepare(self, method, seq_len):
        H = self.hidden
        model = mgnn.gru_classifier(4, H, 4, seq_len, seed=0, dtype="float32")
        common = dict(cf=4, max_levels=2, tol=0.0)
        opts = {} if method == "serial" else dict(fwd=MGRITOptions(max_iter=2, **common),
                                                  bwd=MGRITOptions(max_iter=1, **common))
        self.lp = LayerParallel(model, **opts, guard=None)
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((H, seq_len, 4)).astype(np.float32)
        self.y = rng.integers(0, 4, H)

    def time_loss_and_grad(self, method, seq_len):
        self.lp.loss_and_grad(self.x, self.y)


class TinyGRUTrainStep(GRUTrainStep):
    """:class:`GRUTrainStep` at H = B = 4, the tiny GRU whose time per step issue 13 bounds by
    10 us (a class of its own, so that GRUTrainStep's history keeps its parameter keys)."""

    params = (["serial", "mgrit"], [1024])
    hidden = 4


class BatchNormConvStep(_Warm):
    """A conv ResNet training step (C=8, 16x16, B=32, N=8, float32) with and without batch
    norm (the ratio is the cost of BN in a composed step)."""

    params = (["plain", "batch_norm"],)
    param_names = ["kind"]

    def prepare(self, kind):
        model = mgnn.conv_resnet(1, 8, (16, 16), 10, 8, dtype="float32", seed=0,
                                 batch_norm=kind == "batch_norm")
        self.lp = LayerParallel(model)
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((32, 1, 16, 16)).astype(np.float32)
        self.y = rng.integers(0, 10, 32)

    def time_loss_and_grad(self, kind):
        self.lp.loss_and_grad(self.x, self.y)
